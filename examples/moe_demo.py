"""Train a small character-level MoE language model in JAX and in PyTorch, side by side.

The text is the Python standard library's own sources (every machine has them). The
model reads the last few characters (their embeddings, concatenated and projected),
runs them through MoE blocks (softmax top-k router, permute, a grouped SwiGLU expert
MLP, unpermute; examples/moe_block.py) and predicts the next character. Both
frameworks start from one NumPy initialisation and see the same batches. Every few
steps the router is barred from the experts of a simulated second rank, so all of that
rank's experts receive zero tokens: training goes on and their gradients are exact
zeros. The MoE blocks give the same bits in both frameworks; the embedding projection,
the head and the loss are each framework's own kernels, so the two loss curves agree
closely but not exactly.
Writes a PNG of both loss curves and prints a sample of generated text.

``--experts`` sets how the expert MLPs compute: float32 (the default), bfloat16 (bfloat16
weights, tokens cast to bfloat16 and back), or fp8-rowwise / fp8-blockwise (the same
bfloat16 weights, every expert GEMM of the forward and backward in float8: the training
recipe of GroupedMLP(fp8=...) and grouped_mlp(fp8=...)). Those three use widths of 128
(the blockwise recipe contracts in 128-blocks), so their losses compare with each other.

Run: python examples/moe_demo.py [--steps 300] [--experts float32|bfloat16|fp8-rowwise|fp8-blockwise]
"""

import argparse
import os
import sys
import time

import numpy as np
from moe_block import init_block, jax_block, torch_block_class

VOCAB, CONTEXT, EMBED, EXPERTS, TOP_K, BLOCKS, BATCH = 128, 6, 24, 8, 2, 2, 512
# The expert MLPs' precision -> (model width, FFN width, expert weights' dtype, fp8 recipe).
EXPERTS_PRECISION = {"float32": (96, 96, "float32", None), "bfloat16": (128, 128, "bfloat16", None),
                     "fp8-rowwise": (128, 128, "bfloat16", "rowwise"),
                     "fp8-blockwise": (128, 128, "bfloat16", "blockwise")}
RANKS = 2  # experts [0, 4) on rank 0 and [4, 8) on rank 1, simulated
IDLE_RANK_EVERY = 4  # on these steps rank 1's experts receive no tokens


def corpus(limit=400_000):
    """ASCII text of standard-library modules, sorted by name so every machine reads the same."""
    folder = os.path.dirname(os.__file__)
    text = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8", errors="ignore") as f:
                text.append(f.read())
        if sum(map(len, text)) >= limit:
            break
    data = np.frombuffer("\n".join(text).encode("ascii", errors="ignore"), np.uint8)
    return data[data < VOCAB][:limit].astype(np.int32)


def init_params(dim, ffn, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": (rng.standard_normal((VOCAB, EMBED)) * 0.5).astype(np.float32),
        "proj": (rng.standard_normal((CONTEXT * EMBED, dim)) / np.sqrt(CONTEXT * EMBED)).astype(np.float32),
        "blocks": [init_block(rng, dim, ffn, EXPERTS) for _ in range(BLOCKS)],
        "head": (rng.standard_normal((dim, VOCAB)) / np.sqrt(dim)).astype(np.float32),
    }


def batches(data, steps, seed=1):
    """(contexts [B, CONTEXT], next characters [B], experts allowed [E]) per step."""
    rng = np.random.default_rng(seed)
    window = np.arange(CONTEXT)
    for step in range(steps):
        starts = rng.integers(0, len(data) - CONTEXT - 1, BATCH)
        allowed = np.ones(EXPERTS, bool)
        if step % IDLE_RANK_EVERY == IDLE_RANK_EVERY - 1:
            allowed[EXPERTS // RANKS:] = False  # every expert on rank 1 gets zero tokens
        yield data[starts[:, None] + window], data[starts + CONTEXT], allowed


# ---- JAX ----------------------------------------------------------------------------


def jax_model(fp8=None):
    import jax
    import jax.numpy as jnp

    def forward(params, context, allowed):
        x = params["embed"][context].reshape(context.shape[0], -1) @ params["proj"]
        sizes = []
        for block in params["blocks"]:
            moe, group_sizes = jax_block(block, x, TOP_K, allowed, fp8=fp8)
            x = x + moe
            sizes.append(group_sizes)
        return x @ params["head"], sizes

    def loss_fn(params, context, target, allowed):
        logits, sizes = forward(params, context, allowed)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, target[:, None], 1).mean(), sizes

    @jax.jit
    def step(params, context, target, allowed, lr):
        (loss, sizes), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, context, target, allowed)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, sizes, grads

    return forward, step


