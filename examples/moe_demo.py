"""Train the same top-k MoE block in JAX and in PyTorch with groupgemm, side by side.

Both frameworks start from one NumPy initialisation and see the same batches. Every
few steps the router is barred from the experts of a simulated second rank, so all of
that rank's experts receive zero tokens: training goes on, their gradients are exact
zeros, and the two frameworks keep agreeing. Writes a PNG of both loss curves.

Run: python examples/moe_demo.py [--steps 120]
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from moe_dispatch import sort_by_expert

import groupgemm.jax as gj
from groupgemm.torch import GroupedLinear

DIM, FFN, EXPERTS, TOP_K, TOKENS = 64, 128, 8, 2, 512
RANKS = 2  # experts [0, 4) on rank 0 and [4, 8) on rank 1, simulated
IDLE_RANK_EVERY = 4  # on these steps rank 1's experts receive no tokens


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "router": rng.standard_normal((DIM, EXPERTS)).astype(np.float32) * 0.1,
        "w1": (rng.standard_normal((EXPERTS, DIM, FFN)) / np.sqrt(DIM)).astype(np.float32),
        "w2": (rng.standard_normal((EXPERTS, FFN, DIM)) / np.sqrt(FFN)).astype(np.float32),
    }


def batches(steps, seed=1):
    """A synthetic regression task: y = tanh(x @ teacher)."""
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((DIM, DIM)).astype(np.float32) / np.sqrt(DIM)
    for step in range(steps):
        x = rng.standard_normal((TOKENS, DIM)).astype(np.float32)
        allowed = np.ones(EXPERTS, bool)
        if step % IDLE_RANK_EVERY == IDLE_RANK_EVERY - 1:
            allowed[EXPERTS // RANKS:] = False  # every expert on rank 1 gets zero tokens
        yield x, np.tanh(x @ teacher), allowed


# ---- JAX ------------------------------------------------------------------------


def jax_moe(params, x, allowed):
    logits = jnp.where(allowed, x @ params["router"], -jnp.inf)
    top_p, top_e = jax.lax.top_k(jax.nn.softmax(logits), TOP_K)
    flat_e = top_e.reshape(-1)
    order, sizes = sort_by_expert(flat_e, EXPERTS)  # sizes stay on the device
    token = order // TOP_K
    h = jax.nn.gelu(gj.grouped_matmul(x[token], params["w1"], sizes), approximate=False)
    y = gj.grouped_matmul(h, params["w2"], sizes) * top_p.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y), sizes


@jax.jit
def jax_step(params, x, target, allowed, lr):
    def loss_fn(p):
        out, sizes = jax_moe(p, x, allowed)
        return jnp.mean((out - target) ** 2), sizes

    (loss, sizes), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, sizes, grads


# ---- PyTorch --------------------------------------------------------------------


class TorchMoE(torch.nn.Module):
    def __init__(self, params):
        super().__init__()
        self.router = torch.nn.Parameter(torch.tensor(params["router"]))
        # GroupedLinear stores nn.Linear's [out, in] per expert.
        self.up = GroupedLinear(EXPERTS, DIM, FFN, bias=False)
        self.down = GroupedLinear(EXPERTS, FFN, DIM, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(torch.tensor(params["w1"]).transpose(1, 2))
            self.down.weight.copy_(torch.tensor(params["w2"]).transpose(1, 2))

    def forward(self, x, allowed):
        logits = (x @ self.router).masked_fill(~allowed, float("-inf"))
        top_p, top_e = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
        flat_e = top_e.reshape(-1)
        order, sizes = sort_by_expert(flat_e, EXPERTS)
        token = order // TOP_K
        h = torch.nn.functional.gelu(self.up(x[token], sizes))
        y = self.down(h, sizes) * top_p.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, y)


def progress(step, steps, width=24):
    filled = width * step // steps
    return "[" + "#" * filled + "." * (width - filled) + f"] {step:>3}/{steps}"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=5.0)
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "moe_demo_loss.png"))
    args = parser.parse_args()

    params = init_params()
    jax_params = jax.tree.map(jnp.asarray, params)
    model = TorchMoE(params)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    jax_losses, torch_losses = [], []
    print(f"MoE block: {EXPERTS} experts ({RANKS} simulated ranks), top-{TOP_K}, "
          f"{TOKENS} tokens/step, dim {DIM}, ffn {FFN}, float32 on CPU")
    print(f"{'progress':>34}  {'JAX loss':>9}  {'torch loss':>10}  {'|diff|':>8}  zero-token experts")
    t0 = time.time()
    for step, (x, target, allowed) in enumerate(batches(args.steps), start=1):
        jax_params, loss_j, sizes, jax_grads = jax_step(jax_params, jnp.asarray(x), jnp.asarray(target),
                                                        jnp.asarray(allowed), args.lr)
        opt.zero_grad()
        out = model(torch.from_numpy(x), torch.from_numpy(allowed))
        loss_t = torch.mean((out - torch.from_numpy(target)) ** 2)
        loss_t.backward()
        sizes = np.asarray(sizes)  # host copy for printing only, after the step
        empty = np.flatnonzero(sizes == 0)
        # Experts without tokens have full-shape, exact-zero gradients in both frameworks.
        assert all(not np.asarray(jax_grads["w1"][e]).any() for e in empty)
        assert all(not model.up.weight.grad[e].any() for e in empty)
        opt.step()
        jax_losses.append(float(loss_j))
        torch_losses.append(float(loss_t.detach()))
        note = f"{len(empty)} {[int(e) for e in empty]}" if len(empty) else "0"
        if not allowed[EXPERTS // RANKS:].any():
            note += "  <- every expert on rank 1 idle"
        print(f"{progress(step, args.steps):>34}  {jax_losses[-1]:>9.5f}  {torch_losses[-1]:>10.5f}  "
              f"{abs(jax_losses[-1] - torch_losses[-1]):>8.1e}  {note}")
        sys.stdout.flush()
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(jax_losses, torch_losses))
    print(f"done in {time.time() - t0:.1f} s; loss {jax_losses[0]:.4f} -> {jax_losses[-1]:.4f}; "
          f"largest relative JAX/torch loss difference {worst:.1e}")
    assert worst < 1e-4, "JAX and PyTorch losses diverged"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(jax_losses) + 1)
    ax.plot(steps, jax_losses, label="JAX (groupgemm.jax.grouped_matmul)", lw=2)
    ax.plot(steps, torch_losses, "--", label="PyTorch (groupgemm.torch.GroupedLinear)", lw=2)
    for s in steps[(steps % IDLE_RANK_EVERY) == 0]:
        ax.axvline(s, color="grey", alpha=0.2)
    ax.set_xlabel("step (grey: every expert on rank 1 had zero tokens)")
    ax.set_ylabel("MSE loss")
    ax.set_title("MoE training with groupgemm, same init and batches")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"loss plot written to {args.plot}")


if __name__ == "__main__":
    main()
