"""GroupedLinear(accumulate_into_main_grad=True): Megatron-core's main_grad contract as
TransformerEngine implements it. The weight gradient goes into main_grad; a weight carrying
grad_added_to_main_grad gets the flag set and one cached dummy .grad (filled only with
zero_out_wgrad); a weight without it gets no .grad, and nothing weight-sized is allocated
or filled. The mode compiles with torch.compile(fullgraph=True)."""

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.nn.utils import prune
from torch.utils._python_dispatch import TorchDispatchMode

from groupgemm.torch import GroupedLinear, GroupedMLP

# torch's forward AD loads its decompositions through torch.jit.script on first use.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
E, IN, OUT = 3, 8, 5  # weight [3, 5, 8]: no activation or gradient here has that shape
SIZES = torch.tensor([3, 0, 4])  # expert 1 gets no tokens


def _layer(dtype=torch.float32, bias=True, megatron=True, zero_out_wgrad=False):
    """A layer in main_grad mode, set up as Megatron-core's DDP leaves its parameters
    (main_grad, and grad_added_to_main_grad reset to False) when ``megatron``."""
    torch.manual_seed(0)
    layer = GroupedLinear(E, IN, OUT, bias=bias, dtype=dtype, accumulate_into_main_grad=True)
    layer.weight.main_grad = torch.randn(E, OUT, IN)
    if megatron:
        layer.weight.grad_added_to_main_grad = False
    if zero_out_wgrad:
        layer.weight.zero_out_wgrad = True
    return layer


def _plain_copy(layer):
    reference = GroupedLinear(E, IN, OUT, bias=layer.bias is not None, dtype=layer.weight.dtype)
    reference.load_state_dict(layer.state_dict())
    return reference


def _megatron_step(layer, x):
    """One step as Megatron-core's DDP runs it: flag reset, backward, then its hook on the
    weight's grad accumulator (modelled here after the step) adds .grad into main_grad unless
    the flag is set (or zero_out_wgrad is) and drops .grad."""
    weight = layer.weight
    weight.grad_added_to_main_grad = False
    layer(x, SIZES).float().square().sum().backward()
    if weight.grad is not None and (not weight.grad_added_to_main_grad or getattr(weight, "zero_out_wgrad", False)):
        weight.main_grad.add_(weight.grad)
    weight.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_main_grad_accumulation_follows_megatron_contract(dtype):
    layer = _layer(dtype)
    reference = _plain_copy(layer)
    before = layer.weight.main_grad.clone()
    x = torch.randn(7, IN, dtype=dtype)
    layer(x, SIZES).float().square().sum().backward()
    reference(x, SIZES).float().square().sum().backward()
    assert layer.weight.grad_added_to_main_grad is True
    assert layer.weight.grad.shape == layer.weight.shape  # the dummy: Megatron's hook still fires
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(layer.weight.main_grad - before, reference.weight.grad.float(), **tolerance)
    assert torch.equal(layer.weight.main_grad[1].view(torch.int32), before[1].view(torch.int32))
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


def test_without_megatrons_attribute_the_weight_gets_no_grad_and_no_attribute():
    layer = _layer(megatron=False)
    reference = _plain_copy(layer)
    before = layer.weight.main_grad.clone()
    x = torch.randn(7, IN)
    layer(x, SIZES).square().sum().backward()
    reference(x, SIZES).square().sum().backward()
    assert layer.weight.grad is None and not hasattr(layer.weight, "grad_added_to_main_grad")
    torch.testing.assert_close(layer.weight.main_grad - before, reference.weight.grad)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


@pytest.mark.parametrize("zero_out_wgrad", [False, True], ids=["plain", "zero_out_wgrad"])
def test_main_grad_over_megatron_steps_sums_every_steps_gradient(zero_out_wgrad):
    layer = _layer(zero_out_wgrad=zero_out_wgrad)
    reference = _plain_copy(layer)
    before = layer.weight.main_grad.clone()
    batches = [torch.randn(7, IN), torch.randn(9, IN)]
    for x in batches:
        _megatron_step(layer, x)
        reference(x, SIZES).square().sum().backward()
    torch.testing.assert_close(layer.weight.main_grad - before, reference.weight.grad)


class WeightSizedWork(TorchDispatchMode):
    """Counts allocations and fills of tensors of one shape."""

    ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "clone", "zeros",
                   "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full"}
    FILLS = {"fill_", "zero_", "zeros", "zeros_like", "new_zeros", "full", "full_like", "new_full"}

    def __init__(self, shape):
        super().__init__()
        self.shape, self.allocations, self.fills = tuple(shape), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            if name in self.ALLOCATIONS:
                self.allocations.append(name)
            if name in self.FILLS:
                self.fills.append(name)
        return out


