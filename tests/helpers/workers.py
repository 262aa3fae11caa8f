"""Runs a test's worker script (torch.distributed ranks, a fresh interpreter) in a process
of its own under a timeout, so a hang fails instead of stalling. When the worker fails,
the error's first line, which a test summary shows, says how it ended and its last line
of output (where a rank's exception ends up); the output's tail follows."""

import os
import subprocess
import sys

TAIL_CHARS = 6000


def _last_line(*texts):
    for text in texts:
        lines = [line for line in (text or "").splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
    return "(no output)"


def _text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def run_worker(script, *args, timeout=240, env=None):
    """``python script *args``; raises AssertionError if it fails or runs past ``timeout`` s."""
    return _run([script, *map(str, args)], os.path.basename(script), timeout, env)


def run_code(code, *args, timeout=240, env=None):
    """``python -c code *args``, as run_worker runs a script."""
    return _run(["-c", code, *map(str, args)], "python -c", timeout, env)


def _run(argv, name, timeout, env):
    # A rank that aborts (a C++ std::terminate, a segfault) prints every thread's Python stack.
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    try:
        result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out, err = _text(e.stdout), _text(e.stderr)
        raise AssertionError(f"{name} ran past {timeout} s: {_last_line(err, out)}\n"
                             f"{(out + err)[-TAIL_CHARS:]}") from None
    if result.returncode != 0:
        raise AssertionError(f"{name} exited with {result.returncode}: {_last_line(result.stderr, result.stdout)}\n"
                             f"{(result.stdout + result.stderr)[-TAIL_CHARS:]}")
    return result
