"""A small top-k MoE block for the PyTorch tests: router, dispatch by sort, two
GroupedLinear layers, combine. Group sizes stay tensors (no host sync), so the block
compiles with torch.compile(fullgraph=True)."""

import torch
from moe_dispatch import sort_by_expert
from torch import nn

from groupgemm.torch import GroupedLinear


class MoEBlock(nn.Module):
    def __init__(self, dim, ffn, experts, top_k, dtype=torch.float32, fp8=None):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False, dtype=dtype)
        self.up = GroupedLinear(experts, dim, ffn, dtype=dtype, fp8=fp8)
        self.down = GroupedLinear(experts, ffn, dim, dtype=dtype, fp8=fp8)

    def forward(self, x, expert_mask=None):
        logits = self.router(x)
        if expert_mask is not None:  # experts that may not receive tokens
            logits = logits.masked_fill(~expert_mask, float("-inf"))
        top_p, top_e = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        flat_e = top_e.reshape(-1)
        order, sizes = sort_by_expert(flat_e, self.experts)
        token = order // self.top_k
        h = torch.nn.functional.gelu(self.up(x[token], sizes))
        y = self.down(h, sizes) * top_p.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, y)