def _backward_counting_weight_sized_work(layer, x):
    loss = layer(x, SIZES).square().sum()
    with WeightSizedWork(layer.weight.shape) as work:
        loss.backward()
    return work


def test_megatron_steps_reuse_one_dummy_and_never_fill_it():
    layer = _layer()
    pointers = []
    for step in range(3):
        layer.weight.grad_added_to_main_grad = False
        work = _backward_counting_weight_sized_work(layer, torch.randn(7, IN))
        assert work.fills == [] and work.allocations in ((["empty"], []) if step == 0 else ([],))  # cached after
        assert layer.weight.grad_added_to_main_grad is True
        pointers.append(layer.weight.grad.data_ptr())
        layer.weight.grad = None  # as Megatron's hook leaves it
    assert len(set(pointers)) == 1


def test_zero_out_wgrad_fills_the_dummy_every_step():
    layer = _layer(zero_out_wgrad=True)
    for step in range(3):
        layer.weight.grad_added_to_main_grad = False
        work = _backward_counting_weight_sized_work(layer, torch.randn(7, IN))
        assert work.fills == ["zero_"] and work.allocations in ((["empty"], []) if step == 0 else ([],))
        assert (layer.weight.grad == 0).all()
        layer.weight.grad = None


def test_without_the_attribute_backward_allocates_and_fills_nothing_weight_sized():
    layer = _layer(megatron=False)
    for _ in range(2):
        work = _backward_counting_weight_sized_work(layer, torch.randn(7, IN))
        assert work.allocations == [] and work.fills == [] and layer.weight.grad is None


def _block(megatron):
    """Two main_grad-mode GroupedLinear layers with a gelu between, sharing the routing."""
    torch.manual_seed(0)
    up = GroupedLinear(E, IN, 16, accumulate_into_main_grad=True)
    down = GroupedLinear(E, 16, IN, accumulate_into_main_grad=True)
    for p in (up.weight, down.weight):
        p.main_grad = torch.zeros(p.shape)
        if megatron:
            p.grad_added_to_main_grad = False
    block = torch.nn.ModuleDict({"up": up, "down": down})
    return block, lambda x, sizes: block["down"](torch.nn.functional.gelu(block["up"](x, sizes)), sizes)


@pytest.mark.parametrize("megatron", [True, False], ids=["megatron", "no_attribute"])
def test_compiled_block_in_main_grad_mode_matches_eager(megatron):
    torch._dynamo.reset()
    eager_block, eager = _block(megatron)
    compiled_block, forward = _block(megatron)
    compiled = torch.compile(forward, fullgraph=True)
    for tokens, sizes in ((10, [4, 0, 6]), (13, [0, 0, 13])):
        x = torch.randn(tokens, IN)
        for block, fn in ((eager_block, eager), (compiled_block, compiled)):
            for p in block.parameters():
                if megatron:
                    p.grad_added_to_main_grad = False
                p.grad = None
            fn(x, torch.tensor(sizes)).square().sum().backward()
        for name in ("up", "down"):
            got, want = compiled_block[name], eager_block[name]
            torch.testing.assert_close(got.weight.main_grad, want.weight.main_grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.bias.grad, want.bias.grad, rtol=1e-5, atol=1e-6)
            if megatron:
                assert got.weight.grad_added_to_main_grad is True and got.weight.grad.shape == got.weight.shape
            else:
                assert got.weight.grad is None and not hasattr(got.weight, "grad_added_to_main_grad")


def test_a_deep_copy_gets_its_own_hook_on_its_first_forward():
    layer = _layer()
    twin = copy.deepcopy(layer)  # a Parameter's deep copy keeps neither hooks nor attributes
    twin.weight.main_grad, twin.weight.grad_added_to_main_grad = torch.zeros(E, OUT, IN), False
    twin(torch.randn(7, IN), SIZES).sum().backward()
    assert twin.weight.grad_added_to_main_grad is True and layer.weight.grad_added_to_main_grad is False


