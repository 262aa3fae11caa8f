"""groupgemm's build backend: scikit-build-core, plus what compiling the core needs as
build requirements: the oneDNN headers and OpenBLAS always, the CUTLASS headers wherever
the CUDA backend will be compiled.

pip builds in an isolated environment, so these must come from requirements pip resolves
itself. The CUTLASS headers are asked for only when nvcc is found and CUDA is not turned
off, so CPU-only builds do not download them; none of the three when the module links a
core built earlier (-C cmake.define.GROUPGEMM_PREBUILT_CORE=..., what ./dev.sh wheel does
for every Python after building the core once). The nvcc search is CMakeLists.txt's:
CUDACXX, then PATH, then /usr/local/cuda.
"""

import os
import shutil

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import (  # noqa: F401 - the hooks this backend passes through
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

CUTLASS_HEADERS = "nvidia-cutlass==4.2.0.0"
CPU_LIBRARIES = ("onednn-devel-cpu-gomp==2023.2.0", "scipy-openblas32>=0.3.27")
_OFF = {"0", "off", "false", "no", "n"}


def prebuilt_core(config_settings):
    """The core library the module links instead of compiling one, or None."""
    return (config_settings or {}).get("cmake.define.GROUPGEMM_PREBUILT_CORE") or None


def cuda_requested(config_settings):
    """False when GROUPGEMM_CUDA is turned off by `-C cmake.define.GROUPGEMM_CUDA=OFF` or,
    failing that, by the environment variable of the same name."""
    value = (config_settings or {}).get("cmake.define.GROUPGEMM_CUDA", os.environ.get("GROUPGEMM_CUDA", "ON"))
    return str(value).strip().lower() not in _OFF


def find_nvcc():
    """The CUDA compiler CMake will use, or None."""
    cudacxx = os.environ.get("CUDACXX")
    if cudacxx:
        return cudacxx if shutil.which(cudacxx) else None
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None)


def _cuda_requirements(config_settings):
    return [CUTLASS_HEADERS] if cuda_requested(config_settings) and find_nvcc() else []


def core_requirements(config_settings):
    """What compiling the core needs: nothing when it was built earlier."""
    if prebuilt_core(config_settings):
        return []
    return [*CPU_LIBRARIES, *_cuda_requirements(config_settings)]


def get_requires_for_build_wheel(config_settings=None):
    return _scikit_build.get_requires_for_build_wheel(config_settings) + core_requirements(config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _scikit_build.get_requires_for_build_editable(config_settings) + core_requirements(config_settings)
