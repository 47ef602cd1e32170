"""Shared helpers for jaxops benchmarks: timing, bandwidth, result tables and result files.

Every benchmark script in this directory imports this module (``import _harness`` works when the
script is run as ``python benchmarks/bench_<name>.py``, because Python puts the script's directory
first on ``sys.path``).

- :func:`time_fn` / :func:`time_interleaved`: time jitted functions in this process, compilation
  and warm-up excluded, ``block_until_ready`` on every result, median and min over N samples.
- :func:`gbps` and :func:`copy_bandwidth`: achieved bandwidth, and the device's copy bandwidth
  as the yardstick for memory-bound kernels.
- :class:`Column`, :func:`format_table`, :func:`format_markdown`: fixed-width text and Markdown
  tables from rows of raw numbers.
- :func:`environment` and :func:`write_results`: ``<name>.md`` and ``<name>.json`` (raw numbers and
  the environment they were measured in) in an output directory.
- :func:`busy_core` and :func:`add_busy_argument`: ``--busy`` runs the timings while a second
  process keeps one core busy; :func:`ratio_goal`: "every row >= N x XLA".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Column",
    "CopyBandwidth",
    "Timing",
    "add_busy_argument",
    "busy_core",
    "copy_bandwidth",
    "environment",
    "format_markdown",
    "format_table",
    "gbps",
    "load_summary",
    "measuring",
    "is_gpu",
    "parse_shapes",
    "ratio_goal",
    "time_fn",
    "time_interleaved",
    "write_results",
]

REPO_ROOT = Path(__file__).resolve().parent.parent

# One timed sample lasts at least this long on an asynchronous (GPU) device: short kernels are
# launched several times back to back per sample so that launch overhead and timer resolution
# do not dominate.
_MIN_SAMPLE_S = 0.01
_MAX_CALLS_PER_SAMPLE = 1000


# -------------------------------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call of one function, over `samples` (each the mean of `calls_per_sample`)."""

    samples: tuple[float, ...]
    calls_per_sample: int
    compile_s: float

    @property
    def median(self) -> float:
        """Median seconds per call."""
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        """Fastest sample, seconds per call."""
        return min(self.samples)

    @property
    def median_ms(self) -> float:
        """Median milliseconds per call."""
        return self.median * 1e3

    @property
    def min_ms(self) -> float:
        """Fastest sample, milliseconds per call."""
        return self.min * 1e3

    def to_json(self) -> dict[str, Any]:
        """Raw numbers, JSON-serializable."""
        return {
            "median_s": self.median,
            "min_s": self.min,
            "samples_s": list(self.samples),
            "calls_per_sample": self.calls_per_sample,
            "compile_s": self.compile_s,
        }


def is_gpu(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first default device) is a GPU."""
    device = device or jax.devices()[0]
    return device.platform in ("gpu", "cuda", "rocm")


def _is_async(fn_args: Sequence[Any]) -> bool:
    """Whether calls on these arguments' device can be queued back to back in order.

    GPU work runs in order on one stream, so blocking on the last of several calls waits for
    all of them. CPU executions may run concurrently, so each CPU call is waited for.
    """
    leaves = [x for x in jax.tree.leaves(fn_args) if isinstance(x, jax.Array)]
    devices = {d for x in leaves for d in x.devices()} if leaves else set(jax.devices()[:1])
    return all(is_gpu(d) for d in devices)


def _sample(fn: Callable[..., Any], args: Sequence[Any], calls: int, sync_each: bool) -> float:
    """Seconds per call, averaged over `calls` calls."""
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
        if sync_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def _prepare(
    fn: Callable[..., Any], args: Sequence[Any], warmup: int, calls_per_sample: int | None
) -> tuple[int, bool, float]:
    """Compiles and warms up `fn`; returns (calls per sample, sync each call, compile seconds)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    sync_each = not _is_async(args)
    once = math.inf
    for _ in range(max(1, warmup)):
        once = min(once, _sample(fn, args, 1, True))
    if calls_per_sample is None:
        calls_per_sample = 1
        if not sync_each and once < _MIN_SAMPLE_S:
            calls_per_sample = min(
                _MAX_CALLS_PER_SAMPLE, math.ceil(_MIN_SAMPLE_S / max(once, 1e-7))
            )
    return max(1, calls_per_sample), sync_each, compile_s


