"""The order of a program's collectives, made explicit in its data.

Devices that enter two independent collectives in different orders wait for each other for ever. XLA:CPU orders the
collectives of a program it has just compiled through one communicator resource they all share, but an executable it
reads back (from JAX's persistent compilation cache, or handed from another process) gives each collective a
resource of its own (jaxlib 0.10-0.11): only data dependencies order them then, and two collectives that do not
depend on each other may run in either order. :func:`after` adds the missing dependency, and
:func:`unordered_collectives` finds the pairs a compiled program leaves unordered (the kernels' tests check that
there are none, which is what lets the CLI jobs load their programs from the cache on CPU).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._flags import _UNSIGNED, _to_words


def _first_word(leaf: jax.Array) -> jax.Array:
    """The bits of ``leaf``'s first element as a non-negative int32 (0 for an empty array)."""
    first = jnp.ravel(leaf)[:1]
    if first.size == 0:
        return jnp.int32(0)
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = jnp.real(first)
    return (_to_words(first)[0] & jnp.uint32(0x7FFFFFFF)).astype(jnp.int32)


def _or_zero(leaf: jax.Array, zero: jax.Array) -> jax.Array:
    """``leaf`` with ``zero`` (always 0) OR-ed into its bits: the same values, computed from ``zero``."""
    if leaf.dtype == jnp.bool_:
        return leaf | (zero != 0)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        return lax.complex(_or_zero(jnp.real(leaf), zero), _or_zero(jnp.imag(leaf), zero))
    unsigned = jnp.uint32 if leaf.dtype.itemsize == 8 else _UNSIGNED[leaf.dtype.itemsize]  # (8 bytes: two words)
    bits = lax.bitcast_convert_type(leaf, unsigned) | zero.astype(unsigned)
    return lax.bitcast_convert_type(bits, leaf.dtype)


def after(x: Any, *deps: Any) -> Any:
    """``x`` (a pytree of arrays), unchanged bit for bit, but computed by XLA after every array of ``deps``.

    Use it to order a collective after another one it does not depend on: ``allgather(after(flags, labels))``
    waits for the exchange that made ``labels``. The dependency is the first element of each array in ``deps``
    combined into a zero that XLA cannot prove is zero, OR-ed into ``x``'s bits: one pass over ``x``, so tie small
    arrays. Pass arrays whose first element comes out of the collective to wait for (its output, or a buffer it
    wrote into), not a concatenation that starts with something computed before it: XLA would read that first
    element straight from its source, and the order would be lost (the tests' checker would say so). Differentiated
    as the identity in ``x`` (no derivative flows to ``deps``); the derivative's own collectives are not tied.
    """
    words = [_first_word(leaf) for d in deps for leaf in jax.tree.leaves(d)]
    if not words:
        return x
    combined = words[0]
    for w in words[1:]:
        combined = combined | w
    zero = jnp.minimum(combined, 0)  # every word is non-negative: always 0
    return jax.tree.map(lambda leaf: _tied(jnp.asarray(leaf), zero), x)


@jax.custom_jvp
def _tied(leaf: jax.Array, zero: jax.Array) -> jax.Array:
    """:func:`_or_zero`, differentiated as the identity in ``leaf`` (the bit casts have no derivative of their own,
    and the value is ``leaf``'s)."""
    return _or_zero(leaf, zero)


@_tied.defjvp
def _tied_jvp(primals: tuple[jax.Array, jax.Array], tangents: tuple[Any, Any]) -> tuple[jax.Array, Any]:
    leaf, zero = primals
    return _tied(leaf, zero), tangents[0]


# ------------------------------------------------------------------------------------- checking a compiled program

_COLLECTIVES = frozenset({"all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter",
                          "all-gather-start", "all-reduce-start", "collective-permute-start", "ragged-all-to-all",
                          "collective-broadcast"})
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\((.*)$")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_CALLED_GROUP = re.compile(r"(?:branch_computations|called_computations|calls)=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


class _Instr(NamedTuple):
    name: str
    op: str
    operands: tuple[str, ...]
    calls: tuple[str, ...]
    target: str | None


def _split_args(rest: str) -> tuple[str, str]:
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return rest[:i - 1], rest[i:]


def _computations(text: str) -> dict[str, list[_Instr]]:
    comps: dict[str, list[_Instr]] = {}
    current: list[_Instr] | None = None
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith((" ", "HloModule")):
            header = _HEADER.match(line)
            if header:
                current = comps.setdefault(header.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        found = _INSTRUCTION.match(line) if current is not None else None
        if found is None or current is None:
            continue
        args, attrs = _split_args(found.group(3))
        calls = _CALLED.findall(attrs)
        for group in _CALLED_GROUP.findall(attrs):
            calls += re.findall(r"%([\w.\-]+)", group)
        target = _TARGET.search(attrs)
        current.append(_Instr(found.group(1), found.group(2), tuple(re.findall(r"%([\w.\-]+)", args)),
                              tuple(calls), target.group(1) if target else None))
    return comps


def unordered_collectives(hlo_text: str, custom_targets: tuple[str, ...] = ("shardax", "mpi")) -> Iterator[
        tuple[str, str, str]]:
    """Pairs of collectives of a compiled HLO module (``compiled.as_text()``) that no data dependency orders:
    ``(computation, first, second)``, instruction names. A loop or conditional counts as a collective when its
    body holds one; a custom call counts when its target names one of ``custom_targets``."""
    comps = _computations(hlo_text)
    holds: dict[str, bool] = {}

    def comp_holds(name: str, seen: frozenset[str]) -> bool:
        if name not in holds:
            holds[name] = name in comps and name not in seen and any(
                instr_holds(i, seen | {name}) for i in comps[name])
        return holds[name]

    def instr_holds(i: _Instr, seen: frozenset[str] = frozenset()) -> bool:
        if i.op in _COLLECTIVES:
            return True
        if i.op == "custom-call" and i.target and any(t in i.target.lower() for t in custom_targets):
            return True
        return any(comp_holds(c, seen) for c in i.calls)

    for cname, instrs in comps.items():
        collectives = [i for i in instrs if instr_holds(i)]
        if len(collectives) < 2:
            continue
        bit = {i.name: 1 << k for k, i in enumerate(instrs)}
        before: dict[str, int] = {}  # bit mask of every instruction an instruction depends on
        for i in instrs:  # operands come first in the printed order
            mask = 0
            for o in i.operands:
                if o in before:
                    mask |= before[o] | bit[o]
            before[i.name] = mask
        for k, a in enumerate(collectives):
            for b in collectives[k + 1:]:
                if not (before[b.name] & bit[a.name] or before[a.name] & bit[b.name]):
                    yield cname, a.name, b.name
