"""One device, published widths: the training step's tokens/s, model TFLOP/s and MFU, and its
peak memory against the plan CLI's estimate.

Each case ``CONFIG[/E] : L : B x S [: PARAM_DTYPE]`` is the decoder of
``examples/configs/CONFIG/config.json`` (the published widths: ``qwen3-30b-a3b``,
``deepseek-v3``, ``gpt-oss-20b``, ...) cut to L layers, the family's layer pattern kept
(DeepSeek-V3's first layer dense, gpt-oss's alternating windows; the multi-token-prediction
modules left out), with E routed experts instead of the published number when ``/E`` is given
(one GPU's share under expert parallelism: a token's FLOPs are unchanged, top-k of fewer
experts; DeepSeek-V3's 256 are 11.3 B weights a layer), trained on B sequences of S tokens;
``tiny-FAMILY`` (e.g. ``tiny-qwen3_moe``) names a family's tiny test config instead, for smoke
runs on a CPU. One jitted
``MoEDecoder.train_step`` (optax adamw, the parameters and optimizer state donated) on one device
(the first GPU, else the CPU), in ``--dtype`` compute with ``--param-dtype`` parameters and Adam
moments (or the case's PARAM_DTYPE: one DeepSeek-V3 MoE layer is 11.3 B weights, 180 GB with
float32 Adam), ``--remat`` and ``--fp8``; ``--grouped-gemm`` sets ``JAXOPS_GPU_GROUPED_GEMM``
(kernel, cublaslt or cutlass) for the expert GEMMs.

Reported per case: the step's median ms over ``--repeats`` steps after two warm-up steps,
tokens/s, model TFLOP/s and MFU, the peak memory (the device's ``peak_bytes_in_use`` after the
steps; GPUs only) and the plan's total for the same program (``python -m jaxops.models.plan`` in
a subprocess: XLA:CPU's compile of the same step; ``--no-plan`` skips it) and their ratio.

The FLOPs are the peers' model FLOPs (MaxText's, Megatron's; hardware FLOPs such as remat's
recompute do not count): ``6 x active x tokens`` for the weights, active = the weights a token
multiplies by (the routed experts' counted ``top_k / E``, the embedding lookup not at all, the
output head once), plus attention's scores and values, ``6 x 2 x heads x (d_qk + d_v) x keys``
per token and layer, where keys is the average number a query attends to: ``(S + 1) / 2``
causal, about the window on a sliding layer (``W - W(W - 1) / 2S``), half a chunk on a chunked
one. MFU divides by the device's dense bfloat16 peak (``--peak-tflops``; by default 989.4 for
an H100 SXM or H200, 756 for an H100 PCIe; none on a CPU).

The peer, in the same run on the same device: transformers + torch training the same decoder
(``_torch_step.py``: ``AutoModelForCausalLM.from_config`` of the same config.json, parameters and
AdamW moments in the same dtype, autocast to the compute dtype, gradient checkpointing with
``--remat full``, transformers' fastest expert implementation that runs, ``grouped_mm`` first;
SDPA attention, else eager). The peer's steps run in one subprocess before jax starts on the
device (XLA's allocator keeps what it takes); their tokens/s, peak memory and implementations go
in the rows, and ``jaxops/torch`` is jaxops' tokens/s over the peer's. ``--no-torch`` skips the
peer; so does a missing torch or transformers (``torch_error`` says why).

Goals (on an H100 / H200, the Qwen3-30B-A3B-shaped step in bfloat16): >= 300 model TFLOP/s;
the peak memory within 1.2x of the plan's estimate; every step >= 2x the peer's tokens/s.

Usage, from the repository root: ``python benchmarks/bench_gpu_step.py`` on a GPU (the default
cases), ``--quick`` for a smoke test on a CPU (tiny configs), ``--cases`` to pick (the common
flags: ``_harness.parser``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = "qwen3-30b-a3b:2:4x4096,deepseek-v3/64:2:2x4096:bfloat16,gpt-oss-20b:2:2x4096"
# The defaults fit an H100's 80 GB by the plan CLI's estimate (64.5, 75.5 and 67.1 GB; XLA:CPU's
# temporaries, a GPU's are usually smaller): on an H200 larger batches fill the device.
QUICK_CASES = "tiny-qwen3_moe/8:2:2x64,tiny-gpt_oss:2:2x64"
# Dense bfloat16 peaks (TFLOP/s) by device kind, the MFU's denominator.
PEAKS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4))
COLUMNS = [
    H.Column("case", "config[/E] : L : B x S [: params]", align="<"),
    H.Column("params_b", "params (B)", "{:.3g}"),
    H.Column("active_b", "active (B)", "{:.3g}"),
    H.Column("ms", "step ms", "{:.1f}"),
    H.Column("tokens_per_s", "tokens/s", "{:,.0f}"),
    H.Column("tflops", "model TFLOP/s", "{:.4g}"),
    H.Column("mfu", "MFU", "{:.1%}"),
    H.Column("peak_gb", "peak GB", "{:.1f}"),
    H.Column("plan_gb", "plan GB", "{:.3g}"),
    H.Column("memory_ratio", "peak/plan", "{:.2f}x"),
    H.Column("torch_tokens_per_s", "torch tokens/s", "{:,.0f}"),
    H.Column("torch_peak_gb", "torch peak GB", "{:.1f}"),
    H.Column("torch_ratio", "jaxops/torch", "{:.2f}x"),
]
# The peer's rows by case, measured before jax starts (see torch_peers).
TORCH_ROWS: dict[str, dict[str, Any]] = {}


def _hf_config(name: str, layers: int) -> dict[str, Any]:
    """The case's config.json as a dict: published widths cut to `layers`, or a tiny one."""
    from jaxops.models import family

    name, _, experts = name.partition("/")
    if name.startswith("tiny-"):
        hf = dict(family(name.removeprefix("tiny-")).tiny_config())
    else:
        hf = json.loads((ROOT / "examples" / "configs" / name / "config.json").read_text())
    if experts:  # the families' names for the routed experts' count
        for key in ("num_experts", "n_routed_experts", "num_local_experts"):
            if key in hf:
                hf[key] = int(experts)
    cut = layers < hf["num_hidden_layers"]
    hf["num_hidden_layers"] = layers
    if "layer_types" in hf:  # gpt-oss, Llama 4: the pattern of the first layers
        hf["layer_types"] = hf["layer_types"][:layers]
    if cut and hf.get("first_k_dense_replace"):  # DeepSeek-V3, GLM-4.5: the first layer dense
        hf["first_k_dense_replace"] = 1
    for key in ("num_nextn_predict_layers", "num_mtp_modules"):
        if key in hf:
            hf[key] = 0
    return hf


