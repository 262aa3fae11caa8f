"""The argument contract of every public function, written once for both frontends.

Framework-neutral: it sees shapes (tuples of ints), dtype names ("float32", "uint32"),
flags and plain Python values, never arrays. Each frontend translates its own arrays,
dtypes and devices into these and calls it before any kernel, so JAX and PyTorch apply
the same rules with the same messages. ``fn`` names the public function in a message;
``names`` maps the contract's argument roles to the caller's spelling of them.

The C++ core keeps its own checks as the backstop for C++ callers (tests hold the two
layers to the same bad-input table).
"""

import numbers

import numpy as np

# The core's operand dtypes, and for each the output dtypes allowed besides itself.
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
WIDER_OUTPUTS = {"bfloat16": ("float32",), "float16": ("float32",)}
# The integer dtypes the core reads group sizes and offsets in.
INDEX_DTYPES = ("int32", "int64")
INT64_MAX = 2**63 - 1
# The core counts experts, groups and rows (row_map, group_sizes, expert_indices) in int32.
INT32_MAX = 2**31 - 1

JAX_NAMES = {"lhs": "lhs", "rhs": "rhs", "transpose": "transpose_rhs", "out_dtype": "preferred_element_type"}
TORCH_NAMES = {"lhs": "input", "rhs": "weight", "transpose": "transpose_weight", "out_dtype": "out_dtype"}


def _float_list():
    return ", ".join(FLOAT_DTYPES[:-1]) + " or " + FLOAT_DTYPES[-1]


def check_float(dtype, name, fn):
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: {name} must be {_float_list()}, got {dtype}")


def check_same_dtype(dtype, want, name, other, fn):
    if dtype != want:
        raise TypeError(f"{fn}: {name} dtype {dtype} differs from {other} dtype {want}")


def check_rank(shape, rank, name, layout, fn):
    if len(shape) != rank:
        raise ValueError(f"{fn}: {name} must be {rank}-D {layout}, got shape {tuple(shape)}")


def check_shape(shape, want, name, fn):
    if tuple(shape) != tuple(want):
        raise ValueError(f"{fn}: {name} must have shape {tuple(want)}, got {tuple(shape)}")


def check_device(device, want, name, fn):
    if device != want:
        raise ValueError(f"{fn}: {name} is on {device} but the inputs are on {want}; move it explicitly")


def weight_layout(transpose):
    return "[G, N, K]" if transpose else "[G, K, N]"


def output_dtype(in_dtype, requested, fn, name):
    """The output dtype: the input dtype by default, or float32 for 16-bit inputs."""
    if requested is None or requested == in_dtype:
        return in_dtype
    if requested in WIDER_OUTPUTS.get(in_dtype, ()):
        return requested
    raise TypeError(f"{fn}: {name} {requested} is not supported for {in_dtype} inputs "
                    "(use the input dtype, or float32 for 16-bit inputs)")


def accumulate_dtype(in_dtype):
    """Accumulate mode adds into float32 (float64 for float64 inputs)."""
    return "float64" if in_dtype == "float64" else "float32"


# ---- static integers and integer operands ---------------------------------------


def is_static_int(value):
    """Python and NumPy integers; bool (and NumPy's bool_) is not one here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def static_flag(value, name, fn):
    """A Python or NumPy bool, as a bool. Anything else (a string such as "False", a number)
    is refused, named: truthiness would silently pick the other branch."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be a bool, got {value!r}")
    return bool(value)


def static_count(value, name, fn, limit=None, why=""):
    """A non-negative Python or NumPy integer (bool is not an integer here), at most
    `limit` when given (`why` says where the limit comes from)."""
    if not is_static_int(value) or value < 0:
        symbolic = not isinstance(value, (numbers.Number, np.bool_)) and hasattr(value, "__index__")  # SymInt, a tracer
        raise ValueError(f"{fn}: {name} must be a non-negative int, got {value!r}"
                         + (" (a symbolic size: it must be known when the call is traced)" if symbolic else ""))
    if limit is not None and value > limit:
        raise ValueError(f"{fn}: {name} = {value} exceeds {limit} ({why})")
    return int(value)


def check_num_experts(value, fn):
    """num_experts of permute: bucket E (its dropped slots) and every group size are int32."""
    return static_count(value, "num_experts", fn, INT32_MAX - 1, "expert ids and group sizes are int32")


# Whether a comparison of sizes holds, for certain: plain bools as they are. A frontend
# whose tracer has sizes it cannot compare without guarding on their values, yet presents
# them as ints, sets its own rule, false where unknown; the core checks those sizes when the
# call runs.
size_comparison_holds = bool


def check_slots(num_tokens, top_k, name, fn):
    """T * k slots: row_map holds their rows as int32. A symbolic T (jax.export's shape
    polymorphism, torch's dynamic shapes) is checked by the core when the call runs."""
    slots = num_tokens * top_k
    if is_static_int(slots) and size_comparison_holds(slots > INT32_MAX):
        raise ValueError(f"{fn}: {name} has T * k = {num_tokens} * {top_k} slots, more than row_map's int32 rows "
                         f"hold ({INT32_MAX})")


def is_index_dtype(dtype):
    return dtype.startswith(("int", "uint"))


def check_index_dtype(dtype, name, fn):
    if not is_index_dtype(dtype):
        raise TypeError(f"{fn}: {name} must be an integer array, got {dtype}")


