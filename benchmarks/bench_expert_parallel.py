"""Expert-parallel MoE layer benchmark: jaxops.parallel.expert.moe_layer vs a dense masked layer.

The peer is the same math without expert parallelism: every device holds all E experts and runs
each of them on its own tokens, weighted by the routing probabilities (zero off the top-k) --
``moe_layer_reference`` under jit with the tokens sharded over all devices and the weights
replicated. Both run in one process on the same mesh, params and tokens; their outputs are
checked to agree before anything is timed. Timed per case:

- ``fwd`` and ``fwd+bwd`` (the gradient of a scalar of y and the aux loss w.r.t. params and x):
  step time, tokens/s, and dense/ep ratio;
- the layer's forward split into stages (router, permute, exchange, ffn, combine = exchange back
  + unpermute), from the layer cut after each stage, timed one after another: each stage's time
  is the difference of consecutive cuts (with the all-gather exchange, the default off GPU:
  permute = the routing gathered, exchange = the tokens gathered and permuted, combine =
  unpermute + reduce-scatter);
- with more than one device on the expert axis, the dispatch with ``fp8="block"``: tokens
  crossing the exchange in the activation dtype (quantized by the receiver) against
  ``dispatch="fp8"`` (quantized once by the sender, FP8 + 1 x 128 scales crossing): all-to-all
  bytes per device of the forward and of the fwd+bwd step, read off the HLO shapes (the
  program's, i.e. what a GPU moves, and XLA:CPU's compiled ones, where bf16 collectives are
  widened to f32), and the fwd+bwd step time of each. Off GPU this section pins
  ``exchange="dense"`` (the all-to-all twin of the GPU's ragged exchange; the layer's default
  there is the all-gather form, whose FP8 gather tests/test_expert_parallel.py checks);
- on GPU, the grouped GEMMs (``--gemm-ab``, default on there): the ``fwd+bwd`` step with them as
  jaxops' CUDA grouped GEMM (where built), as ``jax.lax.ragged_dot`` (which XLA:GPU lowers to a
  dense dot over every local expert, a float32 ``[L, R, K]`` operand) and as the loop over
  groups, each forced through the plan (its budget ``GPU_RAGGED_DOT_MAX_BYTES`` and whether the
  kernel counts as available), with the plan's own pick; ragged_dot is not run where its operand
  would pass ``--ragged-dot-max-gib``.

On CPU the mesh is 8 simulated devices ``data x expert`` (default 2 x 4); on a GPU, all local
GPUs on the expert axis. The goal line: the EP layer's fwd+bwd is faster than the dense one
(ratio >= 1) on every case with E / K >= 4, where the dense layer does >= 4x the FLOPs.

Run it from the repository root as ``python benchmarks/bench_expert_parallel.py``; add ``--quick``
for one small case or ``--out benchmarks/results/cpu`` to save the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel import expert

from jaxops.testing import collective_bytes, collective_shapes

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

# T (global tokens) x H x F x E x K
CASES = "4096x256x512x16x2,4096x256x512x32x4"
QUICK_CASES = "512x64x128x8x2"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}

COLUMNS = [
    H.Column("op", "op", align="<"),
    H.Column("case", "T x H x F x E x K", align="<"),
    H.Column("mesh", "mesh", align="<"),
    *H.tokens_columns("ep", "dense"),
]
DISPATCH_COLUMNS = [
    H.Column("case", "T x H x F x E x K", align="<"),
    H.Column("dispatch_bytes", "dispatch bytes bf16", "{:,.0f}"),
    H.Column("dispatch_bytes8", "dispatch bytes fp8", "{:,.0f}"),
    H.Column("dispatch_ratio", "bf16/fp8", "{:.2f}x"),
    H.Column("cpu_dispatch_ratio", "bf16/fp8 (CPU compiled)", "{:.2f}x"),
    H.Column("fwd_ratio", "fwd a2a bf16/fp8", "{:.2f}x"),
    H.Column("step_ratio", "step a2a bf16/fp8", "{:.2f}x"),
    H.Column("step_ms", "step ms bf16", "{:.2f}"),
    H.Column("step_ms8", "step ms fp8", "{:.2f}"),
    H.Column("time_ratio", "bf16/fp8 time", "{:.2f}x"),
]
GEMM_COLUMNS = [
    H.Column("case", "T x H x F x E x K", align="<"),
    H.Column("local", "local experts", "{:d}"),
    H.Column("dense_gib", "ragged_dot operand GiB", "{:.2f}"),
    H.Column("kernel_ms", "kernel ms", "{:.2f}"),
    H.Column("ragged_ms", "ragged_dot ms", "{:.2f}"),
    H.Column("loop_ms", "loop ms", "{:.2f}"),
    H.Column("loop_ratio", "loop/kernel", "{:.2f}x"),
    H.Column("ragged_ratio", "ragged_dot/kernel (or /loop)", "{:.2f}x"),
    H.Column("pick", "plan's pick", align="<"),
]
STAGE_COLUMNS = [
    H.Column("case", "T x H x F x E x K", align="<"),
    *[H.Column(s, f"{s} ms", "{:.2f}") for s in expert.STAGES],
    H.Column("total", "layer ms", "{:.2f}"),
]


def _loss(layer):
    def loss(params, x):
        y, aux = layer(params, x)
        return jnp.mean(y.astype(jnp.float32) ** 2) + aux.loss

    return loss


def _setup(args, mesh, case: str, dtype, **config):
    """The config of `case` (T x H x F x E x K), its params (on the host and sharded for EP) and
    its T tokens, sharded."""
    t, h, f, e, k = (int(v) for v in case.split("x"))
    cfg = expert.MoEConfig(
        num_experts=e, top_k=k, hidden_size=h, expert_ffn=f, dtype=dtype, align=args.align, **config
    )
    params = expert.init_moe_params(jax.random.key(0), cfg)
    specs = expert.moe_param_specs(cfg)
    sharded = {n: jax.device_put(v, jax.NamedSharding(mesh, specs[n])) for n, v in params.items()}
    x = jax.random.normal(jax.random.key(1), (t, h), cfg.dtype)
    return cfg, params, sharded, jax.device_put(x, jax.NamedSharding(mesh, jax.P(cfg.token_axes)))


def _case(args, mesh, case: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cfg, params, params_ep, x = _setup(args, mesh, case, DTYPES[args.dtype])
    params_dense = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))

    def ep(p, x):
        return expert.moe_layer(p, x, cfg, mesh=mesh)

    def dense(p, x):
        return expert.moe_layer_reference(p, x, cfg)

    fns = {
        "fwd": {"ep": jax.jit(ep), "dense": jax.jit(dense)},
        "fwd+bwd": {
            "ep": jax.jit(jax.value_and_grad(_loss(ep), argnums=(0, 1))),
            "dense": jax.jit(jax.value_and_grad(_loss(dense), argnums=(0, 1))),
        },
    }
    y_ep = np.asarray(fns["fwd"]["ep"](params_ep, x)[0], np.float32)
    y_dense = np.asarray(fns["fwd"]["dense"](params_dense, x)[0], np.float32)
    tol = 1e-4 if cfg.dtype == jnp.float32 else 4 * 2**-8
    if not np.allclose(y_ep, y_dense, rtol=tol, atol=tol * float(np.abs(y_dense).max())):
        raise AssertionError(f"{case}: the EP layer and the dense layer disagree")
    mesh_text = "x".join(str(s) for s in mesh.devices.shape)
    rows = []
    for op, pair in fns.items():
        timings = H.time_interleaved(
            {"ep": (pair["ep"], (params_ep, x)), "dense": (pair["dense"], (params_dense, x))},
            repeats=args.repeats,
        )
        row = {"op": op, "case": case, "mesh": mesh_text, "dtype": args.dtype}
        fields = H.tokens_fields(timings, "ep", "dense", x.shape[0])
        rows.append({**row, **fields, "experts_per_top_k": cfg.num_experts / cfg.top_k})
        H.log_row(rows[-1], COLUMNS)
    cuts = {
        stage: (
            jax.jit(lambda p, x, s=stage: expert._stage_probe(p, x, cfg, mesh=mesh, upto=s)),
            (params_ep, x),
        )
        for stage in expert.STAGES
    }
    cut_timings = H.time_interleaved(cuts, repeats=args.repeats)
    stage_row: dict[str, Any] = {"case": case}
    previous = 0.0
    for stage in expert.STAGES:
        ms = cut_timings[stage].median_ms
        stage_row[stage] = max(ms - previous, 0.0)
        previous = ms
    stage_row["total"] = previous
    return rows, stage_row


@contextlib.contextmanager
def _gemm_choice(nbytes: int, kernel: bool) -> Iterator[None]:
    """While open, the plan's GPU budget for ragged_dot's dense operand is `nbytes` (0: the loop
    whenever L > 1) and jaxops' CUDA grouped GEMM counts as available only if `kernel` (and
    built); programs traced inside keep the choice."""
    module = expert._exchange._grouped_gemm
    saved = expert._exchange.GPU_RAGGED_DOT_MAX_BYTES, module.kernel_available
    expert._exchange.GPU_RAGGED_DOT_MAX_BYTES = nbytes
    if not kernel:
        module.kernel_available = lambda *a: False
    try:
        yield
    finally:
        expert._exchange.GPU_RAGGED_DOT_MAX_BYTES, module.kernel_available = saved


def _gemm_case(args, mesh, case: str) -> dict[str, Any]:
    """The EP fwd+bwd step with the grouped GEMMs as jaxops' CUDA kernel (where built), as
    ragged_dot and as the loop over groups (on GPU)."""
    cfg, _, params, x = _setup(args, mesh, case, DTYPES[args.dtype])
    n = mesh.shape[cfg.expert_axis]
    shards = math.prod(mesh.shape[a] for a in cfg.token_axes)
    plan = expert._exchange.make_plan(cfg, mesh, n, shards, x.shape[0])
    local = cfg.num_experts // n
    kernel = H.is_gpu() and expert._exchange._grouped_gemm.kernel_available()
    with _gemm_choice(1 << 62, kernel=False):  # the buffer ragged_dot would get (no padding)
        rows = expert._exchange.make_plan(cfg, mesh, n, shards, x.shape[0]).recv_rows
    dense = expert._exchange.ragged_dot_bytes(cfg, local, rows)
    pick = "ragged_dot" if plan.tile == 0 else "kernel" if kernel else "loop"
    row: dict[str, Any] = {
        "case": case,
        "local": local,
        "dense_gib": dense / 2**30,
        "pick": pick if H.is_gpu() else "CPU kernel",
    }
    variants = {"loop": (0, False)}
    if kernel:
        variants["kernel"] = (0, True)
    if dense <= args.ragged_dot_max_gib * 2**30:
        variants["ragged_dot"] = (1 << 62, False)
    steps, losses = {}, {}
    for name, (budget, use_kernel) in variants.items():
        step = jax.jit(
            jax.value_and_grad(
                _loss(lambda p, x, c=cfg: expert.moe_layer(p, x, c, mesh=mesh)), argnums=(0, 1)
            )
        )
        with _gemm_choice(budget, use_kernel):
            losses[name] = float(step(params, x)[0])  # traced and compiled with this choice
        steps[name] = (step, (params, x))
    for name, loss in losses.items():
        if not np.isclose(loss, losses["loop"], rtol=1e-3):
            raise AssertionError(f"{case}: {name} loss {loss} != the loop's {losses['loop']}")
    timings = H.time_interleaved(steps, repeats=args.repeats)
    for name, key in (("loop", "loop_ms"), ("kernel", "kernel_ms"), ("ragged_dot", "ragged_ms")):
        if name in timings:
            row[key] = timings[name].median_ms
    if "kernel" in timings:
        row["loop_ratio"] = timings["loop"].median / timings["kernel"].median
        if "ragged_dot" in timings:
            row["ragged_ratio"] = timings["ragged_dot"].median / timings["kernel"].median
    elif "ragged_dot" in timings:
        row["ragged_ratio"] = timings["ragged_dot"].median / timings["loop"].median
    row["timings"] = {k: t.to_json() for k, t in timings.items()}
    H.log_row(row, GEMM_COLUMNS)
    return row


def _a2a_bytes(text: str, hidden: int) -> tuple[int, int, int]:
    """All-to-all bytes per device in HLO text: (all, token payloads, scale payloads).

    Token payloads have `hidden` columns, FP8 scale payloads ceil(hidden / 128); a tuple
    all-to-all (XLA:CPU's form) counts every peer's block.
    """
    total = tokens = scales = 0
    for shape in collective_shapes(text, "all-to-all"):
        n = collective_bytes(shape)
        last = int(re.search(r"\[([0-9,]*)\]", shape).group(1).split(",")[-1] or 1)
        total += n
        tokens += n if last == hidden else 0
        scales += n if last == -(-hidden // 128) and last != hidden else 0
    return total, tokens, scales


def _dispatch_case(args, mesh, case: str) -> dict[str, Any]:
    """fp8="block": the dispatch in the activation dtype vs dispatch="fp8"."""
    # The all-to-all forms carry the dispatch this section counts: off GPU the dense twin.
    exchange = "auto" if jax.default_backend() == "gpu" else "dense"
    cfg, _, params, x = _setup(args, mesh, case, jnp.bfloat16, fp8="block", exchange=exchange)
    h = cfg.hidden_size
    row: dict[str, Any] = {"case": case}
    steps, outs = {}, {}
    for tag, c in (("", cfg), ("8", dataclasses.replace(cfg, dispatch="fp8"))):

        def layer(p, x, c=c):
            return expert.moe_layer(p, x, c, mesh=mesh)

        fwd = jax.jit(layer)
        step = jax.jit(jax.value_and_grad(_loss(layer), argnums=(0, 1)))
        # The forward moves the dispatch and the combine (the same rows in the activation
        # dtype); the dispatch is what the forward moves beyond the combine's token payload.
        for prefix, text in (
            ("", fwd.lower(params, x).as_text(dialect="hlo")),
            ("cpu_", fwd.lower(params, x).compile().as_text()),
        ):
            total, tokens, scales = _a2a_bytes(text, h)
            combine = (
                tokens / 2
                if tag == ""
                else max(
                    n for n in (collective_bytes(s) for s in collective_shapes(text, "all-to-all"))
                )
            )
            row[prefix + "dispatch_bytes" + tag] = tokens + scales - combine
            if prefix == "":
                row["fwd_bytes" + tag] = total
        row["step_bytes" + tag] = _a2a_bytes(step.lower(params, x).as_text(dialect="hlo"), h)[0]
        outs[tag] = np.asarray(fwd(params, x)[0], np.float32)
        steps[tag] = (step, (params, x))
    if not np.array_equal(outs[""], outs["8"]):
        raise AssertionError(f"{case}: the FP8 dispatch changed the forward")
    timings = H.time_interleaved(steps, repeats=args.repeats)
    row.update(
        step_ms=timings[""].median_ms,
        step_ms8=timings["8"].median_ms,
        dispatch_ratio=row["dispatch_bytes"] / row["dispatch_bytes8"],
        cpu_dispatch_ratio=row["cpu_dispatch_bytes"] / row["cpu_dispatch_bytes8"],
        fwd_ratio=row["fwd_bytes"] / row["fwd_bytes8"],
        step_ratio=row["step_bytes"] / row["step_bytes8"],
        time_ratio=timings[""].median / timings["8"].median,
        timings={kk or "bf16": tt.to_json() for kk, tt in timings.items()},
    )
    H.log_row(row, DISPATCH_COLUMNS)
    return row


def run(args) -> H.Result:
    """Checks and times every case; the rows, the stage split, the dispatch rows and the goal."""
    mesh = H.mesh(args.mesh, ("data", "expert"), gpu_axis="expert")
    rows, stages = [], []
    for case in args.case_list:
        case_rows, stage_row = _case(args, mesh, case)
        rows += case_rows
        stages.append(stage_row)
    # One device on the expert axis (one GPU) exchanges nothing: no dispatch section.
    exchanging = mesh.shape["expert"] > 1
    dispatch_rows = (
        [_dispatch_case(args, mesh, case) for case in args.case_list] if exchanging else []
    )
    gemm_ab = H.is_gpu() if args.gemm_ab is None else args.gemm_ab
    gemm_rows = [_gemm_case(args, mesh, case) for case in args.case_list] if gemm_ab else []
    goal_rows = [r for r in rows if r["op"] == "fwd+bwd" and r["experts_per_top_k"] >= 4]
    if not goal_rows:
        goals = [H.Goal("ep faster than dense (E/K >= 4)", "no case with E/K >= 4", None)]
    else:
        text = "ep fwd+bwd faster than dense masked (dense/ep >= 1) where E/K >= 4"
        goals = [H.worst_goal(goal_rows, "ratio", 1.0, text, lambda r: r["case"])]
    tables = [
        H.Table(
            "stages",
            stages,
            STAGE_COLUMNS,
            "forward time split (differences of the layer cut after each stage):",
            "Forward time split, ms (differences of the layer cut after each stage):",
        ),
    ]
    if dispatch_rows:
        tables.append(
            H.Table(
                "dispatch",
                dispatch_rows,
                DISPATCH_COLUMNS,
                'fp8="block": dispatch in bf16 vs dispatch="fp8" (bytes per device, from the HLO):',
                'fp8="block": dispatch in bf16 vs dispatch="fp8". All-to-all bytes per device from'
                " the program's HLO (what a GPU moves) and from XLA:CPU's compiled HLO (bf16"
                " widened to f32 there); fwd+bwd step time:",
            )
        )
    if gemm_rows:
        tables.append(
            H.Table(
                "grouped_gemm",
                gemm_rows,
                GEMM_COLUMNS,
                "grouped GEMMs: CUDA kernel vs ragged_dot vs the loop over groups (fwd+bwd step):",
                "Grouped GEMMs: the fwd+bwd step with jaxops' CUDA grouped GEMM, with"
                " `jax.lax.ragged_dot` (dense over the local experts on XLA:GPU) and with the loop"
                " over groups; the plan's pick for the case:",
            )
        )
    return H.Result(rows, COLUMNS, goals, tables=tables)


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the cases and mesh."""
    p = H.parser(__doc__, name="expert_parallel", repeats=7, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated TxHxFxExK", quick=QUICK_CASES)
    p.add_argument("--mesh", default="2x4", help="data x expert on CPU (8 devices)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--align", type=int, default=8)
    p.add_argument(
        "--gemm-ab",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the grouped GEMMs as ragged_dot and as the loop (default: on a GPU only)",
    )
    p.add_argument(
        "--ragged-dot-max-gib",
        type=float,
        default=16.0,
        help="--gemm-ab runs ragged_dot only where its dense operand is at most this many GiB",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8))
