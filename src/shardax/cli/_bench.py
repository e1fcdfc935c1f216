"""``shardax bench``: every kernel side by side with its anchor on 1..8 devices and 2 processes; table, JSON, plots.

Run it as ``shardax bench ...`` or ``python -m shardax.cli bench ...``. It runs on the backend JAX finds (``--backend``
overrides): on CPU devices against NumPy/SciPy anchors, on a GPU against the jitted JAX equivalents on the same
device (SciPy's FoF stays the anchor there: JAX has none). The number of CPU devices is fixed when a JAX backend
starts, so this process starts none: each device configuration runs in its own worker process
(:mod:`shardax.cli._bench_worker`), ``PxM`` ones as ``P`` processes of ``M`` devices through ``shardax launch``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._compile_cache import cache_env, default_cache_dir
from ..runtime import JobResult, ProcessSpec, Stream, launch, mpirun_spec, process_env, run_processes
from ._bench_cases import KERNELS, Kernel, Target, kernels
from ._options import add_run_options, job_parser, positive_int

_QUICK_DEVICES = "1,8"
_FULL_DEVICES = "1,2,4,8,2x4"
_GPU_DEVICES = "1"


def detect_backend(env: Mapping[str, str] | None = None) -> str:
    """``"cpu"`` or ``"gpu"``: the backend the workers' JAX will start, without starting one in this process.

    ``JAX_PLATFORMS`` decides when set (its first entry); otherwise a short subprocess asks JAX.
    """
    env = os.environ if env is None else env
    first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if not first:
        import subprocess

        probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=dict(env),
                               capture_output=True, text=True, timeout=300, check=False)
        lines = probe.stdout.split()
        first = lines[-1].lower() if probe.returncode == 0 and lines else "cpu"
    return "cpu" if first == "cpu" else "gpu"


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """``processes`` processes of ``per_process`` CPU devices each."""

    processes: int
    per_process: int

    @property
    def devices(self) -> int:
        return self.processes * self.per_process

    @property
    def label(self) -> str:
        return str(self.per_process) if self.processes == 1 else f"{self.processes}x{self.per_process}"


def parse_devices(text: str) -> list[DeviceConfig]:
    """``"1,2,4,8,2x4"`` -> device configurations; ``N`` is one process of N devices, ``PxM`` P processes of M."""
    configs = []
    for item in (s.strip() for s in text.split(",")):
        procs, _, per = item.rpartition("x")
        try:
            config = DeviceConfig(int(procs or 1), int(per))
        except ValueError:
            raise ValueError(f"--devices: {item!r} is neither N nor PxM (e.g. '1,2,4,8,2x4')") from None
        if config.processes < 1 or config.per_process < 1:
            raise ValueError(f"--devices: {item!r} must count at least one process and one device")
        if config not in configs:
            configs.append(config)
    return configs


@dataclasses.dataclass
class Row:
    """One line of the table (and of the JSON): a kernel against one anchor at one size and device configuration.

    Times are seconds; ``ratio`` is shardax's median over the anchor's (steady state: the warm-up call is not in
    it); ``first_call_s`` is shardax's first call (compilation, or loading from the persistent cache, and capacity
    retries included); ``value`` is the ratio the target is checked on (``ratio``, or shardax over shardax on one
    device for scaling targets), at the kernel's ``docs_size`` only.
    """

    kernel: str
    anchor: str
    size: int | None
    config: str
    devices: int
    processes: int
    status: str = "ok"
    reason: str = ""
    shardax_s: list[float] = dataclasses.field(default_factory=list)
    anchor_s: list[float] = dataclasses.field(default_factory=list)
    shardax_median_s: float | None = None
    anchor_median_s: float | None = None
    ratio: float | None = None
    first_call_s: float | None = None
    target: str = ""
    versus: str = ""
    value: float | None = None
    met: bool | None = None
    extra: dict[str, float] = dataclasses.field(default_factory=dict)


def bench_parser() -> argparse.ArgumentParser:
    parser = job_parser(
        "bench",
        "Time every shardax kernel side by side with its anchor (NumPy/SciPy, plain JAX collectives, "
        "jnp.fft, jaxdecomp and mpi4jax where installed) on CPU devices: back to back in the same "
        "process, medians over repeats. Prints a table of ratios against the targets of "
        "docs/benchmarks.md, writes the raw timings (JSON) and plots of time vs N and time vs devices. "
        "The size sweep runs on the first device configuration; the others run the largest size.")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes, 2 repeats, devices {_QUICK_DEVICES}: minutes, not hours")
    parser.add_argument("--docs-sizes", action="store_true",
                        help="each kernel at the one size docs/benchmarks.md states its figures and targets at "
                             "(e.g. FoF and kNN 1e6 points); the targets are judged at that size only")
    parser.add_argument("--only", default=None, metavar="K1,K2",
                        help="comma-separated kernels: " + ", ".join(KERNELS))
    parser.add_argument("--repeat", type=positive_int, default=None, metavar="R",
                        help="timed calls per case after a warm-up call (default 2 with --quick, else 5)")
    parser.add_argument("--devices", default=None, metavar="LIST",
                        help=f"device configurations: N (one process of N CPU devices) or PxM (P processes of M, "
                             f"through shardax launch) (default {_QUICK_DEVICES} with --quick, else {_FULL_DEVICES})")
    parser.add_argument("--json", default=None, metavar="PATH", help="results file (default DIR/bench.json)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="persistent compilation cache of the workers (default $JAX_COMPILATION_CACHE_DIR, else "
                             f"{default_cache_dir()}, shared with `shardax halos` and `shardax demo`): a second run "
                             "loads the programs the cache can hold instead of compiling them (on CPU, a program of "
                             "several devices whose collectives are not ordered by data is compiled again)")
    add_run_options(parser, out="bench_out", timeout=3600.0,
                    timeout_help="stop a device configuration's worker after S seconds",
                    cache="compile everything afresh (the 'first call' column is then the compile time)")
    parser.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto",
                        help="where the workers run: 'auto' (default) the backend JAX finds (JAX_PLATFORMS, else "
                             "JAX's own choice), 'cpu' CPU devices with NumPy/SciPy anchors, 'gpu' the accelerator "
                             f"with jitted JAX anchors (default devices there: {_GPU_DEVICES})")
    return parser


def run_cli(argv: Sequence[str]) -> int:
    """``shardax bench ...``: returns 0 when every case ran (skipped ones included), 1 when one failed."""
    parser = bench_parser()
    ns = parser.parse_args(list(argv))
    names = list(KERNELS) if ns.only is None else [s.strip() for s in ns.only.split(",") if s.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if unknown or not names:
        parser.error(f"--only: unknown kernel(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from "
                     f"{', '.join(KERNELS)}")
    backend = detect_backend() if ns.backend == "auto" else ns.backend
    default_devices = _GPU_DEVICES if backend == "gpu" else _QUICK_DEVICES if ns.quick else _FULL_DEVICES
    try:
        configs = parse_devices(ns.devices or default_devices)
    except ValueError as err:
        parser.error(str(err))
    repeat = ns.repeat or (2 if ns.quick else 5)
    os.makedirs(ns.out, exist_ok=True)
    cache = None if ns.no_cache else os.path.abspath(
        ns.cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir())
    table = kernels(backend)
    return bench([table[n] for n in dict.fromkeys(names)], configs, quick=ns.quick, repeat=repeat, out=ns.out,
                 json_path=ns.json or os.path.join(ns.out, "bench.json"), cache_dir=cache, timeout_s=ns.timeout,
                 plain=ns.plain, argv=list(argv), backend=backend, docs_sizes=ns.docs_sizes)


def bench(kernels: Sequence[Kernel], configs: Sequence[DeviceConfig], *, quick: bool, repeat: int, out: str,
          json_path: str, cache_dir: str | None, timeout_s: float, plain: bool, argv: Sequence[str],
          backend: str = "cpu", docs_sizes: bool = False) -> int:
    """Plan, run a worker per device configuration, then print the table and write the JSON and the plots.

    ``kernels`` carry the anchors of ``backend`` (:func:`~shardax.cli._bench_cases.kernels`)."""
    table = {**KERNELS, **{k.name: k for k in kernels}}
    from ._bench_report import print_table, write_plots

    start = time.perf_counter()
    load_before = os.getloadavg()
    skipped, runnable = _skipped_rows(kernels, configs)
    plans = _plans(runnable, configs, quick, docs_sizes)
    mode = "docs sizes" if docs_sizes else "quick" if quick else "full"
    sys.stdout.write(f"shardax bench ({mode}, {backend}): {', '.join(k.name for k in kernels)} on devices "
                     f"{', '.join(c.label for c in configs)}; {repeat} timed call(s) per case\n")
    sys.stdout.flush()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="shardax-bench-") as tmp:
        for index, (config, cases) in enumerate(plans):
            mpi = bool(cases) and cases[0][0] == "mpi4jax"
            where = "2 processes under mpirun (mpi4jax)" if mpi else f"{config.label} device(s)"
            sys.stdout.write(f"[{index + 1}/{len(plans)}] {where}: "
                             f"{', '.join(dict.fromkeys(k for k, _ in cases))}\n")
            sys.stdout.flush()
            t0 = time.perf_counter()
            records, error = _run_worker(config, cases, repeat, tmp, cache_dir, timeout_s, mpi=mpi,
                                         backend=backend)
            rows += _rows(records, cases, config, "2x1 mpirun" if mpi else config.label, error, table)
            sys.stdout.write(f"      {time.perf_counter() - t0:.1f} s\n")
            sys.stdout.flush()
    rows += skipped
    _judge(rows, configs, table)
    rows.sort(key=lambda r: _order(r, configs, table))
    wall = time.perf_counter() - start
    machine = _machine(load_before)
    print_table(rows, kernels, machine, repeat, plain=plain, cache=cache_dir)
    plots, why = write_plots(rows, out)
    sys.stdout.write("".join(f"plot: {p}\n" for p in plots) + (f"plots not written: {why}\n" if why else ""))
    report = {"shardax_bench": 1, "argv": list(argv), "quick": quick, "docs_sizes": docs_sizes, "repeat": repeat,
              "backend": backend, "compilation_cache": cache_dir,
              "devices": [c.label for c in configs], "wall_s": wall, "machine": machine, "plots": plots,
              "kernels": {k.name: {"anchors": dict(k.anchors)} for k in kernels},
              "rows": [dataclasses.asdict(r) for r in rows]}
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    failed = [r for r in rows if r.status == "failed"]
    sys.stdout.write(f"results: {json_path}\nwall time: {wall:.1f} s"
                     + (f"; {len(failed)} case(s) FAILED\n" if failed else "\n"))
    sys.stdout.flush()
    return 1 if failed else 0


def _skipped_rows(kernels: Sequence[Kernel], configs: Sequence[DeviceConfig]) -> tuple[list[Row], list[Kernel]]:
    """Rows for what cannot run here (missing anchors, too few devices), and the kernels that can."""
    rows, runnable = [], []
    most = max(c.devices for c in configs)

    def skip(kernel: Kernel, anchor: str, reason: str) -> None:
        rows.append(Row(kernel.name, anchor, None, "-", 0, 0, status="skipped", reason=reason))

    for kernel in kernels:
        missing = [m for m in kernel.needs if importlib.util.find_spec(m) is None]
        if missing:
            for anchor in kernel.anchors:
                skip(kernel, anchor, f"{', '.join(missing)} not installed (pip install {' '.join(missing)})")
            continue
        if most < kernel.min_devices:
            skip(kernel, next(iter(kernel.anchors)), f"needs at least {kernel.min_devices} devices: add e.g. 8 to "
                                                     "--devices")
            continue
        runnable.append(kernel)
        if kernel.name == "fftn" and most > 1 and importlib.util.find_spec("jaxdecomp") is None:
            skip(kernel, "jaxdecomp", "jaxdecomp not installed (pip install jaxdecomp)")
        if kernel.name == "allreduce":
            reason = _mpi4jax_missing()
            if reason:
                skip(kernel, "mpi4jax", reason)
    return rows, runnable


def _mpi4jax_missing() -> str:
    missing = [m for m in ("mpi4py", "mpi4jax") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install {' '.join(missing)})"
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install openmpi-bin)"
    return ""


def _plans(kernels: Sequence[Kernel], configs: Sequence[DeviceConfig], quick: bool, docs_sizes: bool = False,
           ) -> list[tuple[DeviceConfig, list[tuple[str, int]]]]:
    """Cases per device configuration: every size on a kernel's first usable configuration, the largest elsewhere."""
    plans: list[tuple[DeviceConfig, list[tuple[str, int]]]] = [(c, []) for c in configs]
    for kernel in kernels:
        sizes = kernel.sizes(quick, docs_sizes)
        usable = [cases for c, cases in plans if c.devices >= kernel.min_devices]
        for i, cases in enumerate(usable):
            cases += [(kernel.name, s) for s in (sizes if i == 0 else sizes[-1:])]
    if any(k.name == "allreduce" for k in kernels) and not _mpi4jax_missing():
        plans.append((DeviceConfig(2, 1), [("mpi4jax", KERNELS["allreduce"].sizes(quick, docs_sizes)[-1])]))
    return [(c, cases) for c, cases in plans if cases]