def index_conversion(dtype):
    """How a frontend turns an integer operand into one the core reads, keeping its
    value: (target dtype, saturate) or None when it already is int32/int64.

    Narrow integers widen exactly. uint32 widens to int64 (or, where a framework has no
    int64, saturates at int32's maximum: a size that large already covers every row).
    uint64 saturates at int64's maximum, never wrapping into a negative value, or becomes
    what past_maximum says for the operand's role."""
    if dtype in INDEX_DTYPES:
        return None
    if dtype in ("uint32", "uint64"):
        return "int64", True
    return "int32", False


def past_maximum(role, target):
    """What an index value past its signed target's maximum becomes, by the operand's role:
    - "size" (group sizes, a group window's offset): None, saturated; exact, as sizes are
      clipped to the row count and an offset past the last group selects none;
    - "id" (an expert id): -1, a dropped slot; a window of experts may hold the maximum,
      where a saturated id would land;
    - "id_window" (the offset of a window of expert ids): the target's minimum, a window of
      negative ids, which holds none; exact, as every id it should hold is past the maximum
      too, so dropped (a static offset naming such a window is refused instead)."""
    return {"size": None, "id": -1, "id_window": int(np.iinfo(target).min)}[role]


def check_group_count(entries, num_groups, has_offset, fn, name="group_sizes"):
    """One entry of group_sizes (or offs) per group; at least one per local group with a
    group_offset window."""
    if not has_offset and entries != num_groups:
        raise ValueError(f"{fn}: {name} has {entries} entries but there are "
                         f"{num_groups} groups; pass group_offset to select a window")
    if has_offset and entries < num_groups:
        raise ValueError(f"{fn}: {name} has {entries} entries, fewer than the {num_groups} local groups")


def check_group_sizes(shape, dtype, num_groups, has_offset, fn):
    if len(shape) != 1:
        raise ValueError(f"{fn}: group_sizes must be 1-D, got shape {tuple(shape)}")
    check_index_dtype(dtype, "group_sizes", fn)
    check_group_count(shape[0], num_groups, has_offset, fn)


def check_group_offset_array(shape, dtype, fn):
    if len(shape) > 1 or _size(shape) != 1:
        raise ValueError(f"{fn}: group_offset must be an int or a one-element integer array, "
                         f"got shape {tuple(shape)}")
    check_index_dtype(dtype, "group_offset", fn)


def _size(shape):
    size = 1
    for d in shape:
        size *= d
    return size


def static_group_offset(value, num_local, num_total, fn):
    """A Python or NumPy integer group_offset, clamped to [-num_local, num_total]: every
    offset outside that range selects no group either way, and the clamped one fits any
    index dtype."""
    if not is_static_int(value):
        raise TypeError(f"{fn}: group_offset must be an integer, got {value!r}")
    return max(-num_local, min(int(value), num_total))


def static_window_offset(value, num_local, largest, fn, why=""):
    """A Python or NumPy integer group_offset of a window of expert ids, clamped below at
    -num_local (a window below that holds no id). Above, it is kept: an id may be as large
    as `largest`, and an offset past that is refused (`why` says where the limit comes
    from) rather than moved onto an id."""
    if not is_static_int(value):
        raise TypeError(f"{fn}: group_offset must be an integer, got {value!r}")
    if value > largest:
        raise ValueError(f"{fn}: group_offset = {value} exceeds {largest}{why}")
    if largest == INT64_MAX and value + num_local - 1 > largest:  # ids past it are dropped (index_conversion)
        raise ValueError(f"{fn}: the window of group_offset = {value} and {num_local} experts holds ids past "
                         f"{largest}, which no int64 holds")
    return max(-num_local, int(value))


def static_group_sizes(values, num_rows, fn):
    """A Python sequence of sizes, each clamped to [0, num_rows] (what the kernels do
    with it anyway), so no size overflows the index dtype. A symbolic row count
    (``jax.export``'s, a traced ``SymInt``) cannot be compared: the sizes are clamped to
    int32's maximum, past which no call has rows, and the kernels clip them to the rows."""
    limit = num_rows if is_static_int(num_rows) else INT32_MAX
    sizes = []
    for v in values:
        if not is_static_int(v):
            raise TypeError(f"{fn}: group_sizes must hold integers, got {v!r}")
        sizes.append(max(0, min(int(v), limit)))
    return sizes


# ---- whole calls ----------------------------------------------------------------


def matmul(fn, names, lhs, rhs, transpose, bias=None, out_dtype=None):
    """Checks ``lhs [M, K] @ rhs [G, K, N]`` (``[G, N, K]`` when transposed) ``+ bias [G, N]``.

    ``lhs``, ``rhs`` and ``bias`` are (shape, dtype name) pairs (bias may be None).
    Returns (G, N, output dtype name)."""
    (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype) = lhs, rhs
    check_float(lhs_dtype, names["lhs"], fn)
    check_float(rhs_dtype, names["rhs"], fn)
    check_rank(lhs_shape, 2, names["lhs"], "[M, K]", fn)
    check_rank(rhs_shape, 3, names["rhs"], weight_layout(transpose), fn)
    check_same_dtype(rhs_dtype, lhs_dtype, names["rhs"], names["lhs"], fn)
    k_axis = 2 if transpose else 1
    if rhs_shape[k_axis] != lhs_shape[1]:
        raise ValueError(f"{fn}: {names['rhs']} shape {tuple(rhs_shape)} does not contract with "
                         f"{names['lhs']} shape {tuple(lhs_shape)} ({names['transpose']}={transpose})")
    num_groups, n = rhs_shape[0], rhs_shape[3 - k_axis]
    if bias is not None:
        check_float(bias[1], "bias", fn)
        check_shape(bias[0], (num_groups, n), "bias", fn)
        check_same_dtype(bias[1], lhs_dtype, "bias", names["lhs"], fn)
    return num_groups, n, output_dtype(lhs_dtype, out_dtype, fn, names["out_dtype"])


