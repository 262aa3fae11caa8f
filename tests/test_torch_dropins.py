"""The drop-in recipes (README: "Use it from torchtitan", "Use it from Megatron-core") run as
written, and do what they replace: torchtitan's torch._grouped_mm experts, Megatron-core's
experts with gradient-accumulation fusion."""

import torch
from compiles import counted_compile

# README, "Use it from torchtitan".
TORCHTITAN = '''
import torch
import torch.nn.functional as F
from groupgemm.torch import grouped_mm

# torchtitan's _run_experts_grouped_mm, each torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
# replaced: w1, w3 [E, hidden, dim] and w2 [E, dim, hidden] are read transposed, in place.
def run_experts(w1, w2, w3, x, num_tokens_per_expert):
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(grouped_mm(x, w1, offs=offsets, transpose_weight=True))
    h = h * grouped_mm(x, w3, offs=offsets, transpose_weight=True)
    return grouped_mm(h, w2, offs=offsets, transpose_weight=True)

w1, w3, w2 = torch.randn(4, 32, 16), torch.randn(4, 32, 16), torch.randn(4, 16, 32)
x = torch.randn(12, 16)                             # rows sorted by expert, then 2 padding rows
out = run_experts(w1, w2, w3, x, torch.tensor([4, 0, 6, 0]))
assert (out[10:] == 0).all()                        # rows past offsets[-1] are exact zeros
'''

# README, "Use it from Megatron-core".
MEGATRON = '''
import torch
from groupgemm.torch import GroupedMLP

# The experts of a Megatron-core MoE layer with gradient_accumulation_fusion: fc1.weight
# [E, 2F, H] (gate, then up, as Megatron's swiglu splits it) and fc2.weight [E, H, F].
experts = GroupedMLP(num_experts=4, hidden_size=16, ffn_hidden_size=32, activation="swiglu",
                     accumulate_into_main_grad=True)

# Megatron-core's DistributedDataParallel gives each parameter these (by hand here):
for p in experts.parameters():
    p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    p.grad_added_to_main_grad = False

permuted_tokens = torch.randn(10, 16)               # rows sorted by expert
tokens_per_expert = torch.tensor([4, 0, 6, 0])      # stays on the device: no .tolist()
experts(permuted_tokens, tokens_per_expert).sum().backward()

w = experts.fc1.weight
assert w.grad_added_to_main_grad                    # DDP's hook will not add .grad again
assert (w.main_grad[1] == 0).all()                  # expert 1 got no tokens: exact zeros
'''


def _run(snippet):
    # The snippets draw their inputs from torch's generator: seeded here, so that they do
    # not depend on the tests that ran before (one order left a float32 weight gradient's
    # cancelled sum 0.002 from torch._grouped_mm's, past the 1e-3 tolerance).
    torch.manual_seed(0)
    namespace = {}
    exec(compile(snippet, "snippet", "exec"), namespace)
    return namespace


def _torchtitan_original(w1, w2, w3, x, num_tokens_per_expert):
    """torchtitan's _run_experts_grouped_mm (without its bfloat16 casts)."""
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)


def test_torchtitan_recipe_matches_torch_grouped_mm_forward_and_backward_and_compiles():
    ns = _run(TORCHTITAN)
    run_experts = ns["run_experts"]
    weights = [w.clone().requires_grad_() for w in (ns["w1"], ns["w2"], ns["w3"])]
    x = ns["x"].clone().requires_grad_()
    counts = torch.tensor([4, 0, 6, 0])
    out = run_experts(*weights, x, counts)
    out_grads = torch.autograd.grad(out[:10].square().sum(), (*weights, x))
    want = _torchtitan_original(*weights, x, counts)
    want_grads = torch.autograd.grad(want[:10].square().sum(), (*weights, x))
    torch.testing.assert_close(out[:10], want[:10], rtol=1e-3, atol=1e-3)
    for got, expected in zip(out_grads[:3], want_grads[:3]):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out_grads[3][:10], want_grads[3][:10], rtol=1e-3, atol=1e-3)
    assert (out_grads[3][10:] == 0).all()
    assert (out_grads[0][1] == 0).all() and (out_grads[0][3] == 0).all()  # experts without tokens
    compiled, counter = counted_compile(run_experts)
    for routing in ([4, 0, 6, 0], [0, 0, 0, 12]):  # a new routing needs no recompile or host read
        counts = torch.tensor(routing)
        torch.testing.assert_close(compiled(*weights, x, counts), run_experts(*weights, x, counts))
    assert counter.frame_count == 1


def test_megatron_recipe_puts_every_weight_gradient_in_main_grad():
    ns = _run(MEGATRON)
    experts = ns["experts"]
    reference = type(experts)(4, 16, 32, activation="swiglu")
    reference.load_state_dict(experts.state_dict())
    reference(ns["permuted_tokens"], ns["tokens_per_expert"]).sum().backward()
    for name in ("fc1", "fc2"):
        weight, want = getattr(experts, name).weight, getattr(reference, name).weight.grad
        assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape  # the cached dummy
        torch.testing.assert_close(weight.main_grad, want, rtol=1e-5, atol=1e-6)
