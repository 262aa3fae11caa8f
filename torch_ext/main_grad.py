"""GroupedLinear(accumulate_into_main_grad=True): Megatron-core's main_grad contract, as
TransformerEngine implements it (``get_dummy_wgrads_for_params``).

The weight gradient is added into the float32 ``weight.main_grad`` during backward, never
into ``.grad``. Megatron-core's DDP gives each parameter a ``grad_added_to_main_grad``
attribute (reset to False every step) and a hook on its gradient accumulator, which must
still fire, and which adds ``.grad`` into main_grad unless that flag is True or the
parameter has ``zero_out_wgrad`` set. So:

- a weight that carries the attribute gets it set to True, and its ``.grad`` receives one
  cached dummy tensor per (shape, dtype, device): uninitialised, or zero-filled (every
  time) when the weight has ``zero_out_wgrad`` set;
- a weight without it gets no gradient: ``.grad`` stays None and nothing weight-sized is
  allocated or filled (groupgemm does not create the attribute).

The flag and the cache are Python state, which a backward traced by
``torch.compile(fullgraph=True)`` cannot touch: Dynamo refuses to set an attribute of a
parameter inside a backward. So the traced backward only accumulates into main_grad (an op
that mutates it) and returns a placeholder, a zero scalar expanded to the weight's shape; a
hook on the weight, which autograd runs eagerly after the compiled backward and before
accumulating into ``.grad``, sets the flag and puts the cached dummy in the placeholder's
place. The hook is attached when the layer is built and again by any eager forward that
finds it missing (a deep copy of the Parameter drops it); a compiled forward cannot attach
it, and without it ``.grad`` gets zeros, never garbage.
"""

import weakref

import torch
from torch.autograd import forward_ad
from torch.utils.weak import WeakIdKeyDictionary

from groupgemm import _contract as contract
from groupgemm.torch_ext import core_args, derivatives, gemm_ops
from groupgemm.torch_ext.arguments import dtype_name, shape_and_dtype, written_in_place

Tensor = torch.Tensor
FN = "GroupedLinear(accumulate_into_main_grad=True)"
_DUMMY_WGRADS: dict = {}  # (shape, dtype, device) -> the one dummy weight gradient
_HOOKED = WeakIdKeyDictionary()  # weight -> its hook's handle


def dummy_wgrad(weight: Tensor) -> Tensor:
    """The cached dummy gradient of weight's shape, dtype and device; zero-filled now when
    the weight has ``zero_out_wgrad`` set. A fresh alias, so autograd takes it as ``.grad``
    without copying."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    dummy = _DUMMY_WGRADS.get(key)
    if dummy is None:
        dummy = _DUMMY_WGRADS[key] = torch.empty(key[0], dtype=weight.dtype, device=weight.device)
    if getattr(weight, "zero_out_wgrad", False):
        dummy.zero_()
    return dummy.detach()


def attach(weight: Tensor) -> None:
    """Registers (once) the hook that completes the contract when the backward hands
    ``weight`` its placeholder gradient."""
    if weight in _HOOKED:
        return
    weight_ref = weakref.ref(weight)

    def on_weight_gradient(grad):
        weight = weight_ref()
        if weight is None or not hasattr(weight, "grad_added_to_main_grad"):
            return None
        weight.grad_added_to_main_grad = True
        return dummy_wgrad(weight)

    _HOOKED[weight] = weight.register_hook(on_weight_gradient)


def needs_main_grad(weight: Tensor) -> bool:
    """Whether this call's weight gradient goes to main_grad: a backward may come, and the
    call is not being exported (torch.export captures the forward, whose values are the
    plain layer's; an exported program has no parameters carrying main_grad). Forward-mode
    AD and torch.func transforms are refused (this mode has side effects by design; the plain
    layer supports them)."""
    if getattr(torch.compiler, "is_exporting", bool)():  # where torch has it (not 2.6): export checks main_grad
        return False
    if not torch.compiler.is_compiling() and (
            torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0):
        raise RuntimeError(f"{FN} supports reverse mode only; forward-mode AD and torch.func transforms "
                           "need accumulate_into_main_grad=False")
    return torch.is_grad_enabled() and weight.requires_grad


def checked_main_grad(weight: Tensor) -> Tensor:
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None and not isinstance(weight, torch.nn.Parameter):  # a parametrization's, made per call
        raise RuntimeError(f"{FN}: the weight is computed ({type(weight).__name__}, not a Parameter: a "
                           "parametrization or pruning), so it holds no main_grad; use "
                           "accumulate_into_main_grad=False")
    if main_grad is None:
        raise RuntimeError(f"{FN}: weight.main_grad is not set; allocate a float32 tensor of the weight's shape first")
    shape, dtype = shape_and_dtype(main_grad, "weight.main_grad", FN)
    contract.accumulator(FN, shape, dtype, tuple(weight.shape), dtype_name(weight.dtype), None, "out_dtype",
                         contiguous=main_grad.is_contiguous(), requires_grad=main_grad.requires_grad,
                         name="weight.main_grad")
    written_in_place(main_grad, "weight.main_grad", FN)
    return main_grad


class _MainGradGroupedMM(torch.autograd.Function):
    """grouped_mm of a ``[G, N, K]`` weight whose weight gradient is added into main_grad."""

    @staticmethod
    def forward(input, weight, group_sizes, bias, main_grad, returns_placeholder):
        return gemm_ops.grouped_mm_op(input, weight.contiguous(), group_sizes, bias, None, True, input.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, group_sizes, bias, main_grad, returns_placeholder = inputs
        ctx.save_for_backward(input, weight, group_sizes)
        # An attribute, not saved for backward: other microbatches' backwards add into it
        # between this forward and this backward.
        ctx.main_grad = main_grad
        ctx.returns_placeholder = returns_placeholder
        ctx.transpose_weight, ctx.group_ends = True, False
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad):
        input, weight, group_sizes = ctx.saved_tensors
        grad = core_args.incoming_grad(grad, input.dtype)
        # weight is [G, N, K]: main_grad[g] += grad_g^T @ input_g, beside dinput and dbias.
        dinput, _, dbias = derivatives.grouped_mm_grads(ctx, grad, input, weight.contiguous(), group_sizes, None,
                                                        accumulate_into=ctx.main_grad)
        placeholder = weight.new_zeros(()).expand(weight.shape) if ctx.returns_placeholder else None
        return dinput, placeholder, None, dbias, None, None


def grouped_linear(input: Tensor, weight: Tensor, group_sizes: Tensor, bias: Tensor | None, *,
                   operand: Tensor) -> Tensor:
    """GroupedLinear's product with the weight gradient going to ``weight.main_grad``
    (arguments checked, group_sizes as the core reads it). ``operand`` is the weight as the
    GEMM reads it: the parameter itself, or autocast's cast of it, through which the
    placeholder gradient reaches the parameter."""
    returns_placeholder = hasattr(weight, "grad_added_to_main_grad")
    if returns_placeholder and not torch.compiler.is_compiling():
        attach(weight)
    return _MainGradGroupedMM.apply(input.contiguous(), operand, group_sizes,
                                    None if bias is None else bias.contiguous(), checked_main_grad(weight),
                                    returns_placeholder)
