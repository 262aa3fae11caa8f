"""groupgemm for Flax NNX: the layers of groupgemm.torch as ``flax.nnx.Module``s, on
groupgemm.jax's ops. ``GroupedLinear`` and ``GroupedMLP`` (the expert layers), ``MoE``
(router and grouped expert MLP) and ``ExpertParallelMoE`` (dispatch and combine over a mesh
axis). Their parameters carry sharding annotations (``nnx.with_partitioning``): the
experts over an expert axis, which groupgemm's ops keep under ``nnx.jit`` on a mesh.
Needs flax (``pip install groupgemm[flax]``)."""

from groupgemm.jax_ext.nnx_layers import GroupedLinear, GroupedMLP
from groupgemm.jax_ext.nnx_moe import ExpertParallelMoE, MoE

__all__ = ["ExpertParallelMoE", "GroupedLinear", "GroupedMLP", "MoE"]
