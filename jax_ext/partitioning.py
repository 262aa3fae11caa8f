"""How each FFI call partitions itself under ``jax.jit`` with sharded operands.

An FFI call (ffi_calls.py, expert_ffi_calls.py) is a function of its array operands and
static arguments that returns a tuple of results through ``jax.ffi.ffi_call``. Decorated
with ``@partitioned(layout)`` it becomes a ``PartitionedCall``, which the op's one JAX
primitive (primitives.py's ``define``) lowers to an XLA custom-partitioned call
(``jax.experimental.custom_partitioning``): under jit each device runs the function on its
own shard, and XLA gathers only what the layout cannot keep sharded. Inside shard_map and
on one device the call is the function itself. Under vmap the batch axis is one more
factor (each device maps over its entries), and on a mesh with explicit axes the results'
types carry the shardings the call leaves.

A ``Layout`` says it declaratively, with one factor name per dimension of each operand
and result (Shardy's einsum-like sharding rules: ``"m k"`` for ``lhs [M, K]``, ``""`` for a
scalar). A factor sharded over some mesh axes means, on each device:

- by default (passthrough), the device's slice of that dimension, in operands and
  results alike (N of a GEMM, the tokens of the router);
- ``rows``: the ragged row dimension. The device runs on its block of rows, with group
  sizes computed on the device from the replicated global ones (``local_group_sizes``);
- ``groups``: the expert dimension. The device holds experts ``[d * G_local, ...)`` of the
  window and calls with ``group_offset + d * G_local``, so other devices' rows are padding;
- ``summed``: the device's results are partial sums over the factor (K of a GEMM, the
  experts of a forward, the rows of a weight gradient): one ``psum`` over its axes gives
  each result that lacks the factor (a reduce-scatter where XLA wants that result sharded
  over those axes); the ``added`` operands (bias, accumulator) take part on one device of
  those axes, zeros elsewhere. A 16-bit result summed over a factor other than ``groups``
  is asked in float32 where its call takes its dtype as a static argument (``dtypes``),
  summed so and rounded once: the unsharded call rounds its float32 sum once, where
  rounding each device's part first would lose the bits of parts that cancel. Over the
  grouped GEMMs' experts each row is one device's and the others add exact zeros, so
  those sums stay 16-bit (a layout whose sums over its groups are real ones, the fused
  expert MLP's, declares no ``dtypes``);
- ``replicated``: it cannot be sharded (the group sizes, a sort over all tokens): XLA
  gathers it before the call.
``local_sizes`` names static arguments that are a factor's size (``num_groups``): each
device's call gets its shard's. Where operands shard a factor differently the first one
wins (the experts factor is resolved first, so weights stay put); a mesh axis serves one
factor at most. Under Shardy the layout is the sharding rule propagation reads; under
GSPMD (the default before jax 0.7) the same resolution answers GSPMD's callbacks.

A new FFI call is its function with ``@partitioned(Layout(...))`` above it; a layout that
depends on the static arguments is a function of them and ``num_operands`` (optional
trailing operands, such as a bias, are left out of the call and of the strings).
"""

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

BATCH = "vmapped"  # the factor of a vmapped axis


@dataclasses.dataclass(frozen=True)
class Layout:
    operands: tuple  # factor names of each operand's dimensions, "m k"
    results: tuple  # and of each result's
    rows: str = None  # the ragged row factor
    groups: str = None  # the expert factor
    summed: tuple = ()  # factors the results are partial sums over
    replicated: tuple = ()  # factors that cannot be sharded
    added: tuple = ()  # operand indices added into summed results (bias, accumulator)
    sizes: int = None  # operand index of group_sizes (rows needs it)
    offset: int = None  # operand index of group_offset (groups needs it)
    local_sizes: tuple = ()  # (static argument, factor) pairs
    dtypes: tuple = ()  # (result index, static argument that sets its dtype) pairs

    def truncated(self, num_operands):
        """The layout of a call given its first ``num_operands`` operands."""
        return dataclasses.replace(self, operands=self.operands[:num_operands],
                                   added=tuple(i for i in self.added if i < num_operands))

    def batched(self, batched):
        """The layout with a leading batch factor on the ``batched`` operands and every result."""
        if not any(batched):
            return self
        return dataclasses.replace(
            self, operands=tuple(f"{BATCH} {d}" if b else d for d, b in zip(self.operands, batched)),
            results=tuple(f"{BATCH} {d}" for d in self.results))

    def factors(self):
        """Every factor, in order of first appearance."""
        seen = {}
        for dims in self.operands + self.results:
            for f in dims.split():
                seen.setdefault(f, None)
        return tuple(seen)

    def sharding_rule(self):
        """Shardy's rule: reduction factors are the summed ones no result has."""
        in_results = {f for dims in self.results for f in dims.split()}
        order = self.factors()
        special = dict(
            reduction_factors=tuple(f for f in order if f in self.summed and f not in in_results),
            need_replication_factors=tuple(f for f in order if f in self.replicated))
        rule = ", ".join(self.operands) + " -> " + ", ".join(self.results)
        return rule, {k: v for k, v in special.items() if v}


