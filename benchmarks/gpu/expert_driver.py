"""The expert layer's calls for the sanitizer driver: permute, unpermute and its backward,
the activations and their backward, the router's softmax top-k, its backward and tangent,
through groupgemm._core with torch tensors.

Each call runs twice, on the driver's device and on the CPU backend with the same inputs,
and the device's results are checked against the CPU's: permute's outputs (permuted rows,
group_sizes, row_map) bit for bit; unpermute, its backward and dprobs equal or within
float32 rounding of the same float32 sums (plus one rounding to a 16-bit output); the
activations within ACTIVATION_ULPS float32 ulps of the expression's scale (the host's and
the device's exp and erf may differ in the last bits), plus one 16-bit rounding; the
router's choices bit for bit (its logits have ties and masked experts), its probabilities,
dlogits and tangents within ROUTER_ULPS float32 ulps of their scale. Rows
that must be exact zeros (dropped slots, rows no slot maps to, zero activation rows) are
compared bit for bit. The routing cases cover k = 1..4, no tokens, every slot dropped, no
experts, every token to one expert, zero columns, a row_map naming rows several times (as
permute never makes one), and enough slots (70,000) and experts (4,200) for permute's
scans to span several tiles. Needs NumPy and torch.
"""

import dataclasses

import numpy as np
from bits import raw_bits
from cases import round_to
from driver_calls import DTYPES, ROUTER_KINDS, expert_calls_for, expert_kernels_reached

# CUDA's expf and erff are within 2 ulps (the CUDA C++ Programming Guide's error tables),
# glibc's within 1; around them each expression rounds 3-5 times more, and nvcc contracts
# a * b + c into one FMA where the host compiler may not. 8 float32 ulps of the
# expression's scale covers that (an H100 differed by up to 3); a wrong value is far off.
ACTIVATION_ULPS = 8
ROUTER_ULPS = 8  # exp per expert, a sum over the experts and a division
ACTIVATION_ROWS = 4096  # the activations run on min(T * k, this) rows: enough for many blocks
F32_ROUNDING = 2.0**-23  # one float32 rounding, relative (twice the unit roundoff: products and sums)


@dataclasses.dataclass(frozen=True)
class ExpertCase:
    name: str
    tokens: int  # T
    top_k: int  # k
    experts: int  # E
    hidden: int  # H (the activations: F = H output columns over min(T * k, ACTIVATION_ROWS) rows)
    routing: str = "random"  # "random" (some slots dropped), "kept" (none), "one_expert", "all_dropped"
    index_dtype: str = "int32"  # expert_indices' dtype
    repeat_rows: bool = False  # unpermute's row_map: every third token's slots all name its first slot's row

    @property
    def slots(self):
        return self.tokens * self.top_k


EXPERT_CASES = [
    ExpertCase("top1", 37, 1, 5, 24),
    ExpertCase("top2", 40, 2, 6, 13, index_dtype="int64"),  # odd H: rows not 16-byte multiples
    ExpertCase("top3", 29, 3, 4, 16, routing="kept"),
    ExpertCase("top4", 33, 4, 7, 8, index_dtype="int64"),
    ExpertCase("no_tokens", 0, 2, 3, 8),
    ExpertCase("no_tokens_no_experts", 0, 2, 0, 8),  # permute has nothing to write
    ExpertCase("all_dropped", 9, 2, 3, 8, routing="all_dropped", index_dtype="int64"),
    ExpertCase("no_experts", 6, 2, 0, 8),  # every slot dropped: E = 0
    ExpertCase("one_expert", 25, 2, 4, 8, routing="one_expert"),
    ExpertCase("zero_hidden", 10, 2, 3, 0),
    ExpertCase("repeated_rows", 100, 3, 5, 16, repeat_rows=True),  # 300 slots: two radix passes
    ExpertCase("many_slots", 17500, 4, 8, 8),  # 70,000 slots: the bucket scan over several tiles
    # 4,201 buckets: the start scan over several tiles, and the chunk count capped by the budget
    ExpertCase("many_experts", 6000, 3, 4200, 4, index_dtype="int64"),
]
ALL_EXPERT_CASES = {c.name: c for c in EXPERT_CASES}
# Still every expert kernel (tests/test_gpu_kit.py checks).
QUICK_EXPERT_CASES = ("top2", "all_dropped", "no_experts", "zero_hidden", "repeated_rows", "many_slots",
                      "many_experts")


