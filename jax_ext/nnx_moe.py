"""Flax NNX MoE layers: ``MoE`` (router and grouped expert MLP on one device, or on a mesh
by groupgemm's sharding rules) and ``ExpertParallelMoE`` (dispatch and combine over a mesh
axis inside ``jax.shard_map``), the twins of groupgemm.torch's ExpertParallelMoE and of its
single-process layer: router (a core GEMM of one group), softmax top-k and the experts'
``GroupedMLP.forward_routed``."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from groupgemm import _contract as contract
from groupgemm import _dispatch_plan as rules
from groupgemm.jax_ext.arguments import requested_dtype, shape_and_dtype
from groupgemm.jax_ext.expert import softmax_topk
from groupgemm.jax_ext.expert_parallel import dropless_capacity, moe_layer
from groupgemm.jax_ext.functional import grouped_matmul
from groupgemm.jax_ext.nnx_layers import GroupedMLP, annotated, check_expert_axis, checked_value, parameters_dtype


def _router(hidden_size, num_experts, dtype, mesh, rngs):
    """The router's ``[H, E]`` weight, N(0, 0.02^2) as groupgemm.torch's, whole on every device."""
    init = annotated(nnx.initializers.normal(0.02), (None, None), mesh)
    return nnx.Param(init(rngs.params(), (hidden_size, num_experts), dtype))


def _checked_input(x, allowed, layer, experts_shape, fn):
    """allowed as an array, after x and allowed are checked against the layer."""
    allowed = None if allowed is None else jnp.asarray(allowed)
    contract.layer_input(shape_and_dtype(x), layer.experts.fc1.in_features,
                         None if allowed is None else shape_and_dtype(allowed), experts_shape, fn,
                         parameters_dtype(layer, fn))
    return allowed


def _on_data_axis(x, axis):
    """x with its leading axis (the routing groups) split over ``axis`` of the mesh set by
    ``jax.set_mesh`` where it can be: the mesh has the axis, not as a manual one (inside
    ``shard_map`` x already is the device's share), and its size divides the groups (a
    batch of one, as in decoding, stays whole); x as it is otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty or axis not in mesh.axis_names or axis in mesh.manual_axes \
            or x.shape[0] % mesh.shape[axis]:
        return x
    if axis in mesh.explicit_axes:
        return jax.sharding.reshard(x, P(axis))
    return _split_over(x, axis)


@functools.partial(jax.jit, static_argnums=1)
def _split_over(x, axis):
    """The constraint in a jit of its own: its spec names the abstract mesh, which only a jit
    resolves to jax.set_mesh's devices, so an eager call (or eager grad) of the layer runs
    it as a small program of its own (inside the layer's jit it is inlined)."""
    return jax.lax.with_sharding_constraint(x, P(axis))


def _as_specs(operands, specs, mesh):
    """The operands resharded as shard_map's ``specs`` say where the mesh's axes are
    explicit (shard_map then takes only arrays already sharded so); as they are otherwise."""
    if not mesh.are_all_axes_explicit:
        return operands
    place = (lambda spec: spec) if isinstance(mesh, jax.sharding.AbstractMesh) else \
        (lambda spec: jax.sharding.NamedSharding(mesh, spec))
    return [jax.sharding.reshard(a, place(spec)) for a, spec in zip(operands, specs)]


