"""Qwen3-MoE decoder train step: expert-parallel jaxops.models.MoEDecoder vs the dense MoE twin.

One train step (``MoEDecoder.train_step``: ``loss_and_grads`` + adamw, the parameters and the
optimizer state donated) of a Qwen3-MoE-shaped decoder
(``jaxops.models.MoEDecoder``: GQA attention with q/k norms, RMSNorm kernels, SwiGLU experts)
on the same mesh, parameters and batch, in one run:

- ``ep``: the expert-parallel MoE layer (experts split over the expert axis, tokens exchanged);
- ``dense``: the same model with the dense masked MoE twin (``moe_impl="dense"``: every device
  holds every expert and runs all of them on its tokens, weighted by the routing);
- ``torch`` (``--torch``): transformers' ``Qwen3MoeForCausalLM`` forward + backward + AdamW step
  on the same weights and batch, on the GPU when there is one (else on the CPU, with torch's
  own threads).

A table per model type (``--families``, at ``--family-case``): the same ep and dense steps with
each family's attention, router, shared experts and dense layers, and the KV cache bytes per
token (DeepSeek-V3's multi-head latent attention caches its compressed KV).

A table per ``--remat-cases`` case (default: the small one; see its help): the ep step
under each ``remat`` policy
(:data:`jaxops.models.REMAT_POLICIES`) and with gradient accumulation over 2 microbatches:
the compiled step's temporary bytes (``memory_analysis()``: the activations it keeps) and its
time (a jitted step without donation, compiled once), each checked to give the same loss.

A table of sequence lengths (``--seq-lens``, the model ``--seq-case``): the ep step on one
sequence of S tokens with the whole-scores softmax (``attention_impl="xla"``) and blockwise
attention on one device, and the ring attention of a ``context`` axis on 2 and 4 devices:
per-device temporaries and step time, each checked to give the same loss.

``--no-dense`` leaves the dense twin out of the main table (at 128 experts its activations,
every expert on every token, outgrow a GPU's memory): ours is then timed alone and, with
``--torch``, checked and timed against transformers.

``--dtype bfloat16`` runs every step in bfloat16 compute with float32 parameters and AdamW state
(transformers' under ``torch.autocast``), the losses then checked within 1e-2 instead of 1e-4: on
a GPU that is the step training runs, and its attention takes cuDNN's fused kernel (in float32
the scores are computed in jnp and kept for the backward).

Both jax models are checked to give the same loss before anything is timed (and transformers
too with ``--torch``). Ours and the dense twin are timed interleaved, a sample of each in turn,
so a slower spell of the shared machine falls on both; ours and torch in a second interleaved
pass of their own ("ep ms (vs torch)" is ours in it), each after ``--torch-warmup`` untimed
steps (default 40): what a training run's later steps take. Under ``--reuse-host-memory`` the
process's heap grows in bursts over the first few dozen steps of the 8-device step (glibc's free
lists fill up with the sizes XLA:CPU's eight device programs ask for; every new 4 KiB page is a
page fault), then stops: measured on 2 cores, the 4x256x16x2x256:16x128 step on 2 x 4 took
440-460 ms over steps 1-20 and 385-395 ms from about step 60 on, with no page faults.
Printed: step time, tokens/s and the ratios. On CPU the main table runs each case on every
``--meshes`` mesh ``data x expert`` (default 1 x 1, one device, and 2 x 4, 8 simulated devices
sharing the host's cores; torch uses all the cores either way); on GPUs every local GPU on the
expert axis.

``--scan-unroll 1,all`` adds a row per value of ``MoEDecoder.scan_unroll`` (the layers unrolled
in the layer scans), ``--zero 0,1`` one per value of ``MoEDecoder.zero`` on meshes of several
devices (ZeRO-1: each device updates a slice of the optimizer state, then the parameters are
all-gathered; on 2 x 4 CPU devices that is 8 slices of the update's replicated work);
``--reuse-host-memory`` calls :func:`jaxops.reuse_host_memory` before
anything runs (on CPU XLA allocates each step's temporaries afresh, and glibc's defaults make
that a page fault per 4 KiB page; torch's step is unaffected by it, measured). For the one-device
row in a process of one device: ``JAX_NUM_CPU_DEVICES=1 ... --meshes 1x1`` (in a process of 8
simulated devices the same one-device step ran 1.4-1.6x slower).

``--torch-fresh ROUNDS`` (CPU, with ``--torch``): after the table, each case and mesh at the
settings of its fastest row is timed once more against transformers' step with
``benchmarks/ab_models.py --b torch`` (ours and torch's steps in ROUNDS alternating blocks, in
two fresh processes, each build order once), and the torch goal reads the geometric mean of the
two ratios ("torch/ep (fresh)"). The in-pass ratio of one long process moved between 0.96x and
1.07x over six runs of nearly the same code at 16 experts on 2 x 4, with torch's step at 331-399
ms, more than ours moved (2026-11-29): a fresh pair is the steadier reading of the goal.

Run from the repository root: ``python benchmarks/bench_models.py``, with ``--quick`` (one small
case) for a smoke test, or ``--torch --out benchmarks/results/cpu`` for the saved table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxops.models import (
    MODEL_TYPES,
    REMAT_POLICIES,
    AttentionSpec,
    DecoderConfig,
    Mla,
    MoEDecoder,
    MoESpec,
    Rope,
    from_pretrained,
    save_pretrained,
)
from jaxops.models._mla import cache_bytes_per_token
from jaxops.models._spec import compose

# The harness and the A/B tool next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")
AB = importlib.import_module(f"{__package__}.ab_models" if __package__ else "ab_models")

# Compute dtypes (--dtype), and how close two ways' first losses must be in each.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 1e-2}

# layers x hidden x experts x top_k x expert_ffn, batch x seq
CASES = "4x256x16x2x256:16x128,4x256x32x4x128:16x128"
QUICK_CASES = "2x64x8x2x64:16x32"
FAMILY_CASE = "4x256x16x2x256:16x128"

COLUMNS = [
    H.Column("case", "L x D x E x K x F : B x S", align="<"),
    H.Column("mesh", "mesh", align="<"),
    H.Column("unroll", "scan_unroll", align="<"),
    H.Column("zero", "zero", align="<"),
    *H.tokens_columns("ep", "dense", "{:.1f}"),
    H.Column("ep_vs_torch_ms", "ep ms (vs torch)", "{:.1f}"),
    H.Column("torch_ms", "torch ms", "{:.1f}"),
    H.Column("torch_ratio", "torch/ep", "{:.2f}x"),
    H.Column("torch_fresh", "torch/ep (fresh)", "{:.2f}x"),
]
FAMILY_COLUMNS = [
    H.Column("family", "model_type", align="<"),
    H.Column("case", "L x D x E x K x F : B x S", align="<"),
    *H.tokens_columns("ep", "dense", "{:.1f}"),
    H.Column("kv_bytes", "KV bytes / token (bf16)", "{:,}"),
    H.Column("kv_expanded", "expanded K+V bytes / token", "{:,}"),
]
MEMORY_COLUMNS = [
    H.Column("case", "L x D x E x K x F : B x S", align="<"),
    H.Column("variant", "remat / microbatches", align="<"),
    H.Column("temp_mib", "temp MiB", "{:.1f}"),
    H.Column("temp_ratio", "temp / none", "{:.2f}x"),
    H.Column("ms", "step ms", "{:.1f}"),
    H.Column("time_ratio", "time / none", "{:.2f}x"),
]


def _config(case: str) -> tuple[DecoderConfig, int, int]:
    model, batch = case.split(":")
    layers, hidden, experts, top_k, ffn = (int(v) for v in model.split("x"))
    b, s = (int(v) for v in batch.split("x"))
    heads = max(hidden // 64, 2)
    cfg = DecoderConfig(
        model_type="qwen3_moe",
        vocab_size=1024,
        hidden_size=hidden,
        num_layers=layers,
        attention=AttentionSpec(
            num_heads=heads, num_kv_heads=max(heads // 2, 1), head_dim=hidden // heads, qk_norm=True
        ),
        moe=MoESpec(num_experts=experts, top_k=top_k, expert_ffn=ffn),
    )
    return cfg, b, s


class _Training:
    """Steps of ``model.train_step(opt)`` (what a user runs: parameters and state donated).

    Each call runs one step from the state the last one left and returns its loss; it starts
    from a copy of `params`, which stay usable.
    """

    def __init__(self, model: MoEDecoder, opt, params, batch):
        self.step = model.train_step(opt)
        self.params = jax.tree.map(lambda x: x.copy(), params)
        self.state = model.init_optimizer(opt, self.params)
        self.batch = batch

    def __call__(self) -> jax.Array:
        self.params, self.state, loss = self.step(self.params, self.state, *self.batch)
        return loss


def _step(model: MoEDecoder, opt: optax.GradientTransformation):
    """A jitted step without donation, for compiling once and calling on the same arguments."""

    @jax.jit
    def step(params, state, tokens, targets):
        loss, grads = model.loss_and_grads(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def _torch_step(path: Path, tokens: np.ndarray, targets: np.ndarray, dtype: str = "float32"):
    """(step, first loss): transformers' forward + backward + AdamW step, a function to time.

    Float32 parameters and AdamW state; with `dtype` "bfloat16" the forward runs under
    ``torch.autocast`` in bfloat16 (torch's mixed precision, what ``--dtype bfloat16`` gives
    ours: float32 parameters, bfloat16 compute).
    """
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    x = torch.tensor(tokens, dtype=torch.long, device=device)
    y = torch.tensor(targets, dtype=torch.long, device=device)

    def autocast():
        if dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device, dtype=getattr(torch, dtype))

    def step() -> None:
        with autocast():
            logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad(), autocast():
        logits = model(x).logits
    first = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return step, float(first)


def _family_config(family: str, case: str) -> tuple[DecoderConfig, int, int]:
    """The case's sizes with `family`'s features (attention, router, shared and dense layers)."""
    cfg, b, s = _config(case)
    d, ffn, heads, dh = (
        cfg.hidden_size,
        cfg.moe.expert_ffn,
        cfg.attention.num_heads,
        cfg.attention.head_dim,
    )
    layers = cfg.num_layers
    alternate = ("sliding_attention", "full_attention") * (layers // 2) + (
        "sliding_attention",) * (layers % 2)  # fmt: skip
    routed = dict(router="sigmoid", router_bias=True, n_group=2, topk_group=1,
                  routed_scaling_factor=2.5, shared_ffn=ffn, shared_gate=False,
                  dense_layers=(0,), dense_ffn=4 * d)  # fmt: skip
    kw: dict[str, Any] = {
        "mixtral": dict(qk_norm=False),
        "qwen3_moe": {},
        "qwen2_moe": dict(qk_norm=False, qkv_bias=True, shared_ffn=ffn, shared_gate=True),
        "olmoe": dict(qk_norm_width="projection", normalize_topk=False),
        "glm4_moe": dict(rope=Rope(partial_rotary_factor=0.5), qkv_bias=True, **routed),
        "ernie4_5_moe": dict(
            qk_norm=False,
            rope=Rope(theta=5e5, interleave=True),
            router_bias=True,
            shared_ffn=ffn,
            shared_gate=False,
            dense_layers=(0,),
            dense_ffn=4 * d,
            tie_word_embeddings=True,
        ),
        "deepseek_v3": dict(
            qk_norm=False,
            num_kv_heads=heads,
            head_dim=dh // 2,
            rope=Rope(interleave=True),
            mla=Mla(
                kv_lora_rank=d // 2,
                qk_nope_head_dim=dh,
                qk_rope_head_dim=dh // 2,
                v_head_dim=dh,
                q_lora_rank=d // 2,
            ),
            **routed,
        ),
        "gpt_oss": dict(
            qk_norm=False,
            qkv_bias=True,
            o_bias=True,
            rope=Rope(
                "yarn",
                1.5e5,
                factor=32.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
            sliding_window=max(s // 4, 1),
            layer_types=alternate,
            attention_sinks=True,
            activation="clamped_swiglu",
            expert_bias=True,
            router_logit_bias=True,
        ),
        "llama4_text": dict(
            qk_norm=False,
            top_k=1,
            router="sigmoid",
            normalize_topk=False,
            weight_inputs=True,
            shared_ffn=ffn,
            shared_gate=False,
            dense_layers=tuple(range(0, layers, 2)) if layers > 1 else (),
            dense_ffn=4 * d if layers > 1 else 0,
            rope=Rope(theta=5e5, interleave=True),
            nope_layers=tuple(range(1, layers, 2)),
            attention_chunk_size=max(s // 4, 1),
            layer_types=tuple(
                "full_attention" if i % 2 else "chunked_attention" for i in range(layers)
            ),
            qk_l2_norm=True,
            attn_temperature_tuning=True,
            floor_scale=max(s // 4, 1),
        ),
        "minimax_m2": dict(
            qk_norm_width="projection",
            rope=Rope(theta=5e6, partial_rotary_factor=0.5),
            router="sigmoid",
            router_bias=True,
        ),
    }[family]
    # the family's fields replace those of the specs (attention, moe, pattern)
    specs = compose({"attention": cfg.attention, "moe": cfg.moe, **kw})
    return dataclasses.replace(cfg, model_type=family, **specs), b, s


def _family(args, mesh, family: str, case: str) -> dict[str, Any]:
    """One family's row: its ep and dense train steps, and its KV cache bytes per token."""
    cfg, _, _ = _family_config(family, case)
    row = _case(args, mesh, case, cfg)
    itemsize = 2  # bfloat16
    return {
        **row,
        "family": family,
        "kv_bytes": cfg.num_layers * cache_bytes_per_token(cfg, itemsize),
        "kv_expanded": cfg.num_layers
        * 2
        * cfg.attention.num_heads
        * cfg.attention.qk_head_dim
        * itemsize
        if cfg.attention.mla is not None
        else cfg.num_layers * cache_bytes_per_token(cfg, itemsize),
    }