def expert_inputs(case, seed=0):
    """float64 NumPy inputs of a routing case (expert_indices in its index dtype)."""
    rng = np.random.default_rng(seed)
    t, k, e, h, slots = case.tokens, case.top_k, case.experts, case.hidden, case.slots
    info = np.iinfo(case.index_dtype)
    far = [-1, e, info.min, info.max] + ([-(2**40), 2**40] if case.index_dtype == "int64" else [])
    if case.routing == "kept":
        indices = rng.integers(0, max(e, 1), (t, k))
    elif case.routing == "one_expert":
        indices = np.full((t, k), e - 1)
    elif case.routing == "all_dropped":
        indices = rng.choice(far, (t, k))
    else:  # about one slot in eight dropped, with every kind of out-of-range value
        indices = np.where(rng.random((t, k)) < 0.125, rng.choice(far, (t, k)), rng.integers(0, max(e, 1), (t, k)))
    rows = min(slots, ACTIVATION_ROWS)
    act_h = rng.standard_normal((rows, 2 * h)) * 3
    act_h[rng.random((rows, 2 * h)) < 0.01] = 30.0  # saturated exp
    act_h[rng.random((rows, 2 * h)) < 0.01] = -30.0
    act_dout = rng.standard_normal((rows, h))
    act_h[::5], act_dout[::5] = 0.0, 0.0  # padding rows: exact zeros in, exact zeros out
    return dict(indices=np.asarray(indices, case.index_dtype),
                tokens=rng.standard_normal((t, h)),
                permuted=rng.standard_normal((slots, h)),
                dout=rng.standard_normal((t, h)),
                probs=rng.uniform(0.1, 1.0, (t, k)),
                # logits on a grid of halves (ties in every dtype), about one in ten masked
                logits=np.where(rng.random((t, e)) < 0.1, -np.inf, rng.integers(-6, 7, (t, e)) / 2),
                dprobs=rng.standard_normal((t, k)), tlogits=rng.standard_normal((t, e)),
                act_h=act_h, act_dout=act_dout, zero_rows=np.arange(rows) % 5 == 0)


# ---- tolerances ----------------------------------------------------------------------


def ulp(values, dtype):
    """The spacing of `dtype` at |values| (float64)."""
    v = np.abs(np.asarray(values, np.float64))
    if dtype == "float16":
        return np.spacing(v.astype(np.float16)).astype(np.float64)
    f32 = np.spacing(v.astype(np.float32)).astype(np.float64)
    return f32 * 2.0**16 if dtype == "bfloat16" else f32


def _stored(want, dtype):
    """One extra rounding where the float32 result is stored in a 16-bit dtype."""
    return ulp(want, dtype) if dtype != "float32" else 0.0


def _gathered(values, row_map):
    """values[row_map[t, j]] as [T, k, H], zero where the slot is dropped."""
    kept = row_map >= 0
    rows = values[np.where(kept, row_map, 0)] if values.shape[0] else np.zeros(row_map.shape + values.shape[1:])
    return rows * kept[..., None]


def _activation_scale(call, x, up, dout):
    """A bound on the magnitude of the terms of the activation (or its gradient), per
    output element: its last-bit differences are measured in float32 ulps of this."""
    if call.kind == "activation":
        return np.abs(x) * (np.abs(up) if call.activation == "swiglu" else 1.0)
    if call.activation == "swiglu":
        return np.concatenate([np.abs(dout * up) * (1 + np.abs(x)), np.abs(dout * x)], axis=1)
    return np.abs(dout) * (1 + np.abs(x))


# ---- the calls -----------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    what: str
    got: object  # torch tensor on the host
    want: object  # the CPU backend's
    tolerance: object = 0.0  # float64, broadcast against the values
    exact: object = None  # bool mask of entries that must match bit for bit (None: all when tolerance is 0)


def _permute(dev, case, x, dtype, prefill):
    c = dev.capsule
    permuted = dev.output((case.slots, case.hidden), dtype, prefill)
    sizes, row_map = dev.int_output((case.experts,), prefill), dev.int_output((case.tokens, case.top_k), prefill)
    dev.core.permute(c(dev.tensor(x["tokens"], dtype)), c(dev.index(x["indices"], x["indices"].dtype)), c(permuted),
                     c(sizes), c(row_map), workspace=c(dev.permute_workspace(case.slots, case.experts)),
                     stream=dev.stream())
    return [dev.fetch(t) for t in (permuted, sizes, row_map)]


def _unpermute(dev, x, dtype, probs_dtype, row_map, prefill):
    c = dev.capsule
    probs = None if probs_dtype is None else dev.tensor(x["probs"], probs_dtype)
    out = dev.output(x["dout"].shape, dtype, prefill)
    dev.core.unpermute(c(dev.tensor(x["permuted"], dtype)), c(dev.index(row_map, np.int32)), probs=c(probs), out=c(out),
                       stream=dev.stream())
    return [dev.fetch(out)]


