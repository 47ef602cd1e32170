"""The smallest H100 mesh the memory plan says holds a training step, per published model.

For each config of examples/configs, runs ``python -m jaxops.models.plan`` (a fresh process per
mesh) on meshes of growing size (powers of two from the smallest the parameters and Adam state
allow) until one fits in 80 GB, and writes benchmarks/results/cpu/plan.md. Every step: ZeRO-3,
``remat="full"``, bfloat16 compute with float32 parameters and moments, MoE capacity factor
1.25, the loss over 16384 vocabulary columns at a time (``vocab_chunk``), one sequence of
``--seq`` tokens per device; the experts over an ``expert`` axis as wide
as the experts allow, the rest ``data``. Also records the compile time and the host memory of
the plan process (DeepSeek-V3 on 8, 64 and 256 simulated devices).

    python benchmarks/plan_models.py [--models deepseek-v3,kimi-k2] [--seq 4096]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
MODELS = (
    "qwen3-30b-a3b",
    "gpt-oss-120b",
    "mixtral-8x22b",
    "qwen3-235b-a22b",
    "glm-4.5",
    "llama4-maverick",
    "deepseek-v3",
    "kimi-k2",
)
H100 = 80 * 10**9
MAX_DEVICES = 512
VOCAB_CHUNK = 16384  # the loss's logit columns per step (MoEDecoder.vocab_chunk)


def _run(name: str, mesh: dict[str, int], seq: int, extra=(), batch: int | None = None) -> dict:
    """The plan CLI's JSON report in a fresh process (`batch`: default one sequence a device)."""
    extra = ("--vocab-chunk", str(VOCAB_CHUNK), *extra)
    batch = math.prod(mesh.values()) if batch is None else batch
    args = [
        sys.executable, "-m", "jaxops.models.plan", str(CONFIGS / name),
        "--mesh", ",".join(f"{k}={v}" for k, v in mesh.items()),
        "--zero", "3", "--remat", "full", "--capacity-factor", "1.25",
        "--batch", str(batch), "--seq", str(seq), "--json", *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "maxrss_kb=%M", *args],
        capture_output=True, text=True, timeout=1800, env=env, cwd="/",
    )  # fmt: skip
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1], "mesh": mesh}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    rss = [ln for ln in done.stderr.splitlines() if ln.startswith("maxrss_kb=")]
    out["host_rss_gb"] = int(rss[-1].split("=")[1]) / 1e6 if rss else None
    out["wall_s"] = round(time.perf_counter() - start, 1)
    return out


