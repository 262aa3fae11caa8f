"""experts_implementation="groupgemm" in Hugging Face transformers, against transformers' own
eager experts: every decorated experts class of the installed release (found from the
release, tests/helpers/transformers_families.py), every combination of the decorator's
flags against an independent float64 loop, expert-parallel sentinels, zero-token experts,
torch.compile, training a tiny causal LM, the three ways a model selects the
implementation, and FP8 checkpoints' experts.

Runs against the real transformers package, which ./dev.sh setup installs (pinned, without
its dependencies)."""

import copy
import inspect
import itertools

import pytest
import torch
from clients import require

require("transformers.integrations.moe")
from compiles import counted_compile  # noqa: E402
from transformers import activations  # noqa: E402
from transformers.integrations import moe  # noqa: E402
from transformers_families import EXPERTS, decorated_classes, eager_forward, tiny_experts  # noqa: E402

import groupgemm.torch as gt  # noqa: E402
from groupgemm.integrations import transformers as integration  # noqa: E402
from groupgemm.torch_ext import expert, expert_mlp  # noqa: E402

FAMILIES = decorated_classes()
TOKENS, TOP_K = 9, 2
# Largest error allowed, relative to the largest reference value: float64 differs from the
# eager loop in summation order only, unless the family itself rounds through float32.
TOLERANCE = {torch.float64: 1e-11, torch.float32: 2e-5}


def _close(got, want, tolerance, what):
    want = torch.zeros_like(got) if want is None else want  # eager leaves a skipped expert's grad None
    assert got.shape == want.shape, what
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    error = (got - want).abs().max().item() if want.numel() else 0.0
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} (scale {scale:.3g})"


def _widths(module):
    """(input width, output width) of an experts module, from its weights."""
    up = module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj
    transposed = getattr(module, "is_transposed", False)
    return up.shape[1 if transposed else 2], module.down_proj.shape[2 if transposed else 1]


def _routing(dtype, tokens=TOKENS, experts=range(EXPERTS - 1), seed=1):
    """top_k_index [T, k] over `experts` (the last expert gets no tokens) and top_k_weights."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor(list(experts))
    index = torch.stack([pool[torch.randperm(len(pool), generator=generator)[:TOP_K]] for _ in range(tokens)])
    return index.reshape(tokens, TOP_K), torch.rand(tokens, TOP_K, generator=generator, dtype=dtype)


def _run(forward, module, x, index, weights, dout):
    """(output, [grad of x, of top_k_weights, of each parameter])."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    params = list(module.parameters())
    out = forward(module, x, index, weights)
    return out.detach(), list(torch.autograd.grad(out, [x, weights, *params], dout, allow_unused=True))


def _rounds_through_float32(module, eager_out):
    """Whether the family's own code rounds float64 through float32 (its gate, activation
    or norm casts to float, or its whole eager loop does): then float64 is only that tight."""
    pieces = [eager_out]
    probe = torch.randn(5, 12, dtype=torch.float64)
    if getattr(module, "has_gate", True) and module._apply_gate.__func__ is not moe._default_apply_gate:
        pieces.append(module._apply_gate(probe))
    if getattr(module, "has_post_expert_norm", False):
        pieces.append(module.post_expert_norm(torch.randn(5, _widths(module)[1], dtype=torch.float64)))
    return any(torch.equal(p, p.float().double()) for p in pieces)


