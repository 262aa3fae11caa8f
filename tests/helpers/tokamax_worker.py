"""Worker of test_tokamax.py: groupgemm.jax.tokamax_implementation inside tokamax's
ragged_dot, run in a process of its own (tokamax_env.py says why). Each case's arrays go
to OUT_DIR/results.npz, and what each case raised or which implementation ran to
OUT_DIR/report.json; test_tokamax.py checks them against float64 NumPy.

Usage: python tokamax_worker.py OUT_DIR
"""

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import qwix
import tokamax

import groupgemm.jax as gj

GG = gj.tokamax_implementation
DIMS = {  # tokamax's three dimension numbers of the ragged modes it names
    "forward": jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0]),
    "transposed_rhs": jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0]),
    "weight_gradient": jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], []),
}
# jax.lax.ragged_dot_general with a batch dimension beside the ragged one: not groupgemm's.
BATCHED = jax.lax.RaggedDotDimensionNumbers((([2], [2]), ([0], [0])), [1], [1])


def operands(m, k, n, sizes, dtype="float32", seed=0):
    """lhs [m, k], rhs [G, k, n], group_sizes, dout [m, n] as float32 NumPy rounded to
    dtype (the reference's inputs) and as JAX arrays."""
    rng = np.random.default_rng(seed)
    raw = {"lhs": rng.standard_normal((m, k)), "rhs": rng.standard_normal((len(sizes), k, n)) / 3,
           "dout": rng.standard_normal((m, n))}
    arrays = {name: jnp.asarray(v, dtype) for name, v in raw.items()}
    arrays["group_sizes"] = jnp.asarray(sizes, jnp.int32)
    return arrays


def value_and_grads(call, lhs, rhs, dout):
    """out, and the gradients of sum(out * dout) in lhs and rhs, under jit."""
    def loss(lhs, rhs):
        return jnp.sum(call(lhs, rhs).astype(jnp.float32) * dout.astype(jnp.float32))
    out = jax.jit(call)(lhs, rhs)
    dlhs, drhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    return out, dlhs, drhs


def ran_groupgemm(call, *args):
    """Whether the traced program calls groupgemm's grouped GEMM (not a fallback)."""
    return "groupgemm_matmul" in str(jax.make_jaxpr(call)(*args))