# ---- PyTorch ------------------------------------------------------------------------


def torch_model(params, fp8=None, experts_dtype="float32"):
    import torch

    block_class = torch_block_class()

    class MoELanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Parameter(torch.tensor(params["embed"]))
            self.proj = torch.nn.Parameter(torch.tensor(params["proj"]))
            self.blocks = torch.nn.ModuleList(block_class(b, TOP_K, fp8, getattr(torch, experts_dtype))
                                              for b in params["blocks"])
            self.head = torch.nn.Parameter(torch.tensor(params["head"]))

        def forward(self, context, allowed=None):
            x = self.embed[context].reshape(context.shape[0], -1) @ self.proj
            sizes = []
            for block in self.blocks:
                moe, group_sizes = block(x, allowed)
                x = x + moe
                sizes.append(group_sizes)
            return x @ self.head, sizes

    return MoELanguageModel()


def sample(next_logits, prompt, length, seed=2, temperature=0.8):
    """Characters drawn one at a time from a model's next-character logits."""
    rng = np.random.default_rng(seed)
    text = list(prompt.encode("ascii"))
    for _ in range(length):
        logits = next_logits(np.asarray(text[-CONTEXT:], np.int32)[None]) / temperature
        p = np.exp(logits - logits.max())
        text.append(int(rng.choice(VOCAB, p=p / p.sum())))
    return bytes(text).decode("ascii", errors="replace")


