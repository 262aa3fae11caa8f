"""Counting torch.compile's compilations: a claim that a call reuses a compiled graph (or
that a new shape makes a new one) is a count of the graphs Dynamo handed the backend."""

import torch
import torch._dynamo.testing


def counted_compile(fn, backend="inductor", **options):
    """(torch.compile(fn, fullgraph=True, **options) on `backend`, its counter): the counter's
    frame_count is the number of graphs compiled so far. Dynamo's caches are reset first,
    so an earlier test's graphs of the same code are not reused."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, **options), counter