def _attention_flops(cfg, seq: int) -> float:
    """Attention's FLOPs per token of a step (forward and backward), summed over the layers."""
    a = cfg.attention
    if a.mla is not None:
        d_qk, d_v = a.mla.qk_nope_head_dim + a.mla.qk_rope_head_dim, a.mla.v_head_dim
    else:
        d_qk = d_v = a.head_dim
    # Without per-layer types every layer is "full_attention", windowed where sliding_window is
    # set (Mixtral); with them (gpt-oss, Llama 4) only "sliding_attention" layers are.
    types = cfg.pattern.layer_types or (
        ("sliding_attention" if a.sliding_window else "full_attention",) * cfg.num_layers
    )
    flops = 0.0
    for kind in types:
        if kind == "sliding_attention":
            w = min(a.sliding_window, seq)
            keys = w - w * (w - 1) / (2 * seq)
        elif kind == "chunked_attention":
            keys = (min(a.attention_chunk_size, seq) + 1) / 2
        else:
            keys = (seq + 1) / 2
        flops += 6 * 2 * a.num_heads * (d_qk + d_v) * keys
    return flops


def _peak_tflops(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    if not H.is_gpu():
        return None
    kind = jax.devices()[0].device_kind
    return next((peak for name, peak in PEAKS if name in kind), None)


def _plan_bytes(args, hf: dict[str, Any], batch: int, seq: int, param_dtype: str) -> int | None:
    """The plan CLI's total bytes for the case's step on one device (a fresh CPU process)."""
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "config.json").write_text(json.dumps(hf))
        command = [
            sys.executable,
            "-m",
            "jaxops.models.plan",
            tmp,
            "--mesh",
            "data=1,expert=1",
            f"--batch={batch}",
            f"--seq={seq}",
            f"--dtype={args.dtype}",
            f"--param-dtype={param_dtype}",
            f"--remat={args.remat}",
            "--json",
        ] + (["--fp8=block"] if args.fp8 else [])
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if run.returncode != 0:
        print(f"plan failed ({run.returncode}): {run.stderr[-2000:]}", file=sys.stderr)
        return None
    return int(json.loads(run.stdout.strip().splitlines()[-1])["bytes_per_device"]["total"])


