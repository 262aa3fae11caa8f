"""Loads the CPU GEMM libraries that groupgemm._core links against.

oneDNN and OpenBLAS arrive as Python wheels (``onednn-cpu-gomp``, ``scipy-openblas32``)
that put their shared libraries in places the dynamic linker does not search. Loading
them by absolute path first lets ``_core`` resolve them in regular and editable
installs alike: the dynamic linker reuses a loaded library for a dependency of the same
soname.

They are loaded RTLD_LOCAL, so their symbols stay out of the process's global scope:
libdnnl exports hundreds of C++ standard-library instantiations, which, global, took
the place of a later library's own (torch 2.6, built with the pre-C++11 string ABI,
then crashed in TorchScript with "free(): invalid pointer").
"""

import ctypes
import importlib.metadata
import os


def _dist_file(dist: str, suffix: str) -> str:
    files = importlib.metadata.distribution(dist).files or []
    for f in files:
        if str(f).endswith(suffix):
            return os.path.realpath(importlib.metadata.distribution(dist).locate_file(f))
    raise ImportError(f"groupgemm: package {dist!r} does not contain {suffix}; reinstall it")


def load() -> None:
    import scipy_openblas32

    openblas = os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so")
    ctypes.CDLL(openblas, mode=ctypes.RTLD_LOCAL)
    ctypes.CDLL(_dist_file("onednn-cpu-gomp", "libdnnl.so.3"), mode=ctypes.RTLD_LOCAL)
