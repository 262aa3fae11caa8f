"""GroupedLinear: one nn.Linear per expert, applied to rows sorted by expert."""

import math

import torch
from torch import nn

from groupgemm import _contract as contract
from groupgemm.torch_ext import autocast, expert, expert_mlp, fp8_recipe, functional, main_grad
from groupgemm.torch_ext.arguments import dtype_name, shape_and_dtype


class GroupedLinear(nn.Module):
    """``num_experts`` independent linear layers over rows grouped by expert.

    ``weight`` is ``[num_experts, out_features, in_features]`` and ``bias``
    ``[num_experts, out_features]``, each expert initialised like ``nn.Linear``.
    ``forward(x, group_sizes)`` takes ``x [M, in_features]`` sorted by expert and
    ``group_sizes`` (a 1-D int32/int64 tensor on x's device, or a list of ints) and
    returns ``[M, out_features]``; rows past ``sum(group_sizes)`` are 0. Every parameter
    gets a full-shape gradient, exact zeros for experts without tokens.

    With ``accumulate_into_main_grad=True`` the weight gradient is added into the float32
    ``weight.main_grad`` instead (Megatron-core's contract, main_grad.py): ``.grad`` gets a
    cached dummy and ``weight.grad_added_to_main_grad`` is set when the weight carries that
    attribute, and stays None otherwise. As in TransformerEngine's fused accumulation, the
    addition is part of the layer's backward: a backward through the layer adds into
    main_grad even when it asks only for other gradients (``torch.autograd.grad(loss, x)``);
    run such passes with the plain layer. Module conversion or loading with
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` is refused in this mode
    (torch does not swap a tensor another object holds weakly).

    ``fp8="rowwise"`` or ``"blockwise"`` runs the forward, input-gradient and weight-gradient
    GEMMs in float8 (e4m3) from the float32 or bfloat16 weights and inputs (the recipe of
    groupgemm/_fp8_recipe.py; blockwise needs in_features and out_features to be multiples
    of 128); outputs and gradients keep the layer's dtype, main_grad accumulation included.
    Reverse mode only.

    Under ``torch.autocast`` the layer computes in the autocast dtype, as nn.Linear does,
    its float32 parameters getting float32 gradients (main_grad too); with ``fp8`` it casts
    nothing: the input and weight are quantized from the dtypes they have, the output comes
    in the input's (autocast.py).
    """

    def __init__(self, num_experts, in_features, out_features, bias=True, *, device=None, dtype=None,
                 accumulate_into_main_grad=False, fp8=None):
        super().__init__()
        contract.layer_config("GroupedLinear", dtype_name(dtype or torch.get_default_dtype()),
                              {"bias": bias, "accumulate_into_main_grad": accumulate_into_main_grad},
                              num_experts=num_experts, in_features=in_features, out_features=out_features)
        factory = {"device": device, "dtype": dtype}
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.accumulate_into_main_grad = accumulate_into_main_grad
        contract.fp8_layer("GroupedLinear", fp8, dtype_name(dtype or torch.get_default_dtype()), in_features,
                           out_features)
        self.fp8 = fp8
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts, out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        if accumulate_into_main_grad:
            main_grad.attach(self.weight)

    def reset_parameters(self):
        # nn.Linear's kaiming_uniform_(a=sqrt(5)) and bias init reduce to U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x, group_sizes):
        return self._grouped_product(x, group_sizes, self.bias)

    def _grouped_product(self, x, group_sizes, bias):
        """``x @ weight[g].T (+ bias[g])`` per group, the weight gradient going where the
        layer's mode sends it (bias is self.bias, or None to leave it out)."""
        shape, x_dtype = shape_and_dtype(x, "x", "GroupedLinear")
        contract.layer_x(shape, x_dtype, self.in_features, "in_features",
                         autocast.layer_dtype(x, self, "GroupedLinear"), "GroupedLinear", rank=2)
        contract.layer_group_sizes(group_sizes, self.num_experts, "GroupedLinear", dtype_name)
        if isinstance(group_sizes, (list, tuple)):
            sizes = contract.static_group_sizes(group_sizes, x.shape[0], "GroupedLinear")
            group_sizes = torch.tensor(sizes, dtype=torch.int64, device=x.device)
        if self.fp8 is not None:
            # In an autocast region x may come in another dtype than the weight (float32
            # parameters, bfloat16 activations): each is quantized from the dtype it has, the
            # output comes in x's and the bias joins it there (autocast.py).
            for dtype in dict.fromkeys((dtype_name(self.weight.dtype), x_dtype)):
                contract.fp8_layer("GroupedLinear", self.fp8, dtype, self.in_features, self.out_features)
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)
            group_sizes, _, _ = functional.check_grouped_mm(x, self.weight, group_sizes, bias, True, None, None,
                                                            fn="GroupedLinear", quantized=True)
            return fp8_recipe.grouped_linear(x, self.weight, group_sizes, bias, self.fp8,
                                             self.accumulate_into_main_grad)
        if not (self.accumulate_into_main_grad and main_grad.needs_main_grad(self.weight)):
            return functional.grouped_mm(x, self.weight, group_sizes, bias, transpose_weight=True)
        x, weight, bias = autocast.operands(x, self.weight, bias)
        group_sizes, _, _ = functional.check_grouped_mm(x, weight, group_sizes, bias, True, None,
                                                        None, fn="GroupedLinear")
        return main_grad.grouped_linear(x, self.weight, group_sizes, bias, operand=weight)

    # torch swaps no tensor another object holds weakly, as main_grad's hook holds the weight:
    # where torch would swap the parameters (module conversion, loading), say so first.
    def _apply(self, fn, recurse=True):
        self._refuse_swapping("converting the module")
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._refuse_swapping("load_state_dict")
        return super()._load_from_state_dict(*args, **kwargs)

    def _refuse_swapping(self, what):
        if self.accumulate_into_main_grad and torch.__future__.get_swap_module_params_on_conversion():
            raise RuntimeError(f"{main_grad.FN}: {what} with torch.__future__.set_swap_module_params_on_conversion"
                               "(True) would swap the weight, which this mode's hook holds; turn that off around "
                               "the call, or use accumulate_into_main_grad=False")

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"accumulate_into_main_grad={self.accumulate_into_main_grad}, fp8={self.fp8!r}")


