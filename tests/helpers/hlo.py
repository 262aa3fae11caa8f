"""What a compiled multi-device JAX program does, read from its HLO text: the shapes each
device's custom calls see and the collectives between them."""

import re

import numpy as np

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")  # element types such as f32, f8e4m3fn


def compiled_text(jitted, *args):
    return jitted.lower(*args).compile().as_text()


def _shapes(text):
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _SHAPE.findall(text)]


def _instructions(text, opcode):
    """(result text, rest of line) of each instruction with this opcode."""
    for line in text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) " + re.escape(opcode) + r"\((.*)$", line)
        if match:
            yield match.group(1), match.group(2)


def custom_calls(text, target):
    """[(result shapes, operand shapes)] of the custom calls to ``target`` (per device)."""
    calls = []
    for result, rest in _instructions(text, "custom-call"):
        if f'custom_call_target="{target}"' not in rest:
            continue
        operands = re.search(r"operand_layout_constraints=\{(.*?)\}(?:, [a-z_]+=|$)", rest)
        calls.append((_shapes(result), _shapes(operands.group(1)) if operands else []))
    return calls


def collectives(text, opcode):
    """[(result shapes, device groups)] of each ``all-reduce``, ``all-gather``, ..."""
    return [(_shapes(result), replica_groups(rest)) for result, rest in _instructions(text, opcode)]


def collective_types(text, opcode):
    """The element types of the results of each ``all-reduce``, ``all-gather``, ..."""
    return [[kind for kind, _ in _SHAPE.findall(result)] for result, _ in _instructions(text, opcode)]


def replica_groups(rest):
    """The device groups of a collective, in any of the formats XLA prints them."""
    listed = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
    if listed:
        return sorted(sorted(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([\d,]*)\}", listed.group(1)))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        shape, dims = [int(d) for d in iota.group(1).split(",")], [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(np.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return sorted(sorted(g) for g in ids.reshape(shape).tolist())
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        reduced = [names.index(a) for a in re.findall(r"'(\w+)'", mesh.group(2))]
        kept = [i for i in range(len(names)) if i not in reduced]
        ids = np.arange(np.prod(sizes)).reshape(sizes).transpose(kept + reduced)
        return sorted(sorted(g) for g in ids.reshape(-1, int(np.prod([sizes[i] for i in reduced]))).tolist())
    raise AssertionError(f"unreadable replica groups in: {rest[:300]}")


def mesh_axis_groups(mesh, axis):
    """The device groups that differ only along ``axis`` of ``mesh`` (by device id)."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    i = mesh.axis_names.index(axis)
    moved = np.moveaxis(ids, i, -1)
    return sorted(sorted(g) for g in moved.reshape(-1, ids.shape[i]).tolist())
