"""groupgemm as a Hugging Face transformers experts implementation: ``"groupgemm"``.

transformers 5.x runs the experts of its MoE models through one seam: the forward of every
class decorated with ``@use_experts_implementation`` (``transformers.integrations.moe``)
looks up ``config._experts_implementation`` in ``ExpertsInterface`` and calls
``fn(module, hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k]) -> [S, H]``.
Importing this module registers :func:`experts_forward` there as ``"groupgemm"`` (and
:func:`fp8_experts_forward` in the FP8 experts' interface), so a model picks it with::

    import groupgemm.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="groupgemm")
    # or: model.set_experts_implementation("groupgemm")

transformers accepts a registered name there from 5.7.0 on (5.0 to 5.6 keep a fixed list).

Everything stays on the device, with no host copy. A slot whose expert id is outside
``[0, num_experts)`` (an expert-parallel sentinel) is dropped: never gathered, it adds
exactly nothing. When the module's activation is one the core computes (SwiGLU with the
default gate, or silu, erf-gelu or relu without a gate), the whole expert MLP runs in the
core: groupgemm's fused ``expert_mlp`` where it is the faster path (the CPU), elsewhere
permute, the grouped GEMMs with the activation between them, and unpermute. Otherwise (the
module's own ``_apply_gate``, an interleaved gate/up layout, another activation, a
post-expert norm) that part runs in torch between groupgemm's grouped GEMMs, on the rows
they wrote. Each token's weighted rows are summed in float32; rows owned by no expert are
exact zeros throughout, an expert without tokens gets exact-zero weight and bias
gradients, and ``torch.compile(fullgraph=True)`` traces it.
"""

import torch
from torch.nn.modules import module as torch_module

from groupgemm import _contract as contract
from groupgemm.integrations import _transformers_fp8 as fp8
from groupgemm.torch_ext import arguments, expert, functional
from groupgemm.torch_ext import expert_mlp as fused

try:  # the client, when installed; read at import, so a torch.compile trace sees plain objects
    from transformers import activations as hf_activations
    from transformers.integrations import moe as hf_moe
except ImportError:
    hf_activations = hf_moe = None

__all__ = ["core_activation", "experts_forward", "fp8_experts_forward", "register"]

NAME = "groupgemm"
FN = "groupgemm experts"  # how errors name the implementation
# Families whose own forward computes every projection in float32 from 16-bit weights (their
# eager loop widens each operand with .float(), on purpose): groupgemm computes them in
# float32 too, widening the weights per call as that loop does. transformers' grouped_mm
# computes them in the weights' dtype.
FLOAT32_FAMILIES = frozenset({"OpenAIPrivacyFilterExperts"})