def main(out_dir):
    results, report = {}, {"tokamax": tokamax.__version__, "ran_groupgemm": {}, "errors": {}, "fell_through": {}}

    def save(name, inputs, *arrays):
        named = {**inputs, **dict(zip(("out", "dlhs", "drhs"), arrays))}
        for label, a in named.items():
            results[f"{name}/{label}"] = np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a)

    # Forward and gradients, empty groups first, in the middle and last, and rows past the
    # groups (tokamax's own kernels have given wrong weight gradients for empty groups).
    for name, sizes, dtype in (("empty_groups", [0, 3, 0, 5, 0], "float32"),
                               ("empty_groups_bf16", [0, 3, 0, 5, 0], "bfloat16"),
                               ("all_empty", [0, 0, 0], "float32")):
        a = operands(10, 8, 6, sizes, dtype)
        call = lambda l, r, s=a["group_sizes"]: tokamax.ragged_dot(l, r, s, implementation=[GG, "xla"])  # noqa: E731
        save(name, a, *value_and_grads(call, a["lhs"], a["rhs"], a["dout"]))
        report["ran_groupgemm"][name] = ran_groupgemm(call, a["lhs"], a["rhs"])

    # tokamax.RaggedDotGroupSizes (an array with representative values), a transposed rhs
    # and the weight-gradient form, through ragged_dot_general.
    a = operands(10, 8, 6, [4, 0, 4])
    save("general", a)
    sizes = tokamax.RaggedDotGroupSizes(a["group_sizes"], (4, 3, 3))
    results["group_sizes_object/out"] = np.asarray(tokamax.ragged_dot(a["lhs"], a["rhs"], sizes, implementation=[GG]))
    results["transposed_rhs/out"] = np.asarray(tokamax.ragged_dot_general(
        a["lhs"], jnp.swapaxes(a["rhs"], 1, 2), a["group_sizes"], DIMS["transposed_rhs"], implementation=[GG]))
    results["weight_gradient/out"] = np.asarray(tokamax.ragged_dot_general(
        a["lhs"], a["dout"], a["group_sizes"], DIMS["weight_gradient"], implementation=[GG]))

    # activation (in float32, before rounding), preferred_element_type, precision.
    b = operands(10, 8, 6, [0, 3, 0, 5, 0], "bfloat16")
    gelu = lambda l, r: tokamax.ragged_dot(l, r, b["group_sizes"], preferred_element_type=jnp.float32,  # noqa: E731
                                           activation=jax.nn.gelu, implementation=[GG])
    save("activation", b, *value_and_grads(gelu, b["lhs"], b["rhs"], b["dout"]))
    a = operands(10, 8, 6, [0, 3, 0, 5, 0])
    save("options", a)
    results["bf16_output/out"] = np.asarray(tokamax.ragged_dot(
        a["lhs"], a["rhs"], a["group_sizes"], preferred_element_type=jnp.bfloat16, implementation=[GG]
    ).astype(jnp.float32))
    for precision in (jax.lax.Precision.HIGHEST, "default", jax.lax.DotAlgorithmPreset.F32_F32_F32):
        results[f"precision {precision}/out"] = np.asarray(tokamax.ragged_dot(
            a["lhs"], a["rhs"], a["group_sizes"], precision=precision, implementation=[GG]))

    # float16 with bfloat16: tokamax promotes them to float32 and returns float32 (jax.lax's
    # own rule gives bfloat16).
    m = operands(10, 8, 6, [0, 3, 0, 5, 0], "float16")
    m["rhs"] = m["rhs"].astype(jnp.bfloat16)
    save("mixed", m, tokamax.ragged_dot(m["lhs"], m["rhs"], m["group_sizes"], implementation=[GG]))

    # What groupgemm does not compute: alone it raises NotImplementedError naming the
    # argument; before "xla" tokamax falls through to it, with xla's own result.
    quantized = qwix.quantize(a["rhs"], jnp.int8)
    batched_lhs, batched_rhs = jnp.stack([a["lhs"]] * 2), jnp.stack([a["rhs"]] * 2)
    unsupported = {
        "lhs": lambda impl: tokamax.ragged_dot(a["lhs"].astype(jnp.int8), a["rhs"].astype(jnp.int8), a["group_sizes"],
                                               preferred_element_type=jnp.int32, implementation=impl),
        "rhs": lambda impl: tokamax.ragged_dot(a["lhs"], quantized, a["group_sizes"], implementation=impl),
        "precision": lambda impl: tokamax.ragged_dot(a["lhs"], a["rhs"], a["group_sizes"], implementation=impl,
                                                     precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3),
        "precision:name": lambda impl: tokamax.ragged_dot(a["lhs"], a["rhs"], a["group_sizes"], implementation=impl,
                                                          precision="BF16_BF16_F32_X3"),  # a preset as jax names it
        "precision:algorithm": lambda impl: tokamax.ragged_dot(
            a["lhs"], a["rhs"], a["group_sizes"], implementation=impl,
            precision=jax.lax.DotAlgorithm(jnp.float32, jnp.float32, jnp.float32)),
        "ragged_dot_dimension_numbers": lambda impl: tokamax.ragged_dot_general(
            batched_lhs, batched_rhs, a["group_sizes"], BATCHED, implementation=impl),
    }
    for name, call in unsupported.items():
        try:
            call([GG])
            report["errors"][name] = None
        except Exception as e:  # the type and message are the test's to check
            report["errors"][name] = [type(e).__name__, str(e)]
        if name != "precision:algorithm":  # which "xla" refuses too, on the CPU
            report["fell_through"][name] = bool(np.array_equal(np.asarray(call([GG, "xla"])),
                                                               np.asarray(call(["xla"]))))
    try:
        GG(a["lhs"], a["rhs"], group_sizes=a["group_sizes"], return_residuals=True)
    except Exception as e:
        report["errors"]["return_residuals"] = [type(e).__name__, str(e)]
    try:  # no precision jax.lax knows: jax.lax's own error, as "xla" gives
        GG(a["lhs"], a["rhs"], group_sizes=a["group_sizes"], precision="bogus")
    except Exception as e:
        report["errors"]["precision:invalid"] = [type(e).__name__, str(e)]

    # docs/guides/flax.md's tokamax example, as written.
    guide = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "guides", "flax.md")
    for block in tokamax_blocks(open(guide).read()):
        exec(compile(block, "docs/guides/flax.md", "exec"), {})
    report["guide_blocks_run"] = len(tokamax_blocks(open(guide).read()))

    np.savez(os.path.join(out_dir, "results.npz"), **results)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f)


def tokamax_blocks(page):
    """The page's ```python blocks that call tokamax (test_docs.py's pattern of a block)."""
    return [b for b in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M) if "tokamax.ragged_dot" in b]


if __name__ == "__main__":
    main(sys.argv[1])