class _ProgressSink:
    """Echoes the workers' ``bench:`` progress lines; keeps each process's last other lines to explain a failure."""

    def __init__(self, label: str):
        self.label = label
        self.tails: dict[str, collections.deque[str]] = {}
        self.messages: list[str] = []
        self._lock = threading.Lock()

    def line(self, label: str, stream: Stream, text: str) -> None:
        marker = text.find("bench: ")
        with self._lock:
            if stream == "stdout" and marker >= 0:
                sys.stdout.write(f"      [{self.label}] {text[marker + 7:]}\n")
                sys.stdout.flush()
            elif text.strip():
                self.tails.setdefault(label, collections.deque(maxlen=40)).append(text.strip())

    def message(self, text: str) -> None:
        with self._lock:
            self.messages.append(text)

    def reason(self, job: JobResult) -> str:
        """Why the job failed: the launcher's message and the first exception line a process printed."""
        why = job.message or f"exit code {job.returncode}"
        with self._lock:
            for label, lines in self.tails.items():
                errors = [t for t in lines if _EXCEPTION.match(t)]
                if errors:
                    return f"{why}; process {label}: {errors[-1][:400]}"
            last = [f"[{label}] {lines[-1][:200]}" for label, lines in self.tails.items() if lines]
        return f"{why}; last output: {' | '.join(last) or '(none)'}"


