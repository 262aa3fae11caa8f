"""Runs one command of the kit: output into the log as it comes, a time limit, and the
whole process group ended when the limit passes (pytest and compute-sanitizer start
processes of their own). The group is interrupted first, as Ctrl-C would: pytest then
still prints its failures and its summary line, so a suite cut short says what it found."""

import dataclasses
import os
import shlex
import signal
import subprocess
import threading
import time


@dataclasses.dataclass
class Completed:
    returncode: int
    output: str
    seconds: float
    timed_out: bool


def shell_line(command, env_changes=None):
    """The command as one could type it, with the environment it adds."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env_changes or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(command)


def run(command, log, timeout, env_changes=None, cwd=None):
    """Runs `command` with the environment plus `env_changes`, appending its output to the
    open file `log`. After `timeout` seconds its process group gets SIGINT, then SIGTERM,
    then SIGKILL, 25 seconds in all, and whatever is left of the group SIGKILL."""
    log.write(f"\n$ {shell_line(command, env_changes)}\n")
    log.flush()
    env = dict(os.environ, **(env_changes or {}))
    started = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        log.write(f"cannot start: {exc}\n")
        return Completed(127, f"cannot start: {exc}", 0.0, False)
    chunks = []

    def pump():
        for line in proc.stdout:
            chunks.append(line)
            log.write(line)
        log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        # SIGINT's grace outlasts pytest-xdist's own 10 s wait for its workers, so the
        # summary still comes after a slow worker.
        for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 3), (signal.SIGKILL, 2)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # whatever of the group outlived its leader (a child that ignores SIGINT)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    reader.join(timeout=10)
    seconds = time.monotonic() - started
    if timed_out:
        log.write(f"[kit] stopped after {seconds:.0f} s (limit {timeout:.0f} s)\n")
    log.write(f"[kit] exit {proc.returncode} after {seconds:.1f} s\n")
    log.flush()
    return Completed(proc.returncode if proc.returncode is not None else -9, "".join(chunks), seconds, timed_out)
