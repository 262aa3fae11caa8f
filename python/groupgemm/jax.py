"""groupgemm for JAX: ``grouped_matmul``, ``grouped_matmul_wgrad`` and ``ragged_dot``, and
the expert layer: ``permute``, ``unpermute`` and ``grouped_mlp``."""

from groupgemm.jax_ext.expert import grouped_mlp, permute, unpermute
from groupgemm.jax_ext.functional import grouped_matmul, grouped_matmul_wgrad, ragged_dot

__all__ = ["grouped_matmul", "grouped_matmul_wgrad", "grouped_mlp", "permute", "ragged_dot", "unpermute"]
