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
  is the difference of consecutive cuts;
- the dispatch with ``fp8="block"``: tokens crossing the exchange in the activation dtype
  (quantized by the receiver) against ``dispatch="fp8"`` (quantized once by the sender, FP8 +
  1 x 128 scales crossing): all-to-all bytes per device of the forward and of the fwd+bwd step,
  read off the HLO shapes (the program's, i.e. what a GPU moves, and XLA:CPU's compiled ones,
  where bf16 collectives are widened to f32), and the fwd+bwd step time of each.

On CPU the mesh is 8 simulated devices ``data x expert`` (default 2 x 4); on a GPU, all local
GPUs on the expert axis. The goal line: the EP layer's fwd+bwd is faster than the dense one
(ratio >= 1) on every case with E / K >= 4, where the dense layer does >= 4x the FLOPs.

Usage (from the repository root)::

    python benchmarks/bench_expert_parallel.py
    python benchmarks/bench_expert_parallel.py --quick
    python benchmarks/bench_expert_parallel.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

from jaxops.parallel import expert  # noqa: E402

import jaxops  # noqa: E402
from jaxops.testing import collective_bytes, collective_shapes  # noqa: E402

if __package__:
    from . import _harness as H
else:
    import _harness as H

# T (global tokens) x H x F x E x K
CASES = "4096x256x512x16x2,4096x256x512x32x4"
QUICK_CASES = "512x64x128x8x2"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}

