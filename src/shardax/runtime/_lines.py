"""Whole lines from one output pipe of a launched process, with gloo's reports cut out of the user's lines.

A launched Python process writes unbuffered (``PYTHONUNBUFFERED=1``, so that lines arrive as they are printed), and
``print("x", shape, total)`` is then several writes. gloo, the CPU collectives library under JAX, prints its
connection report (``[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7``)
to the same file descriptor from its own threads, so the report can land between two pieces of one user line. The
assembler cuts every complete report out wherever it lands, gives it as a line of its own, and joins the pieces of
the user's line again. Reports that several gloo threads printed into each other are still recognised as chatter
when the line holds nothing else; each report ends with its own newline, so the ends of the others (their last
numbers, or nothing) follow as lines of their own and are chatter too (a line of only digits and spaces, right
after such a line, is taken for one).
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


# Open MPI's ``--tag-output`` prefix, ``[jobid,rank]<stream>:``. mpirun writes one before every piece it read from a
# rank's pipe and after every newline inside one, so pieces of the ranks' partial lines follow each other in its
# output, each behind its own tag.
_MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<(?:stdout|stderr)>:")
# What may be the start of a tag cut by a pipe read (held until the next read says).
_MPI_TAG_START = re.compile(rb"\[\d*(?:,\d*(?:\](?:<[a-z]*>?)?)?)?\Z")


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
        self._owed = 0  # newlines of reports printed into an earlier line, still to come

    def feed(self, data: bytes) -> list[Line]:
        """The lines that ``data`` completes."""
        buf = self._pending + data
        if not self._owed and not any(word in buf for word in _CLUES):  # the common case: split, nothing to look for
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
                lines.append(Line(_decode(raw), self._chatter(raw)))
                start = end + 1
        self._pending = buf[start:]
        return lines

    def _chatter(self, raw: bytes) -> bool:
        """Whether the whole line ``raw`` is pieces of reports; counts the newlines of those it started."""
        owed = self._owed and _ONLY_NUMBERS.fullmatch(raw) is not None
        if not (owed or _is_chatter(raw)):
            self._owed = 0
            return False
        self._owed = max(0, self._owed + raw.count(b"[Gloo] Rank") - 1)
        return True

    def close(self) -> list[Line]:
        """The last line if the process ended without a newline (a partial line is given whole)."""
        raw, self._pending, self._owed = self._pending, b"", 0
        return [Line(_decode(raw), _is_chatter(raw))] if raw else []


class TaggedLines:
    """Bytes of ``mpirun --tag-output``'s pipe in, whole lines out under the rank their tags name.

    mpirun tags each piece it read from a rank, not each line: a line one rank writes in pieces (an unbuffered
    ``print``) arrives as tagged pieces between other ranks' pieces. Each rank gets its own
    :class:`LineAssembler` here, so its pieces are joined again whatever landed between them; text after a newline
    and before the next tag is mpirun's own (given under ``untagged``).

    Example:
        >>> t = TaggedLines("mpirun")
        >>> got = t.feed(b"[1,0]<stdout>:a from 0[1,1]<stdout>:a from 1[1,1]<stdout>: end\\n"
        ...              b"[1,0]<stdout>: end\\nbye\\n")
        >>> [(label, line.text) for label, line in got]
        [('1', 'a from 1 end'), ('0', 'a from 0 end'), ('mpirun', 'bye')]
    """

    def __init__(self, untagged: str) -> None:
        self._untagged = untagged
        self._label = untagged  # whose bytes these are until the next tag or newline
        self._assemblers: dict[str, LineAssembler] = {}
        self._pending = b""

    def feed(self, data: bytes) -> list[tuple[str, Line]]:
        """The lines that ``data`` completes, each with its rank (or ``untagged``)."""
        buf, start, lines = self._pending + data, 0, []
        for tag in _MPI_TAG.finditer(buf):
            self._give(buf[start:tag.start()], lines)
            self._label, start = tag.group(1).decode(), tag.end()
        rest = buf[start:]
        cut = rest.rfind(b"[")
        if cut >= 0 and _MPI_TAG_START.match(rest, cut):
            rest, self._pending = rest[:cut], rest[cut:]
        else:
            self._pending = b""
        self._give(rest, lines)
        return lines

    def close(self) -> list[tuple[str, Line]]:
        """Every rank's partial last line, given whole."""
        lines: list[tuple[str, Line]] = []
        self._give(self._pending, lines)
        self._pending = b""
        for label, assembler in self._assemblers.items():
            lines += [(label, line) for line in assembler.close()]
        return lines

    def _give(self, data: bytes, lines: list[tuple[str, Line]]) -> None:
        while data:
            end = data.find(b"\n")
            piece, data = (data, b"") if end < 0 else (data[:end + 1], data[end + 1:])
            assembler = self._assemblers.setdefault(self._label, LineAssembler())
            lines += [(self._label, line) for line in assembler.feed(piece)]
            if end >= 0:
                self._label = self._untagged