# A traceback's last line: "ValueError: ...", "shardax._errors.CapacityError: ...".
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")


def _run_worker(config: DeviceConfig, cases: list[tuple[str, int]], repeat: int, tmp: str, cache_dir: str | None,
                timeout_s: float, *, mpi: bool, backend: str = "cpu") -> tuple[list[dict[str, Any]], str | None]:
    """Run one worker (or one launched group of them); its JSON records and, if it failed, why."""
    name = f"{'mpi' if mpi else 'bench'}_{config.label}"
    result = os.path.join(tmp, f"{name}.jsonl")
    plan = os.path.join(tmp, f"{name}.json")
    cpu = backend == "cpu"
    with open(plan, "w") as f:
        json.dump({"cases": cases, "repeat": repeat, "cpu_devices": config.per_process if cpu else None,
                   "devices": config.per_process, "result": result}, f)
    # Every configuration with the environment of launched processes (allocator, unbuffered output).
    env = process_env(cpu_devices=config.per_process if cpu else None)
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    if cache_dir is not None:
        env.update(cache_env(cache_dir))
    else:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    argv = ["-m", "shardax.cli._bench_worker", plan]
    sink = _ProgressSink("mpirun" if mpi else config.label)
    job: JobResult
    if mpi:
        mpirun = shutil.which("mpirun") or "mpirun"
        spec = mpirun_spec(argv, num_processes=config.processes, env=env, mpirun=mpirun)
        job = run_processes([spec], sink=sink, timeout_s=timeout_s)
    elif config.processes == 1:
        spec = ProcessSpec([sys.executable, *argv], env, label="0", name=f"the worker on {config.label} devices")
        job = run_processes([spec], sink=sink, timeout_s=timeout_s)
    else:
        job = launch(argv, num_processes=config.processes, cpu_devices=config.per_process, timeout_s=timeout_s,
                     sink=sink, env=env)
    if job.signal_received is not None:
        # Ctrl-C (or a termination) of this command ends the whole benchmark, not just this configuration.
        raise KeyboardInterrupt(job.message)
    records = []
    if os.path.exists(result):
        with open(result) as f:
            records = [json.loads(line) for line in f if line.strip()]
    if job.returncode == 0:
        return records, None
    return records, sink.reason(job)


