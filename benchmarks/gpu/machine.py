"""What the kit needs to know about the machine before it runs anything: is there an
NVIDIA GPU, which architecture to compile for, where the CUDA tools are. Standard
library only; nothing here imports torch or jax."""

import os
import shutil
import subprocess

CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
# What CMakeLists.txt compiles for when it is not told: used where no GPU can be asked.
DEFAULT_ARCHITECTURES = "80;90a"


def find_tool(name):
    """A CUDA tool on PATH or in the toolkit (compute-sanitizer has a folder of its own
    there), or None."""
    on_path = shutil.which(name)
    if on_path:
        return on_path
    for candidate in (os.path.join(CUDA_HOME, "bin", name), os.path.join(CUDA_HOME, name, name)):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def query_gpus(nvidia_smi=None, timeout=30):
    """[(name, driver, compute capability)] of the local GPUs, [] without any (or
    without nvidia-smi)."""
    nvidia_smi = nvidia_smi or shutil.which("nvidia-smi")
    if not nvidia_smi:
        return []
    try:
        out = subprocess.run([nvidia_smi, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0]:
            gpus.append(tuple(fields))
    return gpus


def cuda_architecture(compute_capability):
    """CMAKE_CUDA_ARCHITECTURES for one compute capability: "9.0" -> "90a" (Hopper's
    arch-specific target, which the default build also uses), "8.0" -> "80"."""
    major, _, minor = str(compute_capability).strip().partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        raise ValueError(f"not a compute capability: {compute_capability!r}")
    number = f"{int(major)}{int(minor or 0)}"
    return number + "a" if number == "90" else number


def torch_compute_capability(python, timeout=120):
    """The first GPU's compute capability as torch sees it ("9.0"), or None; for drivers
    whose nvidia-smi cannot report it. Runs `python` (the one with torch) in a subprocess
    so the kit itself never imports torch."""
    probe = "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[-1] if out.returncode == 0 and lines else None


def architecture_for(gpus, python):
    """CMAKE_CUDA_ARCHITECTURES for the first GPU: from nvidia-smi, else from torch, else
    the default list (no GPU to ask)."""
    if not gpus:
        return DEFAULT_ARCHITECTURES
    for ask in (lambda: gpus[0][2], lambda: torch_compute_capability(python)):
        try:
            return cuda_architecture(ask())
        except ValueError:  # "[N/A]", or None from torch
            continue
    return DEFAULT_ARCHITECTURES
