"""groupgemm for PyTorch: ``grouped_mm``, ``grouped_mm_wgrad`` and ``GroupedLinear``, and the
expert layer: ``permute``, ``unpermute``, ``GroupedMLP`` and ``expert_mlp`` (the three fused).

The ops are registered as ``torch.ops.groupgemm.*`` on import, each differentiable one in
reverse and forward mode (torch.autograd.forward_ad and the torch.func transforms too).
``grouped_mm`` also takes torch._grouped_mm's ``offs=`` (cumulative group ends).
FP8: ``scaled_grouped_mm`` (torch.nn.functional.scaled_grouped_mm's signature),
``quantize_fp8`` / ``quantize_fp8_grouped``, and ``fp8=`` on the modules. Expert parallelism over
a ``torch.distributed`` group: ``dispatch``, ``dispatch_probs``, ``combine``,
``ExpertParallelMoE`` and ``dropless_capacity``; its experts' optimizer state for distributed
checkpoints: ``optimizer_state_dict`` and ``load_optimizer_state_dict``.
"""

from groupgemm.torch_ext import flop_formulas  # noqa: F401 - registers the ops' FLOP counts
from groupgemm.torch_ext.expert import permute, softmax_topk, unpermute
from groupgemm.torch_ext.expert_mlp import expert_mlp
from groupgemm.torch_ext.expert_parallel import ExpertParallelMoE, combine, dispatch, dispatch_probs, dropless_capacity
from groupgemm.torch_ext.expert_parallel_sharding import load_optimizer_state_dict, optimizer_state_dict
from groupgemm.torch_ext.fp8 import quantize_fp8, quantize_fp8_grouped, scaled_grouped_mm
from groupgemm.torch_ext.functional import grouped_mm, grouped_mm_wgrad
from groupgemm.torch_ext.module import GroupedLinear, GroupedMLP

__all__ = ["ExpertParallelMoE", "GroupedLinear", "GroupedMLP", "combine", "dispatch", "dispatch_probs",
           "dropless_capacity", "expert_mlp", "grouped_mm", "grouped_mm_wgrad", "load_optimizer_state_dict",
           "optimizer_state_dict", "permute", "quantize_fp8", "quantize_fp8_grouped", "scaled_grouped_mm",
           "softmax_topk", "unpermute"]