def test_the_installed_release_has_its_decorated_families():
    names = {cls.__name__ for _, cls in FAMILIES}
    assert len(FAMILIES) >= 30, len(FAMILIES)  # 35 classes in transformers 5.7.0, 65 in 5.23.0
    assert {"MixtralExperts", "Qwen3MoeExperts", "GptOssExperts", "NemotronHExperts", "Qwen3NextExperts"} <= names


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("family, cls", FAMILIES, ids=[cls.__name__ for _, cls in FAMILIES])
def test_every_decorated_family_matches_eager_output_and_every_gradient(family, cls, dtype):
    module = tiny_experts(cls, dtype)
    width_in, width_out = _widths(module)
    index, weights = _routing(dtype)
    x = torch.randn(TOKENS, width_in, dtype=dtype)
    dout = torch.randn(TOKENS, width_out, dtype=dtype)
    want, want_grads = _run(eager_forward, module, x, index, weights, dout)
    got, got_grads = _run(integration.experts_forward, module, x, index, weights, dout)
    tolerance = TOLERANCE[dtype]
    if dtype == torch.float64 and _rounds_through_float32(module, want):
        tolerance = TOLERANCE[torch.float32]
    names = ["hidden_states", "top_k_weights", *(name for name, _ in module.named_parameters())]
    _close(got, want, tolerance, f"{family} output")
    for name, g, w in zip(names, got_grads, want_grads):
        _close(g, w, tolerance, f"{family} grad of {name}")
    for (name, p), g in zip(module.named_parameters(), got_grads[2:]):
        if name.endswith("proj") or name.endswith("proj_bias"):  # the last expert got no tokens
            assert g.shape == p.shape and (g[EXPERTS - 1] == 0).all(), name


@pytest.mark.parametrize("family, cls", [(f, c) for f, c in FAMILIES if c.__name__ in integration.FLOAT32_FAMILIES],
                         ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("parametrized", [False, True], ids=["plain", "parametrized"])
def test_a_family_that_computes_in_float32_is_computed_in_float32(family, cls, dtype, parametrized):
    # Its eager loop widens every operand to float32: groupgemm on the 16-bit module gives
    # the bits of groupgemm on a float32 copy, rounded, in the output and every gradient.
    # Parametrized (as PEFT's LoRA on expert weights does), its class is another's subclass
    # named Parametrized<family>: the same family.
    module = tiny_experts(cls, dtype)
    if parametrized:
        up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
        torch.nn.utils.parametrize.register_parametrization(module, up, torch.nn.Identity())
    wide = copy.deepcopy(module).float()
    index, weights = _routing(dtype)
    x, dout = torch.randn(TOKENS, _widths(module)[0], dtype=dtype), torch.randn(TOKENS, _widths(module)[1], dtype=dtype)
    got, got_grads = _run(integration.experts_forward, module, x, index, weights, dout)
    want, want_grads = _run(integration.experts_forward, wide, x.float(), index, weights.float(), dout.float())
    assert torch.equal(got, want.to(dtype))
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w.to(dtype))


# ---- every combination of the decorator's flags, against an independent loop ----------

ACTIVATIONS = ("silu", "gelu", "relu", "gelu_pytorch_tanh")
HIDDEN, FFN = 8, 6


def _flag_experts(has_gate, has_bias, is_transposed, is_concatenated, has_post_expert_norm, activation):
    """An experts class decorated with these flags whose forward is a per-slot float64 loop
    written from the flags' documented meaning."""

    class FlagExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = EXPERTS
            f_in = 2 * FFN if has_gate else FFN
            shape = (lambda n, k: (EXPERTS, k, n)) if is_transposed else (lambda n, k: (EXPERTS, n, k))
            up = "gate_up_proj" if has_gate else "up_proj"
            setattr(self, up, torch.nn.Parameter(torch.randn(shape(f_in, HIDDEN))))
            self.down_proj = torch.nn.Parameter(torch.randn(shape(HIDDEN, FFN)))
            if has_bias:
                setattr(self, f"{up}_bias", torch.nn.Parameter(torch.randn(EXPERTS, f_in)))
                self.down_proj_bias = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN))
            if has_post_expert_norm:  # a LayerNorm maps a zero row to its bias: no row may leak
                self.post_expert_norm = torch.nn.LayerNorm(HIDDEN)
                torch.nn.init.normal_(self.post_expert_norm.bias)
            self.act_fn = activations.ACT2FN[activation]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            up = self.gate_up_proj if has_gate else self.up_proj
            b_up = getattr(self, "gate_up_proj_bias" if has_gate else "up_proj_bias", None)
            out = torch.zeros_like(hidden_states)
            for t, j in itertools.product(range(top_k_index.shape[0]), range(top_k_index.shape[1])):
                e = int(top_k_index[t, j])
                if not 0 <= e < EXPERTS:
                    continue
                h = hidden_states[t] @ (up[e] if is_transposed else up[e].T)
                if b_up is not None:
                    h = h + b_up[e]
                if has_gate:
                    gate, other = (h[:FFN], h[FFN:]) if is_concatenated else (h[0::2], h[1::2])
                    h = self.act_fn(gate) * other
                else:
                    h = self.act_fn(h)
                y = h @ (self.down_proj[e] if is_transposed else self.down_proj[e].T)
                if has_bias:
                    y = y + self.down_proj_bias[e]
                if has_post_expert_norm:
                    y = self.post_expert_norm(y)
                out[t] = out[t] + top_k_weights[t, j] * y
            return out

    return moe.use_experts_implementation(
        FlagExperts, has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed,
        is_concatenated=is_concatenated, **({"has_post_expert_norm": True} if has_post_expert_norm else {}))


