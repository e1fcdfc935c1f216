"""The rows of ``shardax demo``: one per capability, kept in a JSON report and printed as a table (``rich`` if
installed) with the verdict that sets the exit code.

This module imports neither JAX nor the kernels: the parent process of a launched demo uses it to print the report
that process 0 of the run wrote.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

REPORT_NAME = "demo_report.json"

# The capabilities, in the order the demo runs them; a report without one of them failed before reaching it.
CAPABILITIES = ("runtime + collectives", "zsort", "knn density", "fof + catalogue", "potrs", "syevd", "fftn",
                "paint + power spectrum")


@dataclasses.dataclass(frozen=True)
class Row:
    """One capability's line of the table.

    Attributes:
        capability: one of :data:`CAPABILITIES`.
        scale: the problem size, e.g. ``"30000 particles"``.
        first_s: wall seconds of the first call of its distributed functions (compilation included); NaN if it did
            not run.
        warm_s: wall seconds of a second, warm call.
        reference: what the result was compared against.
        ok: whether every comparison passed.
        failures: why not, one line each.
    """

    capability: str
    scale: str
    first_s: float
    warm_s: float
    reference: str
    ok: bool
    failures: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Report:
    """What process 0 of a demo run writes: the world, one row per capability run so far, plots and notes."""

    world: str
    rows: tuple[Row, ...]
    plots: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def with_missing(self, expected: Sequence[str] = CAPABILITIES) -> Report:
        """This report plus a failed row for every ``expected`` capability it does not have (the run ended before
        it)."""
        done = {row.capability for row in self.rows}
        missing = tuple(Row(name, "-", math.nan, math.nan, "-", False, ("did not finish: the run ended first",))
                        for name in expected if name not in done)
        return dataclasses.replace(self, rows=self.rows + missing)


def write_report(path: str, report: Report) -> None:
    """Write ``report`` as JSON to ``path`` (atomically: a reader never sees half a file)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(dataclasses.asdict(report), f, indent=1)
    os.replace(partial, path)


def read_report(path: str) -> Report | None:
    """The report at ``path``, or None if there is none (the run ended before its first stage)."""
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return None
    rows = tuple(Row(**{**row, "failures": tuple(row["failures"])}) for row in data["rows"])
    return Report(data["world"], rows, tuple(data["plots"]), tuple(data["notes"]))


def exit_code(report: Report, expected: Sequence[str] = CAPABILITIES) -> int:
    """0 if every ``expected`` capability ran and passed, else 1."""
    return 0 if all(row.ok for row in report.with_missing(expected).rows) else 1


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f} s"


def _cells(row: Row) -> tuple[str, ...]:
    return (row.capability, row.scale, _seconds(row.first_s), _seconds(row.warm_s), row.reference,
            "PASS" if row.ok else "FAIL")


_HEADER = ("capability", "scale", "first call", "warm", "checked against", "result")


def format_plain(report: Report) -> str:
    """The table as plain text, failures and plots below it."""
    lines = [f"shardax demo on {report.world}"]
    cells = [_HEADER, *(_cells(row) for row in report.rows)]
    widths = [max(len(line[col]) for line in cells) for col in range(len(_HEADER))]
    for line in cells:
        lines.append("  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip())
    return "\n".join(lines + _footer(report)) + "\n"


def _footer(report: Report) -> list[str]:
    lines = [f"{row.capability}: {reason}" for row in report.rows for reason in row.failures]
    lines += [f"plot: {path}" for path in report.plots]
    lines += list(report.notes)
    failed = [row.capability for row in report.rows if not row.ok]
    lines.append(f"demo: FAILED ({', '.join(failed)})" if failed else "demo: every check passed")
    return lines


def _print_rich(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    # Off a terminal (a log, a pipe) rich would wrap the table at 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    table = Table(title=f"shardax demo on {report.world}", title_justify="left")
    for name in _HEADER:
        table.add_column(name, justify="right" if name in ("first call", "warm") else "left")
    for row in report.rows:
        *text, verdict = _cells(row)
        colour = "green" if row.ok else "red"
        table.add_row(*text, f"[bold {colour}]{verdict}[/]")
    console.print(table)
    for line in _footer(report):
        console.print(line, markup=False)


def print_report(report: Report, *, plain: bool = False, out: TextIO | None = None) -> None:
    """Print ``report`` to ``out`` (default stdout): a ``rich`` table unless ``plain`` or ``rich`` is missing."""
    if not plain and out is None:
        try:
            import rich  # noqa: F401
        except ImportError:
            plain = True
    if plain or out is not None:
        stream = out or sys.stdout
        stream.write(format_plain(report))
        stream.flush()
        return
    _print_rich(report)

