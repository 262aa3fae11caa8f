"""An MoE block written with groupgemm's expert layer, in JAX and in PyTorch, from one
NumPy initialisation: a softmax top-k router, permute, the grouped expert MLP (SwiGLU)
and unpermute weighted by the router's probabilities (the caller adds the residual).

Every step with arithmetic runs in groupgemm's core, the router's logits included (one
group holding every token), so the two frameworks compute the same bits: outputs and
gradients of the block are bitwise identical in JAX and PyTorch. x feeds two of its
steps (the router and permute), whose gradients add in either order to the same bits;
a third use, such as a residual inside the block, would leave the order of a three-term
sum to each framework's autograd, which differs between versions.

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


def jax_block(params, x, top_k, allowed=None, fp8=None):
    """x [T, D] -> (MoE(x), group_sizes). ``allowed`` [E] bars experts from routing. The
    expert MLP computes in its weights' dtype (the tokens are cast to it and back), its
    GEMMs in float8 with ``fp8="rowwise"`` or ``"blockwise"``."""
    import jax.numpy as jnp

    import groupgemm.jax as gj

    logits = gj.grouped_matmul(x, params["router"][None], jnp.asarray([x.shape[0]], jnp.int32))
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    probs, experts = gj.softmax_topk(logits, top_k)
    permuted, group_sizes, row_map = gj.permute(x, experts, params["router"].shape[1])
    y = gj.grouped_mlp(permuted.astype(params["w_in"].dtype), params["w_in"], params["w_out"], group_sizes,
                       activation="swiglu", transpose_rhs=True, fp8=fp8)
    return gj.unpermute(y.astype(x.dtype), row_map, probs), group_sizes


def torch_block_class():
    """The PyTorch block (a function, so that importing this file needs neither framework)."""
    import torch

    import groupgemm.torch as gt

    class MoEBlock(torch.nn.Module):
        """The expert MLP keeps its own dtype (``experts_dtype``, default float32) and, with
        ``fp8``, runs its GEMMs in float8; the tokens are cast to its dtype and back."""

        def __init__(self, params, top_k, fp8=None, experts_dtype=torch.float32):
            super().__init__()
            experts, ffn2, dim = params["w_in"].shape
            self.top_k = top_k
            self.router = torch.nn.Parameter(torch.tensor(params["router"]))
            self.experts = gt.GroupedMLP(experts, dim, ffn2 // 2, activation="swiglu", fp8=fp8, dtype=experts_dtype)
            with torch.no_grad():
                self.experts.fc1.weight.copy_(torch.tensor(params["w_in"]))
                self.experts.fc2.weight.copy_(torch.tensor(params["w_out"]))

        def forward(self, x, allowed=None):
            every_token = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)  # no host copy
            logits = gt.grouped_mm(x, self.router[None], every_token)
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            probs, experts = gt.softmax_topk(logits, self.top_k)
            permuted, group_sizes, row_map = gt.permute(x, experts, self.router.shape[1])
            y = self.experts(permuted.to(self.experts.fc1.weight.dtype), group_sizes).to(x.dtype)
            return gt.unpermute(y, row_map, probs), group_sizes

    return MoEBlock