@pytest.fixture
def core_activations(monkeypatch):
    """The activations the core computed, fused into its expert MLP or between the GEMMs."""
    seen = []
    activate, fused = expert.activate, expert_mlp.expert_mlp
    monkeypatch.setattr(expert, "activate", lambda h, name: seen.append(name) or activate(h, name))
    monkeypatch.setattr(expert_mlp, "expert_mlp", lambda *a, **k: seen.append(k["activation"]) or fused(*a, **k))
    return seen


FLAG_CASES = [(gate, bias, transposed, concatenated, norm)
              for gate, bias, transposed, concatenated, norm in itertools.product([True, False], repeat=5)
              if gate or concatenated]  # the gate/up layout only applies to a gate


@pytest.mark.parametrize("flags", FLAG_CASES, ids=lambda f: "-".join(
    name for name, on in zip(("gate", "bias", "transposed", "concatenated", "norm"), f) if on) or "plain")
def test_every_combination_of_the_decorators_flags_matches_an_independent_loop(flags, core_activations):
    if flags[4] and "has_post_expert_norm" not in moe.use_experts_implementation.__kwdefaults__:
        pytest.skip("this transformers release has no has_post_expert_norm")
    activation = ACTIVATIONS[FLAG_CASES.index(flags) % len(ACTIVATIONS)]
    torch.manual_seed(0)
    module = _flag_experts(*flags, activation)(config=None).double()
    index, weights = _routing(torch.float64, experts=[0, 1, 2, EXPERTS, EXPERTS + 2])  # with sentinels
    x, dout = torch.randn(TOKENS, HIDDEN, dtype=torch.float64), torch.randn(TOKENS, HIDDEN, dtype=torch.float64)
    want, want_grads = _run(eager_forward, module, x, index, weights, dout)
    got, got_grads = _run(integration.experts_forward, module, x, index, weights, dout)
    _close(got, want, 1e-12, "output")
    for (name, _), g, w in zip([("hidden_states", 0), ("top_k_weights", 0), *module.named_parameters()],
                               got_grads, want_grads):
        _close(g, w, 1e-12, f"grad of {name}")
    has_gate, concatenated = flags[0], flags[3]
    in_core = "swiglu" if has_gate and concatenated and activation == "silu" else (
        activation if not has_gate and activation != "gelu_pytorch_tanh" else None)
    assert core_activations == ([in_core] if in_core else []), (activation, core_activations)


@pytest.mark.parametrize("name, core", [
    ("silu", "silu"), ("swish", "silu"), ("gelu", "gelu"), ("gelu_python", "gelu"), ("relu", "relu"),
    ("gelu_pytorch_tanh", None), ("gelu_new", None), ("gelu_fast", None), ("quick_gelu", None), ("relu2", None),
    ("gelu_10", None), ("relu6", None), ("mish", None)])
def test_an_activation_runs_in_the_core_only_where_the_core_computes_the_same_function(name, core):
    act = activations.ACT2FN[name]
    assert integration.core_activation(act) == core
    if core is not None:  # the core's function of the same name gives the same values
        h = torch.linspace(-6, 6, 97, dtype=torch.float64).reshape(1, -1)
        torch.testing.assert_close(expert.activate(h, core), act(h), rtol=1e-13, atol=1e-15)


