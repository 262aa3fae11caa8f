"""groupgemm for JAX: ``grouped_matmul``, ``grouped_matmul_wgrad`` and ``ragged_dot``."""

from groupgemm.jax_ext.functional import grouped_matmul, grouped_matmul_wgrad, ragged_dot

__all__ = ["grouped_matmul", "grouped_matmul_wgrad", "ragged_dot"]
