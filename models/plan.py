r"""Ahead-of-time memory plan of a training step: ``python -m jaxops.models.plan``.

Builds the decoder of a Hugging Face ``config.json`` on a mesh of simulated CPU devices, lowers
and compiles its full training step (:meth:`~jaxops.models.MoEDecoder.train_step`: forward,
backward and an ``optax.adamw`` update) for abstract arguments (``jax.ShapeDtypeStruct``:
nothing is allocated), and reports per device: parameters, optimizer state and gradients
(exact: the shards of the arrays the step holds), XLA's temporaries
(``compiled.memory_analysis()``), the total, whether it fits the device memory, the
collectives' bytes per step (from the compiled HLO, loops counted by their trip counts) and
the compile time::

    python -m jaxops.models.plan examples/configs/deepseek-v3 \
        --mesh pipe=8,data=4,expert=32 --zero 1 --batch 256 --seq 4096 --json

What the plan predicts of a GPU compile: the parameters, optimizer state and gradients are the
same arrays on any backend. The temporaries are XLA:CPU's buffer assignment of the same
program; on a GPU they depend on XLA:GPU's fusion and scheduling, the attention (blockwise
here, one block pair's scores; cuDNN's keeps none) and the expert exchange
(``ragged_all_to_all`` on GPU; the plan compiles its dense twin, ``exchange="dense"``, not the
all-gather form, whose buffers grow with the expert axis), so they are an estimate; XLA:CPU
also computes bfloat16 elementwise work in float32, holding float32 copies of values a GPU
keeps in bfloat16. The MoE layer's receive buffers
are the static bounds of :func:`jaxops.parallel.expert.exchange_bounds` either way (dropless
layers size them for the worst routing, which at these sizes is why ``--capacity-factor``
matters). XLA:CPU's dense exchange runs in rounds of ``expert x block`` rows each way
(``block`` about 1.25x the rows one device sends another on average; a skewed routing takes
more rounds, not more memory), which the report names (``moe_exchange.cpu_block_bytes``); a
GPU's ragged_all_to_all sends the rows themselves. The collectives' bytes count such a loop of
unknown trip count once.

With ``--lora RANK`` (and ``--lora-targets``) the step trains LoRA adapters alone (optimizer
state and gradients for them), on a base in ``--param-dtype`` (``--base bf16``: bfloat16) or
kept in block FP8 (``--base fp8``: one byte a base weight plus its scales) or, for gpt-oss,
with its experts in MXFP4 (``--base mxfp4``: half a byte an expert weight)::

    python -m jaxops.models.plan examples/configs/deepseek-v3 --mesh data=1,expert=8 \
        --lora 16 --base fp8 --param-dtype bfloat16 --batch 8 --seq 4096 --device-memory 141GB

The CPU devices must be set before jax starts: run it as a fresh process (the ``main``
function sets ``jax_num_cpu_devices`` and the CPU platform itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxops._errors import InvalidArgumentError

__all__ = ["count_params", "main", "parse_bytes", "parse_mesh", "plan"]

#: The default device memory: an H100's 80 GB.
H100_BYTES = 80 * 10**9
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_mesh(text: str) -> dict[str, int]:
    """``"pipe=2,data=4,expert=8"`` as ``{"pipe": 2, "data": 4, "expert": 8}`` (in order).

    Example:
      >>> parse_mesh("data=4,expert=8")
      {'data': 4, 'expert': 8}
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([A-Za-z_]\w*)=(\d+)", part)
        if m is None or int(m.group(2)) < 1 or m.group(1) in out:
            raise InvalidArgumentError(
                f"jaxops.models.plan.parse_mesh: --mesh must be comma-separated AXIS=SIZE "
                f"entries with distinct axes and sizes >= 1 (e.g. pipe=2,data=4,expert=8), "
                f"got {text!r}"
            )
        out[m.group(1)] = int(m.group(2))
    if "expert" not in out:
        raise InvalidArgumentError(
            f"jaxops.models.plan.parse_mesh: --mesh needs an 'expert' axis (size 1 for none), "
            f"got {text!r}"
        )
    return out


def parse_bytes(text: str | int) -> int:
    """``"80GB"``, ``"80GiB"``, ``"8e10"`` or an int as bytes.

    Example:
      >>> parse_bytes("80GB"), parse_bytes("1GiB"), parse_bytes(512)
      (80000000000, 1073741824, 512)
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?I?B?)\s*", text.upper())
    if m is None or m.group(2) not in _UNITS:
        raise InvalidArgumentError(
            f"jaxops.models.plan.parse_bytes: --device-memory must be bytes such as 80GB or "
            f"85899345920, got {text!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def count_params(abstract: Any) -> int:
    """The elements of a parameter tree (arrays, ``jax.ShapeDtypeStruct`` s or shape tuples)."""
    import jax

    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(a if isinstance(a, tuple) else a.shape) for a in leaves)


def _device_bytes(tree: Any) -> int:
    """Bytes of the largest per-device shard set of `tree`'s arrays (sharded structs)."""
    import jax

    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += math.prod(shape) * a.dtype.itemsize
    return total


