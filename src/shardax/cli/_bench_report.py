"""``shardax bench``'s output: the table of ratios (rich or plain text) and the plots of time vs N and vs devices."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._bench_cases import KERNELS, Kernel

if TYPE_CHECKING:
    from ._bench import Row

_HEADER = ("kernel", "anchor", "size", "devices", "first call", "shardax", "anchor time", "ratio", "target", "met")
_RIGHT = range(4, 8)  # the columns of numbers


def _seconds(t: float | None, gflops: float | None = None) -> str:
    if t is None:
        return "-"
    text = f"{t * 1e3:.2f} ms" if t < 0.01 else f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"
    return text if gflops is None else f"{text} ({gflops:.1f} GF/s)"


def _size(row: Row) -> str:
    return "-" if row.size is None else KERNELS[row.kernel].size_format.format(row.size)


def _cells(row: Row) -> tuple[str, ...]:
    if row.status != "ok":
        met = "skipped" if row.status == "skipped" else "FAILED"
        return (row.kernel, row.anchor, _size(row), row.config, "-", "-", "-", "-", row.target, met)
    target = row.target
    if row.versus == "1 device":
        target += f": {row.value:.2f}x" if row.value is not None else ": no 1-dev run"
    elif "GFLOP/s" in target and row.ratio:
        target += f": {1 / row.ratio:.2f}x"  # shardax's GFLOP/s over the anchor's: the inverse time ratio
    met = "-" if row.met is None else "yes" if row.met else "no"
    return (row.kernel, row.anchor, _size(row), row.config, _seconds(row.first_call_s),
            _seconds(row.shardax_median_s, row.extra.get("shardax_gflops")),
            _seconds(row.anchor_median_s, row.extra.get("anchor_gflops")),
            "-" if row.ratio is None else f"{row.ratio:.2f}x", target, met)


def _notes(rows: Sequence[Row], kernels: Sequence[Kernel], machine: dict[str, Any], repeat: int,
           cache: str | None = None) -> list[str]:
    used = {(r.kernel, r.anchor) for r in rows}
    anchors = [f"  {k.name} vs {a}: {what}" for k in kernels for a, what in k.anchors.items() if (k.name, a) in used]
    load = f"{machine['load_average_start'][0]:.1f} -> {machine['load_average_end'][0]:.1f}"
    sizes = ", ".join(f"{k.name} {k.size_format.format(k.docs_size)}" for k in kernels if k.docs_size is not None)
    first = ("compilation or loading from the persistent cache in " + cache if cache else "compilation")
    lines = [f"ratio = shardax / anchor, medians of {repeat} timed call(s) after a warm-up call, measured back to "
             "back in the same process (< 1: shardax is faster): steady state, no compile time in it. "
             f"'first call' is shardax's warm-up call ({first}, and capacity retries, included).",
             f"Targets are those of docs/benchmarks.md, judged at the sizes it states them for ({sizes}; "
             "--docs-sizes runs exactly those); '1 dev' targets compare shardax with itself on one device at the "
             "same size.",
             f"machine: {machine['cores']} cores, load average {load}, jax {machine['jax']}; the anchors run on "
             "this process's cores whatever the device count.",
             "anchors:", *anchors]
    problems = [f"  {r.kernel} vs {r.anchor}" + (f" [{r.config}]" if r.config != "-" else "")
                + (f" {_size(r)}" if r.size is not None else "") + f": {r.status}: {r.reason}"
                for r in rows if r.status != "ok"]
    if problems:
        lines += ["not run:", *problems]
    return lines


def print_table(rows: Sequence[Row], kernels: Sequence[Kernel], machine: dict[str, Any], repeat: int, *,
                plain: bool = False, cache: str | None = None) -> None:
    """Print the table of every row, then notes: what each anchor is, the machine, skipped and failed cases."""
    cells = [_cells(r) for r in rows]
    notes = _notes(rows, kernels, machine, repeat, cache)
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            plain = True
    if plain:
        widths = [max(len(c[i]) for c in (_HEADER, *cells)) for i in range(len(_HEADER))]
        lines = ["  ".join(f"{c:>{w}}" if i in _RIGHT else f"{c:<{w}}"
                           for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
                 for row in (_HEADER, *cells)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        sys.stdout.write("\n".join(["", *lines, *notes]) + "\n")
        sys.stdout.flush()
        return
    console = Console(highlight=False)
    if not console.is_terminal:
        # A file or a pipe: no terminal width to fit, and 80 columns would fold every cell.
        console = Console(highlight=False, width=200)
    table = Table(title="shardax bench", title_justify="left")
    for i, name in enumerate(_HEADER):
        table.add_column(name, justify="right" if i in _RIGHT else "left")
    colours = {"yes": "green", "no": "red", "FAILED": "bold red", "skipped": "yellow"}
    for c in cells:
        colour = colours.get(c[-1])
        table.add_row(*c[:-1], f"[{colour}]{c[-1]}[/{colour}]" if colour else c[-1])
    console.print(table)
    for line in notes:
        console.print(line, markup=False)


def write_plots(rows: Sequence[Row], out: str) -> tuple[list[str], str]:
    """Write ``time_vs_n.png`` and ``time_vs_devices.png`` into ``out``.

    Returns:
        The paths written, and why a plot was not written ("" when both were).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install matplotlib)"
    ok = [r for r in rows if r.status == "ok" and r.size is not None and r.shardax_median_s is not None]
    written, missing = [], []
    for name, plot in (("time_vs_n.png", _time_vs_n), ("time_vs_devices.png", _time_vs_devices)):
        panels = _panels(ok, by_size=name == "time_vs_n.png")
        if not panels:
            missing.append(f"{name}: no kernel ran at two " + ("sizes" if name == "time_vs_n.png" else
                                                               "device counts"))
            continue
        cols = min(3, len(panels))
        rows_ = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.4 * rows_), squeeze=False)
        for ax, (kernel, data) in zip(axes.ravel(), panels.items(), strict=False):
            plot(ax, kernel, data)
        for ax in axes.ravel()[len(panels):]:
            ax.set_visible(False)
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written, "; ".join(missing)


