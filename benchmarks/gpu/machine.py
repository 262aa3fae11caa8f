"""What the kit needs to know about the machine before it runs anything: is there an
NVIDIA GPU, of which compute capability, and where the CUDA tools are. Standard library
only; nothing here imports torch or jax."""

import os
import shutil
import subprocess

CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"


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
