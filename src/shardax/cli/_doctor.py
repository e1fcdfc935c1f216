"""``shardax doctor``: versions, platform, world, device grid and a collective self-test with bandwidth."""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._version import __version__
from ..runtime import ENV_NUM_PROCESSES
from ._options import add_run_options, add_world_options, job_parser, positive_int

if TYPE_CHECKING:
    from ._selftest import CheckResult


def doctor_parser() -> argparse.ArgumentParser:
    parser = job_parser("doctor", "Print versions, platform, the multi-process world and device grid, then check "
                                  "allreduce, alltoall and alltoallv against NumPy on a flat mesh of all devices and "
                                  "report bandwidth. The exit code is non-zero if any check fails.")
    add_world_options(parser, processes_help="re-run under `shardax launch -n N` (rank 0 prints the report)")
    parser.add_argument("--size-mb", type=float, default=1.0, metavar="MB",
                        help="message size per device for the self-test, in MiB (default 1)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed calls per check; the median is reported (default 5)")
    add_run_options(parser, out=None, timeout=300.0, timeout_help="with --processes: stop after S seconds",
                    cache=False)
    return parser


def run_cli(argv: Sequence[str]) -> int:
    """``shardax doctor ...``: returns 0 if every check passed."""
    parser = doctor_parser()
    ns = parser.parse_args(list(argv))
    if not (math.isfinite(ns.size_mb) and ns.size_mb > 0):
        parser.error(f"--size-mb must be a positive number of MiB, got {ns.size_mb}")
    if ns.processes is not None and ENV_NUM_PROCESSES not in os.environ:
        return _relaunch(ns)
    return doctor(cpu_devices=ns.cpu_devices, nbytes=int(ns.size_mb * 2**20), repeats=ns.repeats,
                  plain=ns.plain)


def _relaunch(ns: argparse.Namespace) -> int:
    from ..runtime import launch

    args = ["-m", "shardax.cli", "doctor", "--size-mb", str(ns.size_mb), "--repeats", str(ns.repeats)]
    if ns.plain:
        args.append("--plain")
    return launch(args, num_processes=ns.processes, cpu_devices=ns.cpu_devices, timeout_s=ns.timeout).returncode