def _with_shardings(tree: Any, shardings: Any) -> Any:
    import jax

    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def plan(
    config: Any,
    mesh_shape: dict[str, int],
    *,
    batch: int,
    seq: int,
    zero: int = 0,
    fp8: Any = None,
    remat: str = "full",
    dtype: str = "bfloat16",
    param_dtype: str = "float32",
    microbatches: int | None = None,
    capacity_factor: float | None = None,
    vocab_chunk: int | None = None,
    device_memory: int = H100_BYTES,
    lora: int | None = None,
    lora_targets: Sequence[str] | None = None,
    base: str | None = None,
    mtp_loss_weight: float = 0.0,
) -> dict[str, Any]:
    """The memory plan of one training step (the process must have the mesh's CPU devices).

    Args:
      config: a :class:`~jaxops.models.DecoderConfig` or a model directory / config.json path.
      mesh_shape: axis -> size (:func:`parse_mesh`); "pipe" makes pipeline stages, "expert"
        holds the experts, "context" splits every sequence (context parallelism), the other
        axes split the batch.
      batch: the global batch in sequences: a multiple of the mesh's batch axes' size but the
        context axis's (times the microbatches), refused before anything is compiled
        otherwise.
      seq: their length in tokens (a multiple of twice the context axis's size).
      zero: :attr:`MoEDecoder.zero` (0, 1 or 3).
      fp8: None or the block :class:`jaxops.fp8.Recipe` (or "block"; :attr:`MoEDecoder.fp8`).
      remat: a :data:`~jaxops.models.REMAT_POLICIES` name.
      dtype: the compute dtype.
      param_dtype: the parameters' and the Adam moments' dtype.
      microbatches: per data shard (default: the pipe size, 1 without a pipeline).
      capacity_factor: the MoE layers' capacity factor (None: dropless).
      vocab_chunk: :attr:`MoEDecoder.vocab_chunk` (None: the loss's logits whole).
      device_memory: bytes per device for ``fits``.
      lora: None (full fine-tuning) or the rank of :class:`jaxops.Lora` adapters (alpha twice
        the rank): the step trains them alone, with optimizer state and gradients for them.
      lora_targets: their targets (default: every one the model has,
        :func:`~jaxops.models._adapters.lora_targets`).
      base: None (the base weights in `param_dtype`), "fp8" (:attr:`MoEDecoder.base`: the
        layers' linear weights as FP8 bytes with 128 x 128 block scales) or "mxfp4" (the
        routed experts as packed MXFP4 bytes with E8M0 scales); with `lora`.
      mtp_loss_weight: :attr:`MoEDecoder.mtp_loss_weight`: > 0 trains the config's
        multi-token-prediction modules (their activations, gradients and optimizer state in
        the plan); 0 keeps them frozen (their parameters only). The report counts them apart
        (``mtp_params``).

    Returns:
      The JSON-ready dict :func:`main` prints (see the module docstring).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxops.parallel.expert._exchange import make_plan

    from jaxops._lora import Lora

    from ._adapters import lora_targets as all_targets
    from ._config import DecoderConfig, read_config
    from ._decoder import MoEDecoder
    from ._hlo import collective_traffic

    try:
        import optax
    except ImportError:
        raise ImportError(
            "jaxops.models.plan: the plan's optimizer is optax.adamw; pip install optax "
            "(or jaxops[examples])"
        ) from None
    cfg = config if isinstance(config, DecoderConfig) else read_config(config)
    devices = math.prod(mesh_shape.values())
    if jax.device_count() < devices:
        raise InvalidArgumentError(
            f"jaxops.models.plan: the mesh {mesh_shape} needs {devices} devices, this process has "
            f"{jax.device_count()} (run `python -m jaxops.models.plan`, which sets them)"
        )
    mesh = jax.make_mesh(
        tuple(mesh_shape.values()), tuple(mesh_shape), devices=jax.devices()[:devices]
    )
    pipe = mesh_shape.get("pipe", 1)
    adapters = None
    if lora is not None:
        targets = tuple(lora_targets) if lora_targets else all_targets(cfg)
        adapters = Lora(lora, 2.0 * lora, targets)
    model = MoEDecoder(
        cfg,
        mesh,
        num_microbatches=microbatches or (pipe if pipe > 1 else 1),
        remat=remat,
        dtype=jnp.dtype(dtype),
        fp8=fp8,
        capacity_factor=capacity_factor,
        zero=zero,
        vocab_chunk=vocab_chunk,
        exchange="dense",  # the GPU's ragged_all_to_all's receive buffers, plus its padding
        lora=adapters,
        base=base,
        mtp_loss_weight=mtp_loss_weight,
    )
    # the batch's sequences split over the batch axes but the context axis (which splits each)
    shards = math.prod(mesh_shape[a] for a in model.input_axes)
    need = shards * model.num_microbatches
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or batch % need:
        times = (
            f" times {model.num_microbatches} microbatches" if model.num_microbatches > 1 else ""
        )
        raise InvalidArgumentError(
            f"jaxops.models.plan: --batch (batch=) must be a positive multiple of {need}, the "
            f"size {shards} of the mesh's batch axes {tuple(model.input_axes)}{times}, "
            f"got {batch!r}"
        )
    if seq % (2 * model.context):
        raise InvalidArgumentError(
            f"jaxops.models.plan: --seq (seq=) must be a multiple of {2 * model.context}: the "
            f"context axis of size {model.context} splits each sequence into "
            f"{2 * model.context} chunks, got {seq!r}"
        )
    optimizer = optax.adamw(1e-4)
    params = model.abstract_params(jnp.dtype(param_dtype))
    trained = model.trainable(params)  # all, or the adapters
    state = _with_shardings(
        jax.eval_shape(optimizer.init, trained), model.optimizer_shardings(optimizer, params)
    )
    grad_specs = model.zero_specs() if zero >= 1 else model.param_specs()
    grad_shardings = model.layout.trainable_specs(model.named(grad_specs))
    grads = _with_shardings(trained, grad_shardings)
    rows = NamedSharding(mesh, P(model.input_axes))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows)
    start = time.perf_counter()
    lowered = model.train_step(optimizer).lower(params, state, tokens, tokens)
    lower_s = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    n = mesh_shape["expert"]
    shards = model.batch_devices  # the MoE layer's token shards (the context axis's too)
    per_device = batch * seq // (shards * model.num_microbatches)
    # the compiled layer's own bounds (its group alignment is the CPU kernels')
    layer = make_plan(model.moe, mesh, n, shards, per_device * shards)
    exchange = {
        "tokens_per_device": per_device,
        "chunk": layer.chunk,
        "block": layer.block,
        "recv_rows": layer.recv_rows,
        "cpu_block_bytes": 2 * n * layer.block * cfg.hidden_size * jnp.dtype(dtype).itemsize,
    }
    traffic = collective_traffic(compiled.as_text())
    by = {
        "params": _device_bytes(params),
        "optimizer": _device_bytes(state),
        "gradients": _device_bytes(grads),
        "temp": int(memory.temp_size_in_bytes),
    }
    arguments = int(memory.argument_size_in_bytes)
    total = arguments + int(memory.output_size_in_bytes) - int(memory.alias_size_in_bytes)
    by["total"] = total + by["temp"]
    return {
        "model_type": cfg.model_type,
        "params": count_params(model.layout.weight_shapes()),  # weights, not their bytes
        "mtp_params": count_params(model.layout.weight_shapes().get("mtp", {})),
        "mtp_loss_weight": model.mtp_loss_weight,
        "mesh": dict(mesh_shape),
        "devices": devices,
        "batch": batch,
        "seq": seq,
        "zero": zero,
        "fp8": None if model.fp8 is None else model.fp8.scaling,
        "remat": remat,
        "dtype": str(jnp.dtype(dtype)),
        "param_dtype": str(jnp.dtype(param_dtype)),
        "microbatches": model.num_microbatches,
        "capacity_factor": capacity_factor,
        "vocab_chunk": vocab_chunk,
        "lora": None if adapters is None else {"rank": lora, "targets": list(adapters.targets)},
        "base": base,
        "trained_params": count_params(trained),
        "bytes_per_device": by,
        "arguments": arguments,
        "fits": by["total"] <= device_memory,
        "device_memory": device_memory,
        "collective_bytes": traffic.total,
        "collectives": {
            k: {"bytes": b, "count": traffic.counts[k]} for k, b in sorted(traffic.bytes.items())
        },
        "unknown_loops": traffic.unknown_loops,
        "moe_exchange": exchange,
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
    }


def _size(n: int) -> str:
    """Bytes in the largest unit of 1000 that keeps a number >= 1."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _report(r: dict[str, Any]) -> str:
    by = r["bytes_per_device"]
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
    ex, n = r["moe_exchange"], r["mesh"]["expert"]
    rows = [
        ("parameters", by["params"], ""),
        ("optimizer state", by["optimizer"], ""),
        ("gradients", by["gradients"], "part of the temporaries"),
        ("temporaries", by["temp"], "XLA:CPU's buffer assignment: a GPU's estimate"),
        (
            "total",
            by["total"],
            f"of {_size(r['device_memory'])}: " + ("fits" if r["fits"] else "DOES NOT FIT"),
        ),
    ]
    coll = "; ".join(
        f"{k} {_size(v['bytes'])} ({v['count']}x)" for k, v in r["collectives"].items()
    )
    lines = [
        f"{r['model_type']}: {r['params'] / 1e9:.2f} B parameters"
        + (
            f" ({r['mtp_params'] / 1e9:.2f} B of them in the MTP modules, "
            + ("trained" if r["mtp_loss_weight"] else "frozen")
            + ")"
            if r.get("mtp_params")
            else ""
        )
        + f" on {r['devices']} devices "
        f"({mesh}), batch {r['batch']} x {r['seq']} tokens, zero={r['zero']}, fp8={r['fp8']}, "
        f"remat={r['remat']}, {r['dtype']} compute, {r['param_dtype']} parameters, "
        f"{r['microbatches']} microbatches, vocab chunk "
        f"{r.get('vocab_chunk') or 'none (whole logits)'}",
        *(
            [
                f"LoRA rank {r['lora']['rank']} on {', '.join(r['lora']['targets'])}: "
                f"{r['trained_params'] / 1e6:.1f} M trained parameters; base "
                f"{r['base'] or r['param_dtype']}"
            ]
            if r.get("lora")
            else []
        ),
        "per device:",
        *(f"  {name:<16} {_size(n):>10}  {note}".rstrip() for name, n, note in rows),
        f"collectives per step and device: {_size(r['collective_bytes'])} ({coll})",
        f"MoE exchange per layer: {ex['tokens_per_device']} tokens per device, receive buffer "
        f"{ex['recv_rows']} rows; XLA:CPU's dense exchange moves {n} x {ex['block']} rows each "
        f"way a round ({_size(ex['cpu_block_bytes'])}; one round unless the routing is skewed; "
        "a GPU's ragged_all_to_all moves the rows themselves)",
        f"compile: {r['compile_s']:.1f} s (lowering {r['lower_s']:.1f} s)",
    ]
    if r["unknown_loops"]:
        lines.append(f"({r['unknown_loops']} loops of unknown trip count counted once)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxops.models.plan",
        description="Memory plan of a training step on simulated devices, compiled ahead of time.",
    )
    p.add_argument("config", help="a model directory holding config.json (or the file)")
    p.add_argument("--mesh", required=True, help="AXIS=SIZE,... e.g. pipe=2,data=4,expert=8")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 3))
    p.add_argument("--fp8", choices=("block",), default=None)
    p.add_argument("--remat", default="full", choices=("none", "full", "matmuls"))
    p.add_argument("--batch", type=int, required=True, help="global batch (sequences)")
    p.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    p.add_argument("--microbatches", type=int, default=None, help="per data shard")
    p.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    p.add_argument(
        "--vocab-chunk", type=int, default=None, help="the loss's logit columns per step"
    )
    p.add_argument("--dtype", default="bfloat16", help="compute dtype")
    p.add_argument("--param-dtype", default="float32", help="parameters and Adam moments")
    p.add_argument("--device-memory", default=str(H100_BYTES), help="bytes (80GB, 141GB, ...)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK", help="train LoRA adapters")
    p.add_argument(
        "--lora-targets", default=None, help="comma-separated (default: every one the model has)"
    )
    p.add_argument(
        "--base",
        default=None,
        choices=("fp8", "mxfp4", "bf16"),
        help="the frozen base with --lora: fp8 (block-FP8 bytes and scales), mxfp4 (the "
        "routed experts as packed MXFP4, gpt-oss's format; the other parameters in "
        "--param-dtype) or bf16 (every parameter bfloat16)",
    )
    p.add_argument(
        "--mtp-loss-weight",
        type=float,
        default=0.0,
        help="train the config's multi-token-prediction modules with this loss weight "
        "(default 0: frozen, their parameters only)",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see ``--help``); returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        mesh_shape = parse_mesh(args.mesh)
        device_memory = parse_bytes(args.device_memory)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", math.prod(mesh_shape.values()))
    try:
        result = plan(
            args.config,
            mesh_shape,
            batch=args.batch,
            seq=args.seq,
            zero=args.zero,
            fp8=args.fp8,
            remat=args.remat,
            dtype=args.dtype,
            param_dtype="bfloat16" if args.base == "bf16" else args.param_dtype,
            microbatches=args.microbatches,
            capacity_factor=args.capacity_factor,
            vocab_chunk=args.vocab_chunk,
            device_memory=device_memory,
            lora=args.lora,
            lora_targets=args.lora_targets.split(",") if args.lora_targets else None,
            base=None if args.base in (None, "bf16") else args.base,
            mtp_loss_weight=args.mtp_loss_weight,
        )
    except (ValueError, TypeError, ImportError) as e:  # refused config, mesh or batch; no optax
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_report(result))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
