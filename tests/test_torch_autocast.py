"""torch.autocast and groupgemm's PyTorch GEMMs: inside a region each public GEMM function
and layer gives the bits of the same call on its floating operands cast to the autocast
dtype by hand, output and every gradient (float32 leaves and parameters get float32
gradients), as torch.mm does; float32 routing weights, integers and float64 are left
alone, the FP8 layers do not take part, torch.compile(fullgraph=True) traces it, and
outside a region nothing changes."""

import copy

import pytest
import torch
from compiles import counted_compile

import groupgemm.torch as gt
from groupgemm.torch_ext import autocast

BF16 = torch.bfloat16  # the autocast dtype of every region here
E, H, F, T, K = 3, 8, 6, 7, 2
SIZES = torch.tensor([3, 0, 4])  # expert 1 gets no tokens
M = int(SIZES.sum())
ENDS = SIZES.cumsum(0).to(torch.int32)
INDICES = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(1))
PROBS = torch.rand(T, K, generator=torch.Generator().manual_seed(2))  # float32: stays float32


def _mlp(fused):
    return gt.GroupedMLP(E, H, F, bias=True, fused=fused)


# name -> (the layer to build or None, the call on (layer, *inputs), the float32 inputs' shapes)
CASES = {
    "grouped_mm": (None, lambda _, x, w, b: gt.grouped_mm(x, w, SIZES, b), [(M, H), (E, H, F), (E, F)]),
    "grouped_mm offs, nn.Linear layout": (
        None, lambda _, x, w: gt.grouped_mm(x, w, offs=ENDS, transpose_weight=True), [(M, H), (E, F, H)]),
    "grouped_mm offs, 2-D weight": (None, lambda _, a, b: gt.grouped_mm(a, b, offs=ENDS), [(H, M), (M, F)]),
    "grouped_mm_wgrad": (None, lambda _, x, g: gt.grouped_mm_wgrad(x, g, SIZES, E), [(M, H), (M, F)]),
    "expert_mlp": (None, lambda _, x, w_in, w_out, b_in: gt.expert_mlp(x, INDICES, PROBS, w_in, w_out, b_in=b_in),
                   [(T, H), (E, H, 2 * F), (E, F, H), (E, 2 * F)]),
    "GroupedLinear": (lambda: gt.GroupedLinear(E, H, F), lambda layer, x: layer(x, SIZES), [(M, H)]),
    "GroupedMLP": (lambda: _mlp(None), lambda layer, x: layer(x, SIZES), [(M, H)]),
    "GroupedMLP.forward_routed fused": (
        lambda: _mlp(True), lambda layer, x: layer.forward_routed(x, INDICES, PROBS), [(T, H)]),
    "GroupedMLP.forward_routed composed": (
        lambda: _mlp(False), lambda layer, x: layer.forward_routed(x, INDICES, PROBS), [(T, H)]),
}


def _build(case):
    make_layer, call, shapes = CASES[case]
    torch.manual_seed(0)
    return None if make_layer is None else make_layer(), call, [torch.randn(shape) for shape in shapes]