class MoE(nnx.Module):
    """A Mixture-of-Experts layer (Flax NNX): softmax top-k router, then the experts on the
    routed tokens, weighted by the router's probabilities (the caller adds the residual).

    ``router [hidden_size, num_experts]`` (N(0, 0.02^2)) and ``experts``, a
    ``GroupedMLP(num_experts, hidden_size, ffn_hidden_size, activation=..., fp8=...,
    fused=...)`` applied by its ``forward_routed``: the fused expert MLP where it is
    measured faster (the CPU; ``fused=None``), else permute, the grouped MLP and unpermute.
    The router's logits are a core GEMM (one group of every token), so every step with
    arithmetic runs in the core: groupgemm.torch's softmax_topk and
    ``GroupedMLP.forward_routed`` around the same parameters, with the same ``fused``,
    give the same bits.

    ``moe(x, allowed=None)``: ``x [T, H]`` -> ``[T, H]``; or ``x [B, T, H]``, B routing
    groups each routed on its own (``jax.vmap``) -> ``[B, T, H]``. ``allowed``
    (broadcastable to ``x.shape[:-1] + (E,)``) bars experts from routing; a token with none
    allowed goes nowhere (output 0). Routing stays on the device: one ``nnx.jit`` compile
    serves every routing, experts without tokens get exact-zero gradients.

    Sharding under ``nnx.jit`` on a mesh: the experts' weights over ``expert_axis``, the
    router whole, and with ``x [B, T, H]`` the routing groups over ``data_axis`` (where the
    mesh set by ``jax.set_mesh`` has that axis, not as a manual one, and its size divides
    B): each device routes its groups' tokens through its own experts, and the only
    collectives are the all-reduces over the expert axis and the data-parallel sum of the
    gradients. Called eagerly inside ``jax.set_mesh``, it splits x so too (x made outside the
    mesh included).

    ``renormalize``: softmax_topk's; None (the default) renormalizes for top_k > 1 only (a
    top-1 weight renormalized is always 1, and the router would not learn).
    """

    def __init__(self, num_experts, hidden_size, ffn_hidden_size, top_k, *, activation="swiglu", fp8=None,
                 dtype=jnp.float32, expert_axis="expert", data_axis="data", mesh=None, fused=None, renormalize=None,
                 rngs):
        fn = "MoE"
        contract.layer_config(fn, requested_dtype(dtype, "dtype", fn), num_experts=num_experts,
                              hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        check_expert_axis(num_experts, expert_axis, mesh, fn)
        self.num_experts = num_experts
        self.top_k, self.renormalize = contract.layer_routing(top_k, num_experts, renormalize, fn)
        self.data_axis = data_axis
        self.router = _router(hidden_size, num_experts, dtype, mesh, rngs)
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size, activation=activation, fp8=fp8,
                                  dtype=dtype, expert_axis=expert_axis, mesh=mesh, fused=fused, rngs=rngs)

    def __call__(self, x, allowed=None):
        fn = "MoE"
        x = jnp.asarray(x)
        if x.ndim not in (2, 3):
            raise ValueError(f"{fn}: x must be 2-D [T, H] or 3-D [B, T, H] (B routing groups), got shape {x.shape}")
        allowed = _checked_input(x, allowed, self, x.shape[:-1] + (self.num_experts,), fn)
        router = checked_value(self.router, (self.experts.fc1.in_features, self.num_experts), "router", fn)

        def route(tokens, allowed):
            logits = grouped_matmul(tokens, router[None], jnp.full((1,), tokens.shape[0], jnp.int32))
            if allowed is not None:
                logits = jnp.where(allowed, logits, -jnp.inf)
            probs, experts = softmax_topk(logits, self.top_k, renormalize=self.renormalize)
            return self.experts.forward_routed(tokens, experts, probs)

        if x.ndim == 2:
            return route(x, allowed)
        if allowed is not None:  # split over the data axis as x is: vmap maps both alike
            allowed = _on_data_axis(jnp.broadcast_to(allowed, x.shape[:-1] + (self.num_experts,)), self.data_axis)
        return jax.vmap(route)(_on_data_axis(x, self.data_axis), allowed)