def wgrad(fn, names, lhs, grad, num_groups):
    """Checks the weight-gradient product ``lhs [M, K]^T @ grad [M, N]`` per group;
    returns (num_groups, the result's shape)."""
    (lhs_shape, lhs_dtype), (grad_shape, grad_dtype) = lhs, grad
    check_float(lhs_dtype, names["lhs"], fn)
    check_float(grad_dtype, "grad", fn)
    check_rank(lhs_shape, 2, names["lhs"], "[M, K]", fn)
    check_rank(grad_shape, 2, "grad", "[M, N]", fn)
    check_same_dtype(grad_dtype, lhs_dtype, "grad", names["lhs"], fn)
    if grad_shape[0] != lhs_shape[0]:
        raise ValueError(f"{fn}: grad has {grad_shape[0]} rows but {names['lhs']} has {lhs_shape[0]}")
    num_groups = static_count(num_groups, "num_groups", fn, INT32_MAX, "the core counts groups in int32")
    return num_groups, (num_groups, lhs_shape[1], grad_shape[1])


def accumulator(fn, shape, dtype, want_shape, in_dtype, requested_out_dtype, out_dtype_name, *,
                contiguous=True, requires_grad=False, name="accumulate_into"):
    """Checks an ``accumulate_into`` buffer (``name``: what the caller calls it), updated in
    place; returns its dtype name. That it shares no memory with an operand is the glue's
    check (python/csrc/op_table.h), which sees the buffers every call passes."""
    want = accumulate_dtype(in_dtype)
    if dtype != want:
        raise TypeError(f"{fn}: {name} must be {want}, got {dtype}")
    if requested_out_dtype is not None and requested_out_dtype != want:
        raise TypeError(f"{fn}: {out_dtype_name} {requested_out_dtype} conflicts with {name}, which is {want}")
    check_shape(shape, want_shape, name, fn)
    if not contiguous:
        raise ValueError(f"{fn}: {name} must be contiguous (it is updated in place)")
    if requires_grad:
        raise ValueError(f"{fn}: {name} must not require grad (it is updated in place, outside autograd)")
    return want


# ---- the expert layer -------------------------------------------------------------

ACTIVATIONS = ("swiglu", "gelu", "relu", "silu")  # the core's Activation enum, in its order