def _run(call, layer, inputs, dout, cast=lambda t: t):
    """(output, input gradients, parameter gradients) of call on leaves copied from inputs,
    each passed through ``cast``."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = call(layer, *map(cast, leaves))
    params = [] if layer is None else list(layer.parameters())
    grads = torch.autograd.grad(out, leaves + params, dout)
    return out, grads[:len(leaves)], grads[len(leaves):]


@pytest.mark.parametrize("case", CASES)
def test_under_autocast_a_gemm_gives_the_bits_of_its_operands_cast_by_hand(case):
    layer, call, inputs = _build(case)
    dout = torch.randn(call(layer, *inputs).shape).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        got, got_dinputs, got_dparams = _run(call, layer, inputs, dout)
    by_hand = None if layer is None else copy.deepcopy(layer).to(BF16)
    want, want_dinputs, want_dparams = _run(call, by_hand, inputs, dout, cast=lambda t: t.to(BF16))
    assert got.dtype == BF16 and torch.equal(got, want)
    for got_grad, want_grad in zip(got_dinputs + got_dparams, want_dinputs + want_dparams):
        assert got_grad.dtype == torch.float32 and torch.equal(got_grad, want_grad.float())


@pytest.mark.parametrize("case", CASES)
def test_outside_autocast_nothing_is_cast(case):
    layer, call, inputs = _build(case)
    outside = call(layer, *inputs)
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        disabled = call(layer, *inputs)
    assert outside.dtype == torch.float32 and torch.equal(disabled, outside)
    assert all(a is b for a, b in zip(autocast.operands(*inputs, None), (*inputs, None)))  # the very tensors


def test_autocast_leaves_float64_and_integer_operands_alone():
    x, w = torch.randn(M, H, dtype=torch.float64), torch.randn(E, H, F, dtype=torch.float64)
    with torch.autocast("cpu", dtype=BF16):
        got = gt.grouped_mm(x, w, SIZES)
        assert all(a is b for a, b in zip(autocast.operands(x, SIZES, w), (x, SIZES, w)))
    assert torch.equal(got, gt.grouped_mm(x, w, SIZES))


def test_routing_weights_stay_float32_and_others_take_the_autocast_dtype():
    torch.manual_seed(0)
    x, w_in, w_out = torch.randn(T, H), torch.randn(E, H, 2 * F), torch.randn(E, F, H)
    for tokens, probs in ((x, PROBS), (x.half(), PROBS.half())):  # float16 probs: the core takes bfloat16 ones
        with torch.autocast("cpu", dtype=BF16):
            got = gt.expert_mlp(tokens, INDICES, probs, w_in, w_out)
        want_probs = probs if probs.dtype == torch.float32 else probs.to(BF16)
        assert torch.equal(got, gt.expert_mlp(tokens.to(BF16), INDICES, want_probs, w_in.to(BF16), w_out.to(BF16)))


def test_main_grad_accumulation_under_autocast_adds_the_autocast_gradient_in_float32():
    torch.manual_seed(0)
    layer = gt.GroupedLinear(E, H, F, accumulate_into_main_grad=True)
    plain = copy.deepcopy(layer)
    plain.accumulate_into_main_grad = False
    layer.weight.main_grad = torch.zeros(E, F, H)
    x = torch.randn(M, H)
    with torch.autocast("cpu", dtype=BF16):
        got, want = layer(x, SIZES), plain(x, SIZES)
    assert got.dtype == BF16 and torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    # main_grad[g] += dout_g^T @ x_g on the bfloat16 operands, added in float32 without a
    # rounding to bfloat16 (which plain's .grad, a cast bfloat16 gradient, went through)
    added = gt.grouped_mm_wgrad(torch.ones(M, F, dtype=BF16), x.to(BF16), SIZES, E,
                                accumulate_into=torch.zeros(E, F, H))
    assert layer.weight.grad is None and torch.equal(layer.weight.main_grad, added)
    torch.testing.assert_close(layer.weight.main_grad, plain.weight.grad, rtol=1e-2, atol=1e-2)
    assert torch.equal(layer.bias.grad, plain.bias.grad) and layer.bias.grad.dtype == torch.float32


def test_the_fp8_layer_is_left_as_it_is_under_autocast():
    torch.manual_seed(0)
    layer = gt.GroupedLinear(E, H, F, fp8="rowwise")
    x = torch.randn(M, H)
    with torch.autocast("cpu", dtype=BF16):
        got = layer(x, SIZES)
    assert got.dtype == torch.float32 and torch.equal(got, layer(x, SIZES))


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_an_fp8_layer_of_float32_weights_takes_bfloat16_activations_in_a_region(recipe):
    """Mixed precision's usual set-up: float32 parameters, bfloat16 activations from the
    region. Each operand is quantized from its own dtype; widening bfloat16 to float32 is
    exact, so the result is the float32 layer's on the widened input, rounded once to
    bfloat16 (the FP8 GEMMs accumulate in float32 and round once), and the weight gradient
    its bits."""
    torch.manual_seed(0)
    layer = gt.GroupedLinear(E, 128, 128, bias=False, fp8=recipe)
    x, dy = torch.randn(M, 128).to(BF16), torch.randn(M, 128).to(BF16)
    want_x = x.float().requires_grad_()
    want = layer(want_x, SIZES)
    want_dx, want_dw = torch.autograd.grad(want, (want_x, layer.weight), dy.float())
    got_x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        got = layer(got_x, SIZES)
    got_dx, got_dw = torch.autograd.grad(got, (got_x, layer.weight), dy)
    assert got.dtype == got_dx.dtype == BF16 and got_dw.dtype == torch.float32
    assert torch.equal(got, want.to(BF16)) and torch.equal(got_dx, want_dx.to(BF16))
    assert torch.equal(got_dw, want_dw) and not got_dw[1].any()  # expert 1 has no rows


def test_an_fp8_mlp_of_float32_weights_trains_on_bfloat16_activations_in_a_region():
    torch.manual_seed(0)
    mlp = gt.GroupedMLP(E, 128, 128, bias=True, fp8="blockwise")
    x = torch.randn(M, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        out = mlp(torch.nn.functional.linear(x, torch.eye(128)), SIZES)  # bfloat16, as a region's layer gives
    out.float().sum().backward()
    assert out.dtype == BF16 and x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 and p.grad.shape == p.shape for p in mlp.parameters())
    assert not mlp.fc1.weight.grad[1].any() and not mlp.fc2.bias.grad[1].any()  # expert 1 has no rows


@pytest.mark.parametrize("case", ["grouped_mm", "expert_mlp"])
def test_torch_compile_fullgraph_under_autocast_gives_the_eager_bits(case):
    layer, call, inputs = _build(case)
    compiled, counter = counted_compile(call)
    dout = torch.randn(call(layer, *inputs).shape).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        want, want_dinputs, _ = _run(call, layer, inputs, dout)
        got, got_dinputs, _ = _run(compiled, layer, inputs, dout)
    assert counter.frame_count == 1 and got.dtype == BF16 and torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_dinputs, want_dinputs))
