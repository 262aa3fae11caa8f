#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh demo   set everything up, then run the MoE training demo
#   ./dev.sh test   set everything up, then run the whole test suite (what CI runs), with the
#                   install checks: an isolated Python 3.12 wheel with the oldest torch and jax
#   ./dev.sh bench  set everything up, then run the CPU benchmarks (results in benchmarks/results/)
#   ./dev.sh docs   set everything up, then build the documentation (docs/_build/html), warnings as errors
#   ./dev.sh setup  only set up: .venv, pinned dependencies, editable build
#   ./dev.sh gpu-wheels [DIR]  download the wheels a GPU machine without network needs (into
#                   .gpu-wheels/, git-ignored: copy it along with the working tree)
#   ./dev.sh gpu [--wheels DIR] [--out DIR] [--quick] [--dry-run]  on a machine with an NVIDIA
#                   GPU, with its own python3 (torch, jax[cuda]): build against the copied wheels,
#                   then CUDA tests, compute-sanitizer, graph capture, benchmark (benchmarks/gpu/)
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
  # jax.export's serialisation (docs/guides/export.md), and the documentation's tools.
  pip install -q flatbuffers==25.12.19 sphinx==9.0.4 myst-parser==5.2.0 alabaster==1.0.0 docutils==0.22.4 \
    markdown-it-py==4.3.0 mdit-py-plugins==0.7.0 Pygments==2.21.0
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

python312() {
  if python3.12 --version >/dev/null 2>&1; then command -v python3.12; return; fi
  ls "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -n 1 | grep . \
    || { echo "dev.sh: python3.12 is needed for the install checks" >&2; return 1; }
}

# A wheel of the checkout built as a user's pip builds it (isolated build environment,
# Python 3.12, XLA FFI headers of the oldest jax), installed into a torch-only and a
# jax-only environment. Its CUDA code is built for sm_80 alone (CUDAARCHS): that still
# exercises the CUDA packaging path, while the sm_90a kernels, which take most of a CUDA
# build, are compiled and checked once, in the dev build. tests/test_install.py runs in each; the case table and parity
# tests run with both (the jax environment's packages on the torch one's path).
install_matrix() {
  local py started=$SECONDS wheel
  py=$(python312)
  mkdir -p build
  printf 'jax==%s\njaxlib==%s\n' "$OLDEST_JAX" "$OLDEST_JAX" > build/oldest-jax.txt
  rm -rf build/wheel-py312
  CUDAARCHS=80 PIP_CONSTRAINT=build/oldest-jax.txt "$py" -m pip wheel -q --no-deps -w build/wheel-py312 .
  wheel=$(ls build/wheel-py312/groupgemm-*.whl)
  echo "isolated Python 3.12 wheel built in $((SECONDS - started)) s: $wheel"
  started=$SECONDS
  local env frameworks
  for env in torch jax; do
    frameworks="torch==$OLDEST_TORCH"
    [ "$env" = jax ] && frameworks="jax==$OLDEST_JAX jaxlib==$OLDEST_JAX"
    [ -x ".venvs/py312-$env/bin/python" ] || "$py" -m venv ".venvs/py312-$env"
    # shellcheck disable=SC2086
    ".venvs/py312-$env/bin/pip" install -q $frameworks pytest hypothesis
    ".venvs/py312-$env/bin/pip" install -q "$wheel"  # its dependencies
    ".venvs/py312-$env/bin/pip" install -q --force-reinstall --no-deps "$wheel"  # this build's bits
  done
  echo "torch-only and jax-only Python 3.12 environments ready in $((SECONDS - started)) s"
  export GROUPGEMM_TORCH_ONLY_PYTHON="$PWD/.venvs/py312-torch/bin/python"
  export GROUPGEMM_JAX_ONLY_PYTHON="$PWD/.venvs/py312-jax/bin/python"
}

oldest_versions_subset() {
  local jax_site
  jax_site=$(.venvs/py312-jax/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  PYTHONPATH="$jax_site" .venvs/py312-torch/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_frontends.py tests/test_parity.py tests/test_expert_layer.py \
    -k "forward_and_gradients_match_reference or bitwise_identical or zero_token_case or expert_layer or permute"
}

case "${1:-}" in
  setup) setup ;;
  test)
    setup
    core_tests
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
    # For the GPU machine's CPython 3.12 on x86-64 Linux, whatever this machine runs.
    exec python3 benchmarks/gpu/wheels.py "${@:2}"
    ;;
  gpu)
    # The machine's own python3, never .venv: it carries the CUDA builds of torch and jax.
    exec python3 benchmarks/gpu/kit.py "${@:2}"
    ;;
  *)
    echo "usage: ./dev.sh {demo|test|bench|docs|setup|gpu-wheels [DIR]|gpu [--quick] [--dry-run] [--wheels DIR] [--out DIR]}" >&2
    exit 2
    ;;
esac
