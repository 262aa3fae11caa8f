"""How groupgemm's differentiable ops are registered: with torch.library directly, each
with an autograd kernel that carries both derivative modes.

torch.library.custom_op's register_autograd covers reverse mode only: the
autograd.Function it generates has no jvp and no setup_context, so forward-mode AD
(torch.autograd.forward_ad, torch.func.jvp) returns a zero tangent without an error and
torch.func.grad refuses the op. These ops are therefore defined with the calls custom_op is
built on (define, a CompositeExplicitAutograd kernel, register_fake) and get their own
Autograd kernel. Below autograd it redispatches as custom_op's kernel does; when a
derivative may be asked for, it applies an autograd.Function with backward and jvp the
way a C++ autograd kernel records its node: straight through torch's C++ apply, on the
tensors of the transform level the dispatcher is at, so torch.func.grad, jvp, jacrev,
jacfwd and hessian treat the op like any aten op. torch.compile traces the op itself and
never sees that Function (Dynamo refuses a custom jvp only in an autograd.Function it
traces). An op without a rule for a mode raises, naming the op: no derivative is ever
silently zero.

Under vmap each op runs once per batch entry (a registered loop, no batched kernel).
"""

import inspect

import torch
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd import forward_ad

Tensor = torch.Tensor
LIBRARY = torch.library.Library("groupgemm", "FRAGMENT")


def _derivative_may_be_asked(args) -> bool:
    """Inputs that require grad (grad mode on), a forward-AD dual level or a torch.func
    transform: the cases where the autograd.Function must run."""
    if torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0:
        return True
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


class Op:
    """The op ``torch.ops.groupgemm.<name>``, defined from ``kernel`` (its annotations give
    the schema, its defaults the schema's defaults) and called like it."""

    def __init__(self, name: str, kernel):
        self.qualname = f"groupgemm::{name}"
        LIBRARY.define(name + torch.library.infer_schema(kernel, mutates_args=()),
                       tags=(torch.Tag.pt2_compliant_tag,))
        LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        self.overload = getattr(torch.ops.groupgemm, name).default
        # The dispatcher drops trailing arguments equal to their defaults before calling a
        # Python kernel; the rules see every argument.
        self._defaults = tuple(a.default_value for a in self.overload._schema.arguments)
        self._setup_context = self._backward = self._jvp = None
        self._function = _derivatives_function(self)
        LIBRARY.impl(name, self._autograd_kernel, "Autograd", with_keyset=True)
        torch.library.register_vmap(self.qualname, self._vmap_by_loop, lib=LIBRARY)

    def __call__(self, *args, **kwargs):
        # When no derivative can be asked (a call under no_grad, and each call a backward
        # makes), go below autograd here, as the autograd kernel would: that saves its
        # Python round trip (36 -> 31 µs for an eager call on a CPU). torch.compile traces
        # the op itself; a __torch_function__ mode or argument sees the call as it was made
        # (it may turn grad mode on, or hand over tensors that require grad).
        if (torch.compiler.is_compiling() or kwargs or torch._C._has_torch_function(args)
                or _derivative_may_be_asked(args)):
            return self.overload(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return self.overload(*args)

    def register_derivatives(self, backward, *, setup_context, jvp):
        """``setup_context(ctx, inputs, output)`` saves what ``backward(ctx, *grads)`` (one
        gradient per input) and ``jvp(ctx, *tangents)`` (one tangent per output) need, as
        for torch.autograd.Function; call the ops themselves in both."""
        self._setup_context, self._backward, self._jvp = setup_context, backward, jvp

    def _all_arguments(self, args) -> tuple:
        return (*args, *self._defaults[len(args):])

    def _autograd_kernel(self, keyset, *args):
        args = self._all_arguments(args)
        if _derivative_may_be_asked(args):
            # Function.apply would hand the call back to functorch (custom_function_call),
            # which has already dispatched it to this level: apply it here, at this level
            # only, as functorch applies the Functions it generates itself.
            with enable_single_level_autograd_function():
                return super(torch.autograd.Function, self._function).apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return self.overload.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    def _vmap_by_loop(self, info, in_dims, *args):
        args = self._all_arguments(args)
        in_dims = [self._entry_dim(d) for d in (*in_dims, *(None,) * (len(args) - len(in_dims)))]
        if info.batch_size == 0:
            return self._empty_batch(args, in_dims)
        results = [self.overload(*(a if d is None else a.select(d, i).contiguous() for a, d in zip(args, in_dims)))
                   for i in range(info.batch_size)]
        if isinstance(results[0], tuple):
            return tuple(torch.stack(r) for r in zip(*results)), (0,) * len(results[0])
        return torch.stack(results), 0

    def _empty_batch(self, args, in_dims):
        """vmap over no entries: empty results of an entry's shapes (the fake kernel's), made
        from the floating-point inputs, so that a derivative through them is zeros, as
        through torch's own ops."""
        entry = self.overload(*(a.new_empty(a.shape[:d] + a.shape[d + 1:], device="meta") if d is not None
                                else a.to("meta") if isinstance(a, Tensor) else a for a, d in zip(args, in_dims)))
        inputs = [a for a in args if isinstance(a, Tensor) and a.is_floating_point()]
        device = next(a.device for a in args if isinstance(a, Tensor))

        def empty(r):
            if not (r.is_floating_point() and inputs):
                return torch.empty((0, *r.shape), dtype=r.dtype, device=device)
            return sum(a.flatten()[:0].to(r.dtype).reshape(0, *r.shape) for a in inputs)

        if isinstance(entry, tuple):
            return tuple(empty(r) for r in entry), (0,) * len(entry)
        return empty(entry), 0

    def _entry_dim(self, in_dim):
        """An argument's batch dimension: an int or None for a tensor or a scalar; a list
        argument's comes as a list of its entries' (a list of flags: all None)."""
        if in_dim is None or isinstance(in_dim, int):
            return in_dim
        if all(d is None for d in in_dim):
            return None
        raise NotImplementedError(f"{self.qualname}: vmap over the entries of a list argument")


def _derivatives_function(op: Op):
    def forward(*args):
        # apply turns gradient recording off, both modes; below this level (an outer
        # torch.func transform) the op must still be recorded, as functorch's own Functions
        # do it.
        with torch.enable_grad(), forward_ad._set_fwd_grad_enabled(True), torch._C._AutoDispatchBelowAutograd():
            return op.overload(*args)

    def setup_context(ctx, inputs, output):
        if op._setup_context is not None:
            op._setup_context(ctx, inputs, output)

    def backward(ctx, *grads):
        if op._backward is None:
            raise RuntimeError(f"{op.qualname} has no derivative: it computes a gradient itself, so a second-order "
                               "gradient (backward with create_graph=True, torch.func.hessian) of an expert op is "
                               "not supported in PyTorch (JAX has every order)")
        return op._backward(ctx, *grads)

    def jvp(ctx, *tangents):
        if op._jvp is None:
            raise RuntimeError(f"{op.qualname} has no forward-mode derivative (jvp): it computes a gradient itself, so "
                               "forward-over-reverse (torch.func.hessian, jvp of a gradient) is not supported in "
                               "PyTorch (JAX has every order)")
        return op._jvp(ctx, *tangents)

    name = "".join(part.title() for part in op.qualname.split("::")[1].split("_")) + "Derivatives"
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp)})


