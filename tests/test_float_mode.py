"""The core computes in one floating-point mode whoever calls it: IEEE 754 with subnormals
kept (core_cuda/src/float_mode.h). XLA's CPU threads flush subnormals to zero, torch's do
not, and OpenMP's workers keep the mode of the thread that first started them; so on inputs
whose results are subnormal, JAX and PyTorch must give the same bits, in either order of
first use within one process, and those bits must be the unflushed ones."""

import json
import os
import textwrap

import numpy as np
import pytest
from workers import run_code

pytest.importorskip("torch")
pytest.importorskip("jax")

# Each op of the case table through one frontend adapter (tests/helpers), on inputs whose
# results are subnormal in float32 (below 1.18e-38); every result's bytes as hex, by op.
# The frameworks run in the order given: the first one's calls start OpenMP's workers.
SCRIPT = textwrap.dedent("""
    import importlib, json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])

    def hexes(*arrays):
        return [np.ascontiguousarray(np.asarray(a)).tobytes().hex() for a in arrays]

    def run(fe, c):
        out = {"grouped_matmul": hexes(*fe.matmul_and_grads(c["x"], c["w"], c["sizes"], c["dy"]))}
        probs, indices, dlogits = fe.softmax_topk_and_grad(c["logits"], 2, False, c["dprobs"], "float32")
        out["softmax_topk"] = hexes(*map(fe.to_float64, (probs, indices, dlogits)))
        for recipe in ("rowwise", "blockwise"):
            q, scale = fe.quantize_fp8(fe.array(c["tiny"], "float32"), recipe)
            out["quantize_fp8 " + recipe] = hexes(fe.to_float64(q), fe.to_float64(scale))
        permuted, sizes, row_map, dtokens = fe.permute_and_grad(c["tokens"], c["experts"], 4, c["dpermuted"],
                                                                "float32")
        row_map = fe.to_float64(row_map).astype(np.int32)
        out["permute"] = hexes(*map(fe.to_float64, (permuted, sizes, dtokens)))
        unpermuted = fe.unpermute_and_grads(fe.to_float64(permuted), row_map, c["probs"], c["dout"], "float32",
                                            "float32")
        out["unpermute"] = hexes(*map(fe.to_float64, unpermuted))
        y, grads = fe.grouped_mlp_and_grads(c["x"], c["w_in"], c["w_out"], c["sizes"], "swiglu", None, None,
                                            c["dy_mlp"], "float32")
        out["grouped_mlp"] = hexes(*map(fe.to_float64, (y, *grads[:3])))
        return out

    case = {k: np.asarray(v, dtype=d) for k, (v, d) in json.load(open(sys.argv[2])).items()}
    print(json.dumps({name: run(importlib.import_module(name + "_frontend"), case) for name in sys.argv[1].split(",")}))
""")


def case():
    """Inputs whose products, softmax tails, amaxes and weighted sums are subnormal."""
    rng = np.random.default_rng(0)
    tiny = lambda *shape: (rng.standard_normal(shape) * 1e-20).astype(np.float32)  # noqa: E731
    logits = np.full((6, 4), -np.inf, np.float32)  # experts 2 and 3 masked off
    logits[:, 0] = rng.standard_normal(6)
    logits[:, 1] = logits[:, 0] - 89.0 - rng.random(6)  # the second choice's probability: exp(-89) at most, 2e-39
    return {"x": (tiny(8, 64), "float32"), "w": (tiny(2, 64, 32), "float32"), "dy": (tiny(8, 32), "float32"),
            "sizes": ([3, 5], "int32"), "logits": (logits, "float32"),
            "dprobs": (rng.standard_normal((6, 2)) * 1e-10, "float32"),
            "tiny": (rng.standard_normal((4, 256)) * 1e-40, "float32"),  # subnormal values, amax and all
            "tokens": (tiny(5, 16), "float32"), "experts": ([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1]], "int32"),
            "dpermuted": (tiny(10, 16), "float32"), "probs": (rng.random((5, 2)) * 1e-19, "float32"),
            "dout": (tiny(5, 16), "float32"),
            "w_in": (rng.standard_normal((2, 64, 64)) * 0.1, "float32"),  # [E, F_in, H]: 2F = 64
            "w_out": (rng.standard_normal((2, 64, 32)) * 0.5, "float32"),  # [E, H, F]
            "dy_mlp": (tiny(8, 64), "float32")}