def _case(
    args,
    mesh,
    case: str,
    cfg: DecoderConfig | None = None,
    unroll: int | bool = 1,
    zero: int = 0,
) -> dict[str, Any]:
    cfg, b, s = (cfg, *_config(case)[1:]) if cfg is not None else _config(case)
    # aux losses off: transformers' training loss is the cross-entropy (comparable losses).
    kw = dict(
        router_aux_loss_coef=0.0,
        router_z_loss_coef=0.0,
        dtype=DTYPES[args.dtype],
        scan_unroll=unroll,
        zero=zero,
    )
    ep_model = MoEDecoder(cfg, mesh, **kw)
    params_ep = ep_model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    batch = ep_model.place_batch(tokens, targets)
    opt = optax.adamw(1e-4, weight_decay=0.0)
    loss_ep = float(jax.jit(ep_model.loss)(params_ep, *batch))
    cases = {"ep": (_Training(ep_model, opt, params_ep, batch), ())}
    if not args.no_dense:
        dense_model = MoEDecoder(cfg, mesh, moe_impl="dense", **kw)
        params_dense = jax.device_put(params_ep, dense_model.shardings())
        loss_dense = float(jax.jit(dense_model.loss)(params_dense, *batch))
        if not np.isclose(loss_ep, loss_dense, rtol=LOSS_RTOL[args.dtype]):
            raise AssertionError(f"{case}: ep loss {loss_ep} != dense loss {loss_dense}")
        cases["dense"] = (_Training(dense_model, opt, params_dense, batch), ())
    if args.torch:
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(ep_model, params_ep, Path(tmp) / "m")
            _, again = from_pretrained(Path(tmp) / "m", mesh=mesh)  # the files round-trip
            if not all(
                np.array_equal(np.asarray(a), np.asarray(c))
                for a, c in zip(jax.tree.leaves(params_ep), jax.tree.leaves(again), strict=True)
            ):
                raise AssertionError("save_pretrained / from_pretrained changed the weights")
            torch_step, torch_loss = _torch_step(Path(tmp) / "m", tokens, targets, args.dtype)
        if not np.isclose(torch_loss, loss_ep, rtol=LOSS_RTOL[args.dtype]):
            raise AssertionError(f"{case}: transformers' loss {torch_loss} != jaxops' {loss_ep}")
    with jax.set_mesh(mesh):
        timings = H.time_interleaved(cases, repeats=args.repeats)
        # ours against torch: a pass of their own, nothing else between their samples (in one
        # pass with the dense twin, 3x longer, our 1-device step measured 458 ms against 396-401
        # ms alone)
        versus = (
            H.time_interleaved(
                {"ep": cases["ep"], "torch": (torch_step, ())},
                repeats=args.repeats,
                warmup=args.torch_warmup,
            )
            if args.torch
            else None
        )
    row: dict[str, Any] = {
        "case": case,
        "mesh": "x".join(str(n) for n in mesh.devices.shape),
        "unroll": "all" if unroll is True else str(unroll),
        "zero": str(zero),
        **(
            H.tokens_fields(timings, "ep", "dense", b * s)
            if "dense" in timings
            else {
                "ep_ms": 1e3 * timings["ep"].median,
                "ep_tok_s": b * s / timings["ep"].median,
                "timings": {"ep": timings["ep"].to_json()},
            }
        ),
        "ep_vs_torch_ms": float("nan"),
        "torch_ms": float("nan"),
        "torch_ratio": float("nan"),
        "torch_fresh": float("nan"),
        "loss": loss_ep,
    }
    if versus is not None:
        ep_s, torch_s = versus["ep"].median, versus["torch"].median
        row.update(ep_vs_torch_ms=1e3 * ep_s, torch_ms=1e3 * torch_s, torch_ratio=torch_s / ep_s)
    return row


