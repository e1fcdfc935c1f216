"""Fingerprints of what a function will run: its code, the values it captures, its defaults.

The program guard compares fingerprints across processes, so they must be equal for equal programs in different
processes (no ``id``, no memory address, no line number: the same code written in two places matches) and differ
when the programs could differ. A fingerprint is a tuple of :class:`Item`\\ s, one per thing that can differ
(the code, each captured variable, each default, each static argument), so that a mismatch names the first item that
differs in plain words: ``k=9`` against ``k=8``.

Values are fingerprinted as follows: ``None``, bools, numbers, strings and bytes by type and value; tuples, lists,
dicts and sets element by element; NumPy scalars and small NumPy arrays (up to :data:`SMALL_ARRAY` elements) by
value, larger arrays and JAX arrays by shape and dtype (the guard cannot see data values); functions by their code
(bytecode, constants, names, nested code objects), the values their closure holds and their defaults, recursively;
``functools.partial``, bound methods and wrappers (``__wrapped__``, e.g. ``jax.jit``) through what they wrap;
dataclasses (frozen ``Tuning`` objects included) field by field (the ``World`` without its
``process_id``); anything else by its ``repr`` with memory addresses
removed. The globals a function reads are not followed (only their names are part of its code).

:func:`function_items` caches per function object, revalidated by the identity of the closure's contents and of the
defaults: a steady-state lookup costs about a microsecond.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import re
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

SMALL_ARRAY = 64  # NumPy arrays up to this many elements are fingerprinted by value
_DEPTH = 12  # nesting followed, at most (deeper structure counts by its type only)
_DESCRIPTION = 160  # characters of a value's description in messages
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Fields that differ between the processes of one run by design, not between programs: a function that captures
# the World is the same program on every process.
_PER_PROCESS: dict[type, tuple[str, ...]] = {}


def per_process_fields(cls: type, names: tuple[str, ...]) -> None:
    """Declare fields of the dataclass ``cls`` that legitimately differ between processes (left out of its
    fingerprint), e.g. ``World.process_id``."""
    _PER_PROCESS[cls] = tuple(names)


@dataclasses.dataclass(frozen=True)
class Item:
    """One comparable part of a program.

    Attributes:
        label: what it is: ``"code"`` (the function's own code), a captured variable's name (``"k"``), a parameter
            with its default (``"x (default)"``), a static argument's name; ``"reduce.r"`` for variable ``r``
            captured by the function held in ``reduce``.
        digest: hex digest of its content; processes compare these.
        description: a short, readable description for messages (``"9"``, ``"<lambda> at run.py:12"``).
    """

    label: str
    digest: str
    description: str


def _short(text: str) -> str:
    text = _ADDRESS.sub("", text)
    return text if len(text) <= _DESCRIPTION else text[: _DESCRIPTION - 3] + "..."


def describe(value: Any) -> str:
    """A short description of ``value`` that is the same in every process (no memory addresses)."""
    fn = _function_of(value)
    if fn is not None:
        code = fn.__code__
        return f"{fn.__qualname__} at {code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"
    if (isinstance(value, np.ndarray) and value.size > SMALL_ARRAY) or _is_jax_array(value):
        return f"{type(value).__name__} {np.dtype(value.dtype).name}{tuple(np.shape(value))}"
    if isinstance(value, type | types.BuiltinFunctionType | types.ModuleType):
        return f"{getattr(value, '__module__', None) or ''}.{getattr(value, '__qualname__', value.__name__)}" \
            .lstrip(".")
    try:
        return _short(repr(value))
    except Exception:  # a broken __repr__ must not break the guard
        return type(value).__qualname__


def _is_jax_array(value: Any) -> bool:
    module = type(value).__module__ or ""
    return hasattr(value, "shape") and hasattr(value, "dtype") and (module.startswith(("jax", "jaxlib")))


def _function_of(value: Any) -> types.FunctionType | None:
    return value if isinstance(value, types.FunctionType) else None


class _Hasher:
    """Feeds a value's content into a hash, depth-first, with type tags (``1`` and ``1.0`` and ``True`` differ)."""

    def __init__(self) -> None:
        self.hash = hashlib.blake2b(digest_size=12)
        self.active: set[int] = set()  # objects on the current path: a cycle is fed as a back reference

    def tag(self, *parts: str) -> None:
        for part in parts:
            data = part.encode("utf-8", "surrogatepass")
            self.hash.update(len(data).to_bytes(4, "little") + data)

    def digest(self) -> str:
        return self.hash.hexdigest()

    def value(self, value: Any, depth: int = 0) -> None:
        if depth > _DEPTH:
            self.tag("deep", type(value).__qualname__)
            return
        if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
            self.tag(type(value).__qualname__, repr(value))
            return
        if isinstance(value, np.generic | np.dtype):
            self.tag("numpy", type(value).__qualname__, repr(value))
            return
        if isinstance(value, np.ndarray):
            self.tag("ndarray", value.dtype.str, repr(value.shape))
            if value.size <= SMALL_ARRAY and value.dtype.kind in "biufcSU":
                self.tag(repr(value.tolist()))
            return
        if _is_jax_array(value):
            self.tag("array", type(value).__qualname__, str(value.dtype), repr(tuple(value.shape)))
            return
        key = id(value)
        if key in self.active:
            self.tag("cycle", type(value).__qualname__)
            return
        self.active.add(key)
        try:
            self._compound(value, depth + 1)
        finally:
            self.active.discard(key)

    def _compound(self, value: Any, depth: int) -> None:
        if isinstance(value, types.FunctionType):
            self.function(value, depth)
        elif isinstance(value, types.CodeType):
            self.code(value, depth)
        elif isinstance(value, tuple | list):
            self.tag(type(value).__qualname__, str(len(value)))
            for element in value:
                self.value(element, depth)
        elif isinstance(value, dict | types.MappingProxyType):
            self.tag(type(value).__qualname__, str(len(value)))
            for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])):
                self.value(k, depth)
                self.value(v, depth)
        elif isinstance(value, set | frozenset):
            self.tag(type(value).__qualname__, str(len(value)))
            for digest in sorted(_digest_of(v, depth) for v in value):
                self.tag(digest)
        elif isinstance(value, functools.partial):
            self.tag("partial")
            self.value(value.func, depth)
            self.value(value.args, depth)
            self.value(value.keywords, depth)
        elif isinstance(value, types.MethodType):
            self.tag("method")
            self.value(value.__func__, depth)
            self.value(value.__self__, depth)
        elif isinstance(value, type | types.BuiltinFunctionType | types.ModuleType):
            self.tag("named", describe(value))
        elif dataclasses.is_dataclass(value):
            self.tag("dataclass", type(value).__module__, type(value).__qualname__)
            skip = _PER_PROCESS.get(type(value), ())
            for field in dataclasses.fields(value):
                if field.name in skip:
                    continue
                self.tag(field.name)
                self.value(getattr(value, field.name, None), depth)
        elif callable(value) and hasattr(value, "__wrapped__"):  # functools.wraps, jax.jit, ...
            self.tag("wrapper", type(value).__qualname__)
            self.value(value.__wrapped__, depth)
        else:
            self.tag("object", type(value).__module__, type(value).__qualname__, describe(value))

    def code(self, code: types.CodeType, depth: int) -> None:
        # Not the names of the function, its file or its line numbers: the same code written twice matches.
        self.tag("code", code.co_code.hex(), repr(code.co_names), repr(code.co_freevars), repr(code.co_cellvars),
                 repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)))
        for const in code.co_consts:
            self.value(const, depth)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        self.tag("function")
        self.code(fn.__code__, depth)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            self.tag(name)
            self.value(_cell_value(cell), depth)
        self.value(fn.__defaults__, depth)
        self.value(fn.__kwdefaults__, depth)


