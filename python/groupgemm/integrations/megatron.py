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

The exchange of tokens between expert-parallel ranks is ``MoELayer.token_dispatcher``
(``megatron.core.transformer.moe.token_dispatcher.MoETokenDispatcher``'s six steps).
:func:`token_dispatcher_class` is one on groupgemm.torch's ``dispatch``, ``dispatch_probs``
and ``combine``, and :func:`use_groupgemm_dispatcher` puts it into a built ``MoELayer``.
"""

import contextlib
import functools

import torch

from groupgemm.torch_ext import module

__all__ = ["ColumnParallelGroupedLinear", "RowParallelGroupedLinear", "token_dispatcher_class",
           "use_groupgemm_dispatcher"]

# TransformerConfig options whose behaviour these layers do not implement (use_kitchen: the
# quantized linears of NVIDIA's kitchen extension; a quant_recipe that names the layer is
# refused by _layer_quantization).
_UNSUPPORTED_OPTIONS = ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad", "fp8", "fp4",
                        "use_kitchen")
# ... and those the token dispatcher does not (the TE/DeepEP paths, quantization padding).
_UNSUPPORTED_DISPATCH_OPTIONS = ("moe_router_padding_for_quantization", "moe_shared_expert_overlap",
                                 "moe_pad_expert_input_to_capacity", "moe_permute_fusion", "fp8", "fp4")


def _group_size(group) -> int:
    return 1 if group is None else group.size()


def _layer_quantization(config, name):
    """The quantization ``config.quant_recipe`` gives the layer called ``name``, by
    Megatron-core's own matching (as TransformerEngine's grouped layers look it up), or None."""
    recipe = getattr(config, "quant_recipe", None)
    if recipe is None:
        return None
    from megatron.core.quantization.utils import get_quant_config_or_none

    return get_quant_config_or_none(name, recipe)


def _expert_rng(weight):
    """Where an expert weight is drawn: on the GPU, under Megatron-core's expert-parallel
    random stream when its tracker is set up (model_parallel_cuda_manual_seed), as its own
    expert layers and TransformerEngine's are (seeded per expert-parallel and
    expert-tensor-parallel rank, so each rank draws its own experts); else, and for weights
    made on the CPU (``use_cpu_initialization``, whose draws that stream does not reach, as
    in Megatron-core's CPU path), the default generator."""
    if weight.device.type != "cuda":
        return contextlib.nullcontext()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

    tracker = get_cuda_rng_tracker()
    if not tracker.is_initialized():
        return contextlib.nullcontext()
    return tracker.fork(get_expert_parallel_rng_tracker_name())


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
        if _layer_quantization(config, name) is not None:
            raise NotImplementedError(f"{fn}: config.quant_recipe quantizes {name!r}, which groupgemm's "
                                      "Megatron-core builders do not; use TransformerEngine's for it, or a recipe "
                                      "that leaves the experts out")
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
        with torch.no_grad(), _expert_rng(self.weight):
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
    ``config.perform_initialization``; on the GPU under Megatron-core's expert-parallel
    random stream, as its own expert layers are), biases to zero.

    ``forward(x, tokens_per_expert)`` returns ``(out [M, output_size / tp], bias or
    None)``; rows past ``sum(tokens_per_expert)`` are exact zeros. Raises
    ``NotImplementedError`` naming a ``TransformerConfig`` option it does not support
    (``delay_wgrad_compute``, ``overlap_dispatch_backward_with_experts_wgrad``, ``fp8``,
    ``fp4``, ``use_kitchen``, a ``quant_recipe`` that matches the layer), and ``ValueError``
    when the split dimension is not divisible by the expert tensor-parallel size or
    ``is_expert`` is False.
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