def _memory(args, mesh, case: str) -> list[dict[str, Any]]:
    """The ep step per remat policy and with 2 microbatches: temp bytes and time."""
    cfg, b, s = _config(case)
    base = MoEDecoder(cfg, mesh, router_aux_loss_coef=0.0, dtype=DTYPES[args.dtype])
    params = base.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    batch = base.place_batch(tokens, np.roll(tokens, -1, axis=1))
    opt = optax.adamw(1e-4, weight_decay=0.0)
    with jax.set_mesh(mesh):
        state = jax.jit(opt.init)(params)
    variants = {f"{r} / 1": dataclasses.replace(base, remat=r) for r in REMAT_POLICIES}
    variants["none / 2"] = dataclasses.replace(base, num_microbatches=2)
    cases, temp, losses = {}, {}, {}
    for name, model in variants.items():
        step = _step(model, opt)
        with jax.set_mesh(mesh):
            compiled = step.lower(params, state, *batch).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
        losses[name] = float(jax.jit(model.loss)(params, *batch))
        cases[name] = (compiled, (params, state, *batch))
    for name, loss in losses.items():
        if not np.isclose(loss, losses["none / 1"], rtol=1e-5):
            raise AssertionError(f"{case} {name}: loss {loss} != {losses['none / 1']}")
    with jax.set_mesh(mesh):
        timings = H.time_interleaved(cases, repeats=args.repeats)
    none_t, none_b = timings["none / 1"].median, temp["none / 1"]
    return [
        {
            "case": case,
            "variant": name,
            "temp_bytes": temp[name],
            "temp_mib": temp[name] / 2**20,
            "temp_ratio": temp[name] / none_b,
            "ms": 1e3 * timings[name].median,
            "time_ratio": timings[name].median / none_t,
        }
        for name in variants
    ]


