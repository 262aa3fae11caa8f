"""What XLA's dump (--xla_dump_to) tells about a program: how many times XLA compiled each
jitted function, per platform, and whether groupgemm's custom calls were put into command
buffers. XLA has outlined each command-buffer sequence in the optimized HLO into a
computation named "command_buffer" (command_buffer.1, ...); with jax 0.11.2 on an H100
no such computation appeared although XLA traced groupgemm's calls into command buffers
(its trace errors showed it), so a count of 0 there tells nothing. Standard library only."""

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


def optimized_modules(dump_dir):
    """[(path, module name, "cpu" or "gpu")] of the optimized modules in `dump_dir`, one
    file per compile (a jitted function f is module "jit_f")."""
    modules = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "module_*after_optimizations.txt"))):
        match = _MODULE_FILE.match(os.path.basename(path))
        if match:
            modules.append((path, match.group("name"), "cpu" if match.group("cpu") else "gpu"))
    return modules


def scan_dump(dump_dir):
    """(inside, total) over the GPU modules' optimized HLO in `dump_dir` (the CPU
    compiler's have no command buffers); (0, 0) when there are none."""
    inside = total = 0
    for path, _, platform in optimized_modules(dump_dir):
        if platform == "cpu":
            continue
        with open(path, errors="replace") as f:
            calls = custom_calls(f.read())
        inside += in_command_buffers(calls)
        total += len(calls)
    return inside, total


def xla_compiles(dump_dir):
    """{(module name, "cpu" or "gpu"): how many times XLA compiled it} over `dump_dir`."""
    counts = {}
    for _, name, platform in optimized_modules(dump_dir):
        counts[(name, platform)] = counts.get((name, platform), 0) + 1
    return counts