def test_plain_torch_activations_map_to_the_core_by_identity():
    functional = torch.nn.functional
    assert [integration.core_activation(a) for a in (functional.silu, functional.gelu, functional.relu, torch.relu,
                                                     torch.nn.GELU(), torch.nn.GELU(approximate="tanh"),
                                                     torch.nn.SiLU(), torch.sigmoid)] == [
        "silu", "gelu", "relu", "relu", "gelu", None, "silu", None]


class _ClampedSiLU(activations.SiLUActivation):
    def forward(self, x):
        return super().forward(x).clamp(max=0.1)


def _clamp_output(module, args, out):
    return out.clamp(max=0.1)


def _global_hook_on(module):
    """torch's global forward hook that clamps the output of ``module`` only."""
    return torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: _clamp_output(m, args, out) if m is module else None)


# Each changes what calling the module's act_fn gives (returning a handle to remove, or None).
ACT_FN_CHANGES = {
    "forward hook": lambda m: m.act_fn.register_forward_hook(_clamp_output),
    "forward pre-hook": lambda m: m.act_fn.register_forward_pre_hook(lambda _, args: (args[0].clamp(max=0.1),)),
    "global forward hook": lambda m: _global_hook_on(m.act_fn),
    "subclass overriding forward": lambda m: setattr(m, "act_fn", _ClampedSiLU()),
    "instance forward": lambda m: setattr(m.act_fn, "forward",
                                          lambda x: torch.nn.functional.silu(x).clamp(max=0.1)),
}


@pytest.mark.parametrize("change", ACT_FN_CHANGES)
def test_an_act_fn_whose_call_differs_from_its_stock_class_runs_in_torch_as_eager_does(change, core_activations):
    module = _qwen3_experts()
    handle = ACT_FN_CHANGES[change](module)
    try:
        index, weights = _routing(torch.float64)
        x = torch.randn(TOKENS, module.gate_up_proj.shape[2], dtype=torch.float64)
        dout = torch.randn_like(x)
        want, want_grads = _run(eager_forward, module, x, index, weights, dout)
        got, got_grads = _run(integration.experts_forward, module, x, index, weights, dout)
    finally:
        if handle is not None:
            handle.remove()
    _close(got, want, TOLERANCE[torch.float64], f"{change}: output")
    for g, w in zip(got_grads, want_grads):
        _close(g, w, TOLERANCE[torch.float64], f"{change}: gradient")
    assert core_activations == []


# ---- expert parallelism, zero tokens, compile, determinism --------------------------------


def _qwen3_experts(dtype=torch.float64):
    (cls,) = [cls for _, cls in FAMILIES if cls.__name__ == "Qwen3MoeExperts"]
    return tiny_experts(cls, dtype)