SEQUENCE_COLUMNS = [
    H.Column("seq", "S", "{:d}"),
    H.Column("variant", "attention (devices)", align="<"),
    H.Column("temp_mib", "temp MiB / device", "{:.1f}"),
    H.Column("temp_ratio", "temp / xla", "{:.2f}x"),
    H.Column("ms", "step ms", "{:.1f}"),
]


def _sequences(args) -> list[dict[str, Any]]:
    """The ep step of --seq-case's model on one sequence of each --seq-lens length: the
    whole-scores softmax ("xla") and blockwise attention on one device, and the ring on 2 and 4
    context devices (each a 1 / C share of the sequence); per-device temporaries and time."""
    cfg, _, _ = _config(args.seq_case + ":1x1")
    opt = optax.adamw(1e-4, weight_decay=0.0)
    rows = []
    for seq in args.seq_len_list:
        tokens = np.random.default_rng(seq).integers(0, cfg.vocab_size, (1, seq), np.int32)
        variants = {
            "xla (1)": ({"attention_impl": "xla"}, (1,), ("expert",)),
            "blockwise (1)": ({}, (1,), ("expert",)),
            "ring (2)": ({}, (2, 1), ("context", "expert")),
            "ring (4)": ({}, (4, 1), ("context", "expert")),
        }
        cases, temp, losses = {}, {}, {}
        for name, (kw, shape, axes) in variants.items():
            mesh = jax.make_mesh(shape, axes, devices=jax.devices()[: int(np.prod(shape))])
            model = MoEDecoder(cfg, mesh, router_aux_loss_coef=0.0, **kw)
            params = model.init(jax.random.key(0))
            batch = model.place_batch(tokens, np.roll(tokens, -1, axis=1))
            with jax.set_mesh(mesh):
                state = jax.jit(opt.init)(params)
                compiled = _step(model, opt).lower(params, state, *batch).compile()
                losses[name] = float(jax.jit(model.loss)(params, *batch))
            temp[name] = compiled.memory_analysis().temp_size_in_bytes
            cases[name] = (compiled, (params, state, *batch))
        for name, loss in losses.items():
            if not np.isclose(loss, losses["xla (1)"], rtol=1e-5):
                raise AssertionError(f"S={seq} {name}: loss {loss} != {losses['xla (1)']}")
        timings = H.time_interleaved(cases, repeats=args.repeats)
        for name in variants:
            rows.append(
                {
                    "seq": seq,
                    "variant": name,
                    "temp_bytes": temp[name],
                    "temp_mib": temp[name] / 2**20,
                    "temp_ratio": temp[name] / temp["xla (1)"],
                    "ms": 1e3 * timings[name].median,
                }
            )
    return rows