def _format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _table_rows(results: Sequence[CheckResult]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for r in results:
        if math.isfinite(r.seconds) and r.seconds > 0:
            timing, bandwidth = f"{r.seconds * 1e3:.2f} ms", f"{r.nbytes / r.seconds / 1e9:.3f}"
        else:
            timing, bandwidth = "-", "-"
        rows.append((r.name, _format_bytes(r.nbytes), timing, bandwidth, "PASS" if r.ok else "FAIL"))
    return rows


def _report_sections() -> list[tuple[str, list[tuple[str, str]]]]:
    import jax
    import jaxlib

    from ..runtime import detect_launch, device_grid, world

    w = world()
    launch = detect_launch()
    where = launch.source + (f" (coordinator {launch.coordinator_address})" if launch.coordinator_address else "")
    grid = device_grid()
    versions = [("shardax", __version__), ("jax", jax.__version__), ("jaxlib", jaxlib.__version__),
                ("python", platform.python_version()), ("platform", platform.platform()),
                ("backend", f"{jax.default_backend()} ({grid[0, 0].device_kind})")]
    world_rows = [("process_id", str(w.process_id)), ("num_processes", str(w.num_processes)),
                  ("local devices", str(w.local_device_count)), ("global devices", str(w.device_count)),
                  ("hosts", str(w.num_hosts)), ("mode", w.mode), ("started by", where),
                  ("sx.comm between processes", _transport_line(w.num_processes, w.platform))]
    if w.platform == "cpu" and w.num_processes > 1:
        world_rows.append(("  native call", _native_line(w.local_device_count)))
    grid_rows = [(f"process {p}", " ".join(f"{d.platform}:{d.id}" for d in grid[p])) for p in range(grid.shape[0])]
    return [("versions", versions), ("world", world_rows),
            (f"device grid ({grid.shape[0]} x {grid.shape[1]})", grid_rows)]


def _native_line(local_devices: int) -> str:
    """Whether MPI collectives run as the native call here, and which of them."""
    from .._transport import cpu_collectives

    if cpu_collectives() != "mpi":
        return "-"
    from .. import _mpi_native

    how = _mpi_native.reason()
    if not how.startswith("native"):
        return how
    which = "every collective over the run" if local_devices == 1 else \
        "allreduce, alltoall and alltoallv/exchange over every device; the rest as host calls"
    return f"{how}; {which}"


def _transport_line(num_processes: int, platform: str) -> str:
    """Which transport carries sx.comm's collectives between processes here, and why."""
    from .._transport import cpu_collectives, transport_reason

    if platform != "cpu":
        return f"XLA's collectives ({platform}; NCCL on NVIDIA GPUs)"
    if num_processes == 1:
        return "none needed (one process; XLA's in-process collectives)"
    if cpu_collectives() == "mpi":
        from mpi4py import MPI

        return f"mpi: {MPI.Get_library_version().split(',')[0].strip()} ({transport_reason()})"
    return f"gloo: XLA's TCP collectives ({transport_reason()})"


def _print_plain(sections: Sequence[tuple[str, list[tuple[str, str]]]], title: str,
                 rows: Sequence[tuple[str, ...]], errors: Sequence[str]) -> None:
    lines = ["shardax doctor"]
    for name, items in sections:
        lines.append(f"{name}:")
        width = max(len(k) for k, _ in items)
        lines += [f"  {k:<{width}}  {v}" for k, v in items]
    lines.append(f"{title}:")
    header = ("check", "message/device", "time", "GB/s", "result")
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines += ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)).rstrip()
              for row in (header, *rows)]
    lines += [f"  {e}" for e in errors]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _print_rich(sections: Sequence[tuple[str, list[tuple[str, str]]]], title: str,
                rows: Sequence[tuple[str, ...]], errors: Sequence[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print("[bold]shardax doctor[/bold]")
    for name, items in sections:
        info = Table(title=name, title_justify="left", show_header=False, box=None, padding=(0, 2))
        info.add_column(style="bold")
        info.add_column(overflow="fold")
        for k, v in items:
            info.add_row(k, v)
        console.print(info)
    table = Table(title=title, title_justify="left")
    for col, justify in (("check", "left"), ("message/device", "right"), ("time", "right"), ("GB/s", "right"),
                         ("result", "center")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        style = "green" if row[-1] == "PASS" else "red"
        table.add_row(*row[:-1], f"[{style}]{row[-1]}[/{style}]")
    console.print(table)
    for e in errors:
        console.print(e, markup=False)


def doctor(*, cpu_devices: int | None = None, nbytes: int = 2**20, repeats: int = 5, plain: bool = False) -> int:
    """Join the run (``sx.initialize``), print the report on process 0 and return 0 if every check passed."""
    from .._errors import DistributedSetupError
    from ..runtime import flat_mesh, initialize
    from ._selftest import run_self_test

    try:
        w = initialize(cpu_devices=cpu_devices)
    except DistributedSetupError as err:
        sys.stderr.write(f"shardax doctor: {err}\n")
        return 1
    sections = _report_sections()
    mesh = flat_mesh()
    results = run_self_test(mesh, nbytes, repeats)
    if w.process_id == 0:
        title = (f"collective self-test (flat mesh of {mesh.size} devices, axis {mesh.axis_names[0]!r}; "
                 "GB/s = bytes sent per device / median time)")
        errors = [f"{r.name}: {r.error}" for r in results if r.error]
        use_rich = not plain
        if use_rich:
            try:
                import rich  # noqa: F401
            except ImportError:
                use_rich = False
        (_print_rich if use_rich else _print_plain)(sections, title, _table_rows(results), errors)
        failed = [r.name for r in results if not r.ok]
        summary = f"FAILED: {', '.join(failed)}" if failed else "all checks passed"
        sys.stdout.write(f"doctor: {summary}\n")
        sys.stdout.flush()
    return 0 if all(r.ok for r in results) else 1
