"""Shared helpers for jaxops benchmarks: the command line, the driver, timing, tables, results.

Every benchmark script in this directory imports this module (``import _harness`` works when the
script is run as ``python benchmarks/bench_<name>.py``, because Python puts the script's directory
first on ``sys.path``; under ``python -m benchmarks.bench_<name>`` it is ``benchmarks._harness``).
A benchmark is a ``parse_args(argv)`` built on :func:`parser`, a ``run(args) -> Result`` with its
measurements, and ``sys.exit(H.main(parse_args, run))``.

- :func:`parser`: the flags every benchmark has: ``--out DIR`` (``<name>.md`` and ``<name>.json``
  there), ``--name``, ``--repeats``, ``--quick`` (a smoke test for CI) and ``--busy``; its
  ``add_list`` adds comma-separated options such as ``--cases``.
- :func:`main`: simulated CPU devices if asked, parse, log the setup, run under :func:`measuring`
  (``--busy``, load averages), :func:`report` the :class:`Result` (printed; written with --out).
- :func:`time_fn` / :func:`time_interleaved`: time jitted functions in this process, compilation
  and warm-up excluded, ``block_until_ready`` on every result, median and min over N samples.
- :func:`gbps` and :func:`copy_bandwidth`: achieved bandwidth, and the device's copy bandwidth
  as the yardstick for memory-bound kernels.
- :class:`Column`, :func:`format_table`, :func:`format_markdown`: fixed-width text and Markdown
  tables from rows of raw numbers; :func:`environment` and :func:`write_results`: the result files.
- :class:`Goal`, :func:`ratio_goal` ("every row >= N x XLA"), :func:`worst_goal`; :class:`FfiXla`,
  :func:`tokens_fields`: the columns, fields and goals that several benchmarks share.
- :func:`busy_core`: a second process keeping one core busy (``--busy``).
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
    "busy_core",
    "busy_ratio_goal",
    "Column",
    "copy_bandwidth",
    "CopyBandwidth",
    "environment",
    "FFI_XLA_COLUMNS",
    "ffi_xla_fields",
    "FfiXla",
    "format_markdown",
    "format_table",
    "gbps",
    "Goal",
    "is_gpu",
    "load_summary",
    "log_row",
    "main",
    "measuring",
    "mesh",
    "parse_shapes",
    "Parser",
    "parser",
    "ratio_goal",
    "report",
    "Result",
    "settings",
    "simulate_cpu_devices",
    "Table",
    "time_fn",
    "time_interleaved",
    "time_train_steps",
    "Timing",
    "tokens_columns",
    "tokens_fields",
    "weight_counts",
    "worst_goal",
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


def weight_counts(model) -> dict[str, int]:
    """Weights of a ``jaxops.models.MoEDecoder``: ``total`` (every weight), and ``trunk`` and
    ``mtp``, the weights a token multiplies by in the decoder and in its multi-token-prediction
    modules, as the peers count a step's ``6 x active x tokens``: the routed experts'
    (``moe/w_in``, ``moe/w_out``) counted ``top_k / E``, the embedding (a lookup) not at all
    unless it is the tied output head."""
    cfg = model.config
    share = cfg.moe.top_k / cfg.moe.num_experts
    counts = {"total": 0.0, "trunk": 0.0, "mtp": 0.0}
    leaves = jax.tree_util.tree_leaves_with_path(
        model.layout.weight_shapes(), is_leaf=lambda x: isinstance(x, tuple)
    )
    for path, shape in leaves:
        keys = [getattr(k, "key", None) for k in path]
        n = float(math.prod(shape))
        counts["total"] += n
        if keys[0] == "embed" and not cfg.tie_word_embeddings:
            continue
        if "moe" in keys and keys[-1] in ("w_in", "w_out"):
            n *= share
        counts["mtp" if keys[0] == "mtp" else "trunk"] += n
    return {k: int(v) for k, v in counts.items()}


def time_train_steps(
    steps: Mapping[str, Callable[..., Any]],
    params: dict[str, Any],
    states: dict[str, Any],
    batch: Sequence[Any],
    *,
    repeats: int = 20,
) -> dict[str, Timing]:
    """Times donating training steps, interleaved (:func:`time_interleaved`).

    `steps`: name -> ``(params, state, *batch) -> (params, state, loss)``. Each call takes
    and returns its parameters and state (`params` and `states`, name -> tree, keep the
    newest), so the timed calls are real training steps.
    """

    def stepper(name: str) -> Callable[[], Any]:
        def call():
            params[name], states[name], loss = steps[name](params[name], states[name], *batch)
            return loss

        return call

    return time_interleaved({name: (stepper(name), ()) for name in steps}, repeats=repeats)


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


def busy_ratio_goal(rows, label, what: str, busy: bool, ratio: float, busy_ratio: float) -> Goal:
    """:func:`ratio_goal`: `ratio` quiet, `busy_ratio` "with one core busy" under ``--busy``."""
    if busy:
        return ratio_goal(rows, busy_ratio, label, what + " with one core busy")
    return ratio_goal(rows, ratio, label, what)


def worst_goal(rows, key: str, bar: float, text: str, label, fmt: str = "{:.2f}x") -> Goal:
    """`text`, met when the smallest ``row[key]`` of `rows` (not empty) is >= `bar`.

    Its value reads ``worst <fmt of the value> (<label of that row>)``.
    """
    worst = min(rows, key=lambda r: r[key])
    return Goal(text, f"worst {fmt.format(worst[key])} ({label(worst)})", worst[key] >= bar)


# -------------------------------------------------------------------------------------------------
# Custom call against its pure-JAX twin: the shared columns and row fields.

FFI_XLA_COLUMNS = (
    Column("ffi_ms", "ffi ms", "{:.3f}"),
    Column("xla_ms", "xla ms", "{:.3f}"),
    Column("ffi_gbps", "ffi GB/s", "{:.1f}"),
    Column("xla_gbps", "xla GB/s", "{:.1f}"),
    Column("speedup", "xla/ffi", "{:.2f}x"),
    Column("ffi_copy_frac", "ffi %copy", lambda v: f"{100 * v:.1f}%"),
)


def ffi_xla_fields(
    timings: Mapping[str, Timing], nbytes: int, copy: CopyBandwidth
) -> dict[str, Any]:
    """The row fields of :data:`FFI_XLA_COLUMNS` (and the raw timings) from the ``"ffi"`` and
    ``"xla"`` timings of an op that must move `nbytes`."""
    ffi_s, xla_s = timings["ffi"].median, timings["xla"].median
    return {
        "bytes": nbytes,
        "ffi_ms": 1e3 * ffi_s,
        "xla_ms": 1e3 * xla_s,
        "ffi_gbps": gbps(nbytes, ffi_s),
        "xla_gbps": gbps(nbytes, xla_s),
        "speedup": xla_s / ffi_s,
        "ffi_copy_frac": gbps(nbytes, ffi_s) / copy.gbps,
        "timings": {k: t.to_json() for k, t in timings.items()},
    }


@dataclasses.dataclass(frozen=True)
class FfiXla:
    """How bench_fp8 and bench_moe judge and report custom calls against their pure-JAX twins.

    Goals: on CPU, xla/ffi >= ``cpu[0]`` on every row (``cpu[1]`` with ``--busy``, and nothing
    more then). On the goal rows (``row[keys[1]]`` in `goal_values`, bfloat16): the worst xla/ffi
    >= ``cpu[2]`` on CPU or ``gpu[0]`` on a GPU, and on a GPU ffi >= ``gpu[1]`` GB/s.

    Attributes:
      keys: the row keys naming a row besides its dtype, e.g. ``("mode", "shape")``.
      goal_values: the stated ``row[keys[1]]`` of the goal rows, e.g. shapes.
      cpu: (every row, every row with --busy, the goal rows) xla/ffi on CPU.
      gpu: (the goal rows' xla/ffi, their ffi GB/s) on a GPU.
    """

    keys: tuple[str, str]
    goal_values: tuple[str, ...]
    cpu: tuple[float, float, float]
    gpu: tuple[float, float]

    def goals(self, rows: Sequence[Mapping[str, Any]], *, gpu: bool, busy: bool) -> list[Goal]:
        """The verdicts on `rows`."""
        first, second = self.keys
        goals = []
        if not gpu:

            def label(r: Mapping[str, Any]) -> str:
                return f"{r[first]} {r['dtype']} {r[second]}"

            what = f"{first}, dtype and {second}"
            goals.append(busy_ratio_goal(rows, label, what, busy, self.cpu[0], self.cpu[1]))
            if busy:
                return goals
        goal_rows = [r for r in rows if r[second] in self.goal_values and r["dtype"] == "bfloat16"]
        if not goal_rows:
            text = f"xla/ffi on the goal {second}s"
            return [*goals, Goal(text, f"run with the default {second}s", None)]
        ratio = self.gpu[0] if gpu else self.cpu[2]

        def goal_label(r: Mapping[str, Any]) -> str:
            return f"{r[first]} {r[second]}"

        text = f"xla/ffi >= {ratio} on {' and '.join(self.goal_values)} bf16 (every {first})"
        goals.append(worst_goal(goal_rows, "speedup", ratio, text, goal_label))
        if gpu:
            bar = self.gpu[1]
            text = f"ffi >= {bar:.0f} GB/s on the goal {second}s"
            goals.append(worst_goal(goal_rows, "ffi_gbps", bar, text, goal_label, "{:.0f} GB/s"))
        return goals

    def result(
        self,
        args: argparse.Namespace,
        rows: Sequence[Mapping[str, Any]],
        columns: Sequence[Column],
        copy: CopyBandwidth,
        bytes_counted: str,
    ) -> Result:
        """The :class:`Result` of `rows`: the goals, and a copy-bandwidth line that says what GB/s
        counts (`bytes_counted`)."""
        copy_line = (
            f"copy bandwidth: {copy.gbps:.1f} GB/s; times are medians of {args.repeats} samples; "
            f"GB/s counts {bytes_counted}"
        )
        goals = self.goals(rows, gpu=is_gpu(), busy=args.busy)
        return Result(rows, columns, goals, lines=[copy_line], copy=copy)


def tokens_columns(mine: str, peer: str, ms: str = "{:.2f}") -> list[Column]:
    """Step times (format `ms`), tokens/s and ``peer/mine`` of :func:`tokens_fields`."""
    return [
        Column(f"{mine}_ms", f"{mine} ms", ms),
        Column(f"{peer}_ms", f"{peer} ms", ms),
        Column(f"{mine}_tok_s", f"{mine} tokens/s", "{:,.0f}"),
        Column(f"{peer}_tok_s", f"{peer} tokens/s", "{:,.0f}"),
        Column("ratio", f"{peer}/{mine}", "{:.2f}x"),
    ]


def tokens_fields(timings: Mapping[str, Timing], mine: str, peer: str, tokens: int) -> dict:
    """Row fields of two timed steps over `tokens` tokens: ms, tokens/s, ``ratio`` (peer / mine)
    and the raw timings."""
    mine_s, peer_s = timings[mine].median, timings[peer].median
    return {
        f"{mine}_ms": 1e3 * mine_s,
        f"{peer}_ms": 1e3 * peer_s,
        f"{mine}_tok_s": tokens / mine_s,
        f"{peer}_tok_s": tokens / peer_s,
        "ratio": peer_s / mine_s,
        "timings": {k: t.to_json() for k, t in timings.items()},
    }


def log_row(row: Mapping[str, Any], columns: Sequence[Column]) -> None:
    """Prints `row` as a line of the text table of `columns` on stderr (progress)."""
    print(format_table([row], columns).splitlines()[-1], file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------
# What a benchmark returns, and how it is printed and written.


@dataclasses.dataclass(frozen=True)
class Table:
    """A further table of a result: printed under the main one, in the notes and in the JSON.

    `key` names its rows in the JSON file; `title` is printed above the text table, `md_title`
    (default: `title`) above the Markdown one; None: no title.
    """

    key: str
    rows: Sequence[Mapping[str, Any]]
    columns: Sequence[Column]
    title: str | None = None
    md_title: str | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """What a benchmark's ``run(args)`` returns to :func:`main`.

    Attributes:
      rows: the main table's rows (raw values; every key goes to the JSON file).
      columns: what the main table shows.
      goals: the verdicts, printed last.
      tables: further tables, in order.
      lines: printed under the tables and written as notes (copy bandwidth, setup).
      copy: the copy-bandwidth probe, saved as ``copy_bandwidth`` in the JSON file.
      extra: more JSON-serializable data for the JSON file.
    """

    rows: Sequence[Mapping[str, Any]]
    columns: Sequence[Column]
    goals: Sequence[Goal] = ()
    tables: Sequence[Table] = ()
    lines: Sequence[str] = ()
    copy: CopyBandwidth | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options a run used: `args` without the parsed ``*_list`` fields and ``_`` ones."""
    return {
        k: v for k, v in vars(args).items() if not k.endswith("_list") and not k.startswith("_")
    }


def _goal_lines(goals: Sequence[Goal]) -> list[str]:
    """One line per goal; a single line when three or more are unmeasured for the same reason."""
    if len(goals) >= 3 and all(g.met is None for g in goals) and len({g.value for g in goals}) == 1:
        return [f"goals: none measured ({goals[0].value})"]
    return [g.line() for g in goals]


def report(args: argparse.Namespace, result: Result) -> tuple[Path, Path] | None:
    """Prints `result` (tables, lines, load line, goals); with ``args.out``, writes its files.

    The files are ``<args.out>/<args.name>.md`` and ``.json`` (see :func:`write_results`); the
    JSON has the :func:`settings`, the copy bandwidth, `result.extra`, every further table's rows
    under its key, and the goals. Returns their paths, or None without ``args.out``.
    """
    print(format_table(result.rows, result.columns))
    for table in result.tables:
        print()
        if table.title is not None:
            print(table.title)
        print(format_table(table.rows, table.columns))
    for line in result.lines:
        print(line)
    load_line = load_summary(args)
    print(load_line)
    for line in _goal_lines(result.goals):
        print(line)
    if not args.out:
        return None
    notes: list[str] = []
    for table in result.tables:
        title = table.md_title if table.md_title is not None else table.title
        notes += [
            *([title, ""] if title is not None else []),
            format_markdown(table.rows, table.columns),
            "",
        ]
    for line in result.lines:
        notes += [line, ""]
    notes += [load_line, "", *[f"- {g.line()}" for g in result.goals]]
    extra = {
        "settings": settings(args),
        **({"copy_bandwidth": result.copy.to_json()} if result.copy is not None else {}),
        **result.extra,
        **{table.key: list(table.rows) for table in result.tables},
        "goals": [dataclasses.asdict(g) for g in result.goals],
    }
    paths = write_results(
        args.out, args.name, result.rows, result.columns, extra=extra, notes=notes
    )
    print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)
    return paths


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
# Command line and the driver every benchmark's main() calls.