@functools.cache  # one class, made on first use
def token_dispatcher_class() -> type:
    """Megatron-core's token dispatcher contract on groupgemm.torch's expert parallelism.

    A ``MoETokenDispatcher`` built as Megatron's own, ``(num_local_experts,
    local_expert_indices, config=..., pg_collection=...)``, plus ``capacity`` (None:
    dropless, one host copy of the counts per step, the sync Megatron's all-to-all
    dispatcher makes; an int: every pair of ranks exchanges that many rows, static shapes,
    no host copy, slots past it dropped and counted in ``dropped``). Tokens go to their
    experts' ranks in Megatron's order (expert, then source rank, then token), each with its
    routing probability for the experts to weight (``TEGroupedMLP`` does); combine sums each
    token's expert outputs in float32 in slot order. Zero tokens on a rank, or for all its
    experts, are ordinary input; every rank takes part in each collective. Refuses, naming
    the option, expert tensor parallelism and the TransformerConfig options it does not
    implement (quantization padding, the fused permute, shared-expert overlap).
    """
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    import groupgemm.torch as gt

    class GroupgemmTokenDispatcher(MoETokenDispatcher):
        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None, *, capacity=None):
            fn = type(self).__name__
            for option in _UNSUPPORTED_DISPATCH_OPTIONS:
                if getattr(config, option, None):
                    raise NotImplementedError(f"{fn}: config.{option} is not supported by groupgemm's token "
                                              "dispatcher; use Megatron-core's for it")
            super().__init__(config=config, pg_collection=pg_collection)
            if self.tp_size > 1:
                raise NotImplementedError(f"{fn}: expert tensor parallelism (expt_tp size {self.tp_size}) is not "
                                          "supported by groupgemm's token dispatcher")
            self.num_experts = config.num_moe_experts
            if list(local_expert_indices) != [self.ep_rank * num_local_experts + i for i in range(num_local_experts)]:
                raise ValueError(f"{fn}: local_expert_indices must be this rank's contiguous block of "
                                 f"{num_local_experts} experts, got {list(local_expert_indices)}")
            self.top_k, self.capacity = config.moe_router_topk, capacity
            self.dropped = None

        def dispatch_preprocess(self, tokens, routing_map, probs):
            """Megatron's router gives a [T, E] mask and [T, E] probs; groupgemm's dispatch
            takes each token's k experts (ascending, a dropped slot as E) and their probs,
            both computed on the device."""
            self.hidden_shape = tokens.shape
            hidden = tokens.reshape(-1, tokens.shape[-1])
            experts = torch.arange(self.num_experts, dtype=torch.int32, device=routing_map.device)
            chosen = torch.where(routing_map, experts, self.num_experts)
            self.expert_indices = chosen.sort(dim=1).values[:, :self.top_k]
            in_range = self.expert_indices < self.num_experts
            slot_probs = probs.gather(1, torch.where(in_range, self.expert_indices, 0).long())
            return hidden, torch.where(in_range, slot_probs, 0)

        def token_dispatch(self, hidden_states, probs):
            expert_input, self.tokens_per_expert, self.plan = gt.dispatch(
                hidden_states, self.expert_indices, self.num_experts, self.ep_group, capacity=self.capacity)
            self.dropped = self.plan.dropped
            return expert_input, gt.dispatch_probs(probs, self.plan)

        def dispatch_postprocess(self, hidden_states, probs):
            """Megatron's experts take ``tokens_per_expert`` to cover every row (SequentialMLP
            and TEGroupedMLP split the rows by it), so capacity mode's padding rows (zero
            rows, probability 0, last; combine reads none of them) are counted into the
            last local expert's; they add exact zeros to its gradients. ``tokens_per_expert``
            (the attribute) keeps the rows each expert received."""
            counts = self.tokens_per_expert
            if self.capacity is not None:  # on the device: no host copy
                counts = counts.clone()
                counts[-1:] += hidden_states.shape[0] - counts.sum()
            return hidden_states, counts, probs

        def combine_preprocess(self, hidden_states):
            return hidden_states

        def token_combine(self, hidden_states, *args, **kwargs):
            del args, kwargs  # Megatron's asynchronous-finish options: the exchange here is synchronous
            return gt.combine(hidden_states, self.plan)

        def combine_postprocess(self, hidden_states):
            return hidden_states.view(self.hidden_shape)

    GroupgemmTokenDispatcher.__module__ = __name__
    GroupgemmTokenDispatcher.__qualname__ = "GroupgemmTokenDispatcher"  # as __getattr__ finds it
    return GroupgemmTokenDispatcher


def __getattr__(name):
    """The dispatcher class, made at run time, by the name pickle looks it up under (a whole
    model pickled, or saved with torch.save)."""
    if name == "GroupgemmTokenDispatcher":
        return token_dispatcher_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_groupgemm_dispatcher(moe_layer, capacity=None):
    """Replaces a built Megatron-core ``MoELayer``'s token dispatcher by
    :func:`token_dispatcher_class`'s, on the layer's own process groups, with ``capacity``
    (None: dropless). Returns the layer."""
    old = moe_layer.token_dispatcher
    moe_layer.token_dispatcher = token_dispatcher_class()(
        moe_layer.num_local_experts, moe_layer.local_expert_indices, config=moe_layer.config,
        pg_collection=_collection_of(old), capacity=capacity)
    # A layer built with transformer_impl="inference_optimized" keeps its training dispatcher
    # aside and puts it back at each forward outside inference mode, which would undo the
    # replacement silently: the one kept aside is replaced too.
    if hasattr(moe_layer, "_training_token_dispatcher"):
        moe_layer._training_token_dispatcher = moe_layer.token_dispatcher
    return moe_layer


def _collection_of(dispatcher):
    """The ProcessGroupCollection a Megatron-core dispatcher was built with (it keeps the
    groups, not the collection)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(ep=dispatcher.ep_group, expt_tp=dispatcher.tp_group, tp_ep=dispatcher.tp_ep_group)
