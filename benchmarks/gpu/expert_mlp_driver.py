"""The fused expert MLP's calls for the sanitizer driver: expert_mlp and expert_mlp_backward
(core_cuda/cuda/expert_mlp.cu) through groupgemm._core with torch tensors, every gradient
asked for.

Each call runs on the driver's device and on the CPU backend with the same inputs; the
device's results (out, h, and dtokens, dw_in, dw_out, dprobs, db_in, db_out) are within the
dtype's tolerance of the CPU's, relative to their scale (the GEMMs add in another order),
and the entries that must be exact zeros are: a dropped slot's h row and dprobs, an idle
expert's weight and bias gradients. The cases cover aligned shapes over several tiles per
expert (the gathered tensor-core GEMMs), shapes whose rows are not 16-byte multiples (the
unaligned gathered GEMM), H = 0 and F = 0 (fills in place of GEMMs over an empty
contraction), no tokens and every slot dropped, with a group_offset window. Needs NumPy and
torch.
"""

import dataclasses

import numpy as np
from bits import raw_bits
from driver_calls import DEFAULT_KERNEL, DTYPES, expert_mlp_calls_for, expert_mlp_kernels_reached

GRADS = ("dtokens", "dw_in", "dw_out", "dprobs", "db_in", "db_out")
# Largest error relative to the result's scale, per dtype (the GEMM driver's).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


@dataclasses.dataclass(frozen=True)
class MlpCase:
    name: str
    tokens: int  # T
    top_k: int  # k
    experts: int  # E, the local experts: global ids [offset, offset + E)
    hidden: int  # H
    ffn: int  # F (F_in = 2F for swiglu)
    ids: tuple  # the global expert ids the routing draws from (-1: a dropped slot)
    offset: int | None = None  # group_offset

    @property
    def slots(self):
        return self.tokens * self.top_k


MLP_CASES = [
    # several tiles per expert (rows, H and F past a 128 tile), ids outside the window, an idle expert
    MlpCase("tiles", 300, 2, 5, 136, 80, (-1, 0, 1, 2, 4, 5, 6), offset=1),
    MlpCase("unaligned", 40, 3, 4, 6, 4, (0, 1, 2, -1)),  # H, F not multiples of 8
    MlpCase("zero_hidden", 12, 2, 3, 0, 8, (0, 1, 2)),
    MlpCase("zero_ffn", 12, 2, 3, 16, 0, (0, 1, 2)),
    MlpCase("no_tokens", 0, 2, 3, 16, 8, (0, 1, 2)),
    MlpCase("all_dropped", 9, 2, 3, 16, 8, (-1, 7)),
]
ALL_MLP_CASES = {c.name: c for c in MLP_CASES}
QUICK_MLP_CASES = ("tiles", "unaligned", "zero_hidden", "zero_ffn")  # still every fused kernel


def mlp_inputs(case, call, seed=0):
    """float64 NumPy inputs (weights in the call's layout), the ids as int32."""
    rng = np.random.default_rng(seed)
    t, k, e, h, f = case.tokens, case.top_k, case.experts, case.hidden, case.ffn
    f_in = 2 * f if call.activation == "swiglu" else f
    w_in, w_out = rng.standard_normal((e, h, f_in)) / 4, rng.standard_normal((e, f, h)) / 4
    if call.transpose:
        w_in, w_out = w_in.transpose(0, 2, 1).copy(), w_out.transpose(0, 2, 1).copy()
    return dict(tokens=rng.standard_normal((t, h)), indices=rng.choice(case.ids, (t, k)).astype(np.int32),
                probs=rng.uniform(0.1, 1.0, (t, k)), w_in=w_in, w_out=w_out, b_in=rng.standard_normal((e, f_in)),
                b_out=rng.standard_normal((e, h)), dout=rng.standard_normal((t, h)), f_in=f_in)