def _unpermute_backward(dev, x, dtype, probs_dtype, row_map, prefill):
    c = dev.capsule
    probs = None if probs_dtype is None else dev.tensor(x["probs"], probs_dtype)
    dprobs = None if probs_dtype is None else dev.output(x["probs"].shape, probs_dtype, prefill)
    dpermuted = dev.output(x["permuted"].shape, dtype, prefill)
    dev.core.unpermute_backward(c(dev.tensor(x["dout"], dtype)), c(dev.tensor(x["permuted"], dtype)),
                                c(dev.index(row_map, np.int32)), probs=c(probs), dpermuted=c(dpermuted),
                                dprobs=c(dprobs), workspace=c(dev.unpermute_backward_workspace(row_map.size)),
                                stream=dev.stream())
    return [dev.fetch(dpermuted)] + ([] if dprobs is None else [dev.fetch(dprobs)])


def _activation_h(x, call):
    h = x["act_h"] if call.activation == "swiglu" else x["act_h"][:, :x["act_dout"].shape[1]]
    return np.ascontiguousarray(h)


def _activation(dev, call, x, prefill):
    c, h = dev.capsule, _activation_h(x, call)
    kind = getattr(dev.core.Activation, call.activation)
    if call.kind == "activation":
        out = dev.output(x["act_dout"].shape, call.dtype, prefill)
        dev.core.activation(c(dev.tensor(h, call.dtype)), c(out), kind, stream=dev.stream())
        return [dev.fetch(out)]
    dh = dev.output(h.shape, call.dtype, prefill)
    dev.core.activation_backward(c(dev.tensor(x["act_dout"], call.dtype)), c(dev.tensor(h, call.dtype)), c(dh), kind,
                                 stream=dev.stream())
    return [dev.fetch(dh)]


def _router(dev, call, case, x, prefill):
    c, t, k = dev.capsule, case.tokens, case.top_k
    logits = dev.tensor(x["logits"], call.dtype)
    indices, probs = dev.int_output((t, k), prefill), dev.output((t, k), "float32", prefill)
    dev.core.softmax_topk(c(logits), c(indices), c(probs), call.renormalize, stream=dev.stream())
    if call.kind == "softmax_topk":
        return [dev.fetch(indices), dev.fetch(probs)]
    if call.kind == "softmax_topk_tangent":
        tprobs = dev.output((t, k), "float32", prefill)
        dev.core.softmax_topk_tangent(c(logits), c(indices), c(dev.tensor(x["tlogits"], call.dtype)), c(tprobs),
                                      call.renormalize, stream=dev.stream())
        return [dev.fetch(tprobs)]
    dlogits = dev.output(x["logits"].shape, call.dtype, prefill)
    dev.core.softmax_topk_backward(c(logits), c(indices), c(dev.tensor(x["dprobs"], "float32")), c(dlogits),
                                   call.renormalize, stream=dev.stream())
    return [dev.fetch(dlogits)]


def row_map_of(cpu, case, x):
    """The routing's row_map, from the CPU backend's permute (with repeat_rows, edited so
    that every third token's slots all name its first slot's row)."""
    row_map = _permute(cpu, case, x, "float32", "nan")[2].numpy()
    if case.repeat_rows:
        row_map[::3] = row_map[::3, :1]
    return row_map


