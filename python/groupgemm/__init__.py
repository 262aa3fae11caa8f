"""groupgemm: grouped GEMM for Mixture-of-Experts layers, for JAX and PyTorch.

The frameworks live in submodules so importing one never imports the other:
``groupgemm.jax`` and ``groupgemm.torch``.
"""

from groupgemm import _libs

_libs.load()

from groupgemm import _core  # noqa: E402
from groupgemm._validation import check_group_sizes  # noqa: E402

__all__ = ["check_group_sizes", "cuda_compiled"]
__version__ = "0.1.0"


def cuda_compiled() -> bool:
    """True when this build contains the CUDA backend."""
    return _core.cuda_compiled()