def activation_kind(name, fn):
    """The core's index of an activation name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{fn}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {name!r}")
    return ACTIVATIONS.index(name)


def activation_width(name, f_in, fn, what="h"):
    """F of ``act(h [M, F_in]) -> [M, F]``: F_in / 2 for swiglu (gate, then up), else F_in."""
    if name != "swiglu":
        return f_in
    if f_in % 2:
        raise ValueError(f"{fn}: swiglu needs an even {what} width F_in = 2F (gate, then up), got {f_in}")
    return f_in // 2


def permute(fn, tokens, expert_indices, num_experts):
    """Checks tokens [T, H] and expert_indices [T, k]; returns (T, k, H, num_experts)."""
    tokens_and_indices(fn, tokens, expert_indices)
    (num_tokens, hidden), (_, top_k) = tokens[0], expert_indices[0]
    return num_tokens, top_k, hidden, check_num_experts(num_experts, fn)


def tokens_and_indices(fn, tokens, expert_indices):
    """Checks tokens [T, H] (float) and expert_indices [T, k] (integers), the routed input of
    permute and of the expert layers."""
    (tokens_shape, tokens_dtype), (indices_shape, indices_dtype) = tokens, expert_indices
    check_float(tokens_dtype, "tokens", fn)
    check_rank(tokens_shape, 2, "tokens", "[T, H]", fn)
    check_rank(indices_shape, 2, "expert_indices", "[T, k]", fn)
    check_index_dtype(indices_dtype, "expert_indices", fn)
    if indices_shape[0] != tokens_shape[0]:
        raise ValueError(f"{fn}: expert_indices has {indices_shape[0]} rows but tokens has {tokens_shape[0]}")
    check_slots(*indices_shape, "expert_indices", fn)


def unpermute(fn, permuted, row_map, probs=None):
    """Checks permuted [R, H], row_map [T, k] (int32, as permute returns it) and probs
    [T, k] (permuted's dtype or float32); returns (T, H)."""
    (permuted_shape, permuted_dtype), (map_shape, map_dtype) = permuted, row_map
    check_float(permuted_dtype, "permuted", fn)
    check_rank(permuted_shape, 2, "permuted", "[T * k, H]", fn)
    check_rank(map_shape, 2, "row_map", "[T, k]", fn)
    if map_dtype != "int32":
        raise TypeError(f"{fn}: row_map must be int32 (as permute returns it), got {map_dtype}")
    check_slots(*map_shape, "row_map", fn)
    if probs is not None:
        probs_shape, probs_dtype = probs
        check_shape(probs_shape, map_shape, "probs", fn)
        check_probs_dtype(probs_dtype, permuted_dtype, "permuted", fn)
    return map_shape[0], permuted_shape[1]


def grouped_mlp(fn, x, w_in, w_out, activation, transpose, x_name="x", b_in=None, b_out=None,
                weight_names=("w_in", "w_out")):
    """Checks ``fc2(act(fc1(x)))``: w_in [E, H, F_in] and w_out [E, F, H] (transposed:
    [E, F_in, H] and [E, H, F]; named as the caller names them), b_in [E, F_in] and b_out
    [E, H] (or None), all in x's float dtype; returns F."""
    (x_shape, dtype), (in_shape, _), (out_shape, _) = x, w_in, w_out
    in_name, out_name = weight_names
    check_float(dtype, x_name, fn)
    check_rank(in_shape, 3, in_name, "[E, F_in, H]" if transpose else "[E, H, F_in]", fn)
    check_rank(out_shape, 3, out_name, "[E, H, F]" if transpose else "[E, F, H]", fn)
    f_in, h = (in_shape[1], in_shape[2]) if transpose else (in_shape[2], in_shape[1])
    if h != x_shape[-1]:
        raise ValueError(f"{fn}: {in_name} {tuple(in_shape)} takes inputs of width {h}, but {x_name} has width "
                         f"{x_shape[-1]} (shape {tuple(x_shape)})")
    f = activation_width(activation, f_in, fn, f"{in_name} output")
    want = (in_shape[0], x_shape[-1], f) if transpose else (in_shape[0], f, x_shape[-1])
    if tuple(out_shape) != want:  # F comes from w_in: the message names both, as either may be the wrong one
        raise ValueError(f"{fn}: {out_name} must have shape {want}, got {tuple(out_shape)} ({in_name} "
                         f"{tuple(in_shape)} gives {f_in} outputs, F = {f} under {activation})")
    for (_, weight_dtype), name in ((w_in, in_name), (w_out, out_name)):
        check_float(weight_dtype, name, fn)
        check_same_dtype(weight_dtype, dtype, name, x_name, fn)
    for bias, name, width in ((b_in, "b_in", f_in), (b_out, "b_out", x_shape[-1])):
        if bias is not None:
            check_float(bias[1], name, fn)
            check_shape(bias[0], (in_shape[0], width), name, fn)
            check_same_dtype(bias[1], dtype, name, x_name, fn)
    return f


def check_probs_dtype(probs_dtype, dtype, rows_name, fn, name="probs"):
    """Routing weights (``name``) are in the dtype of the rows they weight (``rows_name``'s)
    or float32."""
    if probs_dtype not in (dtype, "float32"):
        allowed = "float32" if dtype == "float32" else f"{dtype} ({rows_name}'s dtype) or float32"
        raise TypeError(f"{fn}: {name} must be {allowed}, got {probs_dtype}")


def routed_tokens(fn, tokens, expert_indices, probs):
    """Checks an expert layer's routed input, fused or composed: tokens [T, H] (float),
    expert_indices [T, k] (integers) and probs [T, k] (tokens' dtype or float32) or None."""
    tokens_and_indices(fn, tokens, expert_indices)
    if probs is not None:
        check_shape(probs[0], expert_indices[0], "probs", fn)
        check_probs_dtype(probs[1], tokens[1], "tokens", fn)


def expert_mlp(fn, tokens, expert_indices, probs, w_in, w_out, b_in, b_out, activation, transpose):
    """Checks the fused expert MLP's arguments: routed_tokens', the weights as grouped_mlp's
    (tokens' dtype) and b_in [E, F_in], b_out [E, H] or None; returns (T, k, H, F_in, E)."""
    routed_tokens(fn, tokens, expert_indices, probs)
    (tokens_shape, _), (indices_shape, _) = tokens, expert_indices
    grouped_mlp(fn, tokens, w_in, w_out, activation, transpose, "tokens", b_in, b_out)  # w_in's rank first
    num_experts, f_in = w_in[0][0], w_in[0][1 if transpose else 2]
    if is_static_int(num_experts) and size_comparison_holds(num_experts > INT32_MAX - 1):  # jax.export's E: unknown
        raise ValueError(f"{fn}: w_in holds {num_experts} experts; expert ids are int32 (at most {INT32_MAX - 1})")
    return tokens_shape[0], indices_shape[1], tokens_shape[1], f_in, num_experts


def softmax_topk(fn, logits, k, renormalize):
    """Checks logits [T, E] and 0 <= k <= E; returns (k, probs dtype): float32, or float64
    for float64 logits."""
    shape, dtype = logits
    check_float(dtype, "logits", fn)
    check_rank(shape, 2, "logits", "[T, E]", fn)
    if shape[1] > INT32_MAX:
        raise ValueError(f"{fn}: logits has {shape[1]} experts; expert_indices are int32 (at most {INT32_MAX})")
    k = static_count(k, "k", fn)
    if k > shape[1]:
        raise ValueError(f"{fn}: k = {k} exceeds the {shape[1]} experts (logits' last dimension)")
    static_flag(renormalize, "renormalize", fn)
    return k, accumulate_dtype(dtype)


def check_fused(fused, fp8, fn):
    """A layer's ``fused``: None (the fused expert MLP where it is measured faster), True or
    False; returns it. True with ``fp8`` is refused: the fused op has no FP8 recipe."""
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"{fn}: fused must be None, True or False, got {fused!r}")
    if fused and fp8 is not None:
        raise ValueError(f"{fn}: fused=True asks for the fused expert MLP, which does not run fp8={fp8!r}; pass "
                         "fused=None or False (the composition runs fp8)")
    return fused


