"""Communication volume read from a compiled XLA program (not assumed from the algorithm): how many all-to-all
instructions it holds and how many bytes each device sends through them, for any kernel (the FFT's transposes, the
exchange of particles)."""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-to-all|all-to-all-start)\(")
_EXPLICIT_GROUP = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_IOTA_GROUP = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")


class CollectiveVolume(NamedTuple):
    """``all_to_all`` traffic of one device in a compiled program.

    Attributes:
        ops: number of ``all-to-all`` instructions.
        bytes_sent: bytes each device sends to other devices (its own share excluded).
    """

    ops: int
    bytes_sent: int


def _group_size(line: str) -> int:
    explicit = _EXPLICIT_GROUP.search(line)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = _IOTA_GROUP.search(line)
    if iota:
        return int(iota.group(2))
    raise ValueError(f"cannot read the replica groups of: {line.strip()[:200]}")


def collective_bytes(compiled: Any) -> CollectiveVolume:
    """Count the ``all-to-all`` instructions of a compiled program and the bytes each device sends through them.

    Args:
        compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.

    Returns:
        A :class:`CollectiveVolume`. Both the tuple form (one operand per peer) and the array form of XLA's
        ``all-to-all`` are read; a device's own share is not counted as sent.

    Example:
        >>> import shardax as sx
        >>> sx.comm.collective_bytes("%a = (c64[4]{0}, c64[4]{0}) all-to-all(%x, %y), replica_groups={{0,1}}")
        CollectiveVolume(ops=1, bytes_sent=32)
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    ops = 0
    sent = 0
    for line in text.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        ops += 1
        result = match.group(1)
        pieces = [_ITEMSIZE[dt] * math.prod(int(n) for n in dims.split(",") if n)
                  for dt, dims in _SHAPE.findall(result)]
        if result.startswith("(") and len(pieces) > 1:
            parts = len(pieces)
            sent += sum(pieces) * (parts - 1) // parts
        else:
            parts = _group_size(line)
            sent += sum(pieces) * (parts - 1) // parts
    return CollectiveVolume(ops, sent)