def register():
    """Registers ``"groupgemm"`` in transformers' ``ExpertsInterface`` and, where the release
    has it, its FP8 experts' interface (``FP8ExpertsInterface``). Idempotent; importing this
    module already calls it when transformers is installed."""
    if hf_moe is None:
        raise ImportError("groupgemm.integrations.transformers: transformers is not installed", name="transformers")
    hf_moe.ExpertsInterface.register(NAME, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a release without FP8 experts
        return
    FP8ExpertsInterface.register(NAME, fp8_experts_forward)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of a ``@use_experts_implementation`` module on groupgemm.

    ``hidden_states [S, H]``, ``top_k_index [S, k]`` (ids outside ``[0, num_experts)`` are
    dropped slots) and ``top_k_weights [S, k]``; returns ``[S, H]`` in hidden_states'
    dtype, computed in the weights' dtype (hidden_states is cast to it, as transformers'
    ``grouped_mm`` does), or in float32 for a family whose own code computes in float32
    (``FLOAT32_FAMILIES``); under ``torch.autocast`` the GEMMs run in its dtype, as eager's
    ``F.linear`` calls do. Reads the decorator's flags (``has_gate``, ``has_bias``,
    ``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``) and the module's
    ``gate_up_proj`` / ``up_proj``, ``down_proj``, their ``*_bias``, ``_apply_gate``,
    ``act_fn`` and ``post_expert_norm``. Differentiable in hidden_states, every expert
    parameter and top_k_weights. A module whose layout cannot be mapped raises a
    ``TypeError`` / ``ValueError`` naming the attribute and the class.
    """
    _check_routing(hidden_states, top_k_index, top_k_weights)
    w = _Weights(self, hidden_states.shape[-1])
    x = hidden_states.to(w.dtype)
    activation = _core_activation(self)
    if activation is not None:
        w.check_activation_width(contract.activation_width(activation, w.up_features, FN, f"{w.family}.{w.up_name}"))
    transpose = not w.transposed  # nn.Linear's [E, out, in]: read transposed
    post_norm = getattr(self, "has_post_expert_norm", False)
    if activation is not None and not post_norm and fused.fused_by_default(x.device):
        out = fused.expert_mlp(x, top_k_index, _probs(top_k_weights, w.dtype), w.up, w.down, activation=activation,
                               b_in=w.up_bias, b_out=w.down_bias, transpose_weight=transpose)
        return out.to(hidden_states.dtype)
    rows, group_sizes, row_map = expert.permute(x, top_k_index, w.num_experts)
    h = functional.grouped_mm(rows, w.up, group_sizes, w.up_bias, transpose_weight=transpose)
    if activation is not None:
        h = expert.activate(h, activation)
    else:
        h = _torch_activation(self, h)
        w.check_activation_width(h.shape[-1])
    y = functional.grouped_mm(h, w.down, group_sizes, w.down_bias, transpose_weight=transpose)
    if post_norm:
        y = self.post_expert_norm(y).to(w.dtype)
    return expert.unpermute(y, row_map, _probs(top_k_weights, y.dtype)).to(hidden_states.dtype)


def fp8_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' FP8 experts (``FP8Experts``: an FP8 checkpoint's experts) on groupgemm's
    scaled grouped GEMMs.

    Serves float8_e4m3fn weights with float32 or UE8M0 ``*_scale_inv`` in 128 x 128 blocks
    (``weight_block_size=[128, 128]``: DeepSeek-V3's format, and that of most FP8
    checkpoints) and the dynamic activation scheme: the activations are quantized per
    1 x 128 tile, as groupgemm's blockwise recipe does, so every width must be a multiple of
    128. Differentiable in hidden_states and top_k_weights (the input gradient runs in FP8
    on the same blocks); the FP8 weights are frozen, as in transformers. Weights stored in
    16 bits (a dequantized checkpoint) run :func:`experts_forward`. FP4 weights, static
    activation scales and other block sizes raise, naming the attribute.
    """
    weight = getattr(self, "gate_up_proj" if getattr(self, "has_gate", True) else "up_proj", None)
    if isinstance(weight, torch.Tensor) and weight.element_size() > 1:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)
    _check_routing(hidden_states, top_k_index, top_k_weights)
    up, down = fp8.layers(self, FN)
    dtype = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float32) else torch.float32
    rows, group_sizes, row_map = expert.permute(hidden_states.to(dtype), top_k_index, up.num_experts)
    h = fp8.grouped_linear(rows, up, group_sizes)
    activation = _core_activation(self)
    h = expert.activate(h, activation) if activation is not None else _torch_activation(self, h)
    y = fp8.grouped_linear(h, down, group_sizes)
    return expert.unpermute(y, row_map, _probs(top_k_weights, dtype)).to(hidden_states.dtype)


def _check_routing(hidden_states, top_k_index, top_k_weights):
    """The call's arguments in the caller's names: hidden_states [S, H], top_k_index (integer)
    and top_k_weights [S, k]."""
    (tokens, _), (index, index_dtype), (weights, _) = (
        arguments.shape_and_dtype(t, name, FN) for t, name in
        ((hidden_states, "hidden_states"), (top_k_index, "top_k_index"), (top_k_weights, "top_k_weights")))
    contract.check_rank(tokens, 2, "hidden_states", "[S, H]", FN)
    contract.check_rank(index, 2, "top_k_index", "[S, k]", FN)
    contract.check_index_dtype(index_dtype, "top_k_index", FN)
    if index[0] != tokens[0]:
        raise ValueError(f"{FN}: top_k_index has shape {index}, but hidden_states has {tokens[0]} tokens "
                         f"(shape {tokens})")
    contract.check_shape(weights, index, "top_k_weights", FN)


