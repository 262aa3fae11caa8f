"""JAX on the GPU with XLA command buffers: groupgemm's custom calls recorded into CUDA graphs.

Run it in a fresh process: the very first groupgemm call of the process happens inside
a jitted function, so whatever the core sets up on first use happens while XLA records
its command buffer. One jit compile then serves several routings (all-empty included),
which only works if the group sizes are read on the device (counted from the dump: XLA
compiles each jitted function once per platform). Checked for each routing:
  - a jitted bfloat16 grouped_matmul with bias, and the gradients of lhs, rhs and bias;
  - a jitted weight gradient accumulated into a donated float32 buffer, for a window of
    experts chosen by a traced group_offset;
against the same jitted functions on the CPU backend (within rounding), for exact zeros
in padding rows and empty experts, and bit-for-bit untouched accumulators of empty experts.
Whether the calls ran inside a command buffer is read from the core's own record
(groupgemm._core.cuda_capture_record: each CUDA call asks whether its stream is
capturing): with command buffers on for custom calls, PASS needs positive evidence, the
process's first groupgemm call and others having run while XLA recorded; no such call
is a FAIL, not a PASS. The optimized HLO (--xla_dump_to) is reported beside it.
Exit status: 0 all good, 1 a mismatch or no evidence of capture, 3 no CUDA GPU (or no jax).
"""

import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests")
sys.path[:0] = [HERE, os.path.join(TESTS, "helpers"), TESTS]  # the tests' float64 reference
from hlo_command_buffers import scan_dump, xla_compiles  # noqa: E402

NO_GPU_EXIT = 3
# "+" adds custom calls to XLA's default command types (the flag's add/remove syntax);
# a minimum graph size of 1 lets even a short sequence become a command buffer.
FLAGS = {
    "custom-calls": "--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
    "default": "",
}
M, K, N, G = 96, 64, 32, 4
SIZES = ([24, 24, 24, 24], [0, 0, 0, 0], [96, 0, 0, 0], [10, 0, 50, 7], [0, 100, 0, 0], [-5, 40, 0, 50])
WINDOW = (2, 1)  # local experts and group_offset of the accumulated weight gradient
TOLERANCE = 2e-2  # bfloat16, relative to the largest reference value