class _Empty:
    def __repr__(self) -> str:
        return "<unbound>"


_EMPTY = _Empty()


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a variable not bound yet
        return _EMPTY


def _digest_of(value: Any, depth: int = 0) -> str:
    hasher = _Hasher()
    hasher.value(value, depth)
    return hasher.digest()


def value_item(label: str, value: Any) -> Item:
    """The :class:`Item` of one value (a static argument, a kernel option)."""
    return Item(label, _digest_of(value), describe(value))


def _items(fn: types.FunctionType, prefix: str, depth: int) -> list[Item]:
    code = fn.__code__
    hasher = _Hasher()
    hasher.code(code, depth)
    items = [Item(prefix.rstrip(".") or "code", hasher.digest(), describe(fn))]
    named = [(name, _cell_value(cell)) for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True)]
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    positional = names[: code.co_argcount]
    named += [(f"{name} (default)", v) for name, v in
              zip(positional[len(positional) - len(fn.__defaults__ or ()):], fn.__defaults__ or (), strict=True)]
    named += [(f"{name} (default)", v) for name, v in sorted((fn.__kwdefaults__ or {}).items())]
    for name, value in named:
        inner = _function_of(value)
        if inner is not None and depth < 3:  # a captured function: its own code and captured values, named
            items += _items(inner, f"{prefix}{name}.", depth + 1)
        elif isinstance(value, tuple) and isinstance(fields := getattr(value, "_fields", None), tuple):
            # a NamedTuple of options (a kernel's static arguments bundled): each field is named as the argument
            # it holds, so a mismatch reads "linking_length=0.06", not the whole bundle
            items += [Item(prefix + field, _digest_of(v, depth), describe(v))
                      for field, v in zip(fields, value, strict=True)]
        else:
            items.append(Item(prefix + name, _digest_of(value, depth), describe(value)))
    return items


def _identity(fn: types.FunctionType) -> tuple:
    cells = tuple(id(_cell_value(cell)) for cell in fn.__closure__ or ())
    return cells, id(fn.__defaults__), id(fn.__kwdefaults__)


_cache: weakref.WeakKeyDictionary[Callable[..., Any], tuple[tuple, tuple[Item, ...], str]] = \
    weakref.WeakKeyDictionary()


def function_items(fn: Callable[..., Any]) -> tuple[tuple[Item, ...], str]:
    """``(items, digest)`` of ``fn``: its code, captured variables and defaults, and one digest of them all.

    Cached per function object; recomputed when a captured variable or a default is rebound to another object (a
    mutation inside a captured object is not seen).
    """
    target = _function_of(fn)
    if target is None:
        item = value_item("code", fn)
        return (item,), item.digest
    identity = _identity(target)
    cached = _cache.get(target)
    if cached is not None and cached[0] == identity:
        return cached[1], cached[2]
    items = tuple(_items(target, "", 0))
    digest = hashlib.blake2b("".join(f"{i.label}={i.digest};" for i in items).encode(), digest_size=12).hexdigest()
    _cache[target] = (identity, items, digest)
    return items, digest