def group_ends(group_sizes, num_rows):
    """``min(cumsum(max(sizes, 0)), num_rows)``, saturating instead of overflowing: the
    schedule's clamped group ends (core_cuda/include/groupgemm/schedule.h). The sizes are
    int32/int64, as the core reads them (arguments.index_array), so num_rows fits."""
    sizes = jnp.clip(group_sizes, 0, num_rows)
    return jax.lax.associative_scan(lambda a, b: b + jnp.minimum(a, num_rows - b), sizes)


def local_group_sizes(group_sizes, first_row, num_local_rows, num_rows):
    """Group sizes of rows ``[first_row, first_row + num_local_rows)`` of a call over
    ``num_rows`` rows: each group's rows clipped to the block, computed on the device."""
    ends = group_ends(group_sizes, num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    first = jnp.asarray(first_row, ends.dtype)
    last = first + num_local_rows
    return jnp.clip(ends, first, last) - jnp.clip(starts, first, last)


# ---- factor resolution ----------------------------------------------------------------


def _entry_axes(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _named_spec(sharding, ndim):
    """A NamedSharding's spec, one entry per dimension; None for any other sharding."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _resolve(layout, specs, mesh):
    """factor -> mesh axes, from the shardings the operands (then results) arrive with."""
    order = layout.factors()
    if layout.groups in order:  # experts keep their axes first: gathering weights costs most
        order = (layout.groups,) + tuple(f for f in order if f != layout.groups)
    tensors = list(zip(layout.operands + layout.results, specs))
    axes, used = {}, set()
    for factor in order:
        if factor in layout.replicated:
            continue
        for dims, spec in tensors:
            if spec is None or factor not in dims.split():
                continue
            wanted = _entry_axes(spec[dims.split().index(factor)])
            free = []
            for axis in wanted:  # the longest prefix of axes no other factor holds
                if axis in used:
                    break
                free.append(axis)
            free = [a for a in free if mesh.shape[a] > 1]
            if free:
                axes[factor] = tuple(free)
                used.update(free)
                break
    return axes


def _spec(dims, axes):
    entries = []
    for f in dims.split():
        a = axes.get(f, ())
        entries.append(None if not a else a[0] if len(a) == 1 else a)
    return P(*entries)


def _shards(mesh, axes):
    return math.prod(mesh.shape[a] for a in axes)


def _index(axes):
    return jax.lax.axis_index(axes[0] if len(axes) == 1 else axes)


def _summed_axes(layout, axes, dims):
    """The mesh axes a result of factors ``dims`` is summed over."""
    return tuple(a for f in layout.summed if f in axes and f not in dims.split() for a in axes[f])


def _scatters(whole, layout, axes, result_specs, mesh, sizes):
    """Per result, (dimension, axes) to reduce-scatter it along, or None: where XLA wants a
    summed result sharded over summed axes along an unsharded dimension (tokens gathered to
    meet experts on their axis: the all-gather dispatch's reduce-scatter) the sum scatters,
    if those axes' shards divide the dimension evenly (else it is summed whole, as _plan
    gathers such a dimension)."""
    scatters = []
    for whole_dims, dims, spec in zip(whole.results, layout.results, result_specs):
        over, lead, choice = _summed_axes(layout, axes, dims), len(whole_dims.split()) - len(dims.split()), None
        for j, factor in enumerate(dims.split()):
            wanted = _entry_axes(spec[lead + j]) if spec is not None else ()
            if wanted and factor not in axes and set(wanted) <= set(over) and \
                    sizes[factor] % _shards(mesh, wanted) == 0:
                choice = (j, wanted)
                break
        scatters.append(choice)
    return scatters


def _result_spec(dims, axes, scatter, lead):
    spec = list(_spec(dims, axes))
    if scatter is not None:
        j, wanted = scatter
        spec[lead + j] = wanted[0] if len(wanted) == 1 else wanted
    return P(*spec)


def _widened(layout, axes, result_dtypes):
    """The results a device computes and sums in float32, by index: 16-bit floats summed
    over a factor other than the groups, where their call takes their dtype."""
    not_groups = dataclasses.replace(layout, summed=tuple(f for f in layout.summed if f != layout.groups))
    return {i: name for i, name in layout.dtypes
            if jnp.issubdtype(result_dtypes[i], jnp.floating) and jnp.dtype(result_dtypes[i]).itemsize < 4
            and _summed_axes(not_groups, axes, layout.results[i])}


def _local_call(fn, layout, static, mesh, axes, sizes, scatters, result_dtypes):
    """The per-device function: local group sizes / offset, the call, the psums (or
    reduce-scatters)."""
    summed = [f for f in layout.summed if f in axes]
    widened = _widened(layout, axes, result_dtypes)

    def call(*operands):
        operands = list(operands)
        kwargs = dict(static)
        if layout.rows in axes:
            rows = axes[layout.rows]
            local = sizes[layout.rows] // _shards(mesh, rows)
            operands[layout.sizes] = local_group_sizes(operands[layout.sizes], _index(rows) * local, local,
                                                       sizes[layout.rows])
        if layout.groups in axes:
            groups = axes[layout.groups]
            local = sizes[layout.groups] // _shards(mesh, groups)
            offset = operands[layout.offset]
            operands[layout.offset] = offset + (_index(groups) * local).astype(offset.dtype)
        for name, factor in layout.local_sizes:
            if factor in axes:
                kwargs[name] = kwargs[name] // _shards(mesh, axes[factor])
        for name in widened.values():
            kwargs[name] = np.dtype(np.float32)
        for i in layout.added:  # counted once across the summed factors it lacks
            lacking = [a for f in summed if f not in layout.operands[i].split() for a in axes[f]]
            if lacking:
                operands[i] = jnp.where(_index(tuple(lacking)) == 0, operands[i], jnp.zeros_like(operands[i]))
        results = fn(*operands, **kwargs)
        out = []
        for i, (dims, r, scatter) in enumerate(zip(layout.results, results, scatters)):
            over = _summed_axes(layout, axes, dims)
            if scatter is not None:
                r = jax.lax.psum_scatter(r, scatter[1], scatter_dimension=scatter[0], tiled=True)
                over = tuple(a for a in over if a not in scatter[1])
            r = jax.lax.psum(r, over) if over else r
            out.append(r.astype(result_dtypes[i]) if i in widened else r)
        return tuple(out)

    return call


def _mapped(call, batched):
    """``call`` once per entry of the leading axis of the ``batched`` operands."""
    if not any(batched):
        return call

    def mapped(*operands):
        def one(entries):
            entries = iter(entries)
            return call(*(next(entries) if b else x for x, b in zip(operands, batched)))

        return map_leading(one, [x for x, b in zip(operands, batched) if b])

    return mapped


def map_leading(fn, xs):
    """jax.lax.map(fn, xs). On a mesh with explicit axes lax.map needs its axis unsharded:
    the operands are typed so first, and the results get the axis's sharding back (a
    custom-partitioned call never runs this body on a sharded axis: its shards are local)."""
    lead = None
    specs = [_explicit_spec(getattr(x, "aval", x)) for x in xs]
    for i, (x, spec) in enumerate(zip(xs, specs)):
        if spec is not None and spec[0] is not None:
            mesh = x.aval.sharding.mesh
            lead = lead or (mesh, spec[0])
            xs = [*xs[:i], jax.sharding.reshard(x, NamedSharding(mesh, P(None, *spec[1:])))] + list(xs[i + 1:])
    results = jax.lax.map(fn, xs)
    if lead is None:
        return results
    mesh, axis = lead

    def sharded(r):
        spec = _explicit_spec(r.aval) or (None,) * r.ndim
        return jax.sharding.reshard(r, NamedSharding(mesh, P(axis, *spec[1:])))

    return jax.tree_util.tree_map(sharded, results)


def _factor_sizes(layout, shapes):
    sizes = {}
    for dims, shape in zip(layout.operands + layout.results, shapes):
        sizes.update(zip(dims.split(), shape))
    return sizes


def _plan(layout, mesh, arg_shapes, result_shapes):
    """(factor axes, factor sizes) for these shardings, or None when they are not
    NamedShardings of one mesh (then the call runs unpartitioned, on gathered operands)."""
    shapes = list(arg_shapes) + list(result_shapes)
    specs = [_named_spec(getattr(s, "sharding", None), len(s.shape)) for s in shapes]
    if mesh is None or mesh.empty or any(s is None for s in specs[:len(arg_shapes)]):
        return None
    sizes = _factor_sizes(layout, [s.shape for s in shapes])
    axes = _resolve(layout, specs, mesh)
    # A dimension its shards do not divide evenly (XLA would pad one) is gathered instead.
    return {f: a for f, a in axes.items() if sizes[f] % _shards(mesh, a) == 0}, sizes


def _replicated(mesh, n):
    return tuple(NamedSharding(mesh, P()) for _ in range(n))


@functools.cache
def _custom_partitioned(fn, layout, static, batched):
    """The custom-partitioned call of ``fn`` (its operands ``batched`` along a leading axis)."""
    static = dict(static)
    whole = layout.batched(batched)
    unpartitioned = _mapped(functools.partial(fn, **static), batched)

    def partition(mesh, arg_shapes, result_shape):
        results = tuple(result_shape)
        plan = _plan(whole, mesh, arg_shapes, results)
        if plan is None:
            return mesh, unpartitioned, _replicated(mesh, len(results)), _replicated(mesh, len(arg_shapes))
        axes, sizes = plan
        result_specs = [_named_spec(getattr(r, "sharding", None), len(r.shape)) for r in results]
        scatters = _scatters(whole, layout, axes, result_specs, mesh, sizes)
        lead = int(any(batched))
        arg_shardings = tuple(NamedSharding(mesh, _spec(d, axes)) for d in whole.operands)
        result_shardings = tuple(NamedSharding(mesh, _result_spec(d, axes, sc, lead))
                                 for d, sc in zip(whole.results, scatters))
        local = _local_call(fn, layout, static, mesh, axes, sizes, scatters, [r.dtype for r in results])
        return mesh, _mapped(local, batched), result_shardings, arg_shardings

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        results = tuple(result_shape)
        plan = _plan(whole, mesh, arg_shapes, [])
        if plan is None:
            return _replicated(mesh, len(results))
        return tuple(NamedSharding(mesh, _spec(d, plan[0])) for d in whole.results)

    def call(*operands):
        return tuple(unpartitioned(*operands))

    wrapped = custom_partitioning(call)
    rule, special = whole.sharding_rule()
    if not _SPECIAL_FACTORS:  # jax before 0.7 reads rules without special factors (and uses GSPMD)
        special = {}
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                          propagate_user_sharding=None, sharding_rule=rule, **special)
    return wrapped


_SPECIAL_FACTORS = "reduction_factors" in inspect.signature(custom_partitioning.def_partition).parameters


def lowers_to_partitioned_calls(primitive):
    """Makes ``primitive``, whose lowering makes partitioned calls, run compiled in eager
    mode too (as jax.lax's primitives do: sharded arrays are partitioned there as well),
    and has jit lower it knowing the devices, which custom partitioning needs."""
    from jax._src import dispatch  # jax's own primitives and custom_partitioning use these

    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    dispatch.prim_requires_devices_during_lowering.add(primitive)


_EXPLICIT = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)


def _explicit_mesh(mesh):
    return _EXPLICIT is not None and mesh is not None and _EXPLICIT in getattr(mesh, "axis_types", ())


def explicit_types(aval=None):
    """Whether ``aval`` (else the mesh in context) has explicit axes: types carry shardings."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        mesh = jax.sharding.get_abstract_mesh() if hasattr(jax.sharding, "get_abstract_mesh") else None
    return _explicit_mesh(mesh)


def typed_like(x, aval):
    """``x`` with ``aval``'s sharding as its type, on a mesh with explicit axes (the
    cotangent of an operand, a tangent summed into a result, must be typed like it)."""
    want = getattr(aval, "sharding", None)
    if not _explicit_mesh(getattr(want, "mesh", None)) or getattr(x, "aval", x).sharding == want:
        return x
    return jax.sharding.reshard(x, want)


def reshaped(x, shape):
    """``x.reshape(shape)`` for a reshape that merges or splits the leading (token)
    dimension: on a mesh with explicit axes, which cannot infer such a reshape's sharding,
    the leading dimension keeps its axes, as do trailing dimensions the reshape leaves."""
    aval = getattr(x, "aval", x)
    spec = _explicit_spec(aval)
    if spec is None:
        return x.reshape(shape)
    kept = [None] * len(shape)
    kept[0] = spec[0]
    for i in range(1, min(len(shape), len(aval.shape))):
        if shape[-i] != aval.shape[-i]:
            break
        kept[-i] = spec[-i]
    return jax.lax.reshape(x, shape, out_sharding=NamedSharding(aval.sharding.mesh, P(*kept)))


def _explicit_spec(aval):
    """The spec of an operand typed on a mesh with explicit axes (jax.sharding.AxisType),
    or None."""
    sharding = getattr(aval, "sharding", None)
    if not _explicit_mesh(getattr(sharding, "mesh", None)):
        return None
    return _named_spec(sharding, len(aval.shape))


class PartitionedCall:
    """An FFI call ``fn(*operands, **static) -> tuple of results`` partitioned by its layout
    (see the module docstring): its results' abstract values, and the function a
    primitive's lowering traces. ``layout`` is a ``Layout``, or a function of the static
    arguments and ``num_operands`` returning one. Static arguments are hashable.

    ``without_data(result_shapes)`` gives the results of a call none of whose operands holds
    an element: what the core would write (by default zeros: no row is owned, no slot
    names a row), made without the custom call, which XLA's partitioner refuses to place in
    a manual computation (shard_map) whose operands are all empty."""

    def __init__(self, fn, layout, without_data=None):
        self.fn, self._layout = fn, layout
        self._without_data = without_data or _zeros

    def abstract(self, *avals, batched, **static):
        """The results' abstract values: shapes and dtypes as ``fn`` makes them, typed like
        the operand that varies along the most shard_map axes, sharded as the partitioned
        call leaves them on a mesh with explicit axes."""
        shapes = _result_shapes(self, tuple((a.shape, a.dtype) for a in avals), batched, tuple(sorted(static.items())))
        shardings = self._result_shardings(*avals, batched=batched, **static)
        widest = max(avals, key=varying_count)
        return [widest.update(shape=shape, dtype=dtype, weak_type=False) if s is None else
                widest.update(shape=shape, dtype=dtype, weak_type=False, sharding=s)
                for (shape, dtype), s in zip(shapes, shardings)]

    def lowered(self, ctx, num_operands, batched, static):
        """The function of the operands that a lowering with context ``ctx`` traces: the
        custom-partitioned call, or under ``jax.export``, which cannot serialise a
        partitioning callback, the call on gathered operands."""
        operands = ctx.avals_in[:num_operands]
        if all(a.size == 0 for a in operands):  # nothing to read: the results are known (see without_data)
            shapes = _result_shapes(self, tuple((a.shape, a.dtype) for a in operands), batched,
                                    tuple(sorted(static.items())))
            return lambda *_: self._without_data(shapes)
        if getattr(getattr(ctx.module_context, "lowering_parameters", None), "for_export", False):
            return functools.partial(self._unpartitioned, batched=batched, **static)
        return _custom_partitioned(self.fn, self._layout_of(num_operands, static), tuple(sorted(static.items())),
                                   batched)

    def _layout_of(self, num_operands, static):
        chosen = self._layout(num_operands=num_operands, **static) if callable(self._layout) else self._layout
        return chosen.truncated(num_operands)

    def _result_shardings(self, *operands, batched, **static):
        """Each result's type on a mesh with explicit axes: the sharding the partitioned
        call gives it (the operands' axes, summed factors reduced). None elsewhere."""
        layout = self._layout_of(len(operands), static).batched(batched)
        avals = [getattr(x, "aval", x) for x in operands]  # arrays and tracers, or abstract values
        specs = [_explicit_spec(a) for a in avals]
        typed = [a for a, s in zip(avals, specs) if s is not None]
        if not typed:
            return (None,) * len(layout.results)
        mesh = typed[0].sharding.mesh
        axes = _resolve(layout, [(None,) * len(a.shape) if s is None else s for a, s in zip(avals, specs)], mesh)
        return tuple(NamedSharding(mesh, _spec(d, axes)) for d in layout.results)

    def _unpartitioned(self, *operands, batched, **static):
        return tuple(_mapped(functools.partial(self.fn, **static), batched)(*operands))


def partitioned(layout, without_data=None):
    """Decorator: the FFI call ``fn`` partitioned by ``layout`` (see PartitionedCall)."""
    return lambda fn: PartitionedCall(fn, layout, without_data)


def _zeros(shapes):
    return tuple(jnp.zeros(shape, dtype) for shape, dtype in shapes)


@functools.cache
def _result_shapes(call, operands, batched, static):
    """The results' (shape, dtype) for operands' (shape, dtype), traced once per signature."""
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in operands]
    results = jax.eval_shape(functools.partial(call._unpartitioned, batched=batched, **dict(static)), *structs)
    return tuple((r.shape, r.dtype) for r in results)


def varying_count(aval):
    """How many shard_map axes an abstract value varies along (whichever way this jax types it)."""
    manual = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    return len(getattr(manual, "varying", ())) if manual is not None else len(getattr(aval, "vma", ()))