def _parse_case(args, case: str) -> tuple[str, int, int, int, str]:
    """(config name, layers, batch, sequence, parameter dtype) of a case."""
    name, layers, shape, *rest = case.split(":")
    batch, seq = (int(v) for v in shape.split("x"))
    return name, int(layers), batch, seq, rest[0] if rest else args.param_dtype


def torch_peers(args) -> None:
    """The transformers + torch step of every case (``_torch_step.py``, one subprocess for all)
    into :data:`TORCH_ROWS`; run before jax starts on the device."""
    if args.no_torch:
        return
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        TORCH_ROWS.update({case: {"error": f"not installed: {missing}"} for case in args.case_list})
        return
    device = "cpu" if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") else "auto"
    specs = []
    for case in args.case_list:
        name, layers, batch, seq, param_dtype = _parse_case(args, case)
        specs.append(
            {
                "hf": _hf_config(name, layers),
                "batch": batch,
                "seq": seq,
                "dtype": args.dtype,
                "param_dtype": param_dtype,
                "remat": args.remat,
                "repeats": args.repeats,
                "device": device,
            }
        )
    script = pathlib.Path(__file__).with_name("_torch_step.py")
    limit = args.torch_timeout * len(specs)
    try:
        run = subprocess.run(
            [sys.executable, str(script), json.dumps(specs)],
            capture_output=True,
            text=True,
            timeout=limit,
        )
        lines = run.stdout.strip().splitlines()
        failure = None if run.returncode == 0 else f"exit {run.returncode}: {run.stderr[-1500:]}"
    except subprocess.TimeoutExpired as e:
        lines = (e.stdout or b"").decode().strip().splitlines() if e.stdout else []
        failure = f"timed out after {limit:.0f} s"
    for i, case in enumerate(args.case_list):
        TORCH_ROWS[case] = json.loads(lines[i]) if i < len(lines) else {"error": failure}
        print(f"{case}: torch peer {json.dumps(TORCH_ROWS[case])[:400]}", file=sys.stderr)