def _mesh(experts: int, devices: int) -> dict[str, int]:
    expert = math.gcd(experts, devices)
    return {"data": devices // expert, "expert": expert}


def _row(name: str, r: dict) -> str:
    by = r["bytes_per_device"]
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    gb = lambda n: f"{n / 1e9:.1f}"  # noqa: E731
    state = by["params"] + by["optimizer"] + by["gradients"]
    return (
        f"| {name} | {r['params'] / 1e9:.1f} B | {r['devices']} ({mesh}) | {r['batch']} x "
        f"{r['seq']} | {gb(by['params'])} | {gb(by['optimizer'])} | {gb(by['gradients'])} | "
        f"{gb(state)} | {gb(by['temp'])} | "
        f"{gb(r['moe_exchange']['cpu_block_bytes'])} | {gb(by['total'])} | "
        f"{r['collective_bytes'] / 1e12:.2f} | {r['compile_s']:.0f} | "
        f"{'fits' if r['fits'] else 'does not fit'} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu" / "plan.md"))
    p.add_argument(
        "--update", action="store_true", help="rerun --models only, keep the rest of the .json"
    )
    p.add_argument("--no-scale", action="store_true", help="skip the compile-time runs")
    args = p.parse_args()
    raw = pathlib.Path(args.out).with_suffix(".json")
    names = args.models.split(",")
    kept = json.loads(raw.read_text()) if args.update and raw.exists() else None
    tried = [] if kept is None else [t for t in kept["tried"] if t[0] not in names]
    for name in names:
        from jaxops.models import read_config

        cfg = read_config(CONFIGS / name)
        # float32 parameters + two float32 moments = 12 bytes per parameter, ZeRO-3 sharded
        devices = 8
        while devices < MAX_DEVICES and devices * H100 < 12 * _params(cfg):
            devices *= 2
        while True:
            r = _run(name, _mesh(cfg.moe.num_experts, devices), args.seq)
            tried.append((name, devices, r))
            print(name, devices, json.dumps(r)[:400], flush=True)
            if "error" in r or r["fits"] or devices >= MAX_DEVICES:
                break
            devices *= 2
    tried.sort(key=lambda t: (MODELS.index(t[0]) if t[0] in MODELS else len(MODELS), t[1]))
    last = {
        n: r for n, _, r in tried
    }  # each model's last mesh: the first that fits, or the largest
    rows = [_row(n, r) for n, r in last.items() if "error" not in r]
    scale = [] if kept is None else kept["scale"]  # --update keeps the compile-time runs
    for devices in () if args.no_scale or kept is not None else (8, 64, 256):
        r = _run("deepseek-v3", _mesh(256, devices), args.seq)
        if "error" not in r:
            scale.append(
                f"| {devices} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | {r['wall_s']:.1f} | "
                f"{r['host_rss_gb']:.2f} |"
            )
    # the process wall time of every run, for the compile-time table
    timing = [
        f"| {n} | {d} | {r['compile_s']:.0f} | {r['host_rss_gb']:.2f} |"
        for n, d, r in tried
        if "error" not in r
    ]
    load = os.getloadavg()[0]
    text = [
        "# Memory plans of published models (python -m jaxops.models.plan)",
        "",
        f"Written {time.strftime('%Y-%m-%d')} by benchmarks/plan_models.py on this 2-core CPU "
        f"machine (load average {load:.2f}); jax {_jax_version()}. Every step: ZeRO-3, remat "
        "full, bfloat16 compute, float32 parameters and Adam moments, MoE capacity factor 1.25, "
        f"the loss over {VOCAB_CHUNK} vocabulary columns at a time, one sequence of {args.seq} "
        "tokens per device. Bytes per device in GB (10^9); the "
        "collectives in TB per device and step; compile in seconds. The smallest power-of-two "
        f"mesh (up to {MAX_DEVICES}) that fits 80 GB, or the largest tried:",
        "",
        "| model | parameters | devices (mesh) | batch | params | optimizer | gradients | "
        "exact state | temporaries | CPU exchange blocks | total | collectives TB | "
        "compile s | 80 GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Every mesh tried (per device: exact state = parameters + optimizer state + gradients; "
        "total):",
        "",
        *(f"- {n} on {d}: " + _tried(r) for n, d, r in tried),
        "",
        "Compile time and host memory of the plan process, DeepSeek-V3 (61 layers) at the same "
        "settings:",
        "",
        "| simulated devices | lowering s | compile s | process wall s | host max RSS GB |",
        "|---|---|---|---|---|",
        *scale,
        "",
        "Every run: lowering + compile seconds and the plan process's host max RSS:",
        "",
        "| model | devices | compile s | host max RSS GB |",
        "|---|---|---|---|",
        *timing,
        "",
    ]
    pathlib.Path(args.out).write_text("\n".join(text))
    raw.write_text(json.dumps({"tried": tried, "scale": scale}, indent=1) + "\n")
    print("\n".join(text))


def _tried(r: dict) -> str:
    if "error" in r:
        return r["error"]
    by = r["bytes_per_device"]
    state = (by["params"] + by["optimizer"] + by["gradients"]) / 1e9
    return f"state {state:.1f} GB, total {by['total'] / 1e9:.1f} GB"


def _params(cfg) -> int:
    import jax
    from jaxops.models import MoEDecoder
    from jaxops.models.plan import count_params

    model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
    return count_params(model.abstract_params())


def _jax_version() -> str:
    import jax

    return jax.__version__


if __name__ == "__main__":
    main()
