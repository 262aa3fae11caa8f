"""A tiny MoE language model of groupgemm.flax layers trains with optax under nnx.jit: the
loss falls, the experts barred from routing on a step get exactly zero gradients, and one
compile serves every routing."""

import jax
import jax.numpy as jnp
import numpy as np
from clients import require

nnx = require("flax.nnx")
optax = require("optax")
import groupgemm.flax as gf  # noqa: E402

VOCAB, CONTEXT, DIM, EXPERTS, STEPS = 16, 3, 8, 4, 16
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event of each XLA compile
IDLE = [2, 3]  # barred from routing on odd steps: the experts a second rank would hold


class TinyMoELM(nnx.Module):
    """The last CONTEXT characters' embeddings, concatenated and projected; an MoE block
    with its residual; the next character's logits."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.proj = nnx.Linear(CONTEXT * DIM, DIM, rngs=rngs)
        self.moe = gf.MoE(EXPERTS, DIM, 6, top_k=2, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, context, allowed):
        h = self.proj(self.embed(context).reshape(context.shape[0], -1))
        return self.head(h + self.moe(h, allowed))


def batches(rng, size=64):
    """Contexts of a sequence whose next character follows from the last two (so there is
    something to learn) and their next characters."""
    text = [1, 2]
    for _ in range(4096):
        text.append((3 * text[-1] + text[-2]) % VOCAB)
    text = np.asarray(text, np.int32)
    while True:
        starts = rng.integers(0, len(text) - CONTEXT - 1, size)
        yield text[starts[:, None] + np.arange(CONTEXT)], text[starts + CONTEXT]


def test_tiny_moe_language_model_trains_with_idle_experts_in_one_compile():
    model = TinyMoELM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def train_step(model, optimizer, context, target, allowed):
        traces.append(1)

        def loss_fn(model):
            logits = model(context, allowed)
            return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, grads

    losses, data, compiles = [], batches(np.random.default_rng(0)), []

    def count(event, duration, fun_name="", **kwargs):
        if event == BACKEND_COMPILE:
            compiles.append((len(losses), fun_name))

    jax.monitoring.register_event_duration_secs_listener(count)
    for step in range(STEPS):
        context, target = next(data)
        allowed = np.ones(EXPERTS, bool)
        allowed[IDLE] = step % 2 == 0
        loss, grads = train_step(model, optimizer, jnp.asarray(context), jnp.asarray(target), jnp.asarray(allowed))
        losses.append(float(loss))
        experts = grads["moe"]["experts"]
        for layer in ("fc1", "fc2"):
            grad = np.asarray(experts[layer]["weight"][...])
            assert grad.shape[0] == EXPERTS and grad[0].any()
            assert (grad[IDLE] == 0).all() == (step % 2 == 1), (step, layer)  # zeros exactly when barred
    jax.monitoring.unregister_event_duration_listener(count)
    # Every routing through one trace and one XLA compile of the step; nothing compiles
    # after the first step (the first call also compiles a few small helpers of nnx.jit).
    assert len(traces) == 1 and [name for _, name in compiles].count("jit(train_step)") == 1, compiles
    assert all(step == 0 for step, _ in compiles), compiles
    assert np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4]), losses
