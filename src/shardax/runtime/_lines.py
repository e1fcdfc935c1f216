"""Whole lines from one output pipe of a launched process, with gloo's reports cut out of the user's lines.

A launched Python process writes unbuffered (``PYTHONUNBUFFERED=1``, so that lines arrive as they are printed), and
``print("x", shape, total)`` is then several writes. gloo, the CPU collectives library under JAX, prints its
connection report (``[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7``)
to the same file descriptor from its own threads, so the report can land between two pieces of one user line. The
assembler cuts every complete report out wherever it lands, gives it as a line of its own, and joins the pieces of
the user's line again. Reports that several gloo threads printed into each other are still recognised as chatter
when the line holds nothing else.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# A report's end: every one is a single `std::cout << ... << std::endl`.
_CONNECTED = rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+"
_NOT_CONNECTED = rb"\[Gloo\] Rank \d+ is NOT connected to: \[[\d, ]*\]"
_REPORT = re.compile(rb"(?:(?P<chatter>" + _CONNECTED + rb")|" + _NOT_CONNECTED + rb")\r?\n\Z")
# The fixed words of the connection report, for reports printed in pieces of each other.
_WORDS = re.compile(rb"\[Gloo\] Rank |is connected to|peer ranks\.|Expected number of connected peer ranks is :")
_ONLY_NUMBERS = re.compile(rb"[\d\s:.]*")
# Every report, and every piece of one, holds one of these.
_CLUES = (b"[Gloo]", b"onnected", b"peer ranks")
# A line longer than this is given in parts rather than held (a process writing without newlines).
MAX_LINE = 1 << 20


class Line(NamedTuple):
    """One whole line of output, without its newline; ``chatter`` marks gloo's connection reports."""

    text: str
    chatter: bool = False


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _is_chatter(raw: bytes) -> bool:
    """Whether ``raw`` is made only of connection-report pieces (several gloo threads printing at once)."""
    return _WORDS.search(raw) is not None and _ONLY_NUMBERS.fullmatch(_WORDS.sub(b" ", raw)) is not None


class LineAssembler:
    """Bytes of one pipe in, whole :class:`Line` s out.

    Example:
        >>> a = LineAssembler()
        >>> a.feed(b"X (8, 1000)")
        []
        >>> [l.text for l in a.feed(b"[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected "
        ...                          b"peer ranks is : 7\\n 42\\nlast")]
        ['[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7', 'X (8, 1000) 42']
        >>> a.close()
        [Line(text='last', chatter=False)]
    """

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[Line]:
        """The lines that ``data`` completes."""
        buf = self._pending + data
        if not any(word in buf for word in _CLUES):  # the common case: split, nothing to look for
            *complete, self._pending = buf.split(b"\n")
            lines = [Line(_decode(raw)) for raw in complete]
        else:
            lines = self._scan(buf)
        if len(self._pending) > MAX_LINE:
            lines.append(Line(_decode(self._pending)))
            self._pending = b""
        return lines

    def _scan(self, buf: bytes) -> list[Line]:
        start, lines = 0, []
        while (end := buf.find(b"\n", start)) >= 0:
            raw = buf[start:end + 1]
            report = _REPORT.search(raw)
            if report is not None:
                # What came before the report is the start of a line that goes on after it.
                lines.append(Line(_decode(report.group()), report.group("chatter") is not None))
                buf, start = raw[:report.start()] + buf[end + 1:], 0
            else:
                lines.append(Line(_decode(raw), _is_chatter(raw)))
                start = end + 1
        self._pending = buf[start:]
        return lines

    def close(self) -> list[Line]:
        """The last line if the process ended without a newline (a partial line is given whole)."""
        raw, self._pending = self._pending, b""
        return [Line(_decode(raw), _is_chatter(raw))] if raw else []
