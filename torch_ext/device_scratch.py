"""Where a torch call's CUDA work goes: the current stream, and the CUDA backend's
workspace (the setup kernel's per-group arrays, and on Hopper the sm_90a kernels' own).

The workspace is allocated by torch, so the caching allocator and CUDA-graph memory pools
see it. Outside graph capture one buffer per (device, stream) is reused by every call on
that stream: the stream orders each call's setup after the previous call's GEMMs, so reuse
is safe and saves an allocation per call. While a stream is capturing, each call gets its
own buffer, which the graph's pool then owns for as long as the graph lives.
"""

import torch

from groupgemm import _core

Tensor = torch.Tensor
_REUSED: dict = {}  # (device index, stream) -> uint8 tensor


def stream(device: torch.device) -> int:
    """The current CUDA stream of device as an address (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else
                                              torch.cuda.current_device())


def workspace(device: torch.device, nbytes: int, stream_address: int) -> Tensor | None:
    """At least nbytes of scratch on device for a call on the stream at stream_address."""
    if device.type != "cuda":
        return None
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    key = (device.index, stream_address)
    buffer = _REUSED.get(key)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _REUSED[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer


def gemm_workspace(device: torch.device, num_groups: int, stream_address: int) -> Tensor | None:
    """The GEMM entry points' workspace for num_groups local groups."""
    if device.type != "cuda":
        return None
    # Its size depends on the device (the sm_90a kernels' scratch scales with the SM count).
    index = -1 if device.index is None else device.index
    return workspace(device, _core.workspace_bytes(_core.Device.cuda, num_groups, device_index=index),
                     stream_address)