COLUMNS = [
    H.Column("op", "op", align="<"),
    H.Column("case", "T x H x F x E x K", align="<"),
    H.Column("mesh", "mesh", align="<"),
    H.Column("ep_ms", "ep ms", "{:.2f}"),
    H.Column("dense_ms", "dense ms", "{:.2f}"),
    H.Column("ep_tok_s", "ep tokens/s", "{:,.0f}"),
    H.Column("dense_tok_s", "dense tokens/s", "{:,.0f}"),
    H.Column("ratio", "dense/ep", "{:.2f}x"),
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
STAGE_COLUMNS = [
    H.Column("case", "T x H x F x E x K", align="<"),
    *[H.Column(s, f"{s} ms", "{:.2f}") for s in expert.STAGES],
    H.Column("total", "layer ms", "{:.2f}"),
]


def _mesh(args) -> jax.sharding.Mesh:
    if H.is_gpu():
        return jax.make_mesh((1, len(jax.devices())), ("data", "expert"))
    d, e = (int(v) for v in args.mesh.split("x"))
    return jax.make_mesh((d, e), ("data", "expert"))


def _loss(layer):
    def loss(params, x):
        y, aux = layer(params, x)
        return jnp.mean(y.astype(jnp.float32) ** 2) + aux.loss

    return loss


def _case(args, mesh, case: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    t, h, f, e, k = (int(v) for v in case.split("x"))
    cfg = expert.MoEConfig(
        num_experts=e, top_k=k, hidden=h, ffn_hidden=f, dtype=DTYPES[args.dtype], align=args.align
    )
    params = expert.init_moe_params(jax.random.key(0), cfg)
    specs = expert.moe_param_specs(cfg)
    params_ep = {n: jax.device_put(v, jax.NamedSharding(mesh, specs[n])) for n, v in params.items()}
    params_dense = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    x = jax.random.normal(jax.random.key(1), (t, h), cfg.dtype)
    x = jax.device_put(x, jax.NamedSharding(mesh, jax.P(cfg.token_axes)))

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
        ep_s, dense_s = timings["ep"].median, timings["dense"].median
        rows.append(
            {
                "op": op,
                "case": case,
                "mesh": mesh_text,
                "dtype": args.dtype,
                "ep_ms": 1e3 * ep_s,
                "dense_ms": 1e3 * dense_s,
                "ep_tok_s": t / ep_s,
                "dense_tok_s": t / dense_s,
                "ratio": dense_s / ep_s,
                "experts_per_top_k": e / k,
                "timings": {kk: tt.to_json() for kk, tt in timings.items()},
            }
        )
        print(H.format_table(rows[-1:], COLUMNS).splitlines()[-1], file=sys.stderr)
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
    t, h, f, e, k = (int(v) for v in case.split("x"))
    cfg = expert.MoEConfig(
        num_experts=e,
        top_k=k,
        hidden=h,
        ffn_hidden=f,
        dtype=jnp.bfloat16,
        align=args.align,
        fp8="block",
    )
    params = expert.init_moe_params(jax.random.key(0), cfg)
    specs = expert.moe_param_specs(cfg)
    params = {n: jax.device_put(v, jax.NamedSharding(mesh, specs[n])) for n, v in params.items()}
    x = jax.random.normal(jax.random.key(1), (t, h), cfg.dtype)
    x = jax.device_put(x, jax.NamedSharding(mesh, jax.P(cfg.token_axes)))
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
    print(H.format_table([row], DISPATCH_COLUMNS).splitlines()[-1], file=sys.stderr)
    return row


def run(args) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[H.Goal]]:
    mesh = _mesh(args)
    rows, stages = [], []
    for case in args.case_list:
        case_rows, stage_row = _case(args, mesh, case)
        rows += case_rows
        stages.append(stage_row)
    args.dispatch_rows = [_dispatch_case(args, mesh, case) for case in args.case_list]
    goal_rows = [r for r in rows if r["op"] == "fwd+bwd" and r["experts_per_top_k"] >= 4]
    if not goal_rows:
        goals = [H.Goal("ep faster than dense (E/K >= 4)", "no case with E/K >= 4", None)]
    else:
        worst = min(goal_rows, key=lambda r: r["ratio"])
        goals = [
            H.Goal(
                "ep fwd+bwd faster than dense masked (dense/ep >= 1) where E/K >= 4",
                f"worst {worst['ratio']:.2f}x ({worst['case']})",
                worst["ratio"] >= 1.0,
            )
        ]
    return rows, stages, goals


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=None, help=f"comma-separated TxHxFxExK (default {CASES})")
    p.add_argument("--mesh", default="2x4", help="data x expert on CPU (8 devices)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--align", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help=f"case {QUICK_CASES}, 3 repeats")
    p.add_argument("--out", default=None, help="directory for expert_parallel.md / .json")
    p.add_argument("--name", default="expert_parallel")
    args = p.parse_args(argv)
    if args.quick:
        args.cases = args.cases or QUICK_CASES
        args.repeats = min(args.repeats, 3)
    args.case_list = (args.cases or CASES).split(",")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the tables and the goal, writes files when --out is given."""
    args = parse_args(argv)
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {len(jax.devices())} x {device.device_kind} "
        f"({jax.default_backend()}); jaxops build {jaxops.build_info()}; repeats {args.repeats}",
        file=sys.stderr,
    )
    rows, stages, goals = run(args)
    print(H.format_table(rows, COLUMNS))
    print()
    print("forward time split (differences of the layer cut after each stage):")
    print(H.format_table(stages, STAGE_COLUMNS))
    print()
    print('fp8="block": dispatch in bf16 vs dispatch="fp8" (bytes per device, from the HLO):')
    print(H.format_table(args.dispatch_rows, DISPATCH_COLUMNS))
    for goal in goals:
        print(goal.line())
    if args.out:
        notes = [
            "Forward time split, ms (differences of the layer cut after each stage):",
            "",
            H.format_markdown(stages, STAGE_COLUMNS),
            "",
            'fp8="block": dispatch in bf16 vs dispatch="fp8". All-to-all bytes per device from the'
            " program's HLO (what a GPU moves) and from XLA:CPU's compiled HLO (bf16 widened to"
            " f32 there); fwd+bwd step time:",
            "",
            H.format_markdown(args.dispatch_rows, DISPATCH_COLUMNS),
            "",
            *[f"- {g.line()}" for g in goals],
        ]
        md, js = H.write_results(
            args.out,
            args.name,
            rows,
            COLUMNS,
            extra={
                "settings": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
                "stages": stages,
                "dispatch": args.dispatch_rows,
                "goals": [g.__dict__ for g in goals],
            },
            notes=notes,
        )
        print(f"wrote {md} and {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