class Parser(argparse.ArgumentParser):
    """An argument parser that applies the common rules after parsing (see :func:`parser`)."""

    def __init__(self, quick_repeats: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.quick_repeats = quick_repeats
        self.lists: list[tuple[str, str, str | None, Sequence[str] | None]] = []

    def add_list(
        self,
        flag: str,
        default: str,
        help: str,
        *,
        quick: str | None = None,
        choices: Sequence[str] | None = None,
    ) -> None:
        """A comma-separated list option, e.g. ``--cases``.

        After parsing, ``args.cases`` is the text given, else `quick` under ``--quick`` (when not
        None), else `default`; ``args.case_list`` (the name without its trailing ``s``) holds its
        items, each one of `choices` unless that is None.
        """
        self.add_argument(flag, default=None, help=f"{help} (default {default})")
        self.lists.append((flag[2:].replace("-", "_"), default, quick, choices))

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        if ns.quick and self.quick_repeats is not None and ns.repeats is not None:
            ns.repeats = min(ns.repeats, self.quick_repeats)
        if ns.repeats is not None and ns.repeats < 1:
            self.error("--repeats must be >= 1")
        for dest, default, quick, choices in self.lists:
            if getattr(ns, dest) is None:
                setattr(ns, dest, quick if ns.quick and quick is not None else default)
            items = getattr(ns, dest).split(",")
            unknown = [v for v in items if choices is not None and v not in choices]
            if unknown:
                self.error(f"unknown {dest} {unknown}; choose from {list(choices)}")
            setattr(ns, dest.removesuffix("s") + "_list", items)
        return ns


def parser(
    doc: str,
    *,
    name: str,
    quick: str,
    repeats: int | None,
    quick_repeats: int | None = 3,
    repeats_help: str | None = None,
    out_what: str = "",
) -> Parser:
    """The argument parser every benchmark starts from; it adds its own flags to it.

    Common flags: ``--out DIR`` (write ``<name>.md`` and ``<name>.json`` there; default: print
    only), ``--name`` (their stem, default `name`), ``--repeats`` (default `repeats`; at most
    `quick_repeats` with ``--quick``, unless that is None: the benchmark resolves it), ``--quick``
    (a smoke test for CI; `quick` says what it runs) and ``--busy`` (:func:`busy_core`).

    Args:
      doc: the script's docstring; its first paragraph is the description.
      name: the default stem of the result files, e.g. ``"rms_norm"``.
      quick: help of ``--quick``.
      repeats: default of ``--repeats``; None: the benchmark picks it after parsing.
      quick_repeats: the most repeats ``--quick`` keeps; None: the benchmark resolves it.
      repeats_help: help of ``--repeats``; None: the default and the --quick cap.
      out_what: what ``--out`` writes besides the two files, e.g. ``" and the schedule PNGs"``.
    """
    p = Parser(quick_repeats, description=doc.split("\n\n")[0])
    p.add_argument(
        "--out",
        default=None,
        help=f"directory for {name}.md and {name}.json{out_what} (default: print only)",
    )
    p.add_argument("--name", default=name, help="stem of the result files in --out")
    if repeats_help is None:
        repeats_help = f"timed samples per case (default {repeats}"
        repeats_help += f"; at most {quick_repeats} with --quick)" if quick_repeats else ")"
    p.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument(
        "--busy",
        action="store_true",
        help="keep one core busy with a second process (a spinning numpy loop) during the timings",
    )
    return p


def simulate_cpu_devices(default: int) -> None:
    """Makes jax's CPU backend `default` devices (``JAX_NUM_CPU_DEVICES`` overrides it).

    Must run before jax starts a backend (the first ``jax.devices()`` or computation).
    """
    count = int(os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(default)))
    jax.config.update("jax_num_cpu_devices", count)