def progress(step, steps, width=20):
    filled = width * step // steps
    return "[" + "#" * filled + "." * (width - filled) + f"] {step:>3}/{steps}"


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import torch

    # Both frameworks on the CPU, also on a machine with a GPU (where JAX's default device
    # would be the GPU while torch's stays the CPU): the two runs stay comparable.
    jax.config.update("jax_default_device", "cpu")

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--print-every", type=int, default=25)
    parser.add_argument("--experts", choices=list(EXPERTS_PRECISION), default="float32",
                        help="how the expert MLPs compute (see the description)")
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "moe_demo_loss.png"))
    args = parser.parse_args(argv)

    data = corpus()
    dim, ffn, experts_dtype, fp8 = EXPERTS_PRECISION[args.experts]
    params = init_params(dim, ffn)
    jax_forward, jax_step = jax_model(fp8)
    jax_params = jax.tree.map(jnp.asarray, params)
    for block in jax_params["blocks"]:  # the expert weights in their dtype, as the torch model keeps them
        block["w_in"], block["w_out"] = (block[k].astype(experts_dtype) for k in ("w_in", "w_out"))
    model = torch_model(params, fp8, experts_dtype)
    torch_opt = torch.optim.SGD(model.parameters(), lr=args.lr)  # p - lr * g, as the JAX step
    print(f"character-level MoE language model on {len(data):,} characters of Python's standard library: "
          f"{BLOCKS} MoE blocks, {EXPERTS} experts ({RANKS} simulated ranks), top-{TOP_K}, SwiGLU, width {dim}, "
          f"{BATCH} tokens/step, experts in {args.experts} (the rest float32) on CPU, JAX and PyTorch from one "
          "initialisation")
    print(f"{'progress':>30}  {'JAX loss':>9}  {'torch loss':>10}  {'|diff|':>8}  experts without tokens (block: ids)")
    jax_losses, torch_losses, t0 = [], [], time.time()
    for step, (context, target, allowed) in enumerate(batches(data, args.steps), start=1):
        jax_params, loss_j, sizes, grads = jax_step(jax_params, jnp.asarray(context), jnp.asarray(target),
                                                    jnp.asarray(allowed), args.lr)
        torch_opt.zero_grad()
        logits, torch_sizes = model(torch.from_numpy(context), torch.from_numpy(allowed))
        loss_t = torch.nn.functional.cross_entropy(logits, torch.from_numpy(target).long())
        loss_t.backward()
        # Experts without tokens have full-shape, exact-zero gradients in both frameworks.
        empty = [np.flatnonzero(np.asarray(s) == 0) for s in sizes]  # host copies for printing only
        for block, (idle, torch_sizes_of_block) in enumerate(zip(empty, torch_sizes)):
            assert not np.asarray(grads["blocks"][block]["w_in"])[idle].any()
            torch_idle = torch.nonzero(torch_sizes_of_block == 0).flatten()
            assert not model.blocks[block].experts.fc1.weight.grad[torch_idle].any()
        torch_opt.step()
        jax_losses.append(float(loss_j))
        torch_losses.append(float(loss_t.detach()))
        if step % args.print_every == 0 or step <= IDLE_RANK_EVERY:
            note = "  ".join(f"{b}: {idle.tolist()}" for b, idle in enumerate(empty) if len(idle)) or "-"
            if not allowed[EXPERTS // RANKS:].any():
                note += "  <- every expert on rank 1 idle"
            print(f"{progress(step, args.steps):>30}  {jax_losses[-1]:>9.4f}  {torch_losses[-1]:>10.4f}  "
                  f"{abs(jax_losses[-1] - torch_losses[-1]):>8.1e}  {note}")
            sys.stdout.flush()
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(jax_losses, torch_losses))
    last = max(1, args.steps // 10)  # the final loss: the mean over the last tenth of the steps
    print(f"done in {time.time() - t0:.1f} s; loss {jax_losses[0]:.3f} -> {jax_losses[-1]:.3f} "
          f"(uniform guess: {np.log(VOCAB):.3f}); mean of the last {last} steps: JAX "
          f"{np.mean(jax_losses[-last:]):.4f}, PyTorch {np.mean(torch_losses[-last:]):.4f}; "
          f"largest relative JAX/torch loss difference {worst:.1e}")
    # The MoE blocks give the same bits in both frameworks; the projection, the head and
    # the loss are each framework's own float32 kernels, so the two runs drift apart by
    # rounding (a near-tie in top-k then sends a token to another expert). Experts in
    # bfloat16 or float8 turn those differences into larger ones along the way (a changed
    # input moves a rounding or a block's scale), so there the two runs must end level.
    if args.experts == "float32":
        assert worst < 5e-2, "JAX and PyTorch losses diverged"
    else:
        end_jax, end_torch = np.mean(jax_losses[-last:]), np.mean(torch_losses[-last:])
        assert abs(end_jax - end_torch) < 2e-2 * end_torch, "JAX and PyTorch losses ended apart"

    with torch.no_grad():
        text = sample(lambda c: model(torch.from_numpy(c))[0][0].numpy(), "    def ", 240)
    print("sample (PyTorch model, temperature 0.8):\n" + text)
    write_plot(args.plot, jax_losses, torch_losses)


def write_plot(path, jax_losses, torch_losses):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(jax_losses) + 1)
    ax.plot(steps, jax_losses, label="JAX (groupgemm.jax)", lw=2)
    ax.plot(steps, torch_losses, "--", label="PyTorch (groupgemm.torch)", lw=2)
    for s in steps[(steps % IDLE_RANK_EVERY) == 0]:
        ax.axvline(s, color="grey", alpha=0.12)
    ax.set_xlabel("step (grey: every expert on rank 1 had zero tokens)")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("Character-level MoE language model, same init and batches")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"loss plot written to {path}")


if __name__ == "__main__":
    main()
