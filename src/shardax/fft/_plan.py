"""Transpose plans: the sequence of local FFTs and ``all_to_all`` moves of a distributed transform.

mpi4py-fft's ``Transfer``: a :class:`Transpose` moves the split of mesh axes from one array axis to another with one
``all_to_all``; an :class:`FFTPlan` strings local transforms and transposes together. Plans are found by a shortest
path search over layouts (fewest transposes, then fewest elements moved), so slabs, pencils, real transforms with an
odd ``n // 2 + 1`` last axis and any other split of a 3D array get a plan with the minimal number of transposes.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from ._layout import Group, Layout

Kind = Literal["fftn", "ifftn", "rfftn", "irfftn"]
LayoutMode = Literal["same", "transposed"]
Norm = Literal["backward", "ortho", "forward"]
LayoutArg = LayoutMode | PartitionSpec


@dataclasses.dataclass(frozen=True)
class Transform:
    """A local transform along unsplit array axes.

    Attributes:
        axes: the array axes transformed.
        op: ``"c2c"`` (forward or inverse complex), ``"r2c"`` (``rfft`` along the last axis) or ``"c2r"``
            (``irfft`` along the last axis, to ``n`` points).
        inverse: whether the complex transform is the inverse one.
        n: output length of ``c2r``.
    """

    axes: tuple[int, ...]
    op: Literal["c2c", "r2c", "c2r"]
    inverse: bool = False
    n: int | None = None

    def __call__(self, x: jax.Array, norm: Norm) -> jax.Array:
        if self.op == "r2c":
            return jnp.fft.rfft(x, axis=self.axes[0], norm=norm)
        if self.op == "c2r":
            return jnp.fft.irfft(x, n=self.n, axis=self.axes[0], norm=norm)
        fn = jnp.fft.ifftn if self.inverse else jnp.fft.fftn
        return fn(x, axes=self.axes, norm=norm)


@dataclasses.dataclass(frozen=True)
class Transpose:
    """Move the split over mesh axes ``group`` from array axis ``src`` to array axis ``dst`` (one ``all_to_all``).

    Before it, ``group`` is the minor end of ``src``'s split; after it, the minor end of ``dst``'s.

    Attributes:
        group: the mesh axes of the ``all_to_all``.
        src: the array axis that becomes whole on each device (gathered over ``group``).
        dst: the array axis that gets split over ``group``.
        parts: number of devices along ``group``.
        local_elements: elements of one device's block before the move.
    """

    group: Group
    src: int
    dst: int
    parts: int
    local_elements: int

    def forward(self, x: jax.Array) -> jax.Array:
        """The move itself, on one device's block (inside ``smap``)."""
        return lax.all_to_all(x, self.group, split_axis=self.dst, concat_axis=self.src, tiled=True)

    def backward(self, x: jax.Array) -> jax.Array:
        """The inverse move."""
        return lax.all_to_all(x, self.group, split_axis=self.src, concat_axis=self.dst, tiled=True)

    @property
    def elements_moved(self) -> int:
        """Elements each device sends to other devices (its own share stays)."""
        return self.local_elements * (self.parts - 1) // self.parts


Step = Transform | Transpose


@dataclasses.dataclass(frozen=True)
class FFTPlan:
    """A distributed transform: local transforms and transposes from ``in_layout`` to ``out_layout``.

    Attributes:
        kind: ``"fftn"``, ``"ifftn"``, ``"rfftn"`` or ``"irfftn"``.
        in_layout: layout (and global shape) of the input.
        out_layout: layout (and global shape) of the output.
        steps: the local transforms and transposes, in order.
    """

    kind: Kind
    in_layout: Layout
    out_layout: Layout
    steps: tuple[Step, ...]

    @property
    def transposes(self) -> tuple[Transpose, ...]:
        """The ``all_to_all`` moves of the plan."""
        return tuple(s for s in self.steps if isinstance(s, Transpose))

    def bytes_moved(self, itemsize: int) -> int:
        """Bytes each device sends per transform, for elements of ``itemsize`` bytes while they are moved.

        Moves happen on complex data: pass the complex item size (8 for complex64, 16 for complex128).
        """
        return sum(t.elements_moved for t in self.transposes) * itemsize

    def __call__(self, x: jax.Array, norm: Norm = "backward") -> jax.Array:
        """Run the plan on one device's block (local view)."""
        for step in self.steps:
            x = step.forward(x) if isinstance(step, Transpose) else step(x, norm)
        return x


_Groups = tuple[Group, ...]


