"""Pipeline schedules benchmark: gpipe vs 1f1b vs interleaved, step time and compiled memory.

The same stack of ``2 P`` residual MLP blocks under every schedule, trained with
``jaxops.parallel.pipeline.pipeline_step`` on a ``pipe x data`` mesh: 2 blocks per stage for
the one-chunk schedules, 1 per chunk for the interleaved one (V = 2). Per schedule and number of
microbatches M (microbatch size fixed, so the batch grows with M):

- step time (loss + gradients, median) and the compiled temp memory (memory analysis);
- the bubble: the schedule table's (``(P - 1) / (V M + P - 1)`` in ticks) and a measured one.
  Under the schedule's cost model the step time is ``T(M) = (V M + P - 1) * c``; a least-squares
  line through the step times over the M values gives the work per microbatch (slope) and the
  measured bubble ``1 - slope * M / T(M)``;
- the peer: the schedule MaxText and praxis use, GPipe's forward loop (here
  ``pipeline_forward``) differentiated by ``jax.grad`` as a whole ("autodiff-gpipe"), whose
  activation memory grows with M.

Every schedule's loss is checked against the others before anything is timed. On the CPU host
the 8 devices are simulated and share its cores, so idle pipeline devices lend their cores to
busy ones: the measured bubble there is smaller than on real devices; the memory figures are
what XLA allocates either way. With --out the schedule PNGs (``plot_schedule``) are written too.

From the repository root: ``python benchmarks/bench_pipeline.py`` (``--quick``: hidden 64, M 4 and
16; ``--out benchmarks/results/cpu``: the tables and the schedule PNGs).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel import pipeline

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

# (name, schedule, virtual stages); "autodiff-gpipe" is the peer.
SCHEDULES = [
    ("gpipe", "gpipe", 1),
    ("1f1b", "1f1b", 1),
    ("interleaved", "interleaved", 2),
    ("autodiff-gpipe", None, 1),
]

COLUMNS = [
    H.Column("schedule", "schedule", align="<"),
    H.Column("m", "M", "{:d}"),
    H.Column("step_ms", "step ms", "{:.2f}"),
    H.Column("vs_gpipe", "gpipe/this", "{:.2f}x"),
    H.Column("temp_mib", "temp MiB", "{:.2f}"),
    H.Column("mem_vs_gpipe", "temp/gpipe", "{:.2f}"),
    H.Column("bubble_table", "bubble (table)", "{:.3f}"),
    H.Column("bubble_measured", "bubble (measured)", "{:.3f}"),
]


def _block(params, x):
    h = jax.nn.gelu(x @ params["w1"])
    return x + h @ params["w2"]


def _stage(params, x):
    """The blocks of one stage (params stacked ``[blocks per stage, ...]``), in order."""
    for i in range(params["w1"].shape[0]):
        x = _block(jax.tree.map(lambda a, i=i: a[i], params), x)
    return x


def _model(num_blocks: int, hidden: int, dtype) -> dict[str, jax.Array]:
    """The blocks in model order, stacked ``[num_blocks, ...]``; the same for every schedule."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (num_blocks, hidden, 4 * hidden)) / hidden**0.5,
        "w2": jax.random.normal(k2, (num_blocks, 4 * hidden, hidden)) / (8 * hidden**0.5),
    }
    return jax.tree.map(lambda a: a.astype(dtype), params)


def _stage_params(blocks: dict[str, jax.Array], p: int, v: int) -> dict[str, jax.Array]:
    """Model-order blocks grouped into ``p * v`` stages and laid out for the schedule."""
    stages = jax.tree.map(lambda a: a.reshape(p * v, -1, *a.shape[1:]), blocks)
    return pipeline.interleave(stages, num_stages=p, virtual_stages=v)


def _mse(_, y, t):
    return jnp.mean((y.astype(jnp.float32) - t.astype(jnp.float32)) ** 2)


def _step_fn(mesh, name: str, schedule: str | None, v: int, m: int, remat: bool):
    if schedule is None:  # the peer: GPipe forward loop, backward by autodiff of the whole loop

        def loss(params, x, t):
            y = pipeline.pipeline_forward(_stage, params, x, mesh=mesh, num_microbatches=m)
            return _mse(None, y, t)

        return jax.jit(jax.value_and_grad(loss))

    def step(params, x, t):
        loss, grads = pipeline.pipeline_step(
            _stage,
            params,
            x,
            targets=t,
            loss_fn=_mse,
            mesh=mesh,
            num_microbatches=m,
            schedule=schedule,
            virtual_stages=v,
            remat=remat,
            input_grads=False,
        )
        return loss, grads.stage_params

    return jax.jit(step)