def allocator(device: torch.device):
    """``empty(shape, dtype)`` on ``device``: how an op's kernel allocates its outputs."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


def register_outputs(name: str, outputs) -> None:
    """Registers the fake kernel of ``groupgemm::<name>`` (what torch.compile, meta and fake
    tensors run) as ``outputs``, the function its kernel checks its arguments and allocates
    its outputs with: its parameters are some of the op's arguments, by name, and
    ``empty(shape, dtype)``, which allocates like the first tensor argument. So the op's
    signature and output shapes are written once."""
    schema = getattr(torch.ops.groupgemm, name).default._schema
    names = [a.name for a in schema.arguments]
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    parameters = inspect.signature(outputs).parameters
    wanted = [p for p in parameters if p != "empty"]
    takes_empty = "empty" in parameters

    def fake(*args, **kwargs):
        given = {**defaults, **dict(zip(names, args)), **kwargs}
        like = next(given[n] for n in names if isinstance(given[n], Tensor))
        empty = {"empty": lambda shape, dtype: like.new_empty(shape, dtype=dtype)} if takes_empty else {}
        return outputs(**{p: given[p] for p in wanted}, **empty)

    torch.library.register_fake(f"groupgemm::{name}", fake, lib=LIBRARY)


def define(name: str, outputs):
    """Decorator: ``@define("grouped_mm", outputs)`` over the kernel defines
    ``torch.ops.groupgemm.grouped_mm``, with ``outputs`` (see register_outputs) as its fake kernel."""

    def op(kernel):
        defined = Op(name, kernel)
        register_outputs(name, outputs)
        return defined

    return op
