"""groupgemm for JAX: ``grouped_matmul`` and ``grouped_matmul_wgrad``; the expert layer:
``softmax_topk``, ``permute``, ``unpermute`` and ``grouped_mlp``; and drop-ins for ``jax.lax.ragged_dot``,
``jax.lax.ragged_dot_general`` and megablox's ``gmm`` / ``tgmm``; ``export_disabled_checks`` for
``jax.export``."""

from groupgemm.jax_ext.dropins import gmm, ragged_dot, ragged_dot_general, tgmm
from groupgemm.jax_ext.expert import grouped_mlp, permute, softmax_topk, unpermute
from groupgemm.jax_ext.export import export_disabled_checks
from groupgemm.jax_ext.functional import grouped_matmul, grouped_matmul_wgrad

__all__ = ["export_disabled_checks", "gmm", "grouped_matmul", "grouped_matmul_wgrad", "grouped_mlp", "permute",
           "ragged_dot", "ragged_dot_general", "softmax_topk", "tgmm", "unpermute"]