def time_interleaved(
    cases: Mapping[str, tuple[Callable[..., Any], Sequence[Any]]],
    *,
    repeats: int = 20,
    warmup: int = 2,
    calls_per_sample: int | None = None,
) -> dict[str, Timing]:
    """Times several functions, alternating between them sample by sample.

    Interleaving spreads any slow-down of a shared machine (another process, thermal or clock
    changes) over all cases instead of penalizing whichever happened to run during it.

    Args:
      cases: name -> (function, positional arguments). Functions should be jitted; the first call
        (compilation) and `warmup` further calls are not timed.
      repeats: timed samples per case; the median and the min are reported.
      warmup: untimed calls after compilation.
      calls_per_sample: calls averaged into one sample; None picks 1 on CPU and, on GPU, enough
        back-to-back calls for a sample to last about 10 ms.

    Returns:
      name -> :class:`Timing`, in seconds per call.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    plans = {
        name: _prepare(fn, args, warmup, calls_per_sample) for name, (fn, args) in cases.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (fn, args) in cases.items():
            calls, sync_each, _ = plans[name]
            samples[name].append(_sample(fn, args, calls, sync_each))
    return {name: Timing(tuple(samples[name]), plans[name][0], plans[name][2]) for name in cases}


def time_fn(
    fn: Callable[..., Any],
    *args: Any,
    repeats: int = 20,
    warmup: int = 2,
    calls_per_sample: int | None = None,
) -> Timing:
    """Times one jitted function on `args`; see :func:`time_interleaved`."""
    return time_interleaved(
        {"fn": (fn, args)}, repeats=repeats, warmup=warmup, calls_per_sample=calls_per_sample
    )["fn"]


# -------------------------------------------------------------------------------------------------
# Bandwidth.


def gbps(nbytes: float, seconds: float) -> float:
    """Achieved bandwidth in GB/s (1e9 bytes per second) of moving `nbytes` in `seconds`."""
    if seconds <= 0:
        return math.nan
    return nbytes / seconds / 1e9


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    """The device's copy bandwidth: read `nbytes` and write `nbytes` per call."""

    nbytes: int
    timing: Timing

    @property
    def gbps(self) -> float:
        """Median GB/s, counting bytes read plus bytes written."""
        return gbps(2 * self.nbytes, self.timing.median)

    @property
    def best_gbps(self) -> float:
        """GB/s of the fastest sample."""
        return gbps(2 * self.nbytes, self.timing.min)

    def to_json(self) -> dict[str, Any]:
        """Raw numbers, JSON-serializable."""
        return {
            "nbytes": self.nbytes,
            "gbps_median": self.gbps,
            "gbps_best": self.best_gbps,
            **self.timing.to_json(),
        }


def default_copy_bytes(device: jax.Device | None = None) -> int:
    """1 GiB on a GPU, 256 MiB on a CPU."""
    return (1 << 30) if is_gpu(device) else (256 << 20)


