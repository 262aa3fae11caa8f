"""Were groupgemm's custom calls put into XLA command buffers? Read from the optimized HLO
that --xla_dump_to writes: XLA outlines each command-buffer sequence into a computation
named "command_buffer" (command_buffer.1, ...), so a custom call inside one of those runs
as part of a CUDA graph. Standard library only."""

import glob
import os
import re

_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
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