def _panels(rows: Sequence[Row], *, by_size: bool) -> dict[str, list[Row]]:
    """Kernel -> its rows worth a panel: two sizes or more on one device configuration, or two configurations
    or more at the largest size."""
    panels: dict[str, list[Row]] = {}
    for kernel in dict.fromkeys(r.kernel for r in rows):
        mine = [r for r in rows if r.kernel == kernel]
        if by_size:
            keep = [r for r in mine if len({s.size for s in mine if s.config == r.config}) > 1]
        else:
            largest = max(r.size or 0 for r in mine)
            keep = [r for r in mine if r.size == largest]
            keep = keep if len({r.config for r in keep}) > 1 else []
        if keep:
            panels[kernel] = keep
    return panels


def _time_vs_n(ax: Any, kernel: str, rows: list[Row]) -> None:
    for config in dict.fromkeys(r.config for r in rows):
        mine = sorted((r for r in rows if r.config == config), key=lambda r: r.size or 0)
        ax.plot([r.size for r in mine if r.anchor == mine[0].anchor],
                [r.shardax_median_s for r in mine if r.anchor == mine[0].anchor], "o-", label=f"shardax {config} dev")
        for anchor in dict.fromkeys(r.anchor for r in mine):
            pts = [(r.size, r.anchor_median_s) for r in mine if r.anchor == anchor and r.anchor_median_s]
            if pts:
                ax.plot(*zip(*pts, strict=True), "s--", label=anchor)
    _decorate(ax, kernel, KERNELS[kernel].size_format.replace("{:,}", "{}").format("n"))
    sizes = sorted({r.size for r in rows if r.size is not None})
    ax.set_xticks(sizes, labels=[_tick(s) for s in sizes])
    ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)


def _tick(n: int) -> str:
    return f"{n / 1e6:.3g}M" if n >= 10**6 else f"{n / 1e3:.3g}k" if n >= 10**4 else str(n)


def _time_vs_devices(ax: Any, kernel: str, rows: list[Row]) -> None:
    first = rows[0].anchor
    single = sorted((r for r in rows if r.processes == 1 and r.anchor == first), key=lambda r: r.devices)
    ax.plot([r.devices for r in single], [r.shardax_median_s for r in single], "o-", label="shardax, 1 process")
    for r in rows:
        if r.processes > 1 and r.anchor == first:
            ax.plot([r.devices], [r.shardax_median_s], "^", markersize=9, label=f"shardax {r.config}")
    for anchor in dict.fromkeys(r.anchor for r in rows):
        pts = sorted((r.devices, r.anchor_median_s) for r in rows if r.anchor == anchor and r.anchor_median_s)
        if pts:
            ax.plot(*zip(*pts, strict=True), "s--", label=anchor)
    ax.set_xscale("log", base=2)
    devices = sorted({r.devices for r in rows})
    ax.set_xticks(devices, labels=[str(d) for d in devices])
    ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    size = KERNELS[kernel].size_format.format(rows[0].size)
    ax.set_title(f"{kernel}, {size}")
    ax.set_xlabel("CPU devices")
    ax.set_ylabel("seconds per call (median, warm)")
    ax.set_yscale("log")
    _readable_y(ax)
    ax.legend(fontsize=7)


def _readable_y(ax: Any) -> None:
    """1-2-5 ticks on the log time axis, labelled without overlap, minor ticks unlabelled."""
    from ._plots import log_axis

    lo, hi = ax.get_ylim()
    log_axis(ax.yaxis, lo, hi)
    ax.set_ylim(lo, hi)


def _decorate(ax: Any, kernel: str, xlabel: str) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(kernel)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds per call (median, warm)")
    _readable_y(ax)
    ax.legend(fontsize=7)