@pytest.fixture
def uninitialized_memory_is_nan():
    """Every torch.empty is filled with NaN (deterministic mode's fill), so a row read or
    returned without being written shows up."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("family", ["Qwen3MoeExperts", "GptOssExperts"])
def test_expert_parallel_sentinels_contribute_exact_zeros_with_nan_planted(family, uninitialized_memory_is_nan):
    (cls,) = [cls for _, cls in FAMILIES if cls.__name__ == family]
    module = tiny_experts(cls, torch.float64)
    module._is_expert_parallel = True  # transformers' flag: ids >= num_experts are other ranks' experts
    width_in, width_out = _widths(module)
    index, weights = _routing(torch.float64, experts=[0, 1, EXPERTS, EXPERTS + 3])
    index[:3] = torch.tensor([EXPERTS, EXPERTS + 3])  # tokens 0-2: every slot on another rank
    x = torch.randn(TOKENS, width_in, dtype=torch.float64)
    x[:3] = float("nan")  # ... and their hidden states are NaN: never read
    dout = torch.randn(TOKENS, width_out, dtype=torch.float64)
    got, (dx, dweights, *dparams) = _run(integration.experts_forward, module, x, index, weights, dout)
    assert (got[:3] == 0).all() and (dx[:3] == 0).all()
    sentinel = index >= EXPERTS
    assert (dweights[sentinel] == 0).all() and torch.isfinite(dweights).all()
    assert all(torch.isfinite(g).all() for g in (got, dx, *dparams))
    # The other tokens as eager computes them with each sentinel slot a zero-weight slot.
    eager_index, eager_weights = torch.where(sentinel[3:], 0, index[3:]), torch.where(sentinel[3:], 0.0, weights[3:])
    want, want_grads = _run(eager_forward, module, x[3:], eager_index, eager_weights, dout[3:])
    _close(got[3:], want, 1e-11, "output")
    _close(dx[3:], want_grads[0], 1e-11, "grad of hidden_states")
    _close(dweights[3:][~sentinel[3:]], want_grads[1][~sentinel[3:]], 1e-11, "grad of top_k_weights")
    for (name, _), g, w in zip(module.named_parameters(), dparams, want_grads[2:]):
        _close(g, w, 1e-11, f"grad of {name}")


@pytest.mark.parametrize("tokens", [0, 6])
def test_experts_without_tokens_get_exact_zero_full_shape_gradients(tokens, uninitialized_memory_is_nan):
    module = _qwen3_experts()
    index = torch.full((tokens, TOP_K), EXPERTS)  # every slot another rank's: all experts empty here
    x = torch.randn(tokens, module.gate_up_proj.shape[2], dtype=torch.float64)
    weights = torch.rand(tokens, TOP_K, dtype=torch.float64)
    out, grads = _run(integration.experts_forward, module, x, index, weights, torch.randn_like(x))
    assert out.shape == x.shape and (out == 0).all()
    for g, want in zip(grads, [x, weights, *module.parameters()]):
        assert g is not None and g.shape == want.shape and (g == 0).all()


@pytest.mark.parametrize("family", ["Qwen3MoeExperts", "GptOssExperts"])
def test_the_experts_module_compiles_fullgraph_and_matches_eager(family):
    (cls,) = [cls for _, cls in FAMILIES if cls.__name__ == family]
    module = tiny_experts(cls, torch.float32)
    module.config._experts_implementation = "groupgemm"
    compiled, counter = counted_compile(module)  # fullgraph: a host copy would break the graph
    width_in, width_out = _widths(module)
    index, weights = _routing(torch.float32)
    x, dout = torch.randn(TOKENS, width_in), torch.randn(TOKENS, width_out)
    want, want_grads = _run(lambda m, *a: m(*a), module, x, index, weights, dout)
    got, got_grads = _run(lambda m, *a: compiled(*a), module, x, index, weights, dout)
    assert counter.frame_count == 1
    if family == "Qwen3MoeExperts":  # every op is groupgemm's: the same bits
        assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    else:  # Inductor compiles GPT-OSS's own gate
        _close(got, want, 1e-5, "output")
        for g, w in zip(got_grads, want_grads):
            _close(g, w, 1e-5, "gradient")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_under_autocast_the_experts_run_in_its_dtype_as_eager_does(fused, monkeypatch):
    monkeypatch.setattr(expert_mlp, "fused_by_default", lambda device: fused)
    module = _qwen3_experts(torch.float32)
    index, weights = _routing(torch.float32)
    x = torch.randn(TOKENS, module.gate_up_proj.shape[2])
    dout = torch.randn_like(x)
    float32, _ = _run(integration.experts_forward, module, x, index, weights, dout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _run(eager_forward, module, x, index, weights, dout)
        got, got_grads = _run(integration.experts_forward, module, x, index, weights, dout)
    assert not torch.equal(got, float32) and got.dtype == want.dtype == torch.float32
    tolerance = 2e-2  # a few bfloat16 roundings, at different points in each
    _close(got, want, tolerance, "output")
    for (name, _), g, w in zip([("hidden_states", 0), ("top_k_weights", 0), *module.named_parameters()],
                               got_grads, want_grads):
        assert g.dtype == torch.float32, name
        _close(g, w, tolerance, f"grad of {name}")


def test_the_same_call_gives_the_same_bits():
    module = _qwen3_experts(torch.float32)
    index, weights = _routing(torch.float32)
    x = torch.randn(TOKENS, module.gate_up_proj.shape[2])
    dout = torch.randn(TOKENS, x.shape[1])
    first, second = (_run(integration.experts_forward, module, x, index, weights, dout) for _ in range(2))
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


# ---- a model: selecting the implementation, training -----------------------------------


def _tiny_lm_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


@pytest.fixture
def groupgemm_calls(monkeypatch):
    """How many times groupgemm's experts ran (once per MoE layer and forward)."""
    calls = []

    class Counted(integration._Weights):
        def __init__(self, module, *args):
            calls.append(type(module).__name__)
            super().__init__(module, *args)

    monkeypatch.setattr(integration, "_Weights", Counted)
    return calls