def core_activation(act) -> str | None:
    """The core's activation that computes ``act`` exactly (the same function: silu, the
    erf form of gelu, relu), or None. A module counts only where calling it runs its stock
    class's forward and nothing else: a subclass, a hook (its own or torch's global module
    hooks) or a forward set on the instance changes what it gives, so torch then calls it."""
    nn, F = torch.nn, torch.nn.functional
    if isinstance(act, nn.Module):
        if not _runs_its_class_forward_only(act):
            return None
        kind = type(act)  # the exact class: a subclass may override forward
        if kind in (nn.SiLU, hf_activations.SiLUActivation):
            return "silu"
        if kind is hf_activations.GELUActivation or (kind is nn.GELU and act.approximate == "none"):
            return "gelu"
        return "relu" if kind is nn.ReLU else None
    if act is F.silu:
        return "silu"
    if act is F.gelu:
        return "gelu"
    return "relu" if act in (F.relu, torch.relu) else None


def _runs_its_class_forward_only(module) -> bool:
    """Whether calling the module runs just its class's forward: no hook of any kind (the
    ones nn.Module.__call__ checks before skipping them) and no forward of the instance's own."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
             torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks,
             torch_module._global_backward_hooks, torch_module._global_backward_pre_hooks)
    return not any(hooks) and "forward" not in vars(module)


def _probs(top_k_weights, dtype):
    """The routing weights as the core reads them: the experts' dtype or float32."""
    return top_k_weights if top_k_weights.dtype in (dtype, torch.float32) else top_k_weights.to(dtype)


def _core_activation(module) -> str | None:
    """The core's activation for the module's gate or act_fn, or None: torch computes it."""
    if not getattr(module, "has_gate", True):
        return core_activation(_act_fn(module))
    if not _default_gate(module) or not getattr(module, "is_concatenated", True):
        return None
    return "swiglu" if core_activation(_act_fn(module)) == "silu" else None  # silu(gate) * up


def _torch_activation(module, h):
    """The module's gate or activation of the first GEMM's output, as the module writes it,
    in h's dtype (a family's own gate may compute in float32)."""
    if not getattr(module, "has_gate", True):
        return module.act_fn(h).to(h.dtype)
    if _default_gate(module) and not getattr(module, "is_concatenated", True):  # [gate0, up0, gate1, ...]
        return (module.act_fn(h[..., ::2]) * h[..., 1::2]).to(h.dtype)
    return module._apply_gate(h).to(h.dtype)  # the default gate, or the model's own (clamps, alpha, caps)


def _default_gate(module) -> bool:
    """Whether the module gates with transformers' default ``act_fn(gate) * up`` (the class
    attribute compared, not a bound method: a torch.compile trace folds it)."""
    return "_apply_gate" not in vars(module) and getattr(type(module), "_apply_gate", None) is \
        hf_moe._default_apply_gate


def _act_fn(module):
    act = getattr(module, "act_fn", None)
    if not callable(act):
        raise TypeError(f"{FN}: {type(module).__name__} has no callable act_fn (needed with has_gate="
                        f"{getattr(module, 'has_gate', True)} and the default gate), got {type(act).__name__}")
    return act


def _family(module) -> str:
    """The module's experts class name. torch.nn.utils.parametrize (PEFT's LoRA on expert
    weights) makes a parametrized module's class a subclass named Parametrized<name>: the
    family is the class it subclasses."""
    cls = type(module)
    return (cls.__bases__[0] if torch.nn.utils.parametrize.is_parametrized(module) else cls).__name__