def capture_evidence(record, required):
    """(why the capture is not shown, or None; a line saying what the record shows).
    `record` is groupgemm._core.cuda_capture_record()'s; `required`: command buffers were
    asked for custom calls on a GPU, so the calls must have run while the stream captured."""
    calls, captured = record["calls"], record["calls_under_capture"]
    seen = (f"{captured} of {calls} groupgemm CUDA calls ran while their stream was capturing, "
            f"the first {'among them' if record['first_under_capture'] else 'not'}")
    if not required:
        return None, seen
    if captured == 0:
        return f"no groupgemm call ran inside a command buffer ({seen})", seen
    if not record["first_under_capture"]:
        return f"the process's first groupgemm call ran outside a command buffer ({seen})", seen
    return None, seen


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--command-buffers", choices=sorted(FLAGS), default="custom-calls",
                   help="custom-calls: XLA records groupgemm's calls into command buffers; default: XLA's own choice")
    p.add_argument("--dump-dir", help="where XLA dumps the optimized HLO (default: a temporary folder)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="cpu rehearses the same checks with the CPU backend on both sides")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="groupgemm-xla-")
    shutil.rmtree(dump_dir, ignore_errors=True)  # only this run's modules
    flags = f"{FLAGS[args.command_buffers]} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()  # before jax starts
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
        import reference  # the tests' float64 reference: which rows and experts must be zero
    except ImportError as exc:
        print(f"no CUDA GPU to test: jax is not importable ({exc})")
        print("RESULT: SKIP jax is not installed")
        return NO_GPU_EXIT
    try:
        gpu = jax.devices(args.device)[0]
    except RuntimeError as exc:
        print(f"no CUDA GPU: JAX {jax.__version__} has no GPU device ({str(exc).splitlines()[0]})")
        print("RESULT: SKIP no CUDA GPU")
        return NO_GPU_EXIT
    cpu = jax.devices("cpu")[0]
    import groupgemm.jax as gj

    print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
    rng = np.random.default_rng(0)
    host = {"lhs": rng.standard_normal((M, K)), "rhs": rng.standard_normal((G, K, N)),
            "bias": rng.standard_normal((G, N)), "dout": rng.standard_normal((M, N)),
            "acc": rng.standard_normal((WINDOW[0], K, N))}
    local, offset = WINDOW

    def loss(lhs, rhs, bias, sizes, dout):
        out = gj.grouped_matmul(lhs, rhs, sizes, bias=bias)
        return (out.astype(jnp.float32) * dout).sum(), out

    def accumulate(lhs, dout, sizes, acc, group_offset):
        return gj.grouped_matmul_wgrad(lhs, dout, sizes, num_groups=local, group_offset=group_offset,
                                       accumulate_into=acc)

    # One jitted function per computation serves both devices (its inputs' device picks
    # the compile), so the dump holds one module per platform when nothing recompiles.
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    acc_step = jax.jit(accumulate, donate_argnums=3)
    failures = []

    def fail(message):
        failures.append(message)
        print(f"FAIL {message}", flush=True)

    def close(what, got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        error = float(np.abs(got - want).max(initial=0.0))
        if not error <= TOLERANCE * scale:
            fail(f"{what}: max error {error:.3g} against the CPU backend (scale {scale:.3g})")

    def on(device, dtype, *names):
        return [jax.device_put(jnp.asarray(host[n], dtype), device) for n in names]

    for sizes in SIZES:  # the first iteration is the process's first groupgemm call, inside jit
        try:
            outputs = {}
            for name, device in (("gpu", gpu), ("cpu", cpu)):
                s = jax.device_put(np.asarray(sizes, np.int32), device)
                (_, out), grads = step(*on(device, jnp.bfloat16, "lhs", "rhs", "bias"), s,
                                       *on(device, jnp.float32, "dout"))
                acc = acc_step(*on(device, jnp.bfloat16, "lhs", "dout"), s, *on(device, jnp.float32, "acc"),
                               jax.device_put(np.int32(offset), device))
                outputs[name] = [np.asarray(v, np.float64) for v in (out, *grads, acc)]
        except Exception as exc:  # a failed recording is a result; the next routing still runs
            fail(f"sizes {sizes}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        gpu_out, cpu_out = outputs["gpu"], outputs["cpu"]
        for name, got, want in zip(("out", "dlhs", "drhs", "dbias", "accumulated wgrad"), gpu_out, cpu_out):
            close(f"sizes {sizes} {name}", got, want)
        pad = reference.padding_rows(sizes, M, G)
        if (gpu_out[0][pad] != 0).any() or (gpu_out[1][pad] != 0).any():
            fail(f"sizes {sizes}: padding rows of out or dlhs are not exactly zero")
        for g in reference.empty_groups(sizes, M, G):
            if (gpu_out[2][g] != 0).any() or (gpu_out[3][g] != 0).any():
                fail(f"sizes {sizes}: empty expert {g} has a nonzero drhs or dbias")
        acc_before = np.asarray(np.float32(host["acc"]), np.float64)
        for g in reference.empty_groups(sizes, M, local, offset):
            if not np.array_equal(gpu_out[4][g], acc_before[g]):
                fail(f"sizes {sizes}: accumulator of empty local expert {g} changed")
        print(f"sizes {sizes}: checked", flush=True)

    # XLA's compiles, not jit's cache entries: with jax 0.11.2 on an H100 the donating
    # function's cache held two entries after six routings while XLA compiled it once.
    compiles = xla_compiles(dump_dir)
    for function in ("jit_loss", "jit_accumulate"):
        for platform in sorted({"cpu", args.device}):
            if compiles.get((function, platform), 0) != 1:
                fail(f"XLA compiled {function} for the {platform} {compiles.get((function, platform), 0)} times "
                     f"for {len(SIZES)} routings, not once")
    from groupgemm import _core

    missing, evidence = capture_evidence(_core.cuda_capture_record(),
                                         args.device == "gpu" and args.command_buffers == "custom-calls")
    if missing:
        fail(missing)
    inside, total = scan_dump(dump_dir)
    captured = (f"{evidence}; {inside} of {total} groupgemm custom calls in command-buffer computations of the "
                "HLO (jax 0.11.2's XLA shows none there even for captured calls)" if total
                else f"{evidence}; no optimized HLO found")
    print(captured)
    label = f"command buffers {args.command_buffers}"
    if failures:
        print(f"RESULT: FAIL {label}: {len(failures)} problems; first: {failures[0]}")
        return 1
    print(f"RESULT: PASS {label}: {len(SIZES)} routings match the CPU backend, one compile; {captured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