def layer_config(fn, dtype, flags=None, **sizes):
    """A layer's constructor arguments: each size (num_experts, widths) a non-negative
    int, each of ``flags`` ({name: value}: bias, accumulate_into_main_grad) a bool and the
    parameters' dtype a float dtype, each named when not."""
    for name, value in sizes.items():
        static_count(value, name, fn)
    for name, value in (flags or {}).items():
        static_flag(value, name, fn)
    check_float(dtype, "dtype", fn)


def layer_x(shape, x_dtype, width, width_name, dtype, fn, name="x", rank=None):
    """A layer's input ``name`` (shape, dtype) has ``rank`` dimensions (where given; the MoE
    layers check theirs), is as wide as the layer's ``width_name`` and, given the layer's
    ``dtype`` (its parameters'; None where autocast casts both), of that dtype: the GEMMs
    take one dtype, and the layer does not cast silently."""
    if rank is not None and len(shape) != rank:
        raise ValueError(f"{fn}: {name} must be {rank}-D [rows, {width_name}], got shape {tuple(shape)}")
    if shape[-1] != width:
        raise ValueError(f"{fn}: {name} has width {shape[-1]} (shape {tuple(shape)}), but the layer's {width_name} "
                         f"is {width}")
    if dtype is not None and x_dtype != dtype:
        remedy = f"cast {name} or make the layer in {x_dtype}" if x_dtype in FLOAT_DTYPES else f"cast {name} to {dtype}"
        raise TypeError(f"{fn}: {name} has dtype {x_dtype}, but the layer's dtype (its parameters') is {dtype}; "
                        f"{remedy}")


def layer_group_sizes(group_sizes, num_experts, fn, dtype_name):
    """A grouped layer's ``group_sizes``, a list of ints or an integer array (``dtype_name``:
    the frontend's name of its dtype), with one entry per expert: the layer takes no
    group_offset, so a window is not what was meant. Named as the layer's, not the op's it
    calls; other ranks are the op's to name."""
    listed = isinstance(group_sizes, (list, tuple))
    for v in group_sizes if listed else (group_sizes,):  # a list may hold arrays (jit's tracers)
        if hasattr(v, "dtype"):
            check_index_dtype(dtype_name(v.dtype), "group_sizes", fn)
        elif listed and not is_static_int(v):
            raise TypeError(f"{fn}: group_sizes must hold integers, got {v!r}")
    shape = (len(group_sizes),) if listed else getattr(group_sizes, "shape", None)
    if shape is not None and len(shape) == 1 and shape[0] != num_experts:
        raise ValueError(f"{fn}: group_sizes has {shape[0]} entries, but the layer has num_experts = {num_experts}: "
                         "one size per expert")


def layer_parameters(named_dtypes, fn):
    """A layer's parameters, ``(name, dtype)`` pairs, share one dtype (the layer's): its
    GEMMs take one, and the layer does not cast silently. Names the first that differs."""
    (first, first_dtype), *others = named_dtypes
    for name, dtype in others:
        if dtype != first_dtype:
            raise TypeError(f"{fn}: parameter {name} has dtype {dtype}, but {first} has {first_dtype}; a layer's "
                            "parameters share one dtype: make or convert the layer in one")


def layer_input(x, hidden_size, allowed, experts_shape, fn, dtype=None):
    """An MoE layer's call: ``x`` (shape, dtype) of width hidden_size (and, given the layer's
    ``dtype``, of that dtype), and ``allowed`` (shape, dtype, or None) booleans that
    broadcast to ``experts_shape`` (x's tokens by the experts)."""
    shape, x_dtype = x
    check_float(x_dtype, "x", fn)
    layer_x(shape, x_dtype, hidden_size, "hidden_size", dtype, fn)
    if allowed is None:
        return
    allowed_shape, allowed_dtype = allowed
    if allowed_dtype != "bool":
        raise TypeError(f"{fn}: allowed must hold booleans (True: the expert may be chosen), got {allowed_dtype}")
    fits = len(allowed_shape) <= len(experts_shape) and all(
        a in (1, b) for a, b in zip(reversed(allowed_shape), reversed(experts_shape)))
    if not fits:
        raise ValueError(f"{fn}: allowed has shape {tuple(allowed_shape)}, which does not broadcast to "
                         f"{tuple(experts_shape)} (x's tokens by the experts)")


def layer_routing(top_k, num_experts, renormalize, fn):
    """An MoE layer's (top_k, renormalize). Each token goes to at least one expert (a layer
    that routes nothing would only ever output zeros) and to at most every expert. Its
    router renormalizes its top-k weights (softmax_topk's ``renormalize``) as told (True or
    False), or when not told (None) for k > 1 only: with k = 1 a renormalized weight is
    always 1, so the router would get no gradient and never learn; top-1 routing (Switch
    Transformer) weights its expert by the full softmax."""
    top_k = static_count(top_k, "top_k", fn, num_experts, "the number of experts")
    if top_k == 0:
        raise ValueError(f"{fn}: top_k must be at least 1, got 0: a layer that routes no token to any expert "
                         "outputs only zeros")
    if renormalize is not None and not isinstance(renormalize, bool):
        raise TypeError(f"{fn}: renormalize must be None, True or False, got {renormalize!r}")
    return top_k, (top_k > 1 if renormalize is None else renormalize)


# ---- torch._grouped_mm's offs= convention (cumulative group ends) -------------------