class _Weights:
    """The module's expert weights and biases as groupgemm reads them, checked against each
    other and against ``hidden`` (hidden_states' width)."""

    def __init__(self, module, hidden):
        self.family = family = _family(module)
        self.up_name = up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
        self.up, self.down = _tensor(module, up), _tensor(module, "down_proj")
        self.up_bias = self.down_bias = None
        if getattr(module, "has_bias", False):
            self.up_bias, self.down_bias = _tensor(module, f"{up}_bias"), _tensor(module, "down_proj_bias")
        self.transposed = bool(getattr(module, "is_transposed", False))
        self.dtype = self.up.dtype
        named = ((up, self.up, 3), ("down_proj", self.down, 3), (f"{up}_bias", self.up_bias, 2),
                 ("down_proj_bias", self.down_bias, 2))
        for name, t, rank in named:
            if t is None:
                continue
            if arguments.dtype_name(t.dtype) not in contract.FLOAT_DTYPES:
                raise TypeError(f"{FN}: {family}.{name} is {arguments.dtype_name(t.dtype)}; groupgemm computes in "
                                f"{', '.join(contract.FLOAT_DTYPES)} (an FP8 checkpoint's experts run "
                                "fp8_experts_forward)")
            if t.dtype != self.dtype:
                raise TypeError(f"{FN}: {family}.{name} is {arguments.dtype_name(t.dtype)} but {family}.{up} is "
                                f"{arguments.dtype_name(self.dtype)}; the experts' parameters must share one dtype")
            if t.dim() != rank:
                raise ValueError(f"{FN}: {family}.{name} must be {rank}-D, got shape {tuple(t.shape)}")
        # [E, in, out] when transposed, else nn.Linear's [E, out, in]
        e, in_axis, out_axis = self.up.shape[0], (1 if self.transposed else 2), (2 if self.transposed else 1)
        self.num_experts, self.up_features = e, self.up.shape[out_axis]
        self.mid_features = self.down.shape[in_axis]
        layout = "[E, in, out] (is_transposed)" if self.transposed else "[E, out, in]"
        # down_proj returns hidden_states' width, which the weighted sum per token adds up (as
        # transformers' own implementations require).
        wanted = {up: (e, hidden, self.up_features) if self.transposed else (e, self.up_features, hidden),
                  "down_proj": (e, self.mid_features, hidden) if self.transposed else (e, hidden, self.mid_features),
                  f"{up}_bias": (e, self.up_features), "down_proj_bias": (e, hidden)}
        for name, t, _ in named:
            if t is not None and tuple(t.shape) != wanted[name]:
                raise ValueError(f"{FN}: {family}.{name} has shape {tuple(t.shape)}, expected {wanted[name]} (weights "
                                 f"{layout}, {e} experts as {family}.{up}, {hidden} features as hidden_states)")
        declared = getattr(module, "num_experts", e)
        if declared != e:
            raise ValueError(f"{FN}: {family}.num_experts is {declared} but {family}.{up} holds {e} experts "
                             f"(shape {tuple(self.up.shape)})")
        if family in FLOAT32_FAMILIES and self.dtype in (torch.bfloat16, torch.float16):
            self._widen()

    def _widen(self):
        """The weights and biases as float32 copies (differentiable: their gradients reach the
        module's own, rounded to its dtype)."""
        self.up, self.down = self.up.float(), self.down.float()
        if self.up_bias is not None:
            self.up_bias, self.down_bias = self.up_bias.float(), self.down_bias.float()
        self.dtype = torch.float32

    def check_activation_width(self, width):
        """The gate's or activation's output must be what down_proj takes."""
        if width != self.mid_features:
            raise ValueError(f"{FN}: {self.family}'s gate / activation of {self.up_name}'s {self.up_features} "
                             f"outputs gives {width} features, but {self.family}.down_proj takes {self.mid_features}")


def _tensor(module, name):
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{FN}: {type(module).__name__} has no tensor {name!r} (its decorator's flags: has_gate="
                        f"{getattr(module, 'has_gate', True)}, has_bias={getattr(module, 'has_bias', False)}), "
                        f"got {type(value).__name__}")
    return value


if hf_moe is not None:
    register()
