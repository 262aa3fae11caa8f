"""The MoE layers' routing weights: with top_k > 1 the softmax over the chosen experts
(renormalized, Mixtral), with top_k = 1 the full softmax's probability (Switch Transformer),
so that a top-1 router gets a gradient; ``renormalize`` overrides either. groupgemm.flax's
MoE and groupgemm.torch's ExpertParallelMoE (one rank) against the float64 reference."""

import expert_reference as eref
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
import torch
import torch.distributed as dist
from clients import require

import groupgemm.torch as gt

nnx = require("flax.nnx")
import groupgemm.flax as gf  # noqa: E402

EXPERTS, HIDDEN, FFN, TOKENS = 4, 8, 6, 12
# (top_k, renormalize as given, as the layers resolve it)
SETTINGS = [(1, None, False), (1, True, True), (1, False, False), (2, None, True), (2, False, False)]


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return dict(x=rng.standard_normal((TOKENS, HIDDEN)), router=rng.standard_normal((HIDDEN, EXPERTS)),
                w_in=rng.standard_normal((EXPERTS, 2 * FFN, HIDDEN)) / 3,
                w_out=rng.standard_normal((EXPERTS, HIDDEN, FFN)) / 3, dout=rng.standard_normal((TOKENS, HIDDEN)))


def reference(w, top_k, renormalize):
    """out and the router's gradient in float64, from the float32-rounded inputs."""
    w = {name: value.astype(np.float32).astype(np.float64) for name, value in w.items()}
    logits = w["x"] @ w["router"]
    probs, experts = eref.softmax_topk(logits, top_k, renormalize)
    out, grads = eref.expert_mlp_and_grads(w["x"], experts, probs, w["w_in"], w["w_out"], None, None, w["dout"],
                                           "swiglu")
    dprobs = grads[3]
    return out, w["x"].T @ eref.softmax_topk_grad(logits, experts, dprobs, renormalize)


def nnx_run(w, top_k, renormalize):
    moe = gf.MoE(EXPERTS, HIDDEN, FFN, top_k, renormalize=renormalize, rngs=nnx.Rngs(0))
    for param, name in ((moe.router, "router"), (moe.experts.fc1.weight, "w_in"), (moe.experts.fc2.weight, "w_out")):
        param.set_value(jnp.asarray(w[name], jnp.float32))

    def loss(moe):
        out = moe(jnp.asarray(w["x"], jnp.float32))
        return jnp.sum(out * jnp.asarray(w["dout"], jnp.float32)), out

    grads, out = nnx.grad(loss, has_aux=True)(moe)
    return moe.renormalize, np.asarray(out, np.float64), np.asarray(grads["router"][...], np.float64)


def torch_run(w, top_k, renormalize, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        moe = gt.ExpertParallelMoE(EXPERTS, HIDDEN, FFN, top_k, renormalize=renormalize)
        with torch.no_grad():
            for param, name in ((moe.router, "router"), (moe.experts.fc1.weight, "w_in"),
                                (moe.experts.fc2.weight, "w_out")):
                param.copy_(torch.from_numpy(w[name]))
        out, _ = moe(torch.from_numpy(w["x"]).float())
        out.backward(torch.from_numpy(w["dout"]).float())
        return moe.renormalize, out.detach().double().numpy(), moe.router.grad.double().numpy()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("framework", ["flax", "torch"])
@pytest.mark.parametrize("top_k, renormalize, resolved", SETTINGS)
def test_routing_weights_match_the_reference_and_a_top1_router_learns(framework, top_k, renormalize, resolved,
                                                                      tmp_path):
    w = weights()
    if framework == "flax":
        got_resolved, out, router_grad = nnx_run(w, top_k, renormalize)
    else:
        got_resolved, out, router_grad = torch_run(w, top_k, renormalize, tmp_path / "store")
    assert got_resolved is resolved
    want_out, want_router_grad = reference(w, top_k, resolved)
    ref.assert_close(out, want_out, "float32", "out")
    ref.assert_close(router_grad, want_router_grad, "float32", "router gradient")
    if top_k == 1 and resolved:  # every weight renormalized is 1: nothing reaches the router
        assert (router_grad == 0).all()
    else:
        assert np.abs(router_grad).min() > 0


ROUTING_REFUSED = [  # (top_k, renormalize, error, message after the layer's name)
    (2, "yes", TypeError, "renormalize must be None, True or False, got 'yes'"),
    (2, 1, TypeError, "renormalize must be None, True or False, got 1"),
    (0, None, ValueError, "top_k must be at least 1, got 0"),
    (EXPERTS + 1, None, ValueError, rf"top_k = {EXPERTS + 1} exceeds {EXPERTS} \(the number of experts\)"),
]


@pytest.mark.parametrize("top_k, renormalize, error, message", ROUTING_REFUSED)
def test_routing_arguments_that_mean_nothing_are_refused_naming_them(tmp_path, top_k, renormalize, error, message):
    with pytest.raises(error, match="MoE: " + message):
        gf.MoE(EXPERTS, HIDDEN, FFN, top_k, renormalize=renormalize, rngs=nnx.Rngs(0))
    with pytest.raises(error, match="ExpertParallelMoE: " + message):
        gf.ExpertParallelMoE(EXPERTS, HIDDEN, FFN, top_k, renormalize=renormalize, rngs=nnx.Rngs(0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(error, match="ExpertParallelMoE: " + message):
            gt.ExpertParallelMoE(EXPERTS, HIDDEN, FFN, top_k, renormalize=renormalize)
    finally:
        dist.destroy_process_group()