def test_a_model_selects_groupgemm_by_from_config_set_experts_implementation_and_from_pretrained(
        tmp_path, groupgemm_calls):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 32, (1, 5))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(_tiny_lm_config()), experts_implementation="groupgemm")
    assert model.config._experts_implementation == "groupgemm"
    model(ids)
    assert len(groupgemm_calls) == 2  # both MoE layers
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="groupgemm")
    loaded(ids)
    assert len(groupgemm_calls) == 4
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    eager(ids)
    assert len(groupgemm_calls) == 4
    eager.set_experts_implementation("groupgemm")
    eager(ids)
    assert len(groupgemm_calls) == 6


def test_a_tiny_causal_lm_trains_with_the_same_loss_curve_as_eager():
    from transformers import AutoModelForCausalLM

    curves = {}
    batch = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))
    for implementation in ("eager", "groupgemm"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(_tiny_lm_config()), dtype=torch.float64,
                                                 experts_implementation=implementation)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        curves[implementation] = []
        for _ in range(5):
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curves[implementation].append(loss.item())
    assert curves["eager"][-1] < curves["eager"][0]  # it learns
    torch.testing.assert_close(curves["groupgemm"], curves["eager"], rtol=1e-10, atol=0)


def test_register_is_idempotent_and_reaches_new_interfaces():
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

    integration.register()
    integration.register()
    assert moe.ExpertsInterface().get_interface("groupgemm", None) is integration.experts_forward
    assert FP8ExpertsInterface().get_interface("groupgemm", None) is integration.fp8_experts_forward


# ---- bad input ------------------------------------------------------------------------


def test_a_layout_that_cannot_be_mapped_raises_naming_the_attribute_and_the_family():
    module = _qwen3_experts()
    x, (index, weights) = torch.randn(TOKENS, module.gate_up_proj.shape[2], dtype=torch.float64), _routing(
        torch.float64)
    broken = copy.deepcopy(module)
    del broken.gate_up_proj
    with pytest.raises(TypeError, match="Qwen3MoeExperts has no tensor 'gate_up_proj'"):
        integration.experts_forward(broken, x, index, weights)
    broken = copy.deepcopy(module)
    broken.num_experts = EXPERTS + 1
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts.num_experts is 5 but Qwen3MoeExperts.gate_up_proj holds 4"):
        integration.experts_forward(broken, x, index, weights)
    broken = copy.deepcopy(module)
    broken.down_proj = torch.nn.Parameter(broken.down_proj.float())
    with pytest.raises(TypeError, match="Qwen3MoeExperts.down_proj is float32 but Qwen3MoeExperts.gate_up_proj is "
                                        "float64"):
        integration.experts_forward(broken, x, index, weights)
    broken = copy.deepcopy(module)
    del broken.act_fn
    with pytest.raises(TypeError, match="Qwen3MoeExperts has no callable act_fn"):
        integration.experts_forward(broken, x, index, weights)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts.gate_up_proj has shape \(4, 12, 8\), expected "
                                         r"\(4, 12, 7\) .*7 features as hidden_states"):
        integration.experts_forward(module, x[:, :-1], index, weights)
    broken = copy.deepcopy(module)
    broken.down_proj = torch.nn.Parameter(broken.down_proj[..., :-1])  # takes 5 features, SwiGLU gives 6
    with pytest.raises(ValueError, match="Qwen3MoeExperts.down_proj takes 5"):
        integration.experts_forward(broken, x, index, weights)
    broken = copy.deepcopy(module)
    broken.gate_up_proj = torch.nn.Parameter(broken.gate_up_proj[:, :-1])
    with pytest.raises(ValueError, match="swiglu needs an even Qwen3MoeExperts.gate_up_proj width"):
        integration.experts_forward(broken, x, index, weights)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_a_down_proj_not_returning_the_hidden_width_is_refused_on_either_path(fused, monkeypatch):
    # The per-token sum adds outputs of hidden_states' width, as transformers' own
    # implementations do; the composed path (the GPU's) refused nothing before.
    monkeypatch.setattr(expert_mlp, "fused_by_default", lambda device: fused)
    module = _qwen3_experts()
    x, (index, weights) = torch.randn(TOKENS, module.gate_up_proj.shape[2], dtype=torch.float64), _routing(
        torch.float64)
    module.down_proj = torch.nn.Parameter(torch.cat([module.down_proj, module.down_proj[:, :1]], 1))
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts.down_proj has shape \(4, 9, 6\), expected \(4, 8, 6\)"):
        integration.experts_forward(module, x, index, weights)


