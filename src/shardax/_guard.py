"""Program guard: processes compare what they are about to run before a new distributed program first runs.

Multi-controller JAX hangs (or returns garbage) when processes call different collectives, with different shapes, or
in a different order. Before an ``smap`` function first runs with a new signature (the function's fingerprint: its
code, captured values and defaults, see :mod:`shardax._fingerprint`; argument shapes and dtypes; static
arguments; mesh), every process posts a description of it to JAX's distributed key-value store and reads everyone
else's, with a timeout; a mismatch raises :class:`shardax.ProgramMismatchError` on every process naming who disagrees
and how. Steady-state calls (a signature already checked) cost a dictionary lookup.

Modes (``SHARDAX_GUARD`` or :func:`configure_guard`): ``"new"`` (default: check each new signature), ``"strict"``
(check every call, with its sequence number: also catches a process that re-runs an old program while the others run
a new one), ``"off"``. ``SHARDAX_GUARD_TIMEOUT`` (seconds, default 120) bounds the wait for the other processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from collections.abc import Callable, Hashable
from typing import Any, Literal

import jax

from ._errors import ProgramMismatchError
from ._fingerprint import Item

GuardMode = Literal["new", "strict", "off"]


@dataclasses.dataclass(frozen=True)
class Details:
    """What processes compare before running a program (only ``items``, ``arguments`` and ``mesh`` are compared).

    Attributes:
        function: how messages name the function (``"knn.smap"``, ``"__main__.step"``).
        where: ``file:line`` of the user's call (see :func:`call_site`).
        items: its fingerprint: code, captured values, defaults and static arguments.
        arguments: ``(name, "float32(4, 1024)")`` of each array argument.
        mesh: the mesh's axis sizes.
    """

    function: str
    where: str
    items: tuple[Item, ...]
    arguments: tuple[tuple[str, str], ...]
    mesh: str


@dataclasses.dataclass
class Program:
    """One signature of a distributed function, as the guard sees it.

    Attributes:
        key: equal for equal programs (the function's fingerprint digest, static values, shapes, mesh); a key
            already checked is not checked again in ``"new"`` mode.
        summary: ``name(argument descriptions)``, for the watchdog and for timeout messages.
        details: builds the :class:`Details`; called only when the guard compares (never in steady state).
    """

    key: Hashable
    summary: str
    details: Callable[[], Details]


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


def coordinator_client():
    from jax._src import distributed

    return distributed.global_state.client


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_INTERNAL = (*(os.path.join(_PACKAGE, sub) + os.sep for sub in ("core", "runtime", "testing")),
             os.path.join(_PACKAGE, "_"))   # and the top-level internal modules (_guard.py, ...)
_LIBRARIES = tuple(f"{os.sep}{lib}{os.sep}" for lib in ("jax", "jaxlib"))


def call_site() -> tuple[str | None, str]:
    """``(entry, where)`` of the current call: the public shardax function the user called
    (``"shardax.fft.fftn"``; ``None`` when the user called an ``smap`` function or a ``.smap`` closure directly)
    and ``file:line`` of the user's call. Walks the stack: only for messages, never in steady state."""
    frame = sys._getframe(1)
    entry: str | None = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE + os.sep):
            qualname = frame.f_code.co_qualname
            if entry is None and not path.startswith(_INTERNAL) and "<locals>" not in qualname and \
                    not qualname.startswith("_"):
                module = str(frame.f_globals.get("__name__", ""))
                entry = ".".join([*(p for p in module.split(".") if not p.startswith("_")), qualname])
        elif not any(lib in path for lib in _LIBRARIES) and not path.endswith(("functools.py", "contextlib.py")):
            return entry, f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return entry, "?"


def _payload(details: Details, sequence: int, call: int | None) -> dict[str, Any]:
    return {"function": details.function, "where": details.where, "sequence": sequence, "call": call,
            "items": [[i.label, i.digest, i.description] for i in details.items],
            "arguments": [list(a) for a in details.arguments], "mesh": details.mesh}


def _compared(payload: dict[str, Any]) -> tuple:
    return (tuple((label, digest) for label, digest, _ in payload["items"]),
            tuple(shape for _, shape in payload["arguments"]), payload["mesh"], payload["call"])


def _describe_difference(mine: dict[str, Any], theirs: dict[str, Any], me: int, other: int) -> str:
    name, other_name = mine["function"], theirs["function"]
    for (label, digest, desc), (their_label, their_digest, their_desc) in zip(mine["items"], theirs["items"],
                                                                           strict=False):
        if (label, digest) == (their_label, their_digest):
            continue
        if label != their_label or label == "code":
            if name != other_name:
                return (f"process {other} calls {other_name} ({theirs['where']}) while process {me} calls {name} "
                        f"({mine['where']}) (distributed call #{mine['sequence']} of each)")
            return (f"process {other} runs {their_desc} and process {me} runs {desc}, and their code differs "
                    f"(called at {theirs['where']} and {mine['where']})")
        same = " (the same description: they differ inside)" if desc == their_desc else ""
        return f"process {other} calls {other_name} with {label}={their_desc}, process {me} with {label}={desc}{same}"
    if len(mine["items"]) != len(theirs["items"]):
        return (f"process {other} calls {other_name} ({theirs['where']}) and process {me} calls {name} "
                f"({mine['where']}) with different captured values or static arguments")
    for (arg, a), (_, b) in zip(mine["arguments"], theirs["arguments"], strict=False):
        if a != b:
            return f"process {other} calls {other_name} with {arg} {b}, process {me} with {a}"
    if len(mine["arguments"]) != len(theirs["arguments"]):
        return (f"process {other} calls {other_name} with {len(theirs['arguments'])} array arguments, "
                f"process {me} with {len(mine['arguments'])}")
    if mine["mesh"] != theirs["mesh"]:
        return f"process {other} calls {other_name} on mesh {theirs['mesh']}, process {me} on mesh {mine['mesh']}"
    return (f"process {other} is at distributed call #{theirs['call']} ({other_name}) and process {me} at call "
            f"#{mine['call']} ({name})")


def guard_call(program: Program, *, traced: bool = False) -> None:
    """Check with the other processes before running ``program``; no-op in one process or when already checked.

    ``traced``: the call is being traced inside an outer ``jax.jit`` (or ``grad``): it is checked when first
    traced (the runs of the compiled outer program cannot be seen from Python), not counted as a call.
    """
    with _lock:
        if not traced:
            _state.calls += 1
            _state.last = program.summary
        if _state.mode == "off" or jax.process_count() == 1:
            return
        if (_state.mode == "new" or traced) and program.key in _state.seen:
            return
        client = coordinator_client()
        if client is None:
            return
        _state.sequence += 1
        sequence = _state.sequence
        timeout_s = _state.timeout_s
        call = _state.calls if _state.mode == "strict" and not traced else None
    me = jax.process_index()
    mine = _payload(program.details(), sequence, call)
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
                f"process {me} is about to run {program.summary} ({mine['where']}): process {other} is running a different "
                "program (a different call, or a call whose signature it already checked — SHARDAX_GUARD=strict "
                f"checks every call), has exited, or is stuck ({type(err).__name__})") from None
        if _compared(theirs) != _compared(mine):
            raise ProgramMismatchError(
                "processes are about to run different distributed programs (this would hang or return garbage): "
                + _describe_difference(mine, theirs, me, other))
    with _lock:
        _state.seen.add(program.key)