def copy_bandwidth(
    nbytes: int | None = None,
    *,
    device: jax.Device | None = None,
    repeats: int = 10,
    warmup: int = 2,
) -> CopyBandwidth:
    """Measures the copy bandwidth of `device` with a jitted elementwise ``x + s`` on float32.

    ``s`` is a runtime scalar (zero), so XLA cannot fold the op away: every call reads and writes
    `nbytes`, like a memory-bound kernel does.

    Args:
      nbytes: size of the buffer; None for :func:`default_copy_bytes`.
      device: default: the first default device.
      repeats: timed samples.
      warmup: untimed calls after compilation.
    """
    device = device or jax.devices()[0]
    nbytes = default_copy_bytes(device) if nbytes is None else int(nbytes)
    count = max(1, nbytes // 4)
    x = jax.device_put(jnp.zeros((count,), jnp.float32), device)
    s = jax.device_put(jnp.zeros((), jnp.float32), device)
    fn = jax.jit(lambda x, s: x + s)
    timing = time_fn(fn, x, s, repeats=repeats, warmup=warmup)
    del x
    return CopyBandwidth(count * 4, timing)


# -------------------------------------------------------------------------------------------------
# Tables.


@dataclasses.dataclass(frozen=True)
class Column:
    """One table column: the row key it shows, its header, and a format for its values.

    `fmt` is a ``str.format`` spec applied to the value (``"{:.3f}"``) or a callable; None and
    NaN values print as ``-``. `align` is ``"<"`` (left) or ``">"`` (right).
    """

    key: str
    header: str
    fmt: str | Callable[[Any], str] = "{}"
    align: str = ">"

    def render(self, row: Mapping[str, Any]) -> str:
        """The cell of this column for `row`."""
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        return self.fmt.format(value)


def _cells(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> list[list[str]]:
    return [[c.render(row) for c in columns] for row in rows]


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A fixed-width text table, columns separated by two spaces, with a header rule."""
    cells = _cells(rows, columns)
    widths = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [f"{v:{c.align}{w}}" for v, c, w in zip(values, columns, widths, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line([c.header for c in columns]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def format_markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A GitHub-flavored Markdown table."""
    cells = _cells(rows, columns)
    rule = ["---:" if c.align == ">" else ":---" for c in columns]
    out = ["| " + " | ".join(c.header for c in columns) + " |", "| " + " | ".join(rule) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(out)


# -------------------------------------------------------------------------------------------------
# Environment and result files.


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def environment() -> dict[str, Any]:
    """Where the numbers were measured: versions, device, CPU, jaxops build, date, git commit."""
    import jaxlib.version

    try:
        import jaxops

        jaxops_info: dict[str, Any] = {
            "version": getattr(jaxops, "__version__", None),
            "file": getattr(jaxops, "__file__", None),
            "build_info": jaxops.build_info(),
            "cuda_available": jaxops.cuda_available(),
        }
    except Exception as e:  # the environment of a failed import is still worth recording
        jaxops_info = {"error": f"{type(e).__name__}: {e}"}

    devices = jax.devices()
    device = devices[0]
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib.version.__version__,
        "numpy": np.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_platform": device.platform,
        "device_count": len(devices),
        "platform_version": getattr(getattr(device, "client", None), "platform_version", None),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": _usable_cpus(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "machine": platform.machine(),
        "os": platform.platform(),
        "hostname": platform.node(),
        "jaxops": jaxops_info,
        "git_commit": commit,
        "git_dirty": bool(status) if commit else None,
        "env": {k: os.environ[k] for k in ("XLA_FLAGS", "JAXOPS_IMPL") if k in os.environ},
    }


def _load_text(load: Sequence[float] | None) -> str:
    return "n/a" if not load else ", ".join(f"{v:.2f}" for v in load)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_json = getattr(value, "to_json", None)
        return _jsonable(to_json() if to_json else dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def write_results(
    out_dir: str | os.PathLike[str],
    name: str,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column],
    *,
    env: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> tuple[Path, Path]:
    """Writes ``<out_dir>/<name>.md`` (the table, notes, environment) and ``<name>.json``.

    Args:
      out_dir: created if missing.
      name: file stem, e.g. ``"rms_norm"``.
      rows: raw values keyed by column key (and any further keys: all go to the JSON).
      columns: what the Markdown table shows.
      env: :func:`environment` (computed when None).
      extra: more JSON-serializable data for the JSON file (goals, settings, copy bandwidth).
      notes: lines printed under the Markdown table.

    Returns:
      The paths of the Markdown and JSON files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(environment() if env is None else env)
    md_path, json_path = out / f"{name}.md", out / f"{name}.json"

    jaxops_env = env.get("jaxops", {})
    lines = [
        f"# {name}",
        "",
        f"- date: {env.get('date')}",
        f"- device: {env.get('device_kind')} ({env.get('backend')}), "
        f"{env.get('cpu_usable')} usable CPUs ({env.get('cpu_model')})",
        f"- jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, python {env.get('python')}",
        f"- jaxops build: {jaxops_env.get('build_info', jaxops_env.get('error'))}",
        f"- git commit: {env.get('git_commit') or 'n/a'}"
        + (" (dirty)" if env.get("git_dirty") else ""),
        f"- load average (1, 5, 15 min) when written: {_load_text(env.get('load_average'))}",
        "",
        format_markdown(rows, columns),
        "",
    ]
    if notes:
        lines += [*notes, ""]
    md_path.write_text("\n".join(lines), encoding="utf-8")

    payload = {
        "benchmark": name,
        "environment": env,
        "columns": [{"key": c.key, "header": c.header} for c in columns],
        "rows": list(rows),
        **(dict(extra) if extra else {}),
    }
    json_path.write_text(json.dumps(_jsonable(payload), indent=2) + "\n", encoding="utf-8")
    return md_path, json_path


# -------------------------------------------------------------------------------------------------
# Goals.


@dataclasses.dataclass(frozen=True)
class Goal:
    """One performance goal and its verdict on this run (None: not measured)."""

    text: str
    value: str
    met: bool | None

    def line(self) -> str:
        """``goal <text>: <value> met`` / ``NOT met`` / ``not measured``."""
        if self.met is None:
            return f"goal {self.text}: not measured ({self.value})"
        return f"goal {self.text}: {self.value} {'met' if self.met else 'NOT met'}"


def report(
    args: Any,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column],
    copy: CopyBandwidth | None,
    goals: Sequence[Goal],
    copy_line: str | None,
) -> None:
    """Prints the table, `copy_line` and the goals; writes ``args.out/args.name`` files if asked.

    `args` is the script's argparse namespace (``out``, ``name``; its other fields, except the
    parsed ``*_list`` ones, are saved as the settings). `copy` / `copy_line` are None for a
    benchmark without a copy-bandwidth probe.
    """
    print(format_table(rows, columns))
    if copy_line is not None:
        print(copy_line)
    load_line = load_summary(args)
    print(load_line)
    for goal in goals:
        print(goal.line())
    if not args.out:
        return
    settings = {
        k: v for k, v in vars(args).items() if not k.endswith("_list") and not k.startswith("_")
    }
    md, js = write_results(
        args.out,
        args.name,
        rows,
        columns,
        extra={
            "settings": settings,
            **({"copy_bandwidth": copy.to_json()} if copy is not None else {}),
            "goals": [dataclasses.asdict(g) for g in goals],
        },
        notes=[
            *([copy_line, ""] if copy_line is not None else []),
            load_line,
            "",
            *[f"- {g.line()}" for g in goals],
        ],
    )
    print(f"wrote {md} and {js}", file=sys.stderr)


def ratio_goal(
    rows: Sequence[Mapping[str, Any]],
    ratio: float,
    label: Callable[[Mapping[str, Any]], str],
    what: str,
    key: str = "speedup",
) -> Goal:
    """``every row of `what` >= ratio x XLA``, naming the worst row and every row below the bar."""
    text = f"every {what} >= {ratio}x XLA"
    if not rows:
        return Goal(text, "no rows measured", None)
    worst = min(rows, key=lambda r: r[key])
    below = [r for r in rows if r[key] < ratio]
    met = len(rows) - len(below)
    value = f"worst {worst[key]:.2f}x ({label(worst)}), {met} of {len(rows)} rows at or above"
    if below:
        value += "; below: " + ", ".join(f"{label(r)} {r[key]:.2f}x" for r in below)
    return Goal(text, value, not below)


# -------------------------------------------------------------------------------------------------
# A second process keeping one core busy (--busy).

# Spins numpy arithmetic on a 256 KiB array (it stays in the core's L2) until it is told to stop or
# its parent is gone, so a benchmark killed without cleanup does not leave it running.
_SPIN = """
import os, sys
import numpy as np
parent = int(sys.argv[1])
a = np.linspace(0.0, 1.0, 32768)
while os.getppid() == parent:
    for _ in range(200):
        a = np.sqrt(a * a + 0.5) - 0.5
"""


@contextlib.contextmanager
def busy_core(enabled: bool = True) -> Iterator[subprocess.Popen | None]:
    """Keeps one core busy in a second process (a spinning numpy loop) while the block runs.

    The process is stopped when the block ends, also when it raises (or on Ctrl-C); it also exits
    by itself once this process is gone. With `enabled` False this does nothing and yields None.
    """
    if not enabled:
        yield None
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SPIN, str(os.getpid())],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    print(f"busy: pid {proc.pid} keeps one core busy during the timings", file=sys.stderr)
    try:
        time.sleep(0.5)  # let it start spinning
        if proc.poll() is not None:
            raise RuntimeError(f"the busy-core process exited early (status {proc.returncode})")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print("busy: stopped", file=sys.stderr)


def add_busy_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--busy``: time everything while a second process keeps one core busy."""
    parser.add_argument(
        "--busy",
        action="store_true",
        help="keep one core busy with a second process (a spinning numpy loop) during the timings",
    )


def load_summary(args: Any) -> str:
    """One line: whether --busy was on and the load averages seen at the start and now."""
    start = getattr(args, "_load_start", None)
    now = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    busy = "on (one core kept busy by a second process)" if getattr(args, "busy", False) else "off"
    return f"busy: {busy}; load average (1, 5, 15 min) at start: {_load_text(start)}, at end: " + (
        _load_text(now)
    )


@contextlib.contextmanager
def measuring(args: Any) -> Iterator[None]:
    """Records the load average at the start (for :func:`load_summary`), runs --busy if asked."""
    args._load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    with busy_core(getattr(args, "busy", False)):
        yield


# -------------------------------------------------------------------------------------------------
# Command-line helpers.


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"4096x4096,1024x8192"`` -> ``[(4096, 4096), (1024, 8192)]``."""
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            shape = tuple(int(d) for d in item.split("x"))
        except ValueError:
            raise ValueError(
                f"bad shape {item!r}: expected dims joined by 'x', e.g. 4096x4096"
            ) from None
        if not shape or any(d < 1 for d in shape):
            raise ValueError(f"bad shape {item!r}: dims must be >= 1")
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"no shapes in {text!r}")
    return shapes
