"""groupgemm for PyTorch: ``grouped_mm``, ``grouped_mm_wgrad`` and ``GroupedLinear``.

The ops are registered as ``torch.ops.groupgemm.*`` custom ops on import.
"""

from groupgemm.torch_ext.functional import grouped_mm, grouped_mm_wgrad
from groupgemm.torch_ext.module import GroupedLinear

__all__ = ["GroupedLinear", "grouped_mm", "grouped_mm_wgrad"]