def _rows(records: list[dict[str, Any]], cases: list[tuple[str, int]], config: DeviceConfig, label: str,
          error: str | None, table: Mapping[str, Kernel] = KERNELS) -> list[Row]:
    """The table rows of one worker's records; cases without a record failed with ``error``."""
    rows = []
    for r in records:
        row = Row(_kernel_of(r["case"]), r.get("anchor") or _first_anchor(r["case"], table), r["size"], label,
                  config.devices, config.processes)
        if "error" in r:
            row.status, row.reason = "failed", r["error"]
        else:
            row.shardax_s, row.anchor_s = r["shardax_s"], r["anchor_s"]
            row.first_call_s, row.extra = r["first_call_s"], r["extra"]
            row.shardax_median_s = float(np.median(row.shardax_s))
            if row.anchor_s:
                row.anchor_median_s = float(np.median(row.anchor_s))
                row.ratio = row.shardax_median_s / row.anchor_median_s
        rows.append(row)
    done = {(r["case"], r["size"]) for r in records}
    rows += [Row(_kernel_of(case), _first_anchor(case, table), size, label, config.devices, config.processes,
                 status="failed", reason=error or "the worker ended without a result")
             for case, size in cases if (case, size) not in done]
    return rows


def _kernel_of(case: str) -> str:
    return "allreduce" if case == "mpi4jax" else case


