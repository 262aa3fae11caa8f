"""Flax NNX layers over groupgemm's JAX ops: ``GroupedLinear`` and ``GroupedMLP``, the twins
of groupgemm.torch's modules (torch_ext/module.py). The same arguments, parameter shapes,
initialisation and core calls, so a parameter copied from one to the other gives the same
bits. Every parameter carries its sharding (``nnx.with_partitioning``): experts over the
expert axis, the rest whole, which groupgemm's ops keep under ``nnx.jit`` on a mesh
(partitioning.py)."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from groupgemm import _contract as contract
from groupgemm.jax_ext import fp8_recipe
from groupgemm.jax_ext.arguments import dtype_name, requested_dtype
from groupgemm.jax_ext.expert import grouped_mlp
from groupgemm.jax_ext.expert_mlp import composed_expert_mlp, expert_mlp, runs_fused
from groupgemm.jax_ext.functional import grouped_matmul


def annotated(init, sharding, mesh):
    """``init`` whose parameter carries ``sharding`` (one mesh axis name or None per
    dimension). Flax places an annotated parameter on its mesh as it is created, which
    needs a mesh: ``mesh``, or the one ``jax.set_mesh`` set. Where there is neither, the
    parameter stays where it is and keeps the annotation, for ``nnx.get_partition_spec``."""
    eager = nnx.using_eager_sharding() and (mesh is not None or not jax.sharding.get_abstract_mesh().empty)
    return nnx.with_partitioning(init, sharding, mesh=mesh, eager_sharding=eager)


def symmetric_uniform(bound):
    """U(-bound, bound): nn.Linear's initialisation of both its weight and bias, with
    bound = 1 / sqrt(in_features)."""
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def check_expert_axis(num_experts, expert_axis, mesh, fn):
    """Where the parameters are placed on a mesh as they are created (``annotated``): the
    experts' axis is one of the mesh's axes, and its size divides num_experts."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if expert_axis is None or mesh.empty or not nnx.using_eager_sharding():
        return
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"{fn}: expert_axis {expert_axis!r} is not an axis of the mesh {mesh.axis_names}; pass "
                         "expert_axis=None to keep every expert on every device")
    if num_experts % mesh.shape[expert_axis]:
        raise ValueError(f"{fn}: num_experts = {num_experts} is not a multiple of the {mesh.shape[expert_axis]} "
                         f"devices of the mesh's expert_axis {expert_axis!r}")


def parameters_dtype(layer, fn):
    """The layer's dtype: its parameters', checked to be one."""
    named = [(".".join(map(str, path)), dtype_name(param.dtype))
             for path, param in nnx.to_flat_state(nnx.state(layer, nnx.Param))]
    contract.layer_parameters(named, fn)
    return named[0][1]


def checked_value(param, want, name, fn):
    """A parameter's array, its shape checked against the layer's configuration (a
    parameter replaced or loaded with another shape is named)."""
    value = param[...]
    contract.check_shape(value.shape, want, name, fn)
    return value


class GroupedLinear(nnx.Module):
    """``num_experts`` independent linear layers over rows grouped by expert (Flax NNX).

    ``weight`` is ``[num_experts, out_features, in_features]`` and ``bias``
    ``[num_experts, out_features]``, drawn like ``nn.Linear``'s (and groupgemm.torch's
    GroupedLinear's): ``U(-1/sqrt(in_features), 1/sqrt(in_features))``, in ``dtype``.
    ``layer(x, group_sizes)`` takes ``x [M, in_features]`` (``dtype``) sorted by expert and
    ``group_sizes`` (a 1-D integer array, traced or not, or a list of ints) and returns
    ``[M, out_features]``; rows past ``sum(group_sizes)`` are 0. Every parameter gets a
    full-shape gradient, exact zeros for experts without tokens.

    ``fp8="rowwise"`` or ``"blockwise"`` runs the forward, input-gradient and
    weight-gradient GEMMs in float8 (e4m3) from float32 or bfloat16 weights and inputs, as
    groupgemm.torch's ``GroupedLinear(fp8=...)`` does (blockwise needs in_features and
    out_features to be multiples of 128). Sharding: ``weight`` and ``bias`` are annotated
    ``(expert_axis, None, ...)`` (None: no axis), placed on ``mesh`` or the mesh set by
    ``jax.set_mesh`` when created under one. PyTorch's ``accumulate_into_main_grad`` has no
    counterpart: JAX gradients are values, added where the caller adds them.
    """

    def __init__(self, num_experts, in_features, out_features, bias=True, *, dtype=jnp.float32, fp8=None,
                 expert_axis="expert", mesh=None, rngs):
        fn = "GroupedLinear"
        dtype_named = requested_dtype(dtype, "dtype", fn)
        contract.layer_config(fn, dtype_named, {"bias": bias}, num_experts=num_experts, in_features=in_features,
                              out_features=out_features)
        check_expert_axis(num_experts, expert_axis, mesh, fn)
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.fp8 = contract.fp8_layer(fn, fp8, dtype_named, in_features, out_features)
        init = symmetric_uniform(1.0 / math.sqrt(in_features) if in_features > 0 else 0.0)
        shape = (num_experts, out_features, in_features)
        self.weight = nnx.Param(annotated(init, (expert_axis, None, None), mesh)(rngs.params(), shape, dtype))
        self.bias = (nnx.Param(annotated(init, (expert_axis, None), mesh)(rngs.params(), shape[:2], dtype))
                     if bias else nnx.data(None))

    def weight_and_bias(self):
        """(weight, bias or None) as arrays, their shapes checked."""
        fn = "GroupedLinear"
        weight = checked_value(self.weight, (self.num_experts, self.out_features, self.in_features), "weight", fn)
        bias = None if self.bias is None else checked_value(self.bias, (self.num_experts, self.out_features),
                                                             "bias", fn)
        return weight, bias

    def __call__(self, x, group_sizes):
        x = jnp.asarray(x)
        weight, bias = self.weight_and_bias()
        contract.layer_x(x.shape, dtype_name(x.dtype), self.in_features, "in_features",
                         parameters_dtype(self, "GroupedLinear"), "GroupedLinear", rank=2)
        contract.layer_group_sizes(group_sizes, self.num_experts, "GroupedLinear", dtype_name)
        if self.fp8 is None:
            return grouped_matmul(x, weight, group_sizes, bias=bias, transpose_rhs=True)
        return fp8_recipe.checked_fp8_grouped_matmul(x, weight, group_sizes, bias=bias,
                                                     transpose_rhs=True, group_offset=None, recipe=self.fp8,
                                                     fn="GroupedLinear")