def run(args) -> H.Result:
    """Checks and times every schedule at every M; the rows, the goals and the PNGs."""
    p, d = (int(s) for s in args.mesh.split("x"))
    mesh = jax.make_mesh((p, d), ("pipe", "data"))
    hidden, rows_per_mb = args.hidden, args.rows
    dtype = jnp.dtype(args.dtype)
    rows: list[dict[str, Any]] = []
    for m in args.m_list:
        batch = m * d * rows_per_mb
        x = jax.random.normal(jax.random.key(1), (batch, hidden), dtype)
        t = jax.random.normal(jax.random.key(2), (batch, hidden), dtype)
        fns, inputs, losses = {}, {}, {}
        blocks = _model(p * max(v for *_, v in SCHEDULES), hidden, dtype)
        for name, schedule, v in SCHEDULES:
            params = _stage_params(blocks, p, v)
            fn = _step_fn(mesh, name, schedule, v, m, args.remat)
            compiled = fn.lower(params, x, t).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            fns[name] = (fn, (params, x, t))
            inputs[name] = {"temp": temp, "v": v, "schedule": schedule}
            losses[name] = float(fn(params, x, t)[0])
        # The same model under every schedule.
        base = losses["gpipe"]
        for name in losses:
            if not np.isclose(losses[name], base, rtol=2e-2 if dtype != jnp.float32 else 1e-5):
                raise AssertionError(f"M={m}: {name} loss {losses[name]} != gpipe {base}")
        timings = H.time_interleaved(fns, repeats=args.repeats)
        for name, info in inputs.items():
            v = info["v"]
            table = pipeline.schedule_table(info["schedule"] or "gpipe", p, m, v)
            rows.append(
                {
                    "schedule": name,
                    "m": m,
                    "p": p,
                    "v": v,
                    "step_ms": timings[name].median_ms,
                    "temp_mib": info["temp"] / 2**20,
                    "bubble_table": table.bubble_fraction,
                    "timings": timings[name].to_json(),
                }
            )
        gp = next(r for r in rows[::-1] if r["schedule"] == "gpipe")
        for r in rows[-len(SCHEDULES) :]:
            r["vs_gpipe"] = gp["step_ms"] / r["step_ms"]
            r["mem_vs_gpipe"] = r["temp_mib"] / gp["temp_mib"]
            H.log_row(r, COLUMNS)
    _measured_bubbles(rows)
    return H.Result(rows, COLUMNS, _goals(rows), lines=_plots(args, p, max(args.m_list)))


def _plots(args, p: int, m: int) -> list[str]:
    """With --out, the timeline PNG of every schedule at `m` microbatches; the line naming them."""
    if not args.out:
        return []
    os.makedirs(args.out, exist_ok=True)
    pngs = []
    for name, schedule, v in SCHEDULES[:3]:
        path = os.path.join(args.out, f"{args.name}_{name}.png")
        pipeline.plot_schedule(schedule, p, m, v, path=path)
        pngs.append(os.path.basename(path))
    return [f"Schedule timelines (P={p}, M={m}): " + ", ".join(pngs)]


def _measured_bubbles(rows: list[dict[str, Any]]) -> None:
    """Per schedule, a line T(M) = a M + b through the step times; bubble = 1 - a M / T(M)."""
    for name, *_ in SCHEDULES:
        mine = [r for r in rows if r["schedule"] == name]
        if len(mine) < 2:
            for r in mine:
                r["bubble_measured"] = float("nan")
            continue
        ms = np.array([r["m"] for r in mine], float)
        ts = np.array([r["step_ms"] for r in mine])
        slope, _ = np.polyfit(ms, ts, 1)
        for r in mine:
            r["bubble_measured"] = 1.0 - slope * r["m"] / r["step_ms"]


def _goals(rows: list[dict[str, Any]]) -> list[H.Goal]:
    most = max(r["m"] for r in rows)
    least = min(r["m"] for r in rows)
    at = {r["schedule"]: r for r in rows if r["m"] == most}
    low = {r["schedule"]: r for r in rows if r["m"] == least}
    f1b, gpipe, peer = at["1f1b"], at["gpipe"], at["autodiff-gpipe"]
    growth = f1b["temp_mib"] / low["1f1b"]["temp_mib"]
    return [
        H.Goal(
            f"1f1b temp memory at M={most} (M/P = {most / f1b['p']:g}) <= half of gpipe's",
            f"{f1b['temp_mib']:.2f} / {gpipe['temp_mib']:.2f} MiB = {f1b['mem_vs_gpipe']:.2f}",
            f1b["mem_vs_gpipe"] <= 0.5,
        ),
        H.Goal(
            f"1f1b temp memory flat in M ({least} -> {most})",
            f"x{growth:.2f}",
            growth <= 1.05,
        ),
        H.Goal(
            f"1f1b vs the autodiff GPipe peer at M={most}: memory",
            f"{f1b['temp_mib']:.2f} / {peer['temp_mib']:.2f} MiB",
            f1b["temp_mib"] < peer["temp_mib"],
        ),
        H.Goal(
            f"1f1b step time vs the autodiff GPipe peer at M={most}",
            f"peer/1f1b = {peer['step_ms'] / f1b['step_ms']:.2f}x",
            peer["step_ms"] >= f1b["step_ms"],
        ),
    ]


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the model and mesh."""
    p = H.parser(
        __doc__,
        name="pipeline",
        repeats=7,
        quick="hidden 64, M 4 and 16, 3 repeats",
        out_what=" and the schedule PNGs",
    )
    p.add_argument("--mesh", default="4x2", help="pipe x data (8 devices on CPU)")
    p.add_argument("--microbatches", default="4,8,16", help="comma-separated M values")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rows", type=int, default=64, help="rows per microbatch per data shard")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--remat", action="store_true", help="stash stage inputs only")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.microbatches = 64, "4,16"
    args.m_list = [int(m) for m in args.microbatches.split(",")]
    return args


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8))
