"""The eager path of grouped_mm: an ordinary eager call costs little more than a
dictionary lookup in Python.

A call's checks depend only on its arguments' shapes, strides, dtypes and devices and its
flags, so they run once per distinct call: the first call with a key runs the dispatcher
path's checks (same contract, same messages) and memoises a plan; later calls look the plan
up, allocate the output and hand the core plain addresses and the current raw stream
(groupgemm._core's call plans). Autograd goes through one autograd.Function whose backward
computes every wanted gradient with one core call, or, when the backward may itself be
differentiated, with the differentiable ops (derivatives.py).

Only plain eager calls take this path: anything that must see the call as an op (a
torch.compile trace, a dispatch or __torch_function__ mode, a tensor subclass, a torch.func
transform, forward-mode AD) goes through the ``torch.ops.groupgemm`` ops instead, as do
arguments the core cannot read as they are (an operand to copy or convert). Both paths call
the same core entry points with the same arguments: the same bits.
"""

import atexit
from types import SimpleNamespace

import torch
from torch.autograd import forward_ad

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.torch_ext import derivatives, device_scratch

Tensor = torch.Tensor
_PLANS: dict = {}  # call key -> _Plan, or None: calls with this key take the ops
atexit.register(_PLANS.clear)  # the core's plan objects go before the extension module does
_MAX_PLANS = 4096  # a bound on the memo; a model has a handful of keys per layer
_CORE_DTYPES = {getattr(torch, name): getattr(_core.DType, name) for name in contract.FLOAT_DTYPES}
_PLAIN = (Tensor, torch.nn.Parameter, type(None))  # tensor subclasses take the ops


def takes_eager_path(*tensors) -> bool:
    """Whether a call with these tensors (None for an absent one) is a plain eager call: no
    trace, mode, transform, subclass, or tensor whose values are not its memory (a negated
    view, torch._neg_view: the ops resolve it)."""
    if torch.compiler.is_compiling():  # first: a trace folds it and reads no further
        return False
    for t in tensors:
        if type(t) not in _PLAIN:
            return False
    if (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
            or forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()):
        return False
    for t in tensors:  # after the modes, which would see is_neg
        if t is not None and t.is_neg():
            return False
    return True


def readable_weight(weight: Tensor, transpose: bool) -> tuple[Tensor, bool]:
    """weight as a kernel reads it without a copy: itself when contiguous, or its storage
    read with the other layout when it is a transposed view of a contiguous tensor
    (torchtitan's ``w.transpose(-2, -1)``). Other layouts are copied."""
    if weight.is_contiguous() or weight.dim() != 3:
        return weight, transpose
    if weight.mT.is_contiguous():
        return weight.mT, not transpose
    return weight.contiguous(), transpose


