"""A/B of two MoEDecoder train-step variants, interleaved in one process: a developer's tool.

A change of a few percent in the 8-device CPU train step is lost between fresh processes on a
shared machine: the same build measured 351-376 ms per step across processes (2026-11-29). In
one process, with both steps compiled and run in alternating blocks, the ratio is stable to
about 1%. What remains is an order bias: the program built second ran about 1% slower in either
order here, so the default runs the A/B twice in fresh processes, A built first and then B
first, and prints the geometric mean of the two ratios.

Each variant is a comma-separated list of settings:

- ``mesh=DxE``: the data x expert mesh (default 2x4);
- ``zero=N``, ``scan_unroll=N|all``, ``remat=...``, ``exchange=...``, ``impl=...`` or any other
  :class:`jaxops.models.MoEDecoder` field (a Python literal, else a string);
- ``xla.<flag>=<value>``: an XLA compiler option for that step alone (``.compile(
  compiler_options=...)``), e.g. ``xla.xla_cpu_prefer_vector_width=512``;
- ``env.<NAME>=<value>``: an environment variable set while that variant is traced and timed
  (and unset for the other), for a switch read at trace time or per call.

A variant of just ``torch`` is transformers' step in torch on the same model, weights and batch
(``bench_models``' comparison: forward, backward and AdamW on the whole batch with torch's
threads), timed in the same alternating blocks: ``--b torch`` prints torch / ours as B / A, the
ratio of the models benchmark's goal, measured in fresh processes (torch's step varies more
than ours between processes: 331-376 ms in fresh ones, 399 ms in one of ``bench_models``' long
runs, 2026-11-29).

Printed per variant: the median, mean and fastest step, the process's CPU time per step
(``getrusage``) and the machine's idle core time per step (``/proc/stat``; where the 8 device
threads leave a core idle, mostly at a rendezvous) and the train step's temporaries (XLA's
buffer assignment); then the ratio B / A (below 1: B faster). ``--vocab`` sets the vocabulary
(the bench's is 1024), e.g. for ``vocab_chunk``.

Run from the repository root, e.g. ``python benchmarks/ab_models.py --a mesh=2x4 --b mesh=1x8``;
``--quick`` for a smoke run on a small case.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

CASE = "4x256x16x2x256:16x128"
QUICK_CASE = "2x64x8x2x64:16x32"
_STAT_FIELDS = 8  # user nice system idle iowait irq softirq steal


def parse_variant(text: str) -> dict[str, Any]:
    """A variant's settings as ``{"mesh": (D, E), "kw": {...}, "xla": {...}, "env": {...}}``.

    ``"mesh=1x8,zero=0,xla.flag=1"``: the mesh, MoEDecoder's keywords, the XLA compiler options
    and the environment variables (see the module docstring). Raises ValueError on a malformed
    setting, naming it.
    """
    out: dict[str, Any] = {"mesh": (2, 4), "kw": {}, "xla": {}, "env": {}, "torch": False}
    if text.strip() == "torch":
        return {**out, "torch": True}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" not in item:
            raise ValueError(f"a variant's settings are key=value, got {item!r} in {text!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        if key == "mesh":
            try:
                out["mesh"] = tuple(int(v) for v in value.split("x"))
            except ValueError:
                raise ValueError(f"mesh must be DxE (two integers), got {value!r}") from None
            if len(out["mesh"]) != 2:
                raise ValueError(f"mesh must be DxE (two integers), got {value!r}")
        elif key.startswith("env."):
            out["env"][key[4:]] = value
        else:
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = value
            if key == "scan_unroll" and value == "all":
                parsed = True
            target = "xla" if key.startswith("xla.") else "kw"
            out[target][key[4:] if target == "xla" else key] = parsed
    return out


def _proc_stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1 : 1 + _STAT_FIELDS]]


def _set_env(env: dict[str, str], others: Sequence[dict[str, str]]) -> None:
    for other in others:
        for name in other:
            os.environ.pop(name, None)
    os.environ.update(env)


def _one_process(args: argparse.Namespace) -> dict[str, Any]:
    variants = {"a": parse_variant(args.a), "b": parse_variant(args.b)}
    devices = max(math.prod(v["mesh"]) for v in variants.values())
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(devices))
    import jaxops

    if args.reuse_host_memory:
        jaxops.reuse_host_memory()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jaxops.models import MoEDecoder

    bench = importlib.import_module(
        f"{__package__}.bench_models" if __package__ else "bench_models"
    )
    cfg, b, s = bench._config(args.case)
    if args.vocab is not None:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    targets = np.roll(tokens, -1, 1)
    opt = optax.adamw(1e-4, weight_decay=0.0)
    envs = [v["env"] for v in variants.values()]

    def build(v: dict[str, Any]) -> Any:
        if v["torch"]:
            return build_torch()
        _set_env(v["env"], envs)
        mesh = jax.make_mesh(v["mesh"], ("data", "expert"))
        kw = {"scan_unroll": True, "zero": 1, **v["kw"]}
        # as bench_models' rows: aux losses off, float32
        model = MoEDecoder(
            cfg, mesh, router_aux_loss_coef=0.0, router_z_loss_coef=0.0, dtype=jnp.float32, **kw
        )
        with jax.set_mesh(mesh):
            params = model.init(jax.random.key(0))
            batch = model.place_batch(tokens, targets)
        run = bench._Training(model, opt, params, batch)
        if v["xla"]:
            run.step = run.step.lower(run.params, run.state, *batch).compile(
                compiler_options=v["xla"]
            )
        for _ in range(args.warmup):
            jax.block_until_ready(run())
        return run

    def build_torch() -> Any:
        import tempfile
        from pathlib import Path

        from jaxops.models import save_pretrained

        # the weights ours start from (the same key, the bench's model settings), checked by
        # the first loss as bench_models checks it
        mesh = jax.make_mesh((1, 1), ("data", "expert"), devices=jax.devices()[:1])
        model = MoEDecoder(
            cfg, mesh, router_aux_loss_coef=0.0, router_z_loss_coef=0.0, dtype=jnp.float32
        )
        with jax.set_mesh(mesh):
            params = model.init(jax.random.key(0))
            want = float(jax.jit(model.loss)(params, *model.place_batch(tokens, targets)))
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, params, Path(tmp) / "m")
            step, first = bench._torch_step(Path(tmp) / "m", tokens, targets)
        if not np.isclose(first, want, rtol=1e-4):
            raise AssertionError(f"transformers' first loss {first} != jaxops' {want}")
        for _ in range(args.warmup):
            step()
        return step

    runs = {}
    temp: dict[str, float] = {}  # the train step's temporaries (XLA's buffer assignment), MB
    for key in args.order:
        runs[key] = build(variants[key])
        if not variants[key]["torch"]:
            r = runs[key]
            step = r.step if variants[key]["xla"] else r.step.lower(r.params, r.state, *r.batch)
            compiled = step if variants[key]["xla"] else step.compile()
            temp[key] = compiled.memory_analysis().temp_size_in_bytes / 1e6
    times: dict[str, list[float]] = {"a": [], "b": []}
    cpu = {"a": 0.0, "b": 0.0}
    idle = {"a": 0.0, "b": 0.0}
    loss: dict[str, Any] = {}
    for r in range(args.rounds):
        for key in args.order if r % 2 == 0 else args.order[::-1]:
            _set_env(variants[key]["env"], envs)
            loss[key] = jax.block_until_ready(runs[key]())  # untimed, after the switch
            u0, s0 = resource.getrusage(resource.RUSAGE_SELF), _proc_stat()
            for _ in range(args.block):
                t0 = time.perf_counter()
                loss[key] = jax.block_until_ready(runs[key]())
                times[key].append(time.perf_counter() - t0)
            u1, s1 = resource.getrusage(resource.RUSAGE_SELF), _proc_stat()
            cpu[key] += u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime
            tick = 1.0 / os.sysconf("SC_CLK_TCK")
            idle[key] += (s1[3] - s0[3] + s1[4] - s0[4]) * tick
    out: dict[str, Any] = {"order": args.order}
    for key in "ab":
        t = np.asarray(times[key])
        out[key] = {
            "median_ms": 1e3 * float(np.median(t)),
            "mean_ms": 1e3 * float(t.mean()),
            "min_ms": 1e3 * float(t.min()),
            "cpu_ms": 1e3 * cpu[key] / len(t),
            "idle_core_ms": 1e3 * idle[key] / len(t),
            "loss": float("nan") if loss[key] is None else float(loss[key]),
            "temp_mb": temp.get(key, float("nan")),
        }
    out["ratio"] = out["b"]["median_ms"] / out["a"]["median_ms"]
    return out


def _print(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"built first: {result['order'][0].upper()}")
    for key, text in (("a", args.a), ("b", args.b)):
        r = result[key]
        print(
            f"  {key.upper()} [{text}]: median {r['median_ms']:.1f} ms, mean {r['mean_ms']:.1f},"
            f" min {r['min_ms']:.1f}; CPU {r['cpu_ms']:.0f} ms/step, idle cores"
            f" {r['idle_core_ms']:.0f} ms/step"
            + ("" if math.isnan(r["loss"]) else f"; loss {r['loss']:.6f}")
            + ("" if math.isnan(r["temp_mb"]) else f"; temporaries {r['temp_mb']:.1f} MB")
        )
    print(f"  B / A (median): {result['ratio']:.3f}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--a", default="", help="variant A's settings (default: the bench's step)")
    p.add_argument("--b", required=True, help="variant B's settings, e.g. mesh=1x8,zero=0")
    p.add_argument("--case", default=CASE, help=f"L x D x E x K x F : B x S (default {CASE})")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the bench's)")
    p.add_argument("--rounds", type=int, default=14, help="blocks of each variant (default 14)")
    p.add_argument("--block", type=int, default=4, help="timed steps per block (default 4)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps after building")
    p.add_argument(
        "--order",
        default="both",
        choices=("ab", "ba", "both"),
        help="build order; both (default): two fresh processes, A first, then B first",
    )
    p.add_argument(
        "--no-reuse-host-memory",
        dest="reuse_host_memory",
        action="store_false",
        help="leave glibc's malloc settings alone (default: jaxops.reuse_host_memory())",
    )
    p.add_argument("--quick", action="store_true", help="a small case, few steps, one order")
    args = p.parse_args(argv)
    if args.quick:
        args.case, args.rounds, args.block, args.warmup = QUICK_CASE, 2, 1, 1
        args.order = "ab" if args.order == "both" else args.order
    for name in ("rounds", "block"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    for name in ("a", "b"):
        try:
            parse_variant(getattr(args, name))
        except ValueError as e:
            p.error(f"--{name}: {e}")
    return args


def fresh_pair(argv: Sequence[str]) -> list[dict[str, Any]]:
    """The A/B of these command-line arguments in two fresh processes: A built first, then B.

    Returns the two results (``_one_process``'s dicts, each with ``"ratio"``: B / A by the
    median step). Raises SystemExit, with the run's output on stderr, when a run fails.
    """
    results = []
    for order in ("ab", "ba"):
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--order", order]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"the {order} run failed (exit status {done.returncode})")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.order != "both":
        result = _one_process(args)
        _print(result, args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = fresh_pair(list(sys.argv[1:] if argv is None else argv))
    for result in results:
        _print(result, args)
    ratios = [r["ratio"] for r in results]
    print(f"B / A, geometric mean of both build orders: {math.sqrt(ratios[0] * ratios[1]):.3f}")


if __name__ == "__main__":
    main()
