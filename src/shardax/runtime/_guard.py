"""Program guard: processes compare what they are about to run before a new distributed program first runs.

Multi-controller JAX hangs (or returns garbage) when processes call different collectives, with different shapes, or
in a different order. Before an ``smap`` function first runs with a new signature (function, argument shapes and
dtypes, static arguments, mesh), every process posts a fingerprint to JAX's distributed key-value store and reads
everyone else's, with a timeout; a mismatch raises :class:`shardax.ProgramMismatchError` on every process naming who
disagrees and how. Steady-state calls (a signature already checked) cost a dictionary lookup.

Modes (``SHARDAX_GUARD`` or :func:`configure_guard`): ``"new"`` (default: check each new signature), ``"strict"``
(check every call, with its sequence number: also catches a process that re-runs an old program while the others run
a new one), ``"off"``. ``SHARDAX_GUARD_TIMEOUT`` (seconds, default 120) bounds the wait for the other processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Hashable
from typing import Literal

import jax

from .._errors import ProgramMismatchError

GuardMode = Literal["new", "strict", "off"]


@dataclasses.dataclass
class _GuardState:
    mode: GuardMode
    timeout_s: float
    seen: set = dataclasses.field(default_factory=set)
    sequence: int = 0
    calls: int = 0
    last: str = ""


def _initial_state() -> _GuardState:
    mode = os.environ.get("SHARDAX_GUARD", "new")
    if mode not in ("new", "strict", "off"):
        raise ValueError(f"SHARDAX_GUARD must be 'new', 'strict' or 'off', got {mode!r}")
    return _GuardState(mode=mode, timeout_s=float(os.environ.get("SHARDAX_GUARD_TIMEOUT", "120")))  # type: ignore[arg-type]


_state = _initial_state()
_lock = threading.Lock()


def configure_guard(mode: GuardMode | None = None, *, timeout_s: float | None = None) -> None:
    """Set the program guard's mode (``"new"``, ``"strict"``, ``"off"``) and its timeout, on this process.

    Every process must use the same mode (set it before the first distributed call, e.g. through the
    ``SHARDAX_GUARD`` environment variable, which the launcher passes to every rank).

    Example:
        >>> import shardax as sx
        >>> sx.runtime.configure_guard("strict", timeout_s=30)
        >>> sx.runtime.configure_guard("new", timeout_s=120)
    """
    with _lock:
        if mode is not None:
            if mode not in ("new", "strict", "off"):
                raise ValueError(f"mode must be 'new', 'strict' or 'off', got {mode!r}")
            _state.mode = mode
        if timeout_s is not None:
            if timeout_s <= 0:
                raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
            _state.timeout_s = float(timeout_s)


def last_call() -> tuple[int, str]:
    """(number of distributed calls so far on this process, description of the last one)."""
    return _state.calls, _state.last


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _describe_difference(mine: dict, theirs: dict, me: int, other: int) -> str:
    if mine["function"] != theirs["function"]:
        return (f"process {other} called {theirs['function']} while process {me} called {mine['function']} "
                f"(distributed call #{mine['sequence']} of each)")
    for (name, a), (_, b) in zip(mine["arguments"], theirs["arguments"], strict=False):
        if a != b:
            return f"process {other} called {theirs['function']} with {name} {b}, process {me} with {a}"
    if len(mine["arguments"]) != len(theirs["arguments"]):
        return (f"process {other} called {theirs['function']} with {len(theirs['arguments'])} array arguments, "
                f"process {me} with {len(mine['arguments'])}")
    for field in ("static", "mesh"):
        if mine[field] != theirs[field]:
            return f"process {other} called {theirs['function']} with {field} {theirs[field]}, process {me} with " \
                   f"{mine[field]}"
    return f"process {other} and process {me} disagree on call #{mine['sequence']}"


def guard_call(key: Hashable, function: str, arguments: list[tuple[str, str]], static: str, mesh: str) -> None:
    """Check with the other processes before running ``function``; no-op in one process or when already checked."""
    with _lock:
        _state.calls += 1
        _state.last = f"{function}({', '.join(f'{n} {d}' for n, d in arguments)})"
        if _state.mode == "off" or jax.process_count() == 1:
            return
        if _state.mode == "new" and key in _state.seen:
            return
        client = _client()
        if client is None:
            return
        _state.sequence += 1
        sequence = _state.sequence
        timeout_s = _state.timeout_s
        strict = _state.mode == "strict"
    me = jax.process_index()
    mine = {"function": function, "arguments": arguments, "static": static, "mesh": mesh, "sequence": sequence,
            "call": _state.calls if strict else None}
    prefix = f"shardax/guard/{sequence}"
    client.key_value_set(f"{prefix}/{me}", json.dumps(mine))
    if sequence > 2:  # everyone has read check #sequence-2 once anyone reaches check #sequence
        client.key_value_delete(f"shardax/guard/{sequence - 2}/{me}")
    for other in range(jax.process_count()):
        if other == me:
            continue
        try:
            theirs = json.loads(client.blocking_key_value_get(f"{prefix}/{other}", int(timeout_s * 1000)))
        except Exception as err:  # the runtime raises its own error type on DEADLINE_EXCEEDED
            raise ProgramMismatchError(
                f"process {other} did not reach shardax's program check #{sequence} within {timeout_s:g} s while "
                f"process {me} is about to run {_state.last}: process {other} is running a different program (a "
                "different call, or a call whose signature it already checked — SHARDAX_GUARD=strict checks every "
                f"call), has exited, or is stuck ({type(err).__name__})") from None
        theirs_cmp = {k: (tuple(map(tuple, v)) if k == "arguments" else v) for k, v in theirs.items()}
        mine_cmp = {k: (tuple(map(tuple, v)) if k == "arguments" else v) for k, v in mine.items()}
        if theirs_cmp != mine_cmp:
            raise ProgramMismatchError(
                "processes are about to run different distributed programs (this would hang or return garbage): "
                + _describe_difference(mine, theirs, me, other))
    with _lock:
        _state.seen.add(key)