def _first_anchor(case: str, table: Mapping[str, Kernel] = KERNELS) -> str:
    return "mpi4jax" if case == "mpi4jax" else next(iter(table[case].anchors))


def _judge(rows: list[Row], configs: Sequence[DeviceConfig], table: Mapping[str, Kernel] = KERNELS) -> None:
    """Fill in each row's target, the ratio it is checked on and whether it is met (at the kernel's ``docs_size``:
    elsewhere the ratio is reported without a verdict)."""
    one = {(r.kernel, r.anchor, r.size): r.shardax_median_s for r in rows
           if r.devices == 1 and r.processes == 1 and r.status == "ok"}
    for row in rows:
        kernel = table[row.kernel]
        target: Target | None = kernel.targets.get(row.anchor)
        if row.devices > 1 and kernel.scaling is not None:
            target = kernel.scaling
        if target is None:
            row.target = "report"
            continue
        row.target, row.versus = target.text, target.versus
        if kernel.docs_size is not None and row.size is not None and row.size != kernel.docs_size:
            row.target = f"{target.text} at {kernel.size_format.format(kernel.docs_size)}"
            row.versus = ""
            continue
        if row.status != "ok":
            continue
        if target.versus == "anchor":
            row.value = row.ratio
        else:
            base = one.get((row.kernel, row.anchor, row.size))
            row.value = None if base is None or row.shardax_median_s is None else row.shardax_median_s / base
        row.met = None if row.value is None else row.value <= target.limit


def _order(row: Row, configs: Sequence[DeviceConfig], table: Mapping[str, Kernel] = KERNELS
           ) -> tuple[int, int, int, int]:
    kernel = table[row.kernel]
    labels = [c.label for c in configs]
    config = labels.index(row.config) if row.config in labels else len(labels)
    return (list(KERNELS).index(row.kernel), list(kernel.anchors).index(row.anchor), config, row.size or 0)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    from .._version import __version__

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cores": os.cpu_count(), "usable_cores": usable,
            "load_average_start": list(load_before), "load_average_end": list(os.getloadavg()),
            "platform": platform.platform(), "python": platform.python_version(), "shardax": __version__,
            **{p: _version(p) for p in ("jax", "jaxlib", "numpy", "scipy", "jaxdecomp", "mpi4jax")}}

