"""groupgemm inside Megatron-core's MoE layers (megatron-core 0.19).

Megatron-core's ``TEGroupedMLP`` (``megatron.core.transformer.moe.experts``) builds its two
grouped linear layers from the builders its layer spec names in
``GroupedMLPSubmodules(linear_fc1=..., linear_fc2=...)``. :class:`ColumnParallelGroupedLinear`
and :class:`RowParallelGroupedLinear` are such builders, in the places of TransformerEngine's
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``::

    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from groupgemm.integrations.megatron import ColumnParallelGroupedLinear, RowParallelGroupedLinear

    experts = ModuleSpec(module=TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear))

Each is a ``groupgemm.torch.GroupedLinear`` (one ``weight [E, out, in]``, one
``bias [E, out]``): an expert without tokens gets an exact-zero weight gradient, and with
``config.gradient_accumulation_fusion`` the weight gradient is added into the float32
``weight.main_grad`` that Megatron-core's ``DistributedDataParallel`` gives each parameter,
setting ``grad_added_to_main_grad`` as TransformerEngine does. ``backward_dw()``, which
``TEGroupedMLP.backward_dw`` calls, has nothing left to do: the weight gradient is computed
in the backward.

What still reads the group sizes on the host is Megatron-core's own code:
``TEGroupedMLP.forward`` calls ``tokens_per_expert.tolist()`` before calling these layers
(one device-to-host copy per layer and step); the layers copy the list back to the device.
``groupgemm.torch.GroupedMLP`` takes the sizes as a device tensor, with no host copy at all.

Not supported (each refused with an error naming the option): ``delay_wgrad_compute`` and
``overlap_dispatch_backward_with_experts_wgrad`` (the deferred weight gradient), FP8 / FP4
training, and Megatron-core's distributed checkpointing of these weights
(``sharded_state_dict``; ``state_dict()`` works).
"""

import torch

from groupgemm.torch_ext import module

__all__ = ["ColumnParallelGroupedLinear", "RowParallelGroupedLinear"]

# TransformerConfig options whose behaviour these layers do not implement.
_UNSUPPORTED_OPTIONS = ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad", "fp8", "fp4")


def _group_size(group) -> int:
    return 1 if group is None else group.size()