def run_expert_call(dev, cpu, call, case, x, row_map, prefill):
    """Runs `call` on `dev` and on the CPU backend (`cpu`); returns the Results to check."""
    if call.kind == "permute":
        got, want = (_permute(d, case, x, call.dtype, prefill) for d in (dev, cpu))
        return [Result(what, g, w) for what, g, w in zip(("permuted", "group_sizes", "row_map"), got, want)]
    if call.kind.startswith("activation"):
        got, want = (_activation(d, call, x, prefill)[0] for d in (dev, cpu))
        h = round_to(_activation_h(x, call), call.dtype)
        f = x["act_dout"].shape[1]
        x_col = h[:, :f] if call.activation == "swiglu" else h
        up = h[:, f:] if call.activation == "swiglu" else np.ones_like(h)
        dout = round_to(x["act_dout"], call.dtype)
        w = want.double().numpy()
        scale = np.maximum(_activation_scale(call, x_col, up, dout), np.abs(w))
        tolerance = ACTIVATION_ULPS * ulp(scale, "float32") + _stored(w, call.dtype)
        exact = np.broadcast_to(x["zero_rows"][:, None], w.shape)
        return [Result("out" if call.kind == "activation" else "dh", got, want, tolerance, exact)]
    if call.kind in ROUTER_KINDS:
        if case.top_k > case.experts:
            return []  # not made: the core refuses more choices than experts
        got, want = (_router(d, call, case, x, prefill) for d in (dev, cpu))
        if call.kind == "softmax_topk":  # probabilities are at most 1
            return [Result("expert_indices", got[0], want[0]),
                    Result("probs", got[1], want[1], ROUTER_ULPS * ulp(1.0, "float32"))]
        if call.kind == "softmax_topk_tangent":  # |tprobs| <= 2 max |tlogits|
            scale = 2 * np.abs(round_to(x["tlogits"], call.dtype)).max(axis=1, initial=0.0)[:, None]
            return [Result("tprobs", got[0], want[0], ROUTER_ULPS * ulp(scale, "float32"))]
        w = want[0].double().numpy()
        scale = np.abs(x["dprobs"]).sum(axis=1, keepdims=True)  # |dlogits| <= 2 sum |dprobs|
        return [Result("dlogits", got[0], want[0], ROUTER_ULPS * ulp(scale, "float32") + _stored(w, call.dtype))]
    runner = _unpermute if call.kind == "unpermute" else _unpermute_backward
    got, want = (runner(d, x, call.dtype, call.probs, row_map, prefill) for d in (dev, cpu))
    permuted, dout = round_to(x["permuted"], call.dtype), round_to(x["dout"], call.dtype)
    probs = np.ones(row_map.shape) if call.probs is None else round_to(x["probs"], call.probs)
    kept = row_map >= 0
    rows = _gathered(np.abs(permuted), row_map)  # [T, k, H]
    if call.kind == "unpermute":
        w = want[0].double().numpy()
        bound = (np.abs(probs)[..., None] * rows).sum(axis=1)
        return [Result("out", got[0], want[0], case.top_k * F32_ROUNDING * bound + _stored(w, call.dtype))]
    w = want[0].double().numpy()
    referenced = np.zeros(case.slots, bool)
    referenced[row_map[kept]] = True
    product = np.zeros(w.shape)  # the sum of each row's |terms| (a repeated row has several)
    np.add.at(product, row_map[kept], (np.abs(probs)[..., None] * np.abs(dout)[:, None, :])[kept])
    results = [Result("dpermuted", got[0], want[0], case.top_k * F32_ROUNDING * product + _stored(w, call.dtype),
                      np.broadcast_to(~referenced[:, None], w.shape))]
    if call.probs is not None:
        wp = want[1].double().numpy()
        bound = (rows * np.abs(dout)[:, None, :]).sum(axis=2)
        results.append(Result("dprobs", got[1], want[1],
                              max(case.hidden, 1) * F32_ROUNDING * bound + _stored(wp, call.probs), ~kept))
    return results


def result_mismatch(r):
    """Why a result is wrong, or None."""
    got_bits, want_bits = raw_bits(r.got), raw_bits(r.want)
    if got_bits.shape != want_bits.shape:
        return f"{r.what}: shape {tuple(got_bits.shape)}, expected {tuple(want_bits.shape)}"
    if np.array_equal(got_bits, want_bits):
        return None
    exact = r.exact if r.exact is not None else np.broadcast_to(np.all(np.asarray(r.tolerance) == 0), got_bits.shape)
    if exact.any() and not np.array_equal(got_bits[exact], want_bits[exact]):
        return f"{r.what}: {np.count_nonzero(got_bits[exact] != want_bits[exact])} entries that must equal the " \
               "CPU backend's bit for bit (exact zeros, indices, copies) differ"
    got, want = r.got.double().numpy(), r.want.double().numpy()
    error = np.abs(got - want)
    bad = ~(error <= r.tolerance)  # NaN (an unwritten entry) is bad
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf), -1)), bad.shape)
        return (f"{r.what}: {np.count_nonzero(bad)} entries beyond the tolerance, e.g. at {tuple(map(int, i))}: "
                f"{float(got[i])!r} vs the CPU's {float(want[i])!r}")
    return None


def bitwise_equal(r):
    return np.array_equal(raw_bits(r.got), raw_bits(r.want))


def planned_calls(case):
    """The calls made on a routing case, each with the kernels it reaches."""
    return [(call, expert_kernels_reached(call, case.tokens, case.top_k, case.experts, case.hidden))
            for dtype in DTYPES for call in expert_calls_for(dtype)]

