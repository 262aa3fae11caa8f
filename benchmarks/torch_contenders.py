"""The PyTorch contenders: groupgemm, torch._grouped_mm, a per-expert loop and one dense GEMM
(torch's, and groupgemm's with one group).

All run eagerly. Forward runs under no_grad; forward+backward asks autograd for the
input and weight gradients with a fixed incoming gradient. On CUDA every call ends with
torch.cuda.synchronize(), so the time is the device's, not the launch's.
"""

import numpy as np
import torch
from contenders import (
    DENSE,
    DENSE_KINDS,
    GROUPED_MM,
    GROUPGEMM,
    GROUPGEMM_DENSE,
    HOPPER_FAMILIES,
    PER_EXPERT_LOOP,
    Contender,
    family_contender,
    kernel_family,
)

from groupgemm.torch import grouped_mm


def per_expert_loop(x, w, group_sizes):
    sizes = group_sizes.tolist()  # what a loop needs: the sizes on the host (a sync on CUDA)
    routed = sum(sizes)
    parts = [xs @ wg for xs, wg in zip(torch.split(x[:routed], sizes), w)]
    parts.append(x.new_zeros(x.shape[0] - routed, w.shape[2]))  # padding rows
    return torch.cat(parts)


def _grouped_mm_with_offsets(x, w, group_sizes):
    # torch._grouped_mm takes the end offset of each group rather than its size.
    return torch._grouped_mm(x, w, offs=torch.cumsum(group_sizes, 0, dtype=torch.int32))


_MATMULS = {
    GROUPGEMM: grouped_mm,
    GROUPED_MM: _grouped_mm_with_offsets,
    PER_EXPERT_LOOP: per_expert_loop,
    DENSE: lambda x, w, group_sizes: x @ w,
    GROUPGEMM_DENSE: lambda x, w, group_sizes: grouped_mm(x, w[None], torch.full((1,), x.shape[0],
                                                                                   device=x.device)),
}


def _waiter(device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _peak_bytes(device, fn):
    """Peak CUDA memory of one call above what was allocated before it; None on CPU,
    where torch keeps no allocator statistics."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    return torch.cuda.max_memory_allocated(device) - before


def contenders(problem, device_name):
    """{name: build}, where build() returns that contender's Contender on 'cpu' or 'cuda'."""
    device = torch.device(device_name)
    dtype = getattr(torch, problem.config.dtype)
    tensor = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(device=device, dtype=dtype)  # noqa: E731
    lhs = tensor(problem.lhs).requires_grad_()
    rhs = tensor(problem.rhs).requires_grad_()
    dense_rhs = tensor(problem.dense_rhs).requires_grad_()
    dout = tensor(problem.dout)
    sizes = torch.tensor(problem.config.sizes, dtype=torch.int64, device=device)
    wait = _waiter(device)

    def build(name, matmul, family=None):
        weight = dense_rhs if name in DENSE_KINDS else rhs

        def forward():
            with kernel_family(family), torch.no_grad():
                matmul(lhs, weight, sizes)
            wait()

        def forward_backward():
            with kernel_family(family):
                out = matmul(lhs, weight, sizes)
                grads = torch.autograd.grad(out, (lhs, weight), dout)
            wait()
            return (out.detach(), *grads)

        return Contender(name=name, forward=forward, forward_backward=forward_backward,
                         peak_bytes=lambda: _peak_bytes(device, forward_backward),
                         checked=name not in DENSE_KINDS)

    builds = {name: (lambda name=name, matmul=matmul: build(name, matmul)) for name, matmul in _MATMULS.items()}
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        # groupgemm held to the 2.x kernels, to the sm_90a kernels by shape and to each tile
        # (its default on Hopper is the kernel table's choice per call).
        builds.update({family_contender(f): (lambda f=f: build(family_contender(f), grouped_mm, f))
                       for f in HOPPER_FAMILIES})
    return builds


def to_numpy(x):
    return x.detach().float().cpu().numpy()
