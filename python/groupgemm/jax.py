"""groupgemm for JAX: ``grouped_matmul`` and ``grouped_matmul_wgrad``; the expert layer:
``softmax_topk``, ``permute``, ``unpermute``, ``grouped_mlp``, ``expert_mlp``; and drop-ins for ``jax.lax.ragged_dot``,
``jax.lax.ragged_dot_general`` and megablox's ``gmm`` / ``tgmm``; ``export_disabled_checks`` for
``jax.export``. FP8: ``scaled_grouped_matmul``, ``scaled_grouped_matmul_wgrad``, ``quantize_fp8``,
``quantize_fp8_grouped`` and ``grouped_mlp(fp8=...)``. Expert parallelism inside ``jax.shard_map``:
``dispatch``, ``combine``, ``moe_layer`` and ``dropless_capacity``. ``tokamax_implementation``: groupgemm as an
implementation of ``tokamax.ragged_dot``. Flax NNX layers: ``groupgemm.flax``."""

from groupgemm.jax_ext.dropins import gmm, ragged_dot, ragged_dot_general, tgmm
from groupgemm.jax_ext.expert import grouped_mlp, permute, softmax_topk, unpermute
from groupgemm.jax_ext.expert_mlp import expert_mlp
from groupgemm.jax_ext.expert_parallel import combine, dispatch, dropless_capacity, moe_layer
from groupgemm.jax_ext.export import export_disabled_checks
from groupgemm.jax_ext.fp8 import quantize_fp8, quantize_fp8_grouped, scaled_grouped_matmul, scaled_grouped_matmul_wgrad
from groupgemm.jax_ext.functional import grouped_matmul, grouped_matmul_wgrad
from groupgemm.jax_ext.tokamax_ragged_dot import tokamax_implementation

__all__ = ["combine", "dispatch", "dropless_capacity", "expert_mlp", "export_disabled_checks", "gmm", "grouped_matmul",
           "grouped_matmul_wgrad", "grouped_mlp", "moe_layer", "permute", "quantize_fp8", "quantize_fp8_grouped",
           "ragged_dot", "ragged_dot_general", "scaled_grouped_matmul", "scaled_grouped_matmul_wgrad", "softmax_topk",
           "tgmm", "tokamax_implementation", "unpermute"]