class _Plan:
    """One checked kind of grouped_mm call: its core call plans and output."""

    __slots__ = ("forward_core", "backward_core", "device", "cuda", "out_shape", "out_dtype", "bias_dtype",
                 "num_groups", "transpose", "flip", "ends", "offset", "workspace_bytes")

    def __init__(self, input, weight, sizes, bias, offset, static_offset, transpose, out_dtype, ends):
        self.device = input.device
        self.cuda = self.device.type == "cuda"
        self.flip = not weight.is_contiguous()  # a transposed view, read in place
        self.transpose = transpose != self.flip  # how the core reads weight's storage
        self.ends = ends
        # A static offset's tensor, made from the call's int and kept for every later call (None:
        # each call passes its own); one made under inference mode is copied out of it, since a
        # later call that records a graph saves it.
        self.offset = None
        if static_offset:
            with torch.inference_mode(False):
                self.offset = offset.clone() if offset.is_inference() else offset
        self.num_groups = weight.shape[0]
        self.out_shape = (input.shape[0], weight.shape[1] if transpose else weight.shape[2])
        self.out_dtype, self.bias_dtype = out_dtype, None if bias is None else bias.dtype
        index = self.device.index if self.device.type == "cuda" else -1
        self.workspace_bytes = _core.workspace_bytes(_core.Device.cuda, self.num_groups, device_index=index) \
            if self.device.type == "cuda" else 0
        dims = (input.shape[0], input.shape[1], self.out_shape[1], self.num_groups)
        groups = (sizes.shape[0], sizes.element_size() * 8, ends,
                  0 if offset is None else offset.element_size() * 8, self.transpose, index, self.workspace_bytes)
        dtype = _CORE_DTYPES[input.dtype]
        self.forward_core = _core.MatmulPlan(*dims, dtype, _CORE_DTYPES[out_dtype], *groups)
        self.backward_core = _core.BackwardPlan(*dims, dtype, _CORE_DTYPES[weight.dtype],
                                                _CORE_DTYPES[self.bias_dtype or input.dtype], *groups)

    def _stream_and_workspace(self) -> tuple[int, Tensor | None]:
        """The current stream and the workspace tensor, which the caller holds until the core
        has enqueued its kernels: the stream-ordered allocator may then hand its memory to a
        later call, whose work the stream orders after ours, but not before (another thread
        on the stream that grows the cached buffer drops this one)."""
        if not self.cuda:
            return 0, None
        stream = device_scratch.stream(self.device)
        return stream, device_scratch.workspace(self.device, self.workspace_bytes, stream)

    def forward(self, input, weight, sizes, bias, offset) -> Tensor:
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        stream, workspace = self._stream_and_workspace()
        self.forward_core.run(input.data_ptr(), weight.data_ptr(), sizes.data_ptr(), out.data_ptr(),
                              0 if bias is None else bias.data_ptr(), 0 if offset is None else offset.data_ptr(),
                              0 if workspace is None else workspace.data_ptr(), stream)
        return out

    def backward(self, grad, input, weight, sizes, offset, needs) -> tuple:
        """(dinput, dweight, dbias), each None unless ``needs`` (needs_input_grad) asks for
        it, from one core call; dweight has weight's shape (for a transposed view, it is a
        view of a contiguous gradient in the storage's layout)."""
        dinput = dweight = dbias = None
        dinput_at = dweight_at = dbias_at = 0
        if needs[0]:
            dinput = torch.empty(input.shape, dtype=input.dtype, device=self.device)
            dinput_at = dinput.data_ptr()
        if needs[1]:
            dweight = torch.empty(weight.mT.shape if self.flip else weight.shape, dtype=weight.dtype,
                                  device=self.device)
            dweight_at = dweight.data_ptr()
        if needs[3] and self.bias_dtype is not None:
            dbias = torch.empty((self.num_groups, self.out_shape[1]), dtype=self.bias_dtype, device=self.device)
            dbias_at = dbias.data_ptr()
        stream, workspace = self._stream_and_workspace()
        self.backward_core.run(input.data_ptr(), weight.data_ptr(), grad.data_ptr(), sizes.data_ptr(),
                               0 if offset is None else offset.data_ptr(), dinput_at, dweight_at, dbias_at,
                               0 if workspace is None else workspace.data_ptr(), stream)
        return dinput, dweight.mT if self.flip and dweight is not None else dweight, dbias

    def ops_backward(self, grad, input, weight, sizes, offset, needs) -> tuple:
        """The same gradients through the ops, for a backward that is not a plain eager call
        (create_graph, a transform or mode, a batched gradient)."""
        flags = SimpleNamespace(needs_input_grad=needs, transpose_weight=self.transpose, bias_dtype=self.bias_dtype,
                                group_ends=self.ends)
        stored = weight.mT if self.flip else weight
        dinput, dweight, dbias = derivatives.grouped_mm_grads(flags, grad, input, stored, sizes, offset)
        return dinput, dweight.mT if self.flip and dweight is not None else dweight, dbias


