"""The Hopper kernel table (core_cuda/src/hopper_kernels.def) as data: its sm90 tiles, its
choice of kernel per class of GEMM call, and the rewrite of that choice from a GPU run's
measurements. The core compiles the table; this module reads the same lines, so the tile
list and the rule are written once. Standard library only.

A class is a range of a call's smaller side: the smaller of its rows per group and its
columns (core_cuda/src/kernel_choice.h's smaller_side). A row's bound is the largest
smaller side it takes, 0 for any size; the first row whose bound holds decides.
"""

import dataclasses
import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TABLE = os.path.join(ROOT, "core_cuda", "src", "hopper_kernels.def")
SM80 = "sm80"  # the CUTLASS 2.x kernels, the table's name for them
SM90_BY_SHAPE = "sm90"  # GROUPGEMM_CUDA_KERNEL's value for the table's sm90 column
DEFAULT_KERNEL = "default"  # the benchmarks' and tests' name for GROUPGEMM_CUDA_KERNEL unset

_TILE = re.compile(r"^GG_SM90_TILE\((\w+), (\w+), (\d+), (\d+), (\d+), (\d+), (\d+)\)$")
_CHOICE = re.compile(r"^GG_HOPPER_CHOICE\((\d+), (\w+), (\w+)\)$")
_CHOSEN_BY = "// Chosen by: "


@dataclasses.dataclass(frozen=True)
class Tile:
    name: str  # also GROUPGEMM_CUDA_KERNEL's value for it
    schedule: str  # cooperative or pingpong
    shape: tuple  # (M, N, K)
    cluster: tuple  # (M, N)


@dataclasses.dataclass(frozen=True)
class Choice:
    smaller_side_at_most: int  # 0: any size
    default: str  # SM80 or a tile's name
    sm90: str  # a tile's name

    def takes(self, side):
        return self.smaller_side_at_most == 0 or side <= self.smaller_side_at_most


@dataclasses.dataclass(frozen=True)
class Table:
    tiles: tuple  # of Tile
    choices: tuple  # of Choice, in order
    chosen_by: str  # the comment above the choices: who or what chose them

    @property
    def tile_names(self):
        return tuple(t.name for t in self.tiles)

    def choice_for(self, side):
        return next(c for c in self.choices if c.takes(side))


def read(path=None):
    """The table in `path` (default TABLE); ValueError naming the line when a row is
    malformed or a name unknown."""
    path = path or TABLE
    tiles, choices, chosen_by = [], [], []
    with open(path) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, start=1):
        if line.startswith("GG_SM90_TILE("):
            m = _TILE.match(line)
            if not m:
                raise ValueError(f"{path}:{number}: not a GG_SM90_TILE row: {line}")
            name, schedule, *sizes = m.groups()
            sizes = tuple(map(int, sizes))
            tiles.append(Tile(name, schedule, sizes[:3], sizes[3:]))
        elif line.startswith("GG_HOPPER_CHOICE("):
            m = _CHOICE.match(line)
            if not m:
                raise ValueError(f"{path}:{number}: not a GG_HOPPER_CHOICE row: {line}")
            choices.append(Choice(int(m.group(1)), m.group(2), m.group(3)))
        elif line.startswith(_CHOSEN_BY) or (chosen_by and line.startswith("// ") and not choices):
            chosen_by.append(line[len(_CHOSEN_BY):] if line.startswith(_CHOSEN_BY) else line[3:])
    table = Table(tuple(tiles), tuple(choices), " ".join(chosen_by))
    check(table, path)
    return table


def check(table, where):
    names = table.tile_names
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{where}: the tiles must be named, each once: {names}")
    if not table.choices or table.choices[-1].smaller_side_at_most != 0:
        raise ValueError(f"{where}: the last GG_HOPPER_CHOICE must take any size (0)")
    for c in table.choices:
        if c.default not in (SM80, *names) or c.sm90 not in names:
            raise ValueError(f"{where}: {c} names a kernel the table does not have")


def render_choices(choices, chosen_by):
    """The chosen-by comment and the GG_HOPPER_CHOICE rows, as the file writes them."""
    words, lines, line = chosen_by.split(), [], _CHOSEN_BY.rstrip()
    for word in words:  # wrapped at 90 columns, continuation lines as plain comments
        if len(line) + 1 + len(word) > 90:
            lines.append(line)
            line = "//"
        line += " " + word
    lines.append(line)
    return lines + [f"GG_HOPPER_CHOICE({c.smaller_side_at_most}, {c.default}, {c.sm90})" for c in choices]


def write_choices(choices, chosen_by, path=None):
    """Replaces the table's choices (and the comment saying who chose them) in `path`
    (default TABLE), keeping every other line; returns the new table."""
    path = path or TABLE
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(_CHOSEN_BY))
    end = max(i for i, line in enumerate(lines) if line.startswith("GG_HOPPER_CHOICE(")) + 1
    old = read(path)
    new = Table(old.tiles, tuple(choices), chosen_by)
    check(new, path)
    with open(path, "w") as f:
        f.write("\n".join(lines[:start] + render_choices(choices, chosen_by) + lines[end:]) + "\n")
    return read(path)


# ---- the decision from a GPU run -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Timing:
    """One GEMM of a benchmark cell on one kernel: a forward, dgrad or weight gradient."""
    cell: str  # e.g. "G=8 16384x4096x14336 uniform forward"
    smaller_side: int
    kernel: str  # SM80 or a tile's name
    seconds: float


def decide(table, timings, passed):
    """The choices a run's measurements give: for each class, among the kernels in `passed`
    (those that passed the tests and the sanitizer; sm80 competes for the default only),
    the one whose GEMMs of that class took the least time in all, counting only the GEMMs
    every candidate ran. A class without such GEMMs, or without a passing tile, keeps its
    choice. Returns (choices, {class bound: reason}) ."""
    choices, reasons = [], {}
    for choice in table.choices:
        cls = [t for t in timings if table.choice_for(t.smaller_side) is choice]
        new, why = choice, "no measurement in this class: unchanged"
        measured = {t.kernel for t in cls}  # a kernel the sweep left out (a wrong result) does not compete
        tiles = [k for k in table.tile_names if k in passed and k in measured]
        candidates = ([SM80] if SM80 in passed and SM80 in measured else []) + tiles
        totals = _totals(cls, candidates)
        if totals and tiles:
            default = min(totals, key=totals.get)
            sm90 = min((k for k in totals if k != SM80), key=totals.get)
            new = Choice(choice.smaller_side_at_most, default, sm90)
            why = ", ".join(f"{k} {totals[k] * 1e3:.3f} ms" for k in sorted(totals, key=totals.get))
        elif cls and not tiles:
            why = "no sm90 tile passed: unchanged"
        choices.append(new)
        reasons[choice.smaller_side_at_most] = why
    return tuple(choices), reasons


def _totals(timings, candidates):
    """{kernel: seconds over the cells every candidate ran}, or {} when none did."""
    by_cell = {}
    for t in timings:
        by_cell.setdefault(t.cell, {})[t.kernel] = t.seconds
    complete = [times for times in by_cell.values() if all(k in times for k in candidates)]
    if not complete or not candidates:
        return {}
    return {k: sum(times[k] for times in complete) for k in candidates}