def mesh(shape: str, axes: Sequence[str], *, gpu_axis: str | None = None) -> jax.sharding.Mesh:
    """A mesh of ``"DxE"``-style `shape` over `axes`; on a GPU with `gpu_axis`, every local GPU
    on that axis (size 1 on the others)."""
    if gpu_axis is not None and is_gpu():
        sizes = tuple(len(jax.devices()) if a == gpu_axis else 1 for a in axes)
    else:
        sizes = tuple(int(v) for v in shape.split("x"))
    return jax.make_mesh(sizes, tuple(axes))


def main(
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], Result],
    argv: Sequence[str] | None = None,
    *,
    cpu_devices: int | None = None,
    header: Callable[[argparse.Namespace], str] | None = None,
) -> int:
    """The flow of every benchmark; returns its exit status (0).

    Sets up `cpu_devices` simulated CPU devices (:func:`simulate_cpu_devices`) if given, parses
    `argv`, logs jax, the devices, the jaxops build and the repeats (then `header(args)`) on
    stderr, runs ``run(args)`` under :func:`measuring` (``--busy``, load averages) and hands its
    :class:`Result` to :func:`report` (printed; written with ``--out``).
    """
    if cpu_devices is not None:
        simulate_cpu_devices(cpu_devices)
    args = parse_args(argv)
    import jaxops

    devices = jax.devices()
    line = (
        f"jax {jax.__version__} on {len(devices)} x {devices[0].device_kind} "
        f"({jax.default_backend()}); jaxops build {jaxops.build_info()}; repeats {args.repeats}"
    )
    print(line + (f"; {header(args)}" if header is not None else ""), file=sys.stderr, flush=True)
    with measuring(args):
        result = run(args)
    report(args, result)
    return 0


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