def _sizes(kind: Kind, shape: tuple[int, ...], done: frozenset[int], n_last: int) -> tuple[int, ...]:
    last = len(shape) - 1
    if kind == "rfftn" and last in done:
        return (*shape[:-1], shape[-1] // 2 + 1)
    if kind == "irfftn" and last in done:
        return (*shape[:-1], n_last)
    return shape


def _transforms(kind: Kind, groups: _Groups, done: frozenset[int]) -> list[Transform]:
    """Local transforms that can run now (on unsplit axes), applied eagerly: a transform never hurts a plan."""
    ndim = len(groups)
    last = ndim - 1
    free = [d for d in range(ndim) if d not in done and not groups[d]]
    if kind == "rfftn":
        if last not in done:
            return [Transform((last,), "r2c")] if last in free else []
        free = [d for d in free if d != last]
    steps = []
    complex_axes = tuple(d for d in free if not (kind == "irfftn" and d == last))
    if complex_axes:
        steps.append(Transform(complex_axes, "c2c", inverse=kind in ("ifftn", "irfftn")))
    if kind == "irfftn" and last in free and set(range(last)) <= (done | set(complex_axes)):
        steps.append(Transform((last,), "c2r"))
    return steps


def _preference(groups: _Groups, order: dict[str, int]) -> tuple:
    """Among equally cheap final layouts: mesh axes in mesh order, then the lowest array axes split."""
    unordered = sum(list(g) != sorted(g, key=order.__getitem__) for g in groups)
    return unordered, tuple(-len(g) for g in groups)


def search_plan(kind: Kind, layout: Layout, target: _Groups | None, n_last: int) -> FFTPlan | None:
    """The plan with the fewest transposes (then fewest elements moved) ending in ``target``, or in any layout.

    ``layout`` must be stripped of size-1 mesh axes. Returns ``None`` when no plan exists.
    """
    ndim = len(layout.shape)
    order = {name: i for i, (name, _) in enumerate(layout.axis_sizes)}
    counter = itertools.count()
    start = (layout.groups, frozenset[int]())
    heap: list = [((0, 0), next(counter), start, ())]
    seen: set = set()
    found: list[tuple[_Groups, tuple[int, ...], tuple[Step, ...]]] = []
    found_cost = None
    while heap:
        cost, _, (groups, done), steps = heapq.heappop(heap)
        if found_cost is not None and cost > found_cost:
            break
        while transforms := _transforms(kind, groups, done):
            for transform in transforms:
                steps = (*steps, dataclasses.replace(transform, n=n_last) if transform.op == "c2r" else transform)
                done = done | frozenset(transform.axes)
        if (groups, done) in seen:
            continue
        seen.add((groups, done))
        shape = _sizes(kind, layout.shape, done, n_last)
        if len(done) == ndim and (target is None or groups == target):
            found.append((groups, shape, steps))
            found_cost = cost
            continue
        local = math.prod(shape) // math.prod(layout.group_size(g) for g in groups)
        for src, dst in itertools.permutations(range(ndim), 2):
            local_dst = shape[dst] // layout.group_size(groups[dst])
            for length in range(1, len(groups[src]) + 1):
                moved = groups[src][-length:]
                parts = layout.group_size(moved)
                if local_dst % parts:
                    continue
                new = list(groups)
                new[src] = groups[src][:-length]
                new[dst] = groups[dst] + moved
                step = Transpose(moved, src, dst, parts, local)
                new_cost = (cost[0] + 1, cost[1] + step.elements_moved)
                heapq.heappush(heap, (new_cost, next(counter), (tuple(new), done), (*steps, step)))
    if not found:
        return None
    groups, shape, steps = min(found, key=lambda item: _preference(item[0], order))
    return FFTPlan(kind, layout, layout.with_groups(groups, shape), steps)


def _roll(groups: _Groups, inverse: bool) -> _Groups:
    return (*groups[1:], groups[0]) if inverse else (groups[-1], *groups[:-1])


def out_shape(kind: Kind, shape: tuple[int, ...], n_last: int) -> tuple[int, ...]:
    """Global output shape of a transform of ``kind`` on an input of ``shape``."""
    if kind == "rfftn":
        return (*shape[:-1], shape[-1] // 2 + 1)
    if kind == "irfftn":
        return (*shape[:-1], n_last)
    return shape


@functools.lru_cache(maxsize=256)
def make_plan(kind: Kind, layout: Layout, mode: LayoutArg, n_last: int) -> FFTPlan:
    """The plan of ``kind`` for an input of ``layout`` whose output layout follows ``mode``.

    ``"same"``: the output is split like the input. ``"transposed"``: the input's split rolled by one array axis
    (to the right for forward transforms, to the left for inverse ones, so that an inverse undoes a forward) when the
    sizes allow it, else the layout that the cheapest plan ends in. A ``PartitionSpec``: that output split.
    """
    stripped = layout.stripped()
    inverse = kind in ("ifftn", "irfftn")
    shape = out_shape(kind, layout.shape, n_last)
    if isinstance(mode, PartitionSpec):
        wanted = Layout.from_spec(mode, shape, dict(layout.axis_sizes), f"{kind}: layout")
        outs: list[Layout | None] = [wanted]
    elif mode == "same":
        outs = [layout.with_groups(layout.groups, shape)]
    else:
        outs = [layout.with_groups(_roll(layout.groups, inverse), shape), None]
    for out in outs:
        if out is not None and mode != "transposed":
            for dim, n in enumerate(out.shape):
                if n % out.parts(dim):
                    raise ValueError(
                        f"{kind}: the output's axis {dim} has {n} points, which its split over mesh axes "
                        f"{out.groups[dim]} (of size {out.parts(dim)}) does not evenly divide; pass "
                        f"layout='transposed' or an output PartitionSpec that leaves axis {dim} whole")
        target = None if out is None else out.stripped().groups
        found = search_plan(kind, stripped, target, n_last)
        if found is not None:
            return dataclasses.replace(found, in_layout=layout, out_layout=out or found.out_layout)
    where = f" to the split {outs[0].spec}" if isinstance(mode, PartitionSpec) and outs[0] is not None else ""
    raise ValueError(
        f"{kind}: no sequence of all_to_all transposes computes this transform{where} for global shape "
        f"{layout.shape} split as {layout.spec} over mesh axes {dict(layout.axis_sizes)}: every axis must be whole "
        f"on a device once and the sizes do not divide evenly; choose sizes divisible by the mesh axes or another "
        f"mesh")
