"""What XLA's dump (--xla_dump_to) tells about a program: how many times XLA compiled each
jitted function, per platform, and whether groupgemm's custom calls were put into command
buffers. XLA of jax <= 0.6 outlines each command-buffer sequence in the optimized HLO
into a computation named "command_buffer" (command_buffer.1, ...); newer XLA forms
command buffers from the thunk sequence, after the HLO, so its HLO shows none (jax 0.11.2
on an H100 traced groupgemm's calls into command buffers, as its trace errors showed, with
no such computation in the dump). Standard library only."""

import glob
import os
import re

_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
# module_0042.jit_loss.sm_9.0a_gpu_after_optimizations.txt, module_0002.jit_loss.cpu_after_optimizations.txt
_MODULE_FILE = re.compile(r"^module_\d+\.(?P<name>[^.]+)\..*?(?P<cpu>cpu_)?after_optimizations\.txt$")
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')


def custom_calls(hlo_text, prefix="groupgemm"):
    """[(computation name, target)] of every custom call whose target starts with `prefix`."""
    found, computation = [], None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
            continue
        target = _TARGET.search(line)
        if target and target.group("target").startswith(prefix):
            found.append((computation, target.group("target")))
    return found


def in_command_buffers(calls):
    """How many of `calls` sit in a command-buffer computation."""
    return sum(1 for computation, _ in calls if computation and computation.startswith("command_buffer"))


def scan_dump(dump_dir):
    """(inside, total) over the GPU modules' optimized HLO in `dump_dir` (the CPU
    compiler's, "*.cpu_after_optimizations.txt", have no command buffers); (0, 0) when
    there are none."""
    inside = total = 0
    for path in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        if os.path.basename(path).endswith("cpu_after_optimizations.txt"):
            continue
        with open(path, errors="replace") as f:
            calls = custom_calls(f.read())
        inside += in_command_buffers(calls)
        total += len(calls)
    return inside, total


def xla_compiles(dump_dir):
    """{(module name, "cpu" or "gpu"): how many times XLA compiled it} over the optimized
    modules in `dump_dir` (one file per compile; a jitted function f is module "jit_f")."""
    counts = {}
    for path in glob.glob(os.path.join(dump_dir, "module_*after_optimizations.txt")):
        match = _MODULE_FILE.match(os.path.basename(path))
        if match:
            key = (match.group("name"), "cpu" if match.group("cpu") else "gpu")
            counts[key] = counts.get(key, 0) + 1
    return counts