def _fresh_versus_torch(args, row: dict[str, Any]) -> None:
    """Row's step against transformers' in two fresh processes (``ab_models.py --b torch``).

    Sets ``row["torch_fresh"]`` (torch / ours, the geometric mean of both build orders) and
    ``row["fresh"]`` (each process's medians and ratio).
    """
    argv = [
        "--a",
        f"mesh={row['mesh']},scan_unroll={row['unroll']},zero={row['zero']}",
        "--b",
        "torch",
        "--case",
        row["case"],
        "--warmup",
        str(args.torch_warmup),
        "--rounds",
        str(args.torch_fresh),
    ]
    if not args.reuse_host_memory:
        argv.append("--no-reuse-host-memory")
    results = AB.fresh_pair(argv)
    ratios = [r["ratio"] for r in results]
    row["torch_fresh"] = float(np.sqrt(ratios[0] * ratios[1]))
    row["fresh"] = [
        {
            "built_first": r["order"][0],
            "ep_ms": r["a"]["median_ms"],
            "torch_ms": r["b"]["median_ms"],
            "ratio": r["ratio"],
        }
        for r in results
    ]
    print(
        f"fresh processes, {row['case']} on {row['mesh']} (scan_unroll {row['unroll']}, zero "
        f"{row['zero']}): torch/ep {ratios[0]:.3f} (ours built first), {ratios[1]:.3f} (torch "
        f"first), {row['torch_fresh']:.3f}",
        flush=True,
    )