def _run(dev, case, call, x, prefill):
    """out, h and the six gradients of one forward and one backward call on `dev`."""
    c, dtype, t, k = dev.capsule, call.dtype, case.tokens, case.top_k
    kind = int(getattr(dev.core.Activation, call.activation))
    tokens, w_in, w_out = (dev.tensor(x[n], dtype) for n in ("tokens", "w_in", "w_out"))
    b_in, b_out = (dev.tensor(x[n], dtype) if call.bias else None for n in ("b_in", "b_out"))
    probs = None if call.probs is None else dev.tensor(x["probs"], call.probs)
    indices = dev.index(x["indices"], np.int32)
    offset = None if case.offset is None else dev.index(case.offset, np.int32)
    out, h = dev.output((t, case.hidden), dtype, prefill), dev.output((t, k, x["f_in"]), dtype, prefill)
    rows = dev.output((case.slots, case.hidden), dtype, prefill)

    def workspace(backward):
        if dev.name == "cpu":
            return None
        nbytes = dev.core.expert_mlp_workspace_bytes(dev.core.Device.cuda, case.slots, case.experts, case.hidden,
                                                     x["f_in"], kind, 4 if dtype == "float32" else 2, backward)
        return dev.torch.empty(nbytes, dtype=dev.torch.uint8, device=dev.name)

    dev.core.expert_mlp(c(tokens), c(indices), c(probs), c(w_in), c(w_out), c(b_in), c(b_out), c(offset), c(out),
                        c(h), c(rows), c(workspace(False)), kind=kind, transpose_rhs=int(call.transpose),
                        stream=dev.stream())
    grads = [dev.output(tuple(shape), d, prefill) for shape, d in
             ((tokens.shape, dtype), (w_in.shape, dtype), (w_out.shape, dtype), ((t, k), call.probs or dtype),
              ((case.experts, x["f_in"]), dtype), ((case.experts, case.hidden), dtype))]
    wanted = [True, True, True, call.probs is not None, call.bias, call.bias]
    grads = [g if w else None for g, w in zip(grads, wanted)]
    dev.core.expert_mlp_backward(c(dev.tensor(x["dout"], dtype)), c(tokens), c(indices), c(probs), c(w_in),
                                 c(w_out), c(b_out), c(offset), c(h), *map(c, grads), c(rows),
                                 c(workspace(True)), kind=kind, transpose_rhs=int(call.transpose),
                                 stream=dev.stream())
    return [dev.fetch(out), dev.fetch(h)] + [None if g is None else dev.fetch(g) for g in grads]


def _exact_zeros(case, call, x):
    """{result: mask of the entries that must be exactly 0} (h [T, k, F_in], dprobs, the
    weight and bias gradients)."""
    local = x["indices"].astype(np.int64) - (case.offset or 0)
    dropped = (x["indices"] < 0) | (local < 0) | (local >= case.experts)
    idle = np.array([not (local[~dropped] == e).any() for e in range(case.experts)], bool)
    masks = {"h": np.broadcast_to(dropped[..., None], (case.tokens, case.top_k, x["f_in"])), "dprobs": dropped}
    for name in ("dw_in", "dw_out", "db_in", "db_out"):
        shape = {"dw_in": x["w_in"].shape, "dw_out": x["w_out"].shape, "db_in": (case.experts, x["f_in"]),
                 "db_out": (case.experts, case.hidden)}[name]
        masks[name] = np.broadcast_to(idle.reshape((-1,) + (1,) * (len(shape) - 1)), shape)
    return masks


def run_mlp_call(dev, cpu, case, call, x, prefill):
    """Runs `call` on `dev` and on the CPU backend; returns [(what, problem or None)]."""
    got, want = (_run(d, case, call, x, prefill) for d in (dev, cpu))
    exact = _exact_zeros(case, call, x)
    checks = []
    for what, g, w in zip(("out", "h") + GRADS, got, want):
        if w is None:
            checks.append((what, None if g is None else "given without being asked for"))
            continue
        checks.append((what, mismatch(what, call.dtype, g, w, exact.get(what))))
    return checks


def mismatch(what, dtype, got, want, zeros):
    """Why `got` (a host tensor) is wrong against the CPU's `want`, or None."""
    if tuple(got.shape) != tuple(want.shape):
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = got.double().numpy(), want.double().numpy()
    if zeros is not None and zeros.any() and not (raw_bits(got)[zeros] == 0).all():
        return f"{what}: entries that must be exact zeros (dropped slots, idle experts) are not"
    scale = max(1.0, float(np.abs(w).max(initial=0.0)))
    error = float(np.abs(g - w).max(initial=0.0)) if g.size else 0.0
    if not np.isfinite(error) or error > TOLERANCE[dtype] * scale:
        return f"{what}: max error {error:.3g} > {TOLERANCE[dtype]:g} x scale {scale:.3g}"
    return None


def planned_mlp_calls(case, family=DEFAULT_KERNEL):
    """The calls made on a case under `family` (driver_calls.MLP_FAMILIES), each with the
    kernels it reaches."""
    return [(call, expert_mlp_kernels_reached(call, case.tokens, case.top_k, case.experts, case.hidden, case.ffn,
                                              family))
            for dtype in DTYPES for call in expert_mlp_calls_for(dtype)]