class GroupedMLP(nnx.Module):
    """Each expert's MLP on its rows, ``fc2(act(fc1(x)))`` (Flax NNX), the activation
    computed in the core: groupgemm.torch's GroupedMLP.

    ``fc1 = GroupedLinear(num_experts, hidden_size, F_in)`` and
    ``fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size)``, with
    ``F_in = 2 * ffn_hidden_size`` for ``"swiglu"`` (``silu(gate) * up``, the first
    ffn_hidden_size columns the gate) and ``ffn_hidden_size`` for ``"gelu"`` (exact erf
    form), ``"relu"`` and ``"silu"``. ``mlp(x, group_sizes)`` takes rows sorted by expert
    (as ``permute`` returns them) and runs ``groupgemm.jax.grouped_mlp`` on the layers'
    weights; rows owned by no expert come out as exact zeros, and every parameter gets a
    full-shape gradient, zero for experts without tokens. ``bias``, ``dtype``, ``fp8``,
    ``expert_axis`` and ``mesh`` are GroupedLinear's, for both layers.

    ``forward_routed(tokens, expert_indices, probs)`` applies the experts to routed tokens
    (permute, the MLP and unpermute as one layer). ``fused`` chooses how: the fused op
    (``groupgemm.jax.expert_mlp``: no copy of the tokens, a gradient that keeps fc1's
    output only) or the composition; None (the default) fuses where that is measured
    faster, on the CPU, and never under ``fp8``, which the fused op does not do.
    """

    def __init__(self, num_experts, hidden_size, ffn_hidden_size, *, activation="swiglu", bias=False,
                 dtype=jnp.float32, fp8=None, expert_axis="expert", mesh=None, fused=None, rngs):
        fn = "GroupedMLP"
        dtype_named = requested_dtype(dtype, "dtype", fn)
        contract.layer_config(fn, dtype_named, {"bias": bias}, num_experts=num_experts, hidden_size=hidden_size,
                              ffn_hidden_size=ffn_hidden_size)
        contract.activation_kind(activation, fn)
        check_expert_axis(num_experts, expert_axis, mesh, fn)
        self.activation, self.fp8, self.fused = activation, fp8, contract.check_fused(fused, fp8, fn)
        contract.fp8_layer(fn, fp8, dtype_named, hidden_size, ffn_hidden_size,
                           ("hidden_size", "ffn_hidden_size"))  # in its own terms, before fc1's and fc2's
        f_in = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        common = {"bias": bias, "dtype": dtype, "fp8": fp8, "expert_axis": expert_axis, "mesh": mesh, "rngs": rngs}
        self.fc1 = GroupedLinear(num_experts, hidden_size, f_in, **common)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, **common)

    def __call__(self, x, group_sizes):
        x = jnp.asarray(x)
        (w_in, b_in), (w_out, b_out) = self.fc1.weight_and_bias(), self.fc2.weight_and_bias()
        self._check_input(x, "x")
        contract.layer_group_sizes(group_sizes, self.fc1.num_experts, "GroupedMLP", dtype_name)
        return grouped_mlp(x, w_in, w_out, group_sizes, activation=self.activation, b_in=b_in, b_out=b_out,
                           transpose_rhs=True, fp8=self.fp8)

    def _check_input(self, x, name):
        """The MLP's input in its own terms (hidden_size, the layer's dtype), before the ops
        would name theirs."""
        contract.layer_x(x.shape, dtype_name(x.dtype), self.fc1.in_features, "hidden_size",
                         parameters_dtype(self, "GroupedMLP"), "GroupedMLP", name, rank=2)

    def forward_routed(self, tokens, expert_indices, probs=None, *, group_offset=None):
        """``out [T, H]``: each token's ``sum over j of probs[t, j] * mlp_e(tokens[t])``,
        ``e = expert_indices[t, j] - group_offset`` among this layer's experts (a slot with
        any other id adds nothing; ``probs=None``: weight 1), summed in slot order in
        float32. The same values either way ``fused`` chooses (see the class)."""
        (w_in, b_in), (w_out, b_out) = self.fc1.weight_and_bias(), self.fc2.weight_and_bias()
        tokens = jnp.asarray(tokens)
        self._check_input(tokens, "tokens")
        return (expert_mlp if runs_fused(self.fused, self.fp8, "GroupedMLP") else composed_expert_mlp)(
            tokens, expert_indices, probs, w_in, w_out, activation=self.activation, b_in=b_in, b_out=b_out,
            group_offset=group_offset, transpose_rhs=True, fp8=self.fp8)
