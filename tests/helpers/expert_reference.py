"""Float64 NumPy reference of the expert layer (the router's softmax top-k, permute,
unpermute, the activations, the grouped MLP), written from the semantics in README.md, independently of the core."""

import math

import numpy as np
import reference as ref

_ERFC = np.vectorize(math.erfc, otypes=[np.float64])


def _normal_cdf(x):
    return 0.5 * _ERFC(-x / math.sqrt(2.0))  # no cancellation in the negative tail


def _bucket(expert_indices, num_experts):
    e = np.asarray(expert_indices, np.int64).reshape(-1)
    return np.where((e >= 0) & (e < num_experts), e, num_experts)


def permute(tokens, expert_indices, num_experts):
    """permuted, group_sizes, row_map: a stable sort of the slots by expert, dropped last."""
    tokens = np.asarray(tokens, np.float64)
    t, k = np.asarray(expert_indices).shape
    bucket = _bucket(expert_indices, num_experts)
    order = sorted(range(t * k), key=lambda s: (bucket[s], s))
    permuted = np.zeros((t * k, tokens.shape[1]))
    row_map = -np.ones((t, k), np.int64)
    for row, s in enumerate(order):
        if bucket[s] < num_experts:
            permuted[row] = tokens[s // k]
            row_map[s // k, s % k] = row
    sizes = np.array([np.count_nonzero(bucket == e) for e in range(num_experts)], np.int64)
    return permuted, sizes, row_map


def maps_to_row(row_map, num_rows):
    """Which row_map entries name a row of permuted [R, H]; any other is a dropped slot."""
    row_map = np.asarray(row_map)
    return (row_map >= 0) & (row_map < num_rows)


def unpermute(permuted, row_map, probs=None):
    permuted = np.asarray(permuted, np.float64)
    t, k = row_map.shape
    probs = np.ones((t, k)) if probs is None else np.asarray(probs, np.float64)
    out = np.zeros((t, permuted.shape[1]))
    kept = maps_to_row(row_map, len(permuted))
    for i in range(t):
        for j in range(k):
            if kept[i, j]:
                out[i] += probs[i, j] * permuted[row_map[i, j]]
    return out


def unpermute_grads(dout, permuted, row_map, probs=None):
    """dpermuted (a row gets every slot that names it; zero on rows none names) and dprobs
    (zero for dropped slots): the forward's derivatives."""
    dout, permuted = np.asarray(dout, np.float64), np.asarray(permuted, np.float64)
    t, k = row_map.shape
    probs = np.ones((t, k)) if probs is None else np.asarray(probs, np.float64)
    dpermuted, dprobs = np.zeros_like(permuted), np.zeros((t, k))
    kept = maps_to_row(row_map, len(permuted))
    for i in range(t):
        for j in range(k):
            if kept[i, j]:
                dpermuted[row_map[i, j]] += probs[i, j] * dout[i]
                dprobs[i, j] = permuted[row_map[i, j]] @ dout[i]
    return dpermuted, dprobs


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def activation(h, name):
    h = np.asarray(h, np.float64)
    if name == "swiglu":
        gate, up = np.split(h, 2, axis=1)
        return gate * _sigmoid(gate) * up
    if name == "gelu":
        return h * _normal_cdf(h)
    if name == "relu":
        return np.maximum(h, 0.0)
    return h * _sigmoid(h)  # silu


def _silu_grad(x):
    s = _sigmoid(x)
    return s + x * s * (1.0 - s)


def activation_grad(dout, h, name):
    dout, h = np.asarray(dout, np.float64), np.asarray(h, np.float64)
    if name == "swiglu":
        gate, up = np.split(h, 2, axis=1)
        return np.concatenate([dout * up * _silu_grad(gate), dout * gate * _sigmoid(gate)], axis=1)
    if name == "gelu":
        return dout * (_normal_cdf(h) + h * np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi))
    if name == "relu":
        return dout * (h > 0)
    return dout * _silu_grad(h)


def grouped_mlp_and_grads(x, w_in, w_out, sizes, name, b_in, b_out, dout, round_to=lambda a: a):
    """y and (dx, dw_in, dw_out, db_in, db_out) of fc2(act(fc1(x))) with torch-layout weights
    (w_in [E, F_in, H], w_out [E, H, F]); ``round_to`` rounds the intermediates the way the
    implementation stores them (in x's dtype)."""
    g = w_in.shape[0]
    h = round_to(ref.grouped_matmul(x, w_in, sizes, b_in, transpose_rhs=True))
    a = round_to(activation(h, name))
    y = ref.grouped_matmul(a, w_out, sizes, b_out, transpose_rhs=True)
    da = round_to(ref.grouped_matmul(dout, w_out, sizes, None, transpose_rhs=False))
    dh = round_to(activation_grad(da, h, name))
    dx = ref.grouped_matmul(dh, w_in, sizes, None, transpose_rhs=False)
    dw_out = ref.grouped_matmul_wgrad(dout, a, sizes, g)  # [E, H, F]
    dw_in = ref.grouped_matmul_wgrad(dh, x, sizes, g)  # [E, F_in, H]
    return y, (dx, dw_in, dw_out, ref.grouped_bias_grad(dh, sizes, g), ref.grouped_bias_grad(dout, sizes, g))


def softmax_topk(logits, k, renormalize):
    """probs, expert_indices: per token the k largest logits (ties: lower expert first;
    -inf and NaN never chosen, -1 and 0 for a slot left without one), weighted by the
    softmax over the chosen logits (renormalize) or over every logit but -inf and NaN."""
    logits = np.asarray(logits, np.float64)
    t = logits.shape[0]
    indices, probs = -np.ones((t, k), np.int64), np.zeros((t, k))
    for i, row in enumerate(logits):
        finite = [e for e in range(len(row)) if row[e] > -np.inf]
        chosen = sorted(finite, key=lambda e: (-row[e], e))[:k]
        indices[i, :len(chosen)] = chosen
        if chosen:
            pool = chosen if renormalize else finite
            weights = np.exp(row[pool] - row[chosen[0]])
            probs[i, :len(chosen)] = weights[[pool.index(e) for e in chosen]] / weights.sum()
    return probs, indices


def softmax_topk_grad(logits, indices, dprobs, renormalize):
    """dlogits = J^T dprobs with the choices held fixed, J the Jacobian of the chosen
    probabilities: of the softmax over the chosen logits (renormalize) or the full one."""
    logits, dprobs = np.asarray(logits, np.float64), np.asarray(dprobs, np.float64)
    dlogits = np.zeros_like(logits)
    for i, row in enumerate(logits):
        chosen = [int(e) for e in indices[i] if e >= 0]
        if not chosen:
            continue
        pool = chosen if renormalize else [e for e in range(len(row)) if row[e] > -np.inf]
        p = np.exp(row[pool] - row[chosen[0]])
        p /= p.sum()
        jacobian = np.diag(p) - np.outer(p, p)  # d softmax(pool) / d logits[pool]
        rows = [pool.index(e) for e in chosen]
        dlogits[i, pool] = jacobian[rows].T @ dprobs[i, :len(chosen)]
    return dlogits


def softmax_topk_tangent(logits, indices, tlogits, renormalize):
    """tprobs = J tlogits with the choices held fixed (J as in softmax_topk_grad)."""
    logits, tlogits = np.asarray(logits, np.float64), np.asarray(tlogits, np.float64)
    tprobs = np.zeros(indices.shape)
    for i, row in enumerate(logits):
        chosen = [int(e) for e in indices[i] if e >= 0]
        if not chosen:
            continue
        pool = chosen if renormalize else [e for e in range(len(row)) if row[e] > -np.inf]
        p = np.exp(row[pool] - row[chosen[0]])
        p /= p.sum()
        jacobian = np.diag(p) - np.outer(p, p)
        tprobs[i, :len(chosen)] = jacobian[[pool.index(e) for e in chosen]] @ tlogits[i, pool]
    return tprobs


def window_ids(expert_indices, group_offset, num_experts):
    """Each slot's local expert for experts [group_offset, group_offset + E), -1 when dropped
    (a negative id, or one outside the window)."""
    ids = np.asarray(expert_indices).astype(object)  # Python ints: exact for any id and offset
    local = ids - int(group_offset)
    return np.where((ids >= 0) & (local >= 0) & (local < num_experts), local, -1).astype(np.int64)


def expert_mlp_and_grads(tokens, expert_indices, probs, w_in, w_out, b_in, b_out, dout, name, group_offset=0,
                         round_to=lambda a: a):
    """out and the gradients of (tokens, w_in, w_out, probs, b_in, b_out) of the expert layer
    out[t] = sum over j of probs[t, j] * mlp_e(tokens[t]) for the slots whose expert is local
    (torch-layout weights, w_in [E, F_in, H], w_out [E, H, F]; probs None: weight 1): the
    permute, the grouped MLP and the unpermute above, composed."""
    local = window_ids(expert_indices, group_offset, np.shape(w_in)[0])
    permuted, sizes, row_map = permute(tokens, local, np.shape(w_in)[0])
    y, _ = grouped_mlp_and_grads(permuted, w_in, w_out, sizes, name, b_in, b_out, np.zeros(np.shape(permuted)),
                                 round_to)
    dy, dprobs = unpermute_grads(dout, y, row_map, probs)
    _, (dx, dw_in, dw_out, db_in, db_out) = grouped_mlp_and_grads(permuted, w_in, w_out, sizes, name, b_in, b_out,
                                                                  dy, round_to)
    return unpermute(y, row_map, probs), (unpermute(dx, row_map), dw_in, dw_out, dprobs, db_in, db_out)