def _key(input, weight, sizes, bias, offset, transpose, out_dtype, ends):
    return (input.shape, input.stride(), input.dtype, input.device, weight.shape, weight.stride(), weight.dtype,
            weight.device, sizes.shape, sizes.stride(), sizes.dtype, sizes.device,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
            # An int offset by type too: True and 2.0 equal 1 and 2, and are refused.
            (offset.shape, offset.dtype, offset.device) if isinstance(offset, Tensor) else (type(offset), offset),
            transpose, out_dtype, ends)


_MISSING = object()


def grouped_mm(input, weight, sizes, bias, offset, transpose, out_dtype, ends, check):
    """grouped_mm through its memoised plan, or None when the call takes the ops. On a
    key's first call ``check(input, weight, sizes, bias, offset, transpose, out_dtype,
    ends)`` runs the ops' checks (raising on bad input) and returns (group_sizes,
    group_offset, out_dtype) as the ops would get them. One function, so that a plain call
    pays for few Python frames."""
    if not takes_eager_path(input, weight, sizes, bias, offset if isinstance(offset, Tensor) else None):
        return None
    try:
        key = _key(input, weight, sizes, bias, offset, transpose, out_dtype, ends)
        plan = _PLANS.get(key, _MISSING)
    except (TypeError, AttributeError):  # an argument the ops' checks will name
        return None
    if plan is _MISSING:
        plan = _new_plan(input, weight, sizes, bias, offset, transpose, out_dtype, ends,
                         check(input, weight, sizes, bias, offset, transpose, out_dtype, ends))
        if len(_PLANS) < _MAX_PLANS:
            _PLANS[key] = plan
    if plan is None:
        return None
    if plan.offset is not None:  # made from the call's static offset, part of the key
        offset = plan.offset
    # Inference mode records no graph, even with grad mode on inside it, as torch's ops do.
    if torch._C.is_grad_enabled() and (input.requires_grad or weight.requires_grad or (
            bias is not None and bias.requires_grad)) and not torch._C.is_inference_mode_enabled():
        return _apply(input, weight, sizes, bias, offset, plan)
    return plan.forward(input, weight, sizes, bias, offset)


def _new_plan(input, weight, sizes, bias, offset, transpose, out_dtype, ends, checked):
    """The plan of a checked call, or None when the ops must run it: a call whose operands
    the checks converted, or whose layouts need a copy."""
    checked_sizes, checked_offset, checked_out_dtype = checked
    static_offset = offset is not None and not isinstance(offset, Tensor)
    offset_as_is = offset is None or static_offset or (
        offset.numel() == 1 and offset.dtype in (torch.int32, torch.int64) and offset.is_contiguous())
    if not (checked_sizes is sizes and offset_as_is and input.is_contiguous()
            and (weight.is_contiguous() or (weight.dim() == 3 and weight.mT.is_contiguous()))
            and (bias is None or bias.is_contiguous()) and input.device.type in ("cpu", "cuda")):
        return None
    offset_read = checked_offset if static_offset else offset  # the tensor the core reads
    return _Plan(input, weight, sizes, bias, offset_read, static_offset, transpose, checked_out_dtype, ends)


class _EagerGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, sizes, bias, offset, plan):
        ctx.save_for_backward(input, weight, sizes, offset)
        ctx.plan = plan
        return plan.forward(input, weight, sizes, bias, offset)

    @staticmethod
    def backward(ctx, grad):
        input, weight, sizes, offset = ctx.saved_tensors
        # A wider, stride-0 (y.sum().backward()) or strided incoming gradient.
        if grad.dtype != input.dtype:
            grad = grad.to(input.dtype)
        if not grad.is_contiguous():
            grad = grad.contiguous()
        plain = not derivatives.backward_takes_separate_ops(grad) and takes_eager_path(grad)
        run = ctx.plan.backward if plain else ctx.plan.ops_backward
        dinput, dweight, dbias = run(grad, input, weight, sizes, offset, ctx.needs_input_grad)
        return dinput, dweight, None, dbias, None, None


# The C++ apply, below Function.apply's Python wrapper: that wrapper only hands the call to
# torch.func when a transform is active, which the eager path has already ruled out.
_apply = super(torch.autograd.Function, _EagerGroupedMM).apply
