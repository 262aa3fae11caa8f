"""groupgemm for PyTorch: ``grouped_mm``, ``grouped_mm_wgrad`` and ``GroupedLinear``, and the
expert layer: ``permute``, ``unpermute`` and ``GroupedMLP``.

The ops are registered as ``torch.ops.groupgemm.*`` on import, each differentiable one in
reverse and forward mode (torch.autograd.forward_ad and the torch.func transforms too).
``grouped_mm`` also takes torch._grouped_mm's ``offs=`` (cumulative group ends).
"""

from groupgemm.torch_ext.expert import permute, softmax_topk, unpermute
from groupgemm.torch_ext.functional import grouped_mm, grouped_mm_wgrad
from groupgemm.torch_ext.module import GroupedLinear, GroupedMLP

__all__ = ["GroupedLinear", "GroupedMLP", "grouped_mm", "grouped_mm_wgrad", "permute", "softmax_topk",
           "unpermute"]