@pytest.mark.parametrize("call", ["double", "load_state_dict"])
def test_main_grad_mode_refuses_swapping_its_weight_naming_the_mode(call):
    # The docstring's refusal, in the layer's words (torch's own: "Couldn't swap GroupedLinear.weight").
    layer = GroupedMLP(E, IN, OUT, accumulate_into_main_grad=True)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match=r"GroupedLinear\(accumulate_into_main_grad=True\): .*"
                                               "set_swap_module_params_on_conversion"):
            layer.double() if call == "double" else layer.load_state_dict(GroupedMLP(E, IN, OUT).state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


def test_main_grad_mode_without_main_grad_raises():
    layer = GroupedLinear(2, 4, 4, accumulate_into_main_grad=True)
    with pytest.raises(RuntimeError, match="weight.main_grad is not set"):
        layer(torch.randn(3, 4), [1, 2]).sum().backward()


def test_main_grad_mode_on_a_computed_weight_says_it_has_no_main_grad():
    # Pruning (or any parametrization) makes the weight a tensor computed per call: its
    # main_grad is the Parameter's, which the call never sees. Not "allocate main_grad".
    layer = GroupedLinear(2, 4, 4, accumulate_into_main_grad=True)
    prune.l1_unstructured(layer, "weight", amount=0.5)
    with pytest.raises(RuntimeError, match="the weight is computed .*use accumulate_into_main_grad=False"):
        layer(torch.randn(3, 4), [1, 2]).sum().backward()


def test_main_grad_mode_checks_main_grad_naming_the_layer():
    layer = _layer(torch.bfloat16)
    layer.weight.main_grad = torch.zeros(E, OUT, IN, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"GroupedLinear\(accumulate_into_main_grad=True\): weight.main_grad must "
                                        "be float32"):
        layer(torch.randn(7, IN, dtype=torch.bfloat16), SIZES)
    layer.weight.main_grad = torch.zeros(E, IN, OUT)  # transposed
    with pytest.raises(ValueError, match=rf"weight.main_grad must have shape \({E}, {OUT}, {IN}\)"):
        layer(torch.randn(7, IN, dtype=torch.bfloat16), SIZES)
    layer.weight.main_grad = torch.zeros(E, OUT, IN)._neg_view()  # its memory would hold the sums negated
    with pytest.raises(ValueError, match="weight.main_grad is a negative or conjugate view"):
        layer(torch.randn(7, IN, dtype=torch.bfloat16), SIZES)


def test_main_grad_mode_runs_without_main_grad_when_no_gradient_is_asked_for():
    layer = GroupedLinear(E, IN, OUT, accumulate_into_main_grad=True)
    x = torch.randn(7, IN)
    with torch.no_grad():
        out = layer(x, SIZES)
    torch.testing.assert_close(out, _plain_copy(layer)(x, SIZES))


def test_main_grad_mode_refuses_forward_mode_naming_the_layer():
    layer = _layer()
    x = torch.randn(7, IN)
    with pytest.raises(RuntimeError, match=r"accumulate_into_main_grad=True\) supports reverse mode only"):
        with fwAD.dual_level():
            layer(fwAD.make_dual(x, torch.ones_like(x)), SIZES)
    with pytest.raises(RuntimeError, match="supports reverse mode only"):
        torch.func.jvp(lambda x: layer(x, SIZES), (x,), (x,))


def test_main_grad_mode_accepts_a_non_contiguous_weight():
    torch.manual_seed(0)
    layer = GroupedLinear(2, 4, 6, bias=False, accumulate_into_main_grad=True)
    with torch.no_grad():
        layer.weight.data = layer.weight.data.transpose(1, 2).contiguous().transpose(1, 2)  # [2, 6, 4], strided
    assert not layer.weight.is_contiguous()
    layer.weight.main_grad = torch.zeros(2, 6, 4)
    x = torch.randn(5, 4, requires_grad=True)
    y = layer(x, [2, 3])
    y.sum().backward()
    want = torch.cat([x[:2] @ layer.weight[0].T, x[2:] @ layer.weight[1].T])
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(layer.weight.main_grad[0], torch.ones(6, 2) @ x[:2].detach())  # dy^T @ x


def test_torch_export_captures_the_plain_forward():
    # An exported program has no parameters carrying main_grad: it captures the forward,
    # whose values are the plain layer's (the check once said main_grad was not set).
    torch.manual_seed(0)
    layer = GroupedLinear(3, 8, 5, accumulate_into_main_grad=True)
    layer.weight.main_grad = torch.zeros(3, 5, 8)
    x, sizes = torch.randn(7, 8), torch.tensor([3, 0, 4])
    program = torch.export.export(layer, (x, sizes))
    assert torch.equal(program.module()(x, sizes), layer(x, sizes).detach())
    assert not layer.weight.main_grad.any()


def test_a_backward_asking_only_for_the_inputs_gradient_still_adds_into_main_grad_as_documented():
    # The addition is part of the layer's backward (TransformerEngine's fused accumulation
    # behaves so too); the class docstring says to run such passes with the plain layer.
    torch.manual_seed(0)
    layer, plain = GroupedLinear(3, 8, 5, accumulate_into_main_grad=True), GroupedLinear(3, 8, 5)
    plain.load_state_dict(layer.state_dict())
    layer.weight.main_grad = torch.zeros(3, 5, 8)
    x, sizes = torch.randn(7, 8, requires_grad=True), torch.tensor([3, 0, 4])
    torch.autograd.grad(layer(x, sizes).square().sum(), x)
    plain(x, sizes).square().sum().backward()
    torch.testing.assert_close(layer.weight.main_grad, plain.weight.grad)
