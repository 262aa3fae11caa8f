"""The wheels a GPU machine needs beyond its own python3, and how to fetch them.

A GPU machine without network access has torch, jax (with its CUDA plugin), nanobind,
scikit-build-core, cmake, ninja and pytest, but not the CPU GEMM libraries the extension
links (oneDNN, OpenBLAS), the CUTLASS headers it compiles against, nor pytest-xdist, which
runs the CPU-backend tests there in parallel. They are downloaded
here, for that machine's CPython 3.12 on x86-64 Linux, into a folder that travels with
the working tree. Standard library only: runs under any python3.

    python3 benchmarks/gpu/wheels.py [DEST]     (what ./dev.sh gpu-wheels runs)
"""

import os
import subprocess
import sys

# Pinned: the same versions dev.sh installs (scipy-openblas32 at the version dev.sh's
# ">=0.3.27" resolves to), so the GPU build links what the tests ran against here.
REQUIRED = (
    ("onednn-cpu-gomp", "2023.2.0"),
    ("onednn-devel-cpu-gomp", "2023.2.0"),
    ("scipy-openblas32", "0.3.34.481.3"),
    ("nvidia-cutlass", "4.2.0.0"),  # headers only: installed with --no-deps
    ("pytest-xdist", "3.8.0"),
    ("execnet", "2.1.2"),  # pytest-xdist's one dependency besides pytest
)
DEFAULT_DEST = ".gpu-wheels"
TARGET_PYTHON = "3.12"
# manylinux tags the target accepts, newest first; pip also takes older ones (manylinux1).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The wheels folder travels with the working tree to a machine without network; a cap keeps
# that transfer small.
SIZE_LIMIT_BYTES = 55 * 10**6


def wheel_prefix(name, version):
    """How a wheel file of this distribution and version begins (PEP 427 escaping)."""
    return f"{name.replace('-', '_')}-{version}-"


def find_wheels(folder):
    """({name: path} of the required wheels present in `folder`, [name==version missing])."""
    files = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
    found, missing = {}, []
    for name, version in REQUIRED:
        match = [f for f in files if f.endswith(".whl") and f.lower().startswith(wheel_prefix(name, version).lower())]
        if match:
            found[name] = os.path.join(folder, match[0])
        else:
            missing.append(f"{name}=={version}")
    return found, missing


def download_command(name, version, dest, python=sys.executable):
    """pip download of one wheel for the GPU machine's interpreter, never its dependencies."""
    command = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + ["-d", dest, f"{name}=={version}"]


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print(f"usage: {os.path.basename(__file__)} [DEST] (default {DEFAULT_DEST})", file=sys.stderr)
        return 2
    dest = args[0] if args else DEFAULT_DEST
    os.makedirs(dest, exist_ok=True)
    for name, version in REQUIRED:
        if subprocess.call(download_command(name, version, dest)) != 0:
            print(f"download of {name}=={version} failed", file=sys.stderr)
            return 1
    found, missing = find_wheels(dest)
    total = 0
    for name, path in found.items():
        size = os.path.getsize(path)
        total += size
        print(f"{size / 1e6:6.1f} MB  {os.path.basename(path)}")
    print(f"{total / 1e6:6.1f} MB  in {dest} (limit {SIZE_LIMIT_BYTES / 1e6:.0f} MB)")
    if missing:
        print("missing after download: " + ", ".join(missing), file=sys.stderr)
        return 1
    if total > SIZE_LIMIT_BYTES:
        print("the wheels are too large to travel with the working tree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
