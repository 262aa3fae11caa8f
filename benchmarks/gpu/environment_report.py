"""Prints what the GPU run ran on: GPU, driver, glibc, compute-sanitizer, torch, jax,
whether each framework sees the GPU, and the groupgemm wheel installed (its tag, its CUDA
architectures). Ends with "RESULT: PASS ..." when torch and JAX both see a GPU and CUDA is
compiled in."""

import importlib.metadata
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import find_tool, query_gpus  # noqa: E402


def first_line_with(command, word):
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "not found"
    lines = [line.strip() for line in out.splitlines() if word in line]
    return lines[-1] if lines else "not found"


def main():
    facts, problems, jax_gpu = {}, [], False
    gpus = query_gpus()
    facts["gpu"] = "; ".join(f"{name} (compute {cc})" for name, _, cc in gpus) or "none (nvidia-smi found none)"
    facts["driver"] = gpus[0][1] if gpus else "n/a"
    nvcc, sanitizer = find_tool("nvcc"), find_tool("compute-sanitizer")
    facts["nvcc"] = first_line_with([nvcc, "--version"], "release") if nvcc else "not found"
    facts["compute-sanitizer"] = first_line_with([sanitizer, "--version"], "Version") if sanitizer else "not found"
    facts["ncu"] = find_tool("ncu") or "not found"
    facts["python"] = sys.version.split()[0]
    facts["glibc"] = " ".join(platform.libc_ver())
    try:
        import torch

        facts["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
        facts["torch sees a GPU"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            facts["torch device"] = torch.cuda.get_device_name(0)
    except ImportError as exc:
        facts["torch"] = f"not importable: {exc}"
    try:
        import jax

        facts["jax"] = jax.__version__
        try:
            facts["jax GPU devices"] = ", ".join(str(d) for d in jax.devices("gpu"))
            jax_gpu = True
        except RuntimeError as exc:
            facts["jax GPU devices"] = f"none ({str(exc).splitlines()[0]})"
    except ImportError as exc:
        facts["jax"] = f"not importable: {exc}"
    try:
        import groupgemm
        from groupgemm import _core

        facts["groupgemm"] = os.path.dirname(groupgemm.__file__)
        wheel = importlib.metadata.distribution("groupgemm").read_text("WHEEL") or ""
        facts["wheel tag"] = ", ".join(line.split()[1] for line in wheel.splitlines() if line.startswith("Tag:"))
        facts["cuda_compiled"] = groupgemm.cuda_compiled()
        facts["compiled for"] = _core.cuda_architectures() or "n/a"
    except ImportError as exc:
        facts["groupgemm"] = f"not importable: {exc}"
    for key, value in facts.items():
        print(f"{key}: {value}")

    if not facts.get("torch sees a GPU"):
        problems.append("torch sees no GPU")
    if not jax_gpu:
        problems.append("JAX sees no GPU")
    if facts.get("cuda_compiled") is not True:
        problems.append("groupgemm has no CUDA backend")
    summary = (f"{facts.get('torch device') or facts['gpu']}, driver {facts['driver']}, torch {facts.get('torch')}, "
               f"jax {facts.get('jax')}, compiled for {facts.get('compiled for', 'n/a')}")
    print(f"RESULT: {'FAIL' if problems else 'PASS'} " + ("; ".join(problems) + "; " if problems else "") + summary)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
