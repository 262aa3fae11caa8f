"""An MoE block written with groupgemm's expert layer, in JAX and in PyTorch, from one
NumPy initialisation: a softmax top-k router, permute, the grouped expert MLP (SwiGLU),
unpermute weighted by the router's probabilities, and a residual connection.

Nothing here reads routing on the host: expert choices, group sizes and row maps stay
on the device, a token can go to no expert (every choice masked) and an expert can get
no token, with no special case anywhere.
"""

import numpy as np


def init_block(rng, dim, ffn, experts):
    """The block's parameters as NumPy arrays, in PyTorch's weight layout."""
    return {
        "router": (rng.standard_normal((dim, experts)) * 0.02).astype(np.float32),
        "w_in": (rng.standard_normal((experts, 2 * ffn, dim)) / np.sqrt(dim)).astype(np.float32),
        "w_out": (rng.standard_normal((experts, dim, ffn)) / np.sqrt(ffn) / 2).astype(np.float32),
    }


def jax_block(params, x, top_k, allowed=None):
    """x [T, D] -> (x + MoE(x), group_sizes). ``allowed`` [E] bars experts from routing."""
    import jax
    import jax.numpy as jnp

    import groupgemm.jax as gj

    logits = x @ params["router"]
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    probs, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    probs = probs / probs.sum(-1, keepdims=True)
    permuted, group_sizes, row_map = gj.permute(x, experts, params["router"].shape[1])
    y = gj.grouped_mlp(permuted, params["w_in"], params["w_out"], group_sizes, activation="swiglu",
                       transpose_rhs=True)
    return x + gj.unpermute(y, row_map, probs), group_sizes


def torch_block_class():
    """The PyTorch block (a function, so that importing this file needs neither framework)."""
    import torch

    import groupgemm.torch as gt

    class MoEBlock(torch.nn.Module):
        def __init__(self, params, top_k):
            super().__init__()
            experts, ffn2, dim = params["w_in"].shape
            self.top_k = top_k
            self.router = torch.nn.Parameter(torch.tensor(params["router"]))
            self.experts = gt.GroupedMLP(experts, dim, ffn2 // 2, activation="swiglu")
            with torch.no_grad():
                self.experts.fc1.weight.copy_(torch.tensor(params["w_in"]))
                self.experts.fc2.weight.copy_(torch.tensor(params["w_out"]))

        def forward(self, x, allowed=None):
            logits = x @ self.router
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            probs, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
            probs = probs / probs.sum(-1, keepdim=True)
            permuted, group_sizes, row_map = gt.permute(x, experts, self.router.shape[1])
            y = self.experts(permuted, group_sizes)
            return x + gt.unpermute(y, row_map, probs), group_sizes

    return MoEBlock