def sizes_or_ends(fn, has_sizes, has_ends):
    """Exactly one of group_sizes and offs describes the groups."""
    if has_sizes and has_ends:
        raise TypeError(f"{fn}: pass group_sizes or offs (cumulative group ends), not both")
    if not has_sizes and not has_ends:
        raise TypeError(f"{fn}: group_sizes (or offs, the cumulative group ends) is required")


def group_ends(fn, shape, dtype, num_groups=None, has_offset=False):
    """Checks offs: 1-D integers, one cumulative end per group (``num_groups`` of them,
    or at least that many with a group_offset window; None: any number)."""
    if len(shape) != 1:
        raise ValueError(f"{fn}: offs must be 1-D (cumulative group ends), got shape {tuple(shape)}")
    check_index_dtype(dtype, "offs", fn)
    if num_groups is not None:
        check_group_count(shape[0], num_groups, has_offset, fn, "offs")


def ragged_contraction(fn, names, lhs, rhs, out_dtype=None, *, bias=False, transpose=False, has_offset=False):
    """Checks ``lhs [M, K] @ rhs [K, N]`` with K split into groups by offs (torch._grouped_mm's
    2d x 2d form: ``out[g] = lhs[:, K_g] @ rhs[K_g, :]``, ``[G, M, N]``); returns the output
    dtype name. ``bias``, ``transpose`` and ``has_offset`` say whether those were passed:
    none applies to this form."""
    (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype) = lhs, rhs
    check_float(lhs_dtype, names["lhs"], fn)
    check_float(rhs_dtype, names["rhs"], fn)
    check_rank(lhs_shape, 2, names["lhs"], "[M, K]", fn)
    check_rank(rhs_shape, 2, names["rhs"], "[K, N] (the 2d x 2d form of offs)", fn)
    check_same_dtype(rhs_dtype, lhs_dtype, names["rhs"], names["lhs"], fn)
    # An option this form lacks first: with it, a weight laid out for it would not contract.
    for passed, name in ((bias, "bias"), (transpose, names["transpose"]), (has_offset, "group_offset")):
        if passed:
            raise ValueError(f"{fn}: {name} does not apply to the 2d x 2d form of offs "
                             f"({names['rhs']} [K, N], groups along K)")
    if rhs_shape[0] != lhs_shape[1]:
        raise ValueError(f"{fn}: {names['rhs']} shape {tuple(rhs_shape)} does not contract with "
                         f"{names['lhs']} shape {tuple(lhs_shape)} (the 2d x 2d form of offs)")
    return output_dtype(lhs_dtype, out_dtype, fn, names["out_dtype"])


# ---- FP8: scaled grouped GEMMs and their quantization (groupgemm/fp8.h) ----------------

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # the core's Fp8Type, in its order; e5m2 for the lhs only (a gradient)
FP8_RECIPES = ("rowwise", "blockwise")  # the core's Fp8Scaling, in its order
FP8_ROWWISE = FP8_RECIPES.index("rowwise")
FP8_OUTPUTS = ("bfloat16", "float32")
FP8_INPUTS = ("float32", "bfloat16", "float16")  # what is quantized
FP8_BLOCK = 128

FP8_JAX_NAMES = {"lhs": "lhs", "rhs": "rhs", "lhs_scale": "lhs_scale", "rhs_scale": "rhs_scale",
                 "out_dtype": "preferred_element_type", "recipe": "recipe"}
# torch.nn.functional.scaled_grouped_mm's spelling.
FP8_TORCH_NAMES = {"lhs": "mat_a", "rhs": "mat_b", "lhs_scale": "scale_a", "rhs_scale": "scale_b",
                   "out_dtype": "output_dtype", "recipe": "scale_recipe_a / scale_recipe_b"}


