"""groupgemm for PyTorch: ``grouped_mm``, ``grouped_mm_wgrad`` and ``GroupedLinear``, and the
expert layer: ``permute``, ``unpermute`` and ``GroupedMLP``.

The ops are registered as ``torch.ops.groupgemm.*`` custom ops on import.
"""

from groupgemm.torch_ext.expert import permute, unpermute
from groupgemm.torch_ext.functional import grouped_mm, grouped_mm_wgrad
from groupgemm.torch_ext.module import GroupedLinear, GroupedMLP

__all__ = ["GroupedLinear", "GroupedMLP", "grouped_mm", "grouped_mm_wgrad", "permute", "unpermute"]