def test_routing_arguments_that_do_not_fit_raise_in_the_callers_names():
    module = _qwen3_experts()
    x, (index, weights) = torch.randn(TOKENS, module.gate_up_proj.shape[2], dtype=torch.float64), _routing(
        torch.float64)
    calls = [((x, index, weights[:, :1]), ValueError, r"top_k_weights must have shape \(9, 2\), got \(9, 1\)"),
             ((x[:-1], index, weights), ValueError, r"top_k_index has shape \(9, 2\), but hidden_states has 8 tokens"),
             ((x[None], index, weights), ValueError, r"hidden_states must be 2-D \[S, H\]"),
             ((x, index.double(), weights), TypeError, "top_k_index must be an integer array, got float64")]
    for args, error, match in calls:
        with pytest.raises(error, match=f"groupgemm experts: {match}"):
            integration.experts_forward(module, *args)


def test_a_dtype_the_core_lacks_raises_naming_it():
    module = _qwen3_experts()
    module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.to(torch.float8_e4m3fn), requires_grad=False)
    x, (index, weights) = torch.randn(TOKENS, module.gate_up_proj.shape[2]), _routing(torch.float32)
    with pytest.raises(TypeError, match="Qwen3MoeExperts.gate_up_proj is float8_e4m3fn"):
        integration.experts_forward(module, x, index, weights)


# ---- FP8 checkpoints ------------------------------------------------------------------

FP8_WIDTH = 128  # hidden and moe_intermediate: the blockwise recipe's block


