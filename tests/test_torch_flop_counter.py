"""torch.utils.flop_counter counts groupgemm's GEMMs: a forward+backward under FlopCounterMode
counts what the same layer written with dense torch.mm over the same rows counts (every row
routed), for each set of gradients asked, and FP8 layers count their GEMMs as the
unquantized ones do."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import groupgemm.torch as gt

E, H, F, T, K = 3, 16, 8, 10, 2
SIZES = torch.tensor([4, 0, 6])  # expert 1 gets no rows
M = int(SIZES.sum())
INDICES = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(0))


def _flops(fn) -> int:
    """The FLOPs of fn() and, where its output requires grad, of its backward."""
    with FlopCounterMode(display=False) as counter:
        out = fn()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
    return counter.get_total_flops()


def _tensors(shapes, grads):
    return [torch.randn(shape, requires_grad=grad) for shape, grad in zip(shapes, grads)]


def _dense_mlp(x, w_in, w_out):
    """SwiGLU over the rows of x, each through expert 0's weights ([E, 2F, H], [E, H, F])."""
    gate, up = (x @ w_in[0].T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w_out[0].T


def _slots(x):
    return x.repeat_interleave(K, dim=0)  # every slot's token row


@pytest.mark.parametrize("grads", [(False, False), (True, False), (False, True), (True, True)])
def test_grouped_mm_counts_the_dense_product_of_its_rows(grads):
    x, w = _tensors([(M, H), (E, H, F)], grads)
    assert _flops(lambda: gt.grouped_mm(x, w, SIZES)) == _flops(lambda: x @ w[0]) > 0


def test_grouped_mm_wgrad_and_its_accumulating_form_count_the_weight_gradient():
    x, g = torch.randn(M, H), torch.randn(M, F)
    dense = _flops(lambda: x.T @ g)
    assert _flops(lambda: gt.grouped_mm_wgrad(x, g, SIZES, E)) == dense > 0
    into = torch.zeros(E, H, F)
    assert _flops(lambda: gt.grouped_mm_wgrad(x, g, SIZES, E, accumulate_into=into)) == dense


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, False)])
def test_the_expert_layer_counts_what_the_dense_layer_over_its_slots_counts(fused, grads):
    """grads: (tokens and routing weights, the weights)."""
    mlp = gt.GroupedMLP(E, H, F, fused=fused).requires_grad_(grads[1])
    x, probs = _tensors([(T, H), (T, K)], [grads[0]] * 2)
    w_in, w_out = (p.detach().requires_grad_(grads[1]) for p in mlp.parameters())
    assert _flops(lambda: mlp.forward_routed(x, INDICES, probs)) == \
        _flops(lambda: _dense_mlp(_slots(x), w_in, w_out)) > 0


def test_the_fused_backward_takes_the_routing_weights_gradient_from_fc2s_input_gradient():
    """With only the routing weights to differentiate, the fused op multiplies dout by fc2's
    weight (it keeps no expert output to take the products from)."""
    w_in, w_out = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    x, probs = torch.randn(T, H), torch.randn(T, K, requires_grad=True)
    forward = _flops(lambda: _dense_mlp(_slots(x), w_in, w_out))
    assert _flops(lambda: gt.expert_mlp(x, INDICES, probs, w_in, w_out, transpose_weight=True)) == \
        forward + 2 * T * K * F * H


def test_fp8_layers_count_the_gemms_of_the_unquantized_layer():
    x = torch.randn(M, H, dtype=torch.bfloat16, requires_grad=True)
    counts = [_flops(lambda: gt.GroupedLinear(E, H, F, bias=False, dtype=torch.bfloat16, fp8=fp8)(x, SIZES))
              for fp8 in (None, "rowwise")]
    assert counts[0] == counts[1] > 0