def _case(args, case: str, mesh) -> dict[str, Any]:
    from jaxops.models import DecoderConfig, MoEDecoder

    name, layers, batch, seq, param_dtype = _parse_case(args, case)
    hf = _hf_config(name, layers)
    cfg = DecoderConfig.from_hf(hf)
    model = MoEDecoder(
        cfg, mesh, dtype=args.dtype, remat=args.remat, fp8="block" if args.fp8 else None
    )
    opt = optax.adamw(1e-5)
    params = model.init(jax.random.key(0), param_dtype)
    state = model.init_optimizer(opt, params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    data = model.place_batch(tokens, np.roll(tokens, -1, axis=1))
    timing = H.time_train_steps(
        {"step": model.train_step(opt)},
        {"step": params},
        {"step": state},
        data,
        repeats=args.repeats,
    )["step"]
    seconds = timing.median
    counts = H.weight_counts(model)  # no MTP modules here: the decoder's weights alone
    weights, active = counts["total"], counts["trunk"]
    n = batch * seq
    flops = 6.0 * active * n + _attention_flops(cfg, seq) * n
    tflops = flops / seconds / 1e12
    peak = _peak_tflops(args)
    stats = jax.devices()[0].memory_stats() if H.is_gpu() else None
    peak_bytes = None if not stats else stats.get("peak_bytes_in_use")
    plan_bytes = None if args.no_plan else _plan_bytes(args, hf, batch, seq, param_dtype)
    peer = TORCH_ROWS.get(case, {"error": "not run (--no-torch)"})
    peer_tokens = peer.get("tokens_per_s")
    row = {
        "case": case,
        "params_b": weights / 1e9,
        "active_b": active / 1e9,
        "ms": 1e3 * seconds,
        "tokens_per_s": n / seconds,
        "model_flops": flops,
        "tflops": tflops,
        "mfu": None if peak is None else tflops / peak,
        "peak_gb": None if peak_bytes is None else peak_bytes / 1e9,
        "plan_gb": None if plan_bytes is None else plan_bytes / 1e9,
        "memory_ratio": None if not (peak_bytes and plan_bytes) else peak_bytes / plan_bytes,
        "param_dtype": param_dtype,
        "grouped_gemm": os.environ.get("JAXOPS_GPU_GROUPED_GEMM", "kernel"),
        "timing": timing.to_json(),
        "torch_tokens_per_s": peer_tokens,
        "torch_peak_gb": peer.get("peak_gb"),
        "torch_ratio": None if not peer_tokens else n / seconds / peer_tokens,
        "torch_error": peer.get("error"),
        "torch": peer,
    }
    H.log_row(row, COLUMNS)
    return row


def run(args) -> H.Result:
    """Times every case; the rows and the goals."""
    if args.grouped_gemm:
        os.environ["JAXOPS_GPU_GROUPED_GEMM"] = args.grouped_gemm
    mesh = H.mesh("1x1", ("data", "expert"))
    rows = [_case(args, case, mesh) for case in args.case_list]
    goals = []
    qwen = [r for r in rows if r["case"].startswith("qwen3-30b-a3b")]
    if H.is_gpu() and qwen and args.dtype == "bfloat16" and not args.fp8:
        text = "Qwen3-30B-A3B-shaped bf16 step >= 300 model TFLOP/s"
        goals.append(H.worst_goal(qwen, "tflops", 300.0, text, lambda r: r["case"], "{:.1f}"))
    compared = [r for r in rows if r["torch_ratio"] is not None]
    if H.is_gpu() and compared:
        text = "every step >= 2x transformers + torch's tokens/s on the same device"
        goals.append(H.worst_goal(compared, "torch_ratio", 2.0, text, lambda r: r["case"]))
    measured = [r for r in rows if r["memory_ratio"] is not None]
    if measured:
        text = "peak memory within 1.2x of the plan's estimate"
        worst = max(measured, key=lambda r: abs(np.log(r["memory_ratio"])))
        ratio = worst["memory_ratio"]
        goals.append(H.Goal(text, f"worst {ratio:.2f}x ({worst['case']})", 1 / 1.2 <= ratio <= 1.2))
    device = jax.devices()[0]
    lines = [
        f"one device ({device.device_kind}); compute {args.dtype}, parameters and Adam moments "
        f"{args.param_dtype} (unless the case names them); remat {args.remat}; "
        f"fp8 {'block' if args.fp8 else 'none'}; "
        f"grouped GEMM {os.environ.get('JAXOPS_GPU_GROUPED_GEMM', 'kernel')}; model TFLOP/s = "
        "(6 x active x tokens + attention) / step time; MFU against the dense bf16 peak "
        f"{_peak_tflops(args)} TFLOP/s"
    ]
    return H.Result(rows, COLUMNS, goals, lines=lines)


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the step's."""
    p = H.parser(__doc__, name="gpu_step", repeats=10, quick=f"cases {QUICK_CASES}, 3 repeats")
    p.add_list(
        "--cases", CASES, "comma-separated CONFIG[/E]:L:BxS[:PARAM_DTYPE]", quick=QUICK_CASES
    )
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (default bfloat16)")
    p.add_argument("--param-dtype", default="float32", help="parameters and Adam moments")
    p.add_argument("--remat", default="full", help="MoEDecoder.remat (default full)")
    p.add_argument("--fp8", action="store_true", help="the block FP8 recipe (fp8='block')")
    p.add_argument(
        "--grouped-gemm",
        choices=("kernel", "cublaslt", "cutlass"),
        default=None,
        help="JAXOPS_GPU_GROUPED_GEMM for the expert GEMMs (default: as set, else kernel)",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="the MFU's denominator")
    p.add_argument("--no-plan", action="store_true", help="skip the plan CLI's estimate")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers + torch peer")
    p.add_argument(
        "--torch-timeout", type=float, default=900, help="seconds for each case's peer step"
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    torch_peers(parse_args(sys.argv[1:]))  # before jax starts on the device
    sys.exit(H.main(parse_args, run, cpu_devices=1))