class ExpertParallelMoE(nnx.Module):
    """An expert-parallel MoE layer over a mesh axis (Flax NNX), groupgemm.torch's
    ExpertParallelMoE: softmax top-k router (``router [H, E]``, whole on every device),
    dispatch, the grouped MLP of each device's experts (``experts``, a GroupedMLP of all
    ``num_experts`` experts whose weights are split over ``expert_axis``: device d of that
    axis holds experts ``[d * E_local, (d + 1) * E_local)``), combine;
    ``groupgemm.jax.moe_layer`` inside ``jax.shard_map``.

    ``moe(x, allowed=None)`` takes the global ``x [T, H]``, its tokens split over
    ``data_axis`` (where the mesh has it) and ``expert_axis``, each device's block its
    own tokens (T a multiple of the number of blocks), and returns ``(out [T, H],
    dropped)``, ``dropped [blocks]`` each block's slots past capacity. ``allowed``
    (broadcastable to ``[T, E]``) bars experts from routing. ``capacity`` as in
    ``groupgemm.jax.dispatch``; None (the default): ``dropless_capacity`` of a block,
    nothing dropped. Static shapes: one ``nnx.jit`` compile serves every routing. The
    router's gradient is the sum over every device's tokens. ``mesh``: the mesh to run on
    (and to place the parameters on as they are created); None: the mesh set by
    ``jax.set_mesh`` when the layer is called. ``fused``: GroupedMLP's, for the rows each
    device receives (moe_layer's). ``renormalize``: moe_layer's.
    """

    def __init__(self, num_experts, hidden_size, ffn_hidden_size, top_k, mesh=None, *, capacity=None,
                 activation="swiglu", fp8=None, dtype=jnp.float32, expert_axis="expert", data_axis="data", fused=None,
                 renormalize=None, rngs):
        fn = "ExpertParallelMoE"
        contract.layer_config(fn, requested_dtype(dtype, "dtype", fn), num_experts=num_experts,
                              hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        rules.check(num_experts, 1, capacity, fn)
        self.num_experts, self.capacity, self.activation, self.fp8 = num_experts, capacity, activation, fp8
        self.top_k, self.renormalize = contract.layer_routing(top_k, num_experts, renormalize, fn)
        self.mesh, self.expert_axis, self.data_axis = mesh, expert_axis, data_axis
        known = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        if not known.empty:  # checked now where the mesh is known, else at the call
            self._token_axes(known)
        self.router = _router(hidden_size, num_experts, dtype, mesh, rngs)
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size, activation=activation, fp8=fp8,
                                  dtype=dtype, expert_axis=expert_axis, mesh=mesh, fused=fused, rngs=rngs)

    def _token_axes(self, mesh):
        """The mesh axes the tokens are split over, checking that the expert axis divides num_experts."""
        fn = "ExpertParallelMoE"
        if self.expert_axis not in mesh.axis_names:
            raise ValueError(f"{fn}: expert_axis {self.expert_axis!r} is not an axis of the mesh {mesh.axis_names}")
        rules.check(self.num_experts, mesh.shape[self.expert_axis], self.capacity, fn)
        return tuple(a for a in (self.data_axis, self.expert_axis) if a in mesh.axis_names)

    def __call__(self, x, allowed=None):
        fn = "ExpertParallelMoE"
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(f"{fn}: no mesh: pass mesh= or call the layer under jax.set_mesh(mesh)")
        x = jnp.asarray(x)
        contract.check_rank(x.shape, 2, "x", "[T, H]", fn)
        allowed = _checked_input(x, allowed, self, (x.shape[0], self.num_experts), fn)
        token_axes = self._token_axes(mesh)
        blocks = math.prod(mesh.shape[a] for a in token_axes)
        if x.shape[0] % blocks:
            raise ValueError(f"{fn}: x has {x.shape[0]} tokens, not a multiple of the {blocks} devices of mesh axes "
                             f"{token_axes} that each hold a block of them")
        capacity = self.capacity or dropless_capacity(x.shape[0] // blocks, self.top_k)
        router = checked_value(self.router, (self.experts.fc1.in_features, self.num_experts), "router", fn)
        (w_in, _), (w_out, _) = self.experts.fc1.weight_and_bias(), self.experts.fc2.weight_and_bias()
        operands, tokens = [router, w_in, w_out, x], P(token_axes)
        specs = [P(), P(self.expert_axis), P(self.expert_axis), tokens]
        if allowed is not None:
            operands.append(jnp.broadcast_to(allowed, (x.shape[0], self.num_experts)))
            specs.append(tokens)

        def local(router, w_in, w_out, x, allowed=None):
            out, dropped = moe_layer({"router": router, "w_in": w_in, "w_out": w_out}, x,
                                     num_experts=self.num_experts, top_k=self.top_k, axis_name=self.expert_axis,
                                     capacity=capacity, activation=self.activation, transpose_rhs=True,
                                     allowed=allowed, fp8=self.fp8, fused=self.experts.fused,
                                     renormalize=self.renormalize)
            return out, dropped[None]

        return jax.shard_map(local, mesh=self.mesh, in_specs=tuple(specs), out_specs=(tokens, tokens))(
            *_as_specs(operands, specs, mesh))