def fp8_blocks(length):
    """Blocks of 128 covering `length` (the last may be partial)."""
    return -(-length // FP8_BLOCK)


def fp8_recipe(recipe, fn, name="recipe"):
    """The recipe name, "rowwise" or "blockwise"; returns the core's index of it."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"{fn}: {name} must be 'rowwise' or 'blockwise', got {recipe!r}")
    return FP8_RECIPES.index(recipe)


def fp8_format(dtype, name, fn):
    """A float8 dtype name; returns the core's Fp8Type index."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{fn}: {name} must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return FP8_DTYPES.index(dtype)


def fp8_output_dtype(requested, fn, name):
    """bfloat16 (the default, as torch's) or float32."""
    out = "bfloat16" if requested is None else requested
    if out not in FP8_OUTPUTS:
        raise TypeError(f"{fn}: {name} must be bfloat16 or float32 for float8 inputs, got {out}")
    return out


def fp8_token_block_bound(m, num_groups):
    """Scale rows of the blockwise weight gradient: each group's tokens in blocks of 128,
    restarting at the group's first token, need at most floor((M + 127 G) / 128). The core's
    rule (groupgemm/fp8_blocks.h, token_block_bound; a test holds the two equal), in Python
    so that torch.compile traces it with symbolic sizes."""
    if m <= 0 or num_groups <= 0:
        return 0
    return (m + (FP8_BLOCK - 1) * num_groups) // FP8_BLOCK


def _fp8_scale(shape, dtype, want, name, recipe, fn):
    if dtype != "float32":
        raise TypeError(f"{fn}: {name} must be float32, got {dtype}")
    if tuple(shape) != tuple(want):
        raise ValueError(f"{fn}: {name} must have shape {tuple(want)} for {recipe} scaling, got {tuple(shape)}")


def _fp8_pair(fn, names, lhs_dtype, rhs_dtype):
    """lhs float8_e4m3fn, or float8_e5m2 as a gradient; rhs float8_e4m3fn. Returns the
    core's Fp8Type indices."""
    lhs_type, rhs_type = fp8_format(lhs_dtype, names["lhs"], fn), fp8_format(rhs_dtype, names["rhs"], fn)
    if rhs_dtype != "float8_e4m3fn":
        raise TypeError(f"{fn}: {names['rhs']} must be float8_e4m3fn; float8_e5m2 is accepted for "
                        f"{names['lhs']} (a gradient), got {rhs_dtype}")
    return lhs_type, rhs_type


def scaled_matmul(fn, names, lhs, rhs, lhs_scale, rhs_scale, recipe, bias=None, out_dtype=None):
    """Checks ``lhs [M, K] @ rhs [G, N, K]^T`` per group, float8 with float32 scales:
    rowwise ``[M]`` and ``[G, N]``; blockwise ``[M, ceil(K/128)]`` and
    ``[G, ceil(N/128), ceil(K/128)]``, K a multiple of 128; bias ``[G, N]`` in the output
    dtype. Each operand is a (shape, dtype name) pair (bias may be None). Returns
    (G, N, output dtype name, lhs Fp8Type, rhs Fp8Type, recipe index)."""
    (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype) = lhs, rhs
    scaling = fp8_recipe(recipe, fn, names["recipe"])
    lhs_type, rhs_type = _fp8_pair(fn, names, lhs_dtype, rhs_dtype)
    check_rank(lhs_shape, 2, names["lhs"], "[M, K]", fn)
    check_rank(rhs_shape, 3, names["rhs"], "[G, N, K] (K-major)", fn)
    (m, k), (g, n, rhs_k) = lhs_shape, rhs_shape
    if rhs_k != k:
        raise ValueError(f"{fn}: {names['lhs']} has K = {k} but {names['rhs']} has K = {rhs_k}")
    if recipe == "blockwise" and k % FP8_BLOCK:
        raise ValueError(f"{fn}: blockwise scaling needs K (the contraction, {names['lhs']}'s last dimension) "
                         f"to be a multiple of 128, got K = {k}")
    kb = fp8_blocks(k)
    want_lhs, want_rhs = ((m,), (g, n)) if recipe == "rowwise" else ((m, kb), (g, fp8_blocks(n), kb))
    _fp8_scale(*lhs_scale, want_lhs, names["lhs_scale"], recipe, fn)
    _fp8_scale(*rhs_scale, want_rhs, names["rhs_scale"], recipe, fn)
    out = fp8_output_dtype(out_dtype, fn, names["out_dtype"])
    if bias is not None:
        check_shape(bias[0], (g, n), "bias", fn)
        if bias[1] != out:
            raise TypeError(f"{fn}: bias must have the output dtype {out}, got {bias[1]}")
    return g, n, out, lhs_type, rhs_type, scaling


def scaled_wgrad(fn, names, lhs, rhs, lhs_scale, rhs_scale, recipe, num_groups):
    """Checks the weight-gradient form ``out[g] = lhs[:, rows_g] @ rhs[:, rows_g]^T``:
    ``lhs [K, M]``, ``rhs [N, M]`` (the tokens contiguous), float8; scales rowwise
    ``[G, K]`` / ``[G, N]`` (one per group and channel; ``[G * K]`` / ``[G * N]`` flat too,
    torch's layout) or blockwise ``[B, K]`` / ``[B, N]`` with B = fp8_token_block_bound(M, G).
    Returns (G, the result's shape, lhs Fp8Type, rhs Fp8Type, recipe index)."""
    (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype) = lhs, rhs
    scaling = fp8_recipe(recipe, fn, names["recipe"])
    lhs_type, rhs_type = _fp8_pair(fn, names, lhs_dtype, rhs_dtype)
    check_rank(lhs_shape, 2, names["lhs"], "[K, M] (tokens last)", fn)
    check_rank(rhs_shape, 2, names["rhs"], "[N, M] (tokens last)", fn)
    (k, m), (n, rhs_m) = lhs_shape, rhs_shape
    if rhs_m != m:
        raise ValueError(f"{fn}: {names['lhs']} has {m} tokens but {names['rhs']} has {rhs_m}")
    g = static_count(num_groups, "num_groups", fn)
    rows = g if recipe == "rowwise" else fp8_token_block_bound(m, g)
    for (shape, dtype), width, name in ((lhs_scale, k, names["lhs_scale"]), (rhs_scale, n, names["rhs_scale"])):
        flat = recipe == "rowwise" and len(shape) == 1
        _fp8_scale(shape, dtype, (rows * width,) if flat else (rows, width), name, recipe, fn)
    return g, (g, k, n), lhs_type, rhs_type, scaling


def fp8_accumulator(fn, shape, dtype, want_shape, requested_out_dtype, out_dtype_name, **kwargs):
    """An accumulate_into buffer of a weight-gradient form: float32, updated in place; an
    output dtype asked for besides (``out_dtype_name``, None when not) must be float32 too."""
    return accumulator(fn, shape, dtype, want_shape, "float32", requested_out_dtype, out_dtype_name, **kwargs)


def quantize_fp8(fn, x, recipe, dtype):
    """Checks ``quantize_fp8(x, recipe, dtype)``: x 2-D ``[M, K]`` (activations: scales
    ``[M]`` or ``[M, ceil(K/128)]``) or 3-D ``[G, N, K]`` (weights: ``[G, N]`` or
    ``[G, ceil(N/128), ceil(K/128)]``). Returns (scale shape, Fp8Type, recipe index)."""
    shape, x_dtype = x
    scaling = fp8_recipe(recipe, fn)
    if x_dtype not in FP8_INPUTS:
        raise TypeError(f"{fn}: x must be float32, bfloat16 or float16, got {x_dtype}")
    fp8_type = fp8_format(dtype, "dtype", fn)
    if len(shape) not in (2, 3):
        raise ValueError(f"{fn}: x must be 2-D [M, K] (activations) or 3-D [G, N, K] (weights), "
                         f"got shape {tuple(shape)}")
    if len(shape) == 2:
        m, k = shape
        scale = (m,) if recipe == "rowwise" else (m, fp8_blocks(k))
    else:
        g, n, k = shape
        scale = (g, n) if recipe == "rowwise" else (g, fp8_blocks(n), fp8_blocks(k))
    return scale, fp8_type, scaling


def local_group_count(num_groups, sizes_shape, has_offset, fn, name="group_sizes"):
    """The local groups of a call that takes ``num_groups``: given, or without group_offset
    ``len(group_sizes)`` (``sizes_shape``, None when group_sizes has no shape: the
    group_sizes check then names it)."""
    one_dimensional = sizes_shape is not None and len(sizes_shape) == 1
    if num_groups is not None:  # checked before the shapes that follow from it
        num_groups = static_count(num_groups, "num_groups", fn)
        if one_dimensional:
            check_group_count(sizes_shape[0], num_groups, has_offset, fn, name)
        return num_groups
    if has_offset:
        raise TypeError(f"{fn}: num_groups is required with group_offset (the window's group count)")
    return sizes_shape[0] if one_dimensional else 0


def quantize_fp8_grouped(fn, x, recipe, dtype, num_groups):
    """Checks ``quantize_fp8_grouped``: x ``[M, C]`` -> q ``[C, M]``, scales ``[G, C]``
    (rowwise) or ``[fp8_token_block_bound(M, G), C]`` (blockwise). Returns (q shape, scale
    shape, Fp8Type, recipe index)."""
    shape, x_dtype = x
    scaling = fp8_recipe(recipe, fn)
    if x_dtype not in FP8_INPUTS:
        raise TypeError(f"{fn}: x must be float32, bfloat16 or float16, got {x_dtype}")
    fp8_type = fp8_format(dtype, "dtype", fn)
    check_rank(shape, 2, "x", "[M, C] (rows sorted by group)", fn)
    m, c = shape
    g = static_count(num_groups, "num_groups", fn)
    rows = g if recipe == "rowwise" else fp8_token_block_bound(m, g)
    return (c, m), (rows, c), fp8_type, scaling


# torch.nn.functional.ScalingType names per form: what each recipe's pair of scale recipes is.
TORCH_FP8_RECIPES = {
    ("2d-3d", "RowWise", "RowWise"): "rowwise",
    ("2d-3d", "BlockWise1x128", "BlockWise128x128"): "blockwise",
    ("2d-2d", "RowWise", "RowWise"): "rowwise",
    ("2d-2d", "BlockWise1x128", "BlockWise1x128"): "blockwise",
}


def torch_fp8_scalings(form, recipe):
    """torch's (scale_recipe_a, scale_recipe_b) names of a recipe in a form."""
    return next((a, b) for (f, a, b), r in TORCH_FP8_RECIPES.items() if f == form and r == recipe)


def torch_fp8_recipe(fn, form, recipe_a, recipe_b):
    """The recipe of torch's (scale_recipe_a, scale_recipe_b) names in the ``form``
    ("2d-3d": forward / dgrad, "2d-2d": weight gradient)."""
    recipe = TORCH_FP8_RECIPES.get((form, recipe_a, recipe_b))
    if recipe is None:
        pairs = " or ".join(f"{a} x {b}" for f, a, b in TORCH_FP8_RECIPES if f == form)
        raise ValueError(f"{fn}: scale_recipe_a x scale_recipe_b {recipe_a} x {recipe_b} is not supported in the "
                         f"{form} form; use {pairs}")
    return recipe


def fp8_layer(fn, recipe, dtype, in_features, out_features, names=("in_features", "out_features")):
    """``fp8=`` of a grouped linear layer: None (off), "rowwise" or "blockwise". Its GEMMs
    write the layer's dtype, float32 or bfloat16; blockwise contracts over in_features
    (forward) and out_features (input gradient) in 128-blocks, so both must be multiples
    of 128. ``names``: the caller's names of the two sizes (an MLP's: its hidden and FFN
    widths, which cover both of its layers'). Returns the recipe."""
    if recipe is None:
        return None
    fp8_recipe(recipe, fn, "fp8")
    if dtype not in FP8_OUTPUTS:
        raise TypeError(f"{fn}: fp8={recipe!r} needs float32 or bfloat16 weights and inputs, got {dtype}")
    if recipe == "blockwise":
        for size, name in zip((in_features, out_features), names):
            if size % FP8_BLOCK:
                raise ValueError(f"{fn}: fp8='blockwise' needs {name} to be a multiple of 128 (its GEMMs contract "
                                 f"over it in 128-blocks), got {size}")
    return recipe