def run(args) -> H.Result:
    """Checks and times every case; the rows, the remat table and the goal."""
    meshes = [H.mesh(m, ("data", "expert"), gpu_axis="expert") for m in args.mesh_list]
    if H.is_gpu():  # every local GPU on the expert axis: one mesh
        meshes = meshes[-1:]
    mesh = meshes[-1]  # the remat and per-family tables
    rows, memory = [], []
    for case in args.remat_case_list:
        memory.extend(_memory(args, mesh, case))
        for row in memory[-len(REMAT_POLICIES) - 1 :]:
            H.log_row(row, MEMORY_COLUMNS)
    sequences = []
    for row in _sequences(args) if args.seq_len_list else ():
        sequences.append(row)
        H.log_row(row, SEQUENCE_COLUMNS)
    families = []
    for family in args.familie_list:  # (the harness drops the trailing s)
        case = args.family_case or (QUICK_CASES if args.quick else FAMILY_CASE)
        families.append(_family(args, mesh, family, case))
        H.log_row(families[-1], FAMILY_COLUMNS)
    for case in args.case_list:
        for m in meshes:
            # ZeRO on one device is the same program: its rows on meshes of several only
            zeros = args.zero_list if m.devices.size > 1 else [0]
            for unroll in args.unroll_list:
                for zero in zeros:
                    rows.append(_case(args, m, case, unroll=unroll, zero=zero))
                    H.log_row(rows[-1], COLUMNS)
    text = "EP decoder train step faster than the dense-MoE decoder (dense/ep >= 1)"
    table = H.Table(
        "remat",
        memory,
        MEMORY_COLUMNS,
        "ep train step per remat policy (microbatches: gradient accumulation)",
    )
    family_table = H.Table(
        "families",
        families,
        FAMILY_COLUMNS,
        "per model type at --family-case (its attention, router, shared and dense layers; "
        "glm4_moe, deepseek_v3 and ernie4_5_moe with a dense first layer, deepseek_v3 with MLA, "
        "gpt_oss with sliding-window layers of S/4 and sinks, llama4_text top-1 with dense "
        "layers 0 and 2 and chunks of S/4); KV bytes per token over all layers",
    )
    dense_rows = [r for r in rows if "ratio" in r]
    goals = (
        [H.worst_goal(dense_rows, "ratio", 1.0, text, lambda r: f"{r['case']} on {r['mesh']}")]
        if dense_rows
        else [H.Goal(text, "--no-dense", None)]
    )
    if args.torch:
        # Each case and mesh at the scan_unroll and zero of our fastest step ("ep ms", timed
        # apart from torch): chosen by our own time, not by the ratio, so that the goal does
        # not read the largest of several noisy ratios.
        best: dict[tuple[str, str], dict[str, Any]] = {}
        for r in rows:
            key = (r["case"], r["mesh"])
            if key not in best or r["ep_ms"] < best[key]["ep_ms"]:
                best[key] = r
        fresh = args.torch_fresh > 0 and not H.is_gpu()
        for r in best.values() if fresh else ():
            _fresh_versus_torch(args, r)
        goals.append(
            H.worst_goal(
                list(best.values()),
                "torch_fresh" if fresh else "torch_ratio",
                1.0,
                "MoEDecoder train step at least as fast as transformers + torch with the same "
                "threads (torch/ep >= 1; each case and mesh at the scan_unroll and zero of its "
                "fastest ep ms"
                + (
                    f"; timed by ab_models.py in two fresh processes, {args.torch_fresh} "
                    "alternating blocks each, the geometric mean of both build orders)"
                    if fresh
                    else ")"
                ),
                lambda r: (
                    f"{r['case']} on {r['mesh']}, scan_unroll {r['unroll']}, zero {r['zero']}"
                ),
            )
        )
    line = f"compute dtype {args.dtype}; parameters and AdamW state float32" + (
        " (transformers: torch.autocast in bfloat16)" if args.dtype == "bfloat16" else ""
    )
    sequence_table = H.Table(
        "sequences",
        sequences,
        SEQUENCE_COLUMNS,
        f"ep train step of {args.seq_case} on one sequence of S tokens: attention_impl 'xla' "
        "(float32 [H, S, S] scores) and blockwise (blocks of 512) on one device, the ring "
        "attention of a context axis on 2 and 4 (each device a 1 / C share of the sequence; "
        "time on simulated devices sharing the host's cores)",
    )
    tables = [table, family_table] + ([sequence_table] if sequences else [])
    return H.Result(rows, COLUMNS, goals, tables=tables, lines=[line])


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the cases and mesh."""
    p = H.parser(__doc__, name="models", repeats=7, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated cases", quick=QUICK_CASES)
    p.add_list(
        "--remat-cases",
        QUICK_CASES,
        "cases of the remat table (on 8 simulated CPU devices, remat='full' at the default "
        "cases' size deadlocks in XLA:CPU's in-process collectives: devices start two "
        "independent all-reduces in different orders)",
        quick=QUICK_CASES,
    )
    p.add_list(
        "--families",
        ",".join(MODEL_TYPES),
        "model types of the per-family table",
        quick="deepseek_v3",
        choices=MODEL_TYPES,
    )
    p.add_list(
        "--seq-lens",
        "1024,2048,4096",
        "sequence lengths of the sequence table ('' for none)",
        quick="512",
    )
    p.add_argument(
        "--seq-case",
        default="2x256x8x2x256",
        help="the model (L x D x E x K x F) of the sequence table (default 2x256x8x2x256)",
    )
    p.add_argument(
        "--family-case",
        default=None,
        help=f"the per-family table's case (default {FAMILY_CASE}; {QUICK_CASES} with --quick)",
    )
    p.add_argument(
        "--meshes",
        default="1x1,2x4",
        help="comma-separated data x expert meshes of the main table on CPU (the last, of 8 "
        "devices, also runs the remat and per-family tables); on GPUs every local GPU on the "
        "expert axis",
    )
    p.add_argument("--torch", action="store_true", help="also transformers' step in torch")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="compute dtype of every step (parameters and AdamW state stay float32; torch: "
        "autocast). On a GPU bfloat16 is what training runs, and attention then takes cuDNN's "
        "fused kernel, which keeps no score matrix (float32: jnp scores; the 128-expert case "
        "4x2048x128x8x768:8x2048 ran an H200 out of memory in float32)",
    )
    p.add_argument(
        "--no-dense",
        action="store_true",
        help="main table without the dense-MoE twin (it runs every expert on every token: at "
        "128 experts its activations outgrow a GPU); with --torch, ours is checked and timed "
        "against transformers only",
    )
    p.add_argument(
        "--scan-unroll",
        default="1",
        help="comma-separated MoEDecoder.scan_unroll values of the main table, a row each "
        "('all' unrolls every layer; default 1: one compiled layer body)",
    )
    p.add_argument(
        "--zero",
        default="0",
        help="comma-separated MoEDecoder.zero values of the main table on meshes of more than "
        "one device, a row each (default 0; 1: ZeRO-1, each device updates its slice of the "
        "optimizer state and the parameters are all-gathered after the update)",
    )
    p.add_argument(
        "--torch-warmup",
        type=int,
        default=40,
        help="untimed steps of ours and of transformers' before the pass that times them against "
        "each other (default 40: a train step's heap on CPU is still growing over its first "
        "few dozen steps, a page fault per new 4 KiB page; see the module docstring)",
    )
    p.add_argument(
        "--torch-fresh",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="with --torch on CPU: time each case and mesh (at its fastest row's settings) "
        "against transformers' step again with ab_models.py in two fresh processes, ROUNDS "
        "alternating blocks each, and read the torch goal from their ratios (default 0: off, "
        "the goal reads the in-pass ratio)",
    )
    p.add_argument(
        "--reuse-host-memory",
        action="store_true",
        help="call jaxops.reuse_host_memory() first (glibc keeps freed memory: XLA:CPU's "
        "per-step temporaries are not page-faulted in again; transformers + torch runs in the "
        "same process under the same setting)",
    )
    args = p.parse_args(argv)
    if args.torch_warmup < 0:
        p.error(f"--torch-warmup must be >= 0, got {args.torch_warmup}")
    if args.torch_fresh < 0:
        p.error(f"--torch-fresh must be >= 0, got {args.torch_fresh}")
    if args.torch_fresh and args.dtype != "float32":
        p.error(f"--torch-fresh times float32 steps only (ab_models.py), got --dtype {args.dtype}")
    if args.torch_fresh and not args.torch:
        p.error("--torch-fresh times ours against transformers' step: it needs --torch")
    args.mesh_list = args.meshes.split(",")
    args.seq_len_list = [int(v) for v in args.seq_len_list if v]
    args.unroll_list = [True if v == "all" else int(v) for v in args.scan_unroll.split(",")]
    args.zero_list = [int(v) for v in args.zero.split(",")]
    if any(z not in (0, 1, 3) for z in args.zero_list):
        p.error(f"--zero takes 0, 1 or 3, got {args.zero}")
    if args.reuse_host_memory:
        import jaxops

        if not jaxops.reuse_host_memory():
            raise SystemExit("--reuse-host-memory: this C library has no glibc mallopt")
    return args


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8))