def _fp8_experts(block_size=(FP8_WIDTH, FP8_WIDTH), activation_scheme="dynamic", scale_fmt="float"):
    """transformers' FP8Experts as an FP8 checkpoint loads it (decorated with the FP8
    interface, as replace_with_fp8_linear does), its weights an FP8 quantization of
    random bfloat16 ones (UE8M0 scales: powers of two); and those dequantized weights in
    float64."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations import finegrained_fp8

    class TinyFP8Experts(finegrained_fp8.FP8Experts):  # the decorator edits the class it is given
        pass

    cls = moe.use_experts_implementation(TinyFP8Experts, experts_interface=finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    config = Qwen3MoeConfig(hidden_size=FP8_WIDTH, moe_intermediate_size=FP8_WIDTH, num_experts=EXPERTS)
    config._experts_implementation = "groupgemm"
    if scale_fmt != "float" and "scale_fmt" not in inspect.signature(finegrained_fp8.FP8Experts).parameters:
        pytest.skip("this transformers release's FP8 experts have no UE8M0 scales")
    module = cls(config, block_size=block_size, activation_scheme=activation_scheme,
                 **({"scale_fmt": scale_fmt} if scale_fmt != "float" else {}))
    dequantized = {}
    generator = torch.Generator().manual_seed(0)
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name)
        q, scale = gt.quantize_fp8(torch.randn(weight.shape, generator=generator).to(torch.bfloat16) * 0.1,
                                   "blockwise", power_of_two=scale_fmt == "ue8m0")
        scale_inv = getattr(module, f"{name}_scale_inv")
        weight.data, scale_inv.data = q, scale.to(scale_inv.dtype)
        dequantized[name] = q.double() * scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return module, dequantized


def _tile_quantized(x):
    """x [M, K] through float8_e4m3fn per 1 x 128 tile, as the dynamic scheme quantizes it
    (scale = amax / 448, q = x / scale rounded), back in float64."""
    tiles = x.float().reshape(x.shape[0], -1, 128)
    scale = (tiles.abs().amax(-1, keepdim=True) / 448).clamp(min=2.0**-126)
    scale = torch.where(tiles.abs().amax(-1, keepdim=True) == 0, 1.0, scale)
    return ((tiles / scale).to(torch.float8_e4m3fn).double() * scale.double()).reshape(x.shape)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_checkpoint_experts_match_the_float64_product_of_their_quantized_operands(scale_fmt):
    module, w = _fp8_experts(scale_fmt=scale_fmt)
    index, weights = _routing(torch.float32, tokens=6)
    x = torch.randn(6, FP8_WIDTH, requires_grad=True)
    out = module(x, index, weights)  # the module's own dispatch: the FP8 interface's "groupgemm"
    dout = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dout)
    want, want_dx = torch.zeros(6, FP8_WIDTH, dtype=torch.float64), torch.zeros(6, FP8_WIDTH, dtype=torch.float64)
    for t, j in itertools.product(range(6), range(TOP_K)):
        e = int(index[t, j])
        h = _tile_quantized(x[t:t + 1].detach()) @ w["gate_up_proj"][e].T
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        want[t] += weights[t, j].double() * (_tile_quantized(a) @ w["down_proj"][e].T)[0]
        # dx through the same blocks: each GEMM's incoming gradient quantized per 1 x 128 tile
        da = _tile_quantized(dout[t:t + 1].double() * weights[t, j].double()) @ w["down_proj"][e]
        sigmoid = torch.sigmoid(gate)
        dgate, dup = da * up * sigmoid * (1 + gate * (1 - sigmoid)), da * torch.nn.functional.silu(gate)
        want_dx[t] += (_tile_quantized(torch.cat([dgate, dup], -1)) @ w["gate_up_proj"][e])[0]
    # The FP8 products are exact: only float32 accumulation (and the rounding of the
    # intermediate before its quantization) separates the two.
    _close(out.double(), want, 1e-5, "output")
    _close(dx.double(), want_dx, 1e-5, "grad of hidden_states")


def test_fp8_checkpoint_experts_compile_fullgraph_under_grad_with_the_eager_bits():
    module, _ = _fp8_experts()
    index, weights = _routing(torch.float32, tokens=6)
    x, dout = torch.randn(6, FP8_WIDTH), torch.randn(6, FP8_WIDTH)
    # Dynamo traces the backward too (in its strict mode) and AOTAutograd splits the graph;
    # Inductor would recompile FP8Experts' own _apply_gate, which runs in torch, to other bits.
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")

    def run(forward):
        leaves = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = forward(leaves[0], index, leaves[1])
        return out.detach(), torch.autograd.grad(out, leaves, dout)

    (want, want_grads), (got, got_grads) = run(module), run(compiled)
    assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


@pytest.mark.parametrize("option, width, match", [
    ({"block_size": None}, FP8_WIDTH, r"TinyFP8Experts.block_size \(the checkpoint's weight_block_size\) is None"),
    ({"activation_scheme": "static"}, FP8_WIDTH, "TinyFP8Experts.activation_scheme is 'static'"),
    ({}, 2 * FP8_WIDTH, "TinyFP8Experts.gate_up_proj takes 128 input features, got 256")])
def test_fp8_experts_that_groupgemm_does_not_serve_raise_naming_the_attribute(option, width, match):
    module, _ = _fp8_experts(**option)
    index, weights = _routing(torch.float32, tokens=4)
    with pytest.raises(ValueError, match=match):
        module(torch.randn(4, width), index, weights)
