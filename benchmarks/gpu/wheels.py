"""The wheels a lent GPU machine needs beyond its own python3, gathered into one folder
that travels with the working tree (./dev.sh gpu-wheels): the redistributable cp312
groupgemm wheel (./dev.sh wheel 3.12 builds it into dist/) and its two runtime
dependencies, oneDNN and OpenBLAS, cut to what runs there; and Hugging Face transformers
with what it imports, whole, for the transformers experts benchmark. The machine has no
network and no room for a build: the kit installs exactly what a user would, and nothing
is compiled.

The oneDNN wheel holds libdnnl.so three times (libdnnl.so, .so.3 and .so.3.2, none a link:
38.9 MB) and OpenBLAS's its headers and CMake files; only libdnnl.so.3 and OpenBLAS's
library and Python package are loaded, so the copies here keep just those (with their
licences) and a RECORD that lists them. Standard library only.

    python3 benchmarks/gpu/wheels.py [--dist DIST] [DEST]
"""

import argparse
import base64
import fnmatch
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_DEST = ".gpu-wheels"
TARGET_PYTHON = "3.12"  # the lent machines' python3
GROUPGEMM = "groupgemm"
# transformers for benchmarks/transformers_experts.py, and what importing it and running
# Qwen3MoeExperts need that the machine's python3 lacks (it has torch, jax, numpy, pytest
# and their own dependencies: packaging, filelock, fsspec, typing_extensions, jinja2).
# tokenizers is not on the benchmark's path, but with transformers installed the suite runs
# the integration's tests, whose import of transformers' auto classes fails without it.
# Carried whole: which model families a test or a lazy import reaches is transformers' to
# decide, and the whole set is 19 MiB.
TRANSFORMERS = (("transformers", "5.23.0"), ("huggingface-hub", "2.4.0"), ("safetensors", "0.8.0"),
                ("tokenizers", "0.23.3"), ("regex", "2026.11.19"), ("pyyaml", "6.0.4"), ("tqdm", "4.70.1"),
                ("httpx2", "2.16.2"), ("httpcore2", "2.16.2"), ("h11", "0.16.0"), ("idna", "3.20"),
                ("truststore", "0.10.5"))
# Pinned: the versions the groupgemm wheel was built and tested against (dev.sh).
DEPENDENCIES = (("onednn-cpu-gomp", "2023.2.0"), ("scipy-openblas32", "0.3.34.481.3"), *TRANSFORMERS)
# What a dependency's copy keeps besides its .dist-info (fnmatch patterns); one not named
# here travels whole.
KEEP = {"onednn-cpu-gomp": ("*/lib/libdnnl.so.3", "*/LICENSE*", "*/THIRD-PARTY-PROGRAMS"),
        "scipy-openblas32": ("scipy_openblas32/lib/libscipy_openblas.so", "scipy_openblas32/*.py")}
# manylinux tags the target accepts, newest first; pip also takes older ones (manylinux1).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The working tree that travels (tracked files, untracked ones git does not ignore, and
# the carried folder) may be 64 MiB; this keeps a margin.
TRAVEL_LIMIT_BYTES = 60 * 2**20


def wheel_prefix(name, version=None):
    """How a wheel file of this distribution (and version) begins (PEP 427 escaping)."""
    return f"{name.replace('-', '_')}-" + (f"{version}-" if version else "")


def find_wheels(folder):
    """({name: path} of the wheels the machine needs present in `folder`, [what is missing])."""
    files = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
    wanted = [(GROUPGEMM, None, f"-cp{TARGET_PYTHON.replace('.', '')}-")] + [(n, v, "") for n, v in DEPENDENCIES]
    found, missing = {}, []
    for name, version, tag in wanted:
        match = [f for f in files if f.endswith(".whl") and f.lower().startswith(wheel_prefix(name, version).lower())
                 and tag in f]
        if match:
            found[name] = os.path.join(folder, match[-1])
        else:
            missing.append(f"{name}=={version}" if version else f"{name} (cp{TARGET_PYTHON.replace('.', '')})")
    return found, missing


def download_command(name, version, dest, python=sys.executable):
    """pip download of one wheel for the GPU machine's interpreter, never its dependencies."""
    command = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + ["-d", dest, f"{name}=={version}"]


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(source, dest, keep):
    """A copy of the wheel `source` at `dest` with only the files matching `keep` and its
    .dist-info, whose RECORD then lists exactly those."""
    with zipfile.ZipFile(source) as zin:
        names = [n for n in zin.namelist() if ".dist-info/" in n or any(fnmatch.fnmatch(n, p) for p in keep)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            lines = []
            for name in names:
                if name == record or name.endswith("/"):
                    continue
                data = zin.read(name)
                zout.writestr(zin.getinfo(name), data)
                lines.append(_record_line(name, data))
            zout.writestr(record, "\n".join(lines + [f"{record},,"]) + "\n")


def travel_bytes(repo=REPO, carried=()):
    """Bytes of what travels to the machine: the files git tracks or would track (not the
    ignored ones), plus the carried folders."""
    listed = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    total = sum(os.path.getsize(os.path.join(repo, f)) for f in listed if f and os.path.isfile(os.path.join(repo, f)))
    for folder in carried:
        for root, _, names in os.walk(folder):
            total += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return total


def gather(dest, dist):
    """Fills `dest`; returns the problems (empty when all is well)."""
    os.makedirs(dest, exist_ok=True)
    for old in glob.glob(os.path.join(dest, "*.whl")):
        os.remove(old)
    ours = sorted(glob.glob(os.path.join(dist, f"{GROUPGEMM}-*-cp{TARGET_PYTHON.replace('.', '')}-*.whl")))
    if not ours:
        return [f"no cp{TARGET_PYTHON.replace('.', '')} groupgemm wheel in {dist}: run ./dev.sh wheel {TARGET_PYTHON}"]
    shutil.copyfile(ours[-1], os.path.join(dest, os.path.basename(ours[-1])))
    with tempfile.TemporaryDirectory() as downloads:
        for name, version in DEPENDENCIES:
            if subprocess.call(download_command(name, version, downloads)) != 0:
                return [f"download of {name}=={version} failed"]
            (source,) = glob.glob(os.path.join(downloads, wheel_prefix(name, version) + "*.whl"))
            target = os.path.join(dest, os.path.basename(source))
            if name in KEEP:
                trim(source, target, KEEP[name])
            else:
                shutil.copyfile(source, target)
    return []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", nargs="?", default=DEFAULT_DEST)
    p.add_argument("--dist", default=os.path.join(REPO, "dist"), help="where ./dev.sh wheel put the wheels")
    args = p.parse_args(argv)
    problems = gather(args.dest, args.dist)
    found, missing = find_wheels(args.dest)
    for path in found.values():
        print(f"{os.path.getsize(path) / 2**20:6.1f} MiB  {os.path.basename(path)}")
    carried = sum(os.path.getsize(p) for p in found.values())
    travelling = travel_bytes(REPO, [args.dest])
    print(f"{carried / 2**20:6.1f} MiB  carried in {args.dest}")
    print(f"{travelling / 2**20:6.1f} MiB  travel in all (the working tree and {args.dest}; "
          f"limit {TRAVEL_LIMIT_BYTES / 2**20:.0f} MiB)")
    problems += [f"missing: {', '.join(missing)}"] if missing else []
    problems += ["what travels is over the limit"] if travelling > TRAVEL_LIMIT_BYTES else []
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