class GroupedMLP(nn.Module):
    """Each expert's MLP on its rows: ``fc2(act(fc1(x)))``, the activation computed in the core.

    ``fc1 = GroupedLinear(num_experts, hidden_size, F_in)`` and
    ``fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size)``, with
    ``F_in = 2 * ffn_hidden_size`` for ``"swiglu"`` (``silu(gate) * up``, the first
    ffn_hidden_size columns the gate) and ``ffn_hidden_size`` for ``"gelu"`` (exact erf
    form), ``"relu"`` and ``"silu"``. ``forward(x, group_sizes)`` takes rows sorted by
    expert (as ``permute`` returns them); rows owned by no expert come out as exact zeros,
    and every parameter gets a full-shape gradient, zero for experts without tokens.
    ``fp8`` is GroupedLinear's, for both layers.

    ``forward_routed(tokens, expert_indices, probs)`` applies the experts to routed tokens
    (permute, the MLP and unpermute as one layer). ``fused`` chooses how: the fused op
    (``expert_mlp``: no copy of the tokens, a gradient that keeps fc1's output only) or the
    composition; None (the default) fuses where that is measured faster, on the CPU, and
    never under ``fp8`` or main_grad accumulation, which the fused op does not do. It is
    ``module(tokens, expert_indices=..., probs=..., group_offset=...)``: a call of the
    module, so that its hooks run around either form (FSDP2's ``fully_shard`` gathers the
    parameters in one).
    """

    def __init__(self, num_experts, hidden_size, ffn_hidden_size, *, activation="swiglu", bias=False, device=None,
                 dtype=None, accumulate_into_main_grad=False, fp8=None, fused=None):
        super().__init__()
        fn = "GroupedMLP"
        contract.layer_config(fn, dtype_name(dtype or torch.get_default_dtype()),
                              {"bias": bias, "accumulate_into_main_grad": accumulate_into_main_grad},
                              num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        contract.activation_kind(activation, fn)
        self.activation = activation
        self.fused = contract.check_fused(fused, fp8, fn)
        contract.fp8_layer(fn, fp8, dtype_name(dtype or torch.get_default_dtype()), hidden_size, ffn_hidden_size,
                           ("hidden_size", "ffn_hidden_size"))  # in its own terms, before fc1's and fc2's
        f_in = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        common = {"bias": bias, "device": device, "dtype": dtype,
                  "accumulate_into_main_grad": accumulate_into_main_grad, "fp8": fp8}
        self.fc1 = GroupedLinear(num_experts, hidden_size, f_in, **common)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, **common)

    def forward(self, x, group_sizes=None, *, expert_indices=None, probs=None, group_offset=None):
        """Rows sorted by expert (``group_sizes``), or routed tokens (``expert_indices`` and
        the rest: ``forward_routed``'s arguments)."""
        if (group_sizes is None) == (expert_indices is None):
            raise TypeError("GroupedMLP: give group_sizes (rows sorted by expert) or expert_indices (routed "
                            f"tokens), one of them; got {'neither' if group_sizes is None else 'both'}")
        if group_sizes is not None:
            if probs is not None or group_offset is not None:
                raise TypeError("GroupedMLP: probs and group_offset go with expert_indices (routed tokens), "
                                "not with group_sizes")
            self._check_input(x, "x")
            contract.layer_group_sizes(group_sizes, self.fc1.num_experts, "GroupedMLP", dtype_name)
            return self.fc2(expert.activate(self.fc1(x, group_sizes), self.activation), group_sizes)
        self._check_input(x, "tokens")
        if self._runs_fused(x.device):
            return expert_mlp.expert_mlp(x, expert_indices, probs, self.fc1.weight, self.fc2.weight,
                                         activation=self.activation, b_in=self.fc1.bias, b_out=self.fc2.bias,
                                         group_offset=group_offset, transpose_weight=True, fp8=self.fc1.fp8)
        return expert_mlp.composed_expert_mlp(x, expert_indices, probs, self, group_offset=group_offset)

    def forward_routed(self, tokens, expert_indices, probs=None, *, group_offset=None):
        """``out [T, H]``: each token's ``sum over j of probs[t, j] * mlp_e(tokens[t])``,
        ``e = expert_indices[t, j] - group_offset`` among this module's experts (a slot with
        any other id adds nothing; ``probs=None``: weight 1), summed in slot order in
        float32. The same values either way ``fused`` chooses (see the class)."""
        return self(tokens, expert_indices=expert_indices, probs=probs, group_offset=group_offset)

    def _check_input(self, x, name):
        """The MLP's input in its own terms (hidden_size, the layer's dtype), before fc1 or the
        fused op would name theirs (fc1's in_features, permuted rows)."""
        shape, x_dtype = shape_and_dtype(x, name, "GroupedMLP")
        contract.layer_x(shape, x_dtype, self.fc1.in_features, "hidden_size",
                         autocast.layer_dtype(x, self, "GroupedMLP"), "GroupedMLP", name, rank=2)

    def _runs_fused(self, device):
        if self.fused and self.fc1.accumulate_into_main_grad:
            raise NotImplementedError("GroupedMLP: fused=True does not accumulate into main_grad; use fused=None "
                                      "(the composition) with accumulate_into_main_grad")
        if self.fused is not None:
            return self.fused
        return (expert_mlp.fused_by_default(device) and self.fc1.fp8 is None
                and not self.fc1.accumulate_into_main_grad)

    def extra_repr(self):
        return f"activation={self.activation!r}, fused={self.fused!r}"