class _MegatronGroupedLinear(module.GroupedLinear):
    """The builder contract of ``TEGroupedMLP``'s ``linear_fc1`` / ``linear_fc2``."""

    parallel_mode = ""  # "column" or "row": the dimension expert tensor parallelism splits

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool = True, tp_comm_buffer_name: str | None = None,
                 pg_collection=None, name: str | None = None):
        fn = type(self).__name__
        for option in _UNSUPPORTED_OPTIONS:
            if getattr(config, option, None):
                raise NotImplementedError(f"{fn}: config.{option} is not supported by groupgemm's Megatron-core "
                                          "builders; use TransformerEngine's for it")
        if not is_expert:
            raise ValueError(f"{fn}: is_expert must be True (TEGroupedMLP's experts), got {is_expert}")
        tp_size = _group_size(getattr(pg_collection, "expt_tp", None))
        split = "output_size" if self.parallel_mode == "column" else "input_size"
        sizes = {"input_size": input_size, "output_size": output_size}
        if sizes[split] % tp_size:
            raise ValueError(f"{fn}: {split} = {sizes[split]} is not divisible by the expert tensor-parallel "
                             f"size {tp_size}")
        sizes[split] //= tp_size
        device = (torch.device("cpu") if getattr(config, "use_cpu_initialization", False)
                  or not torch.cuda.is_available() else torch.device("cuda", torch.cuda.current_device()))
        super().__init__(num_local_experts, sizes["input_size"], sizes["output_size"], bias=bias, device=device,
                         dtype=getattr(config, "params_dtype", torch.float32),
                         accumulate_into_main_grad=bool(getattr(config, "gradient_accumulation_fusion", False)))
        self.skip_bias_add = skip_bias_add
        self.name = name
        self._init_method = init_method if getattr(config, "perform_initialization", True) else None
        self.reset_parameters()
        self._mark_parameters(config)

    def reset_parameters(self):
        init_method = getattr(self, "_init_method", None)
        if init_method is None:  # GroupedLinear's own initialisation (also while it is being built)
            return super().reset_parameters()
        with torch.no_grad():
            for expert_weight in self.weight:  # Megatron's init methods take one [out, in] weight
                init_method(expert_weight)
            if self.bias is not None:
                self.bias.zero_()

    def _mark_parameters(self, config):
        """The attributes Megatron-core's DDP and gradient clipping read, as TransformerEngine
        sets them on its grouped layers: ``allreduce`` False puts a parameter in the expert
        data-parallel buffers; ``tensor_model_parallel`` / ``partition_dim`` name the split axis
        (of ``[E, out, in]`` here)."""
        expert_tp = getattr(config, "expert_tensor_parallel_size", None)
        expert_groups = (getattr(config, "expert_model_parallel_size", 1) > 1
                         or expert_tp not in (None, getattr(config, "tensor_model_parallel_size", 1)))
        for kind, param in (("weight", self.weight), ("bias", self.bias)):
            if param is None:
                continue
            param.allreduce = not expert_groups
            partitioned = kind == "weight" or self.parallel_mode == "column"
            param.tensor_model_parallel = partitioned
            if partitioned:
                param.partition_dim = (2 if self.parallel_mode == "row" else 1) if kind == "weight" else 1
                param.partition_stride = 1

    def forward(self, x: torch.Tensor, tokens_per_expert) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, bias)``: ``out[r] = x[r] @ weight[g].T (+ bias[g])`` over the rows of each
        expert, ``tokens_per_expert`` a list of ints (as ``TEGroupedMLP`` passes it) or a 1-D
        integer tensor on x's device. With ``skip_bias_add`` the bias is returned for the
        caller to add, as Megatron-core's layers do; otherwise the second value is None."""
        if self.skip_bias_add and self.bias is not None:
            return self._grouped_product(x, tokens_per_expert, None), self.bias
        return self._grouped_product(x, tokens_per_expert, self.bias), None

    def backward_dw(self) -> None:
        """Nothing to do: the weight gradient is computed in the backward (Megatron-core calls
        this for layers that defer it under ``delay_wgrad_compute``, which is refused)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        raise NotImplementedError(f"{type(self).__name__}: Megatron-core's distributed checkpointing of "
                                  "groupgemm's expert weights is not implemented; save model.state_dict() instead")

    def extra_repr(self):
        return f"{super().extra_repr()}, parallel_mode={self.parallel_mode!r}, skip_bias_add={self.skip_bias_add}"


class ColumnParallelGroupedLinear(_MegatronGroupedLinear):
    """``TEGroupedMLP``'s ``linear_fc1``: ``[E, output_size / tp, input_size]`` weights.

    Built by ``TEGroupedMLP`` as ``ColumnParallelGroupedLinear(num_local_experts,
    input_size, output_size, config=..., init_method=..., bias=..., skip_bias_add=...,
    is_expert=True, tp_comm_buffer_name=..., pg_collection=..., name=...)``. The output
    dimension is split over ``pg_collection.expt_tp`` (Megatron's token dispatcher does the
    communication). Parameters live on the current CUDA device, or on the CPU with
    ``config.use_cpu_initialization`` or without CUDA, in ``config.params_dtype``; each
    expert's weight is initialised by ``init_method`` (when
    ``config.perform_initialization``), biases to zero.

    ``forward(x, tokens_per_expert)`` returns ``(out [M, output_size / tp], bias or
    None)``; rows past ``sum(tokens_per_expert)`` are exact zeros. Raises
    ``NotImplementedError`` naming a ``TransformerConfig`` option it does not support
    (``delay_wgrad_compute``, ``overlap_dispatch_backward_with_experts_wgrad``, ``fp8``,
    ``fp4``), and ``ValueError`` when the split dimension is not divisible by the expert
    tensor-parallel size or ``is_expert`` is False.
    """

    parallel_mode = "column"


class RowParallelGroupedLinear(_MegatronGroupedLinear):
    """``TEGroupedMLP``'s ``linear_fc2``: ``[E, output_size, input_size / tp]`` weights.

    The input dimension is split over ``pg_collection.expt_tp``; the bias (``[E,
    output_size]``) is not split. ``TEGroupedMLP`` builds it with ``skip_bias_add=True``,
    so ``forward`` returns the bias for ``TEGroupedMLP`` to add weighted by each token's
    routing probability. Otherwise as :class:`ColumnParallelGroupedLinear`.
    """

    parallel_mode = "row"