def run(order, tmp_path):
    path = tmp_path / "case.json"
    path.write_text(json.dumps({k: (np.asarray(v, dtype=d).tolist(), d) for k, (v, d) in case().items()}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    helpers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
    done = run_code(SCRIPT, order, path, helpers, env=env, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_jax_and_torch_give_the_same_bits_on_subnormal_results_in_either_order(tmp_path):
    jax_first, torch_first = run("jax,torch", tmp_path), run("torch,jax", tmp_path)
    assert set(jax_first["jax"]) == {"grouped_matmul", "softmax_topk", "quantize_fp8 rowwise",
                                     "quantize_fp8 blockwise", "permute", "unpermute", "grouped_mlp"}
    for op in jax_first["jax"]:
        assert jax_first["jax"][op] == jax_first["torch"][op], f"{op}: JAX and torch differ (JAX first)"
        assert torch_first["jax"][op] == torch_first["torch"][op], f"{op}: JAX and torch differ (torch first)"
        assert jax_first["torch"][op] == torch_first["torch"][op], f"{op}: torch differs after a JAX call"


def test_the_bits_are_the_unflushed_ones(tmp_path):
    results = run("jax", tmp_path)["jax"]  # JAX alone: its threads flush, unless the core sets its own mode
    f64 = lambda op, i=0: np.frombuffer(bytes.fromhex(results[op][i]), np.float64)  # noqa: E731
    subnormal = lambda a: (a != 0) & (np.abs(a) < np.finfo(np.float32).tiny)  # noqa: E731
    c = {k: np.asarray(v, dtype=d) for k, (v, d) in case().items()}
    # Products of two 1e-20 values: flushed, they would be exact zeros.
    y = f64("grouped_matmul").reshape(8, 32)
    assert subnormal(y).any() and np.count_nonzero(y) > 0.9 * y.size
    want = np.concatenate([c["x"][:3].astype(np.float64) @ c["w"][0], c["x"][3:].astype(np.float64) @ c["w"][1]])
    np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-44)
    assert subnormal(f64("softmax_topk").reshape(6, 2)[:, 1]).all()  # the second choice's weight
    # A block of subnormal values has a non-zero amax: its scale is amax / 448 held at 2^-126
    # (fp8_math.h), not the 1 of an all-zero block, and its values quantize to non-zeros.
    for recipe in ("rowwise", "blockwise"):
        q, scale = f64(f"quantize_fp8 {recipe}"), f64(f"quantize_fp8 {recipe}", 1)
        assert (scale == 2.0**-126).all() and np.count_nonzero(q) > 0.9 * q.size, (recipe, scale)
    assert subnormal(f64("unpermute")).any() and subnormal(f64("grouped_mlp")).any()


# The fused expert MLP's backward with one expert run alone (skewed routing) whose first
# parallel work is a GEMM kept to one thread (bfloat16 weight gradients): its workers still
# get the core's mode. The caller flushes subnormals and starts torch's workers in that mode;
# the weighted dout values (1e-9 * 1e-30) are subnormal.
ALONE_SCRIPT = textwrap.dedent("""
    import hashlib, sys
    import numpy as np, torch
    import groupgemm.torch as gt
    torch.set_num_threads(2)
    torch.set_flush_denormal(sys.argv[1] == "flush")
    torch.ones(1 << 20).sum()  # torch's OpenMP workers start, in the caller's mode
    counts = [400] + [20] * 10
    rng = np.random.default_rng(0)
    bf16 = lambda a: torch.from_numpy(a.astype(np.float32)).bfloat16()
    indices = torch.from_numpy(np.repeat(np.arange(len(counts)), counts).astype(np.int32)[:, None])
    x, w_in = bf16(rng.standard_normal((sum(counts), 8))), bf16(rng.standard_normal((len(counts), 8, 16)))
    w_out = bf16(rng.standard_normal((len(counts), 8, 8))).requires_grad_()
    b_out = torch.zeros(len(counts), 8, dtype=torch.bfloat16, requires_grad=True)
    dy = bf16(rng.standard_normal((sum(counts), 8)) * 1e-30)
    for _ in range(3):
        w_out.grad = b_out.grad = None
        gt.expert_mlp(x, indices, torch.full((sum(counts), 1), 1e-9), w_in, w_out, b_out=b_out).backward(dy)
        bits = b_out.grad.view(torch.int16)  # compared as bits: a flushing caller's != 0 reads subnormals as 0
        print(hashlib.sha1(bits.numpy().tobytes()).hexdigest(), int((bits != 0).any(1).sum()))
""")


def test_an_expert_run_alone_gives_every_worker_the_cores_mode():
    def hashes(mode):
        return run_code(ALONE_SCRIPT, mode, timeout=300).stdout.split()

    plain = hashes("plain")
    assert plain[1] == "11"  # every expert's bias gradient holds subnormal sums, not zeros
    assert hashes("flush") == plain


# float64 subnormal products (OpenBLAS), in a process that flushed while groupgemm loaded:
# OpenBLAS started its own threads then, in that mode, and the core's float-mode scope never
# reached them (half the products came out 0). The core runs it on the calling thread.
FLUSHED_IMPORT_SCRIPT = textwrap.dedent("""
    import hashlib, sys, numpy as np, torch
    torch.set_flush_denormal(sys.argv[1] == "flush")
    import groupgemm.torch as gt
    torch.set_flush_denormal(False)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((1024, 256)) * 1e-160)
    w = torch.from_numpy(rng.standard_normal((2, 256, 256)) * 1e-160)
    y = gt.grouped_mm(x, w, torch.tensor([512, 512])).numpy()  # about 1e-320: float64 subnormals
    print(hashlib.sha1(y.tobytes()).hexdigest(), int((y != 0).sum()))
""")


def test_float64_keeps_subnormals_when_the_process_flushed_as_groupgemm_loaded():
    def hashes(mode):
        return run_code(FLUSHED_IMPORT_SCRIPT, mode, timeout=300).stdout.split()

    plain = hashes("plain")
    assert int(plain[1]) > 0.99 * 1024 * 256
    assert hashes("flush") == plain


# A flushing process whose first parallel work is a groupgemm call: OpenMP's workers start
# inside the call. They took the core's mode and kept it, so torch's later flushing work
# kept subnormals on the workers' share (half of y * y below).
WORKERS_START_SCRIPT = textwrap.dedent("""
    import torch
    import groupgemm.torch as gt
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)
    gt.grouped_mm(torch.randn(4000, 64), torch.randn(4, 64, 64), torch.tensor([1000, 1000, 1000, 1000]))
    y = torch.full((2048, 2048), 1e-20)
    print(int(((y * y) != 0).sum()))
""")


def test_workers_a_call_starts_keep_the_callers_mode_after_it():
    # every product flushed, as the caller asked
    assert run_code(WORKERS_START_SCRIPT, timeout=300).stdout.split() == ["0"]
