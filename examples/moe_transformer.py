"""A small MoE transformer trained from scratch: ``jaxops.models.MoEDecoder`` on synthetic data.

The model is the library's decoder (the one ``jaxops.models.from_pretrained`` loads Qwen3-MoE,
Mixtral and Qwen2-MoE checkpoints into), built from a :class:`Config` instead of a config.json:
per layer ``jaxops.rms_norm``, GQA attention with RoPE (and Qwen3's q/k norms) whose projections
are ``jaxops.gemm`` or ``jaxops.fp8.linear`` with ``fp8``, ``jaxops.add_rms_norm`` and the
expert-parallel ``jaxops.parallel.expert.moe_layer``; the layers are split into ``pipe``
pipeline stages trained with ``jaxops.parallel.pipeline.pipeline_step(schedule="1f1b")`` on a
``("pipe", "data", "expert")`` mesh: batch over ``data`` and ``expert``, experts over
``expert``. Matmul precision comes from ``jaxops.precision(cfg.precision)``; optax adamw.

:func:`make_reference_grad_fn` is the same model on one device (no pipeline; the batch split
into the pipeline's microbatches, so the MoE auxiliary losses see the same tokens), the oracle
of ``tests/test_e2e.py``.

Usage (a library module; ``examples/train_moe.py`` is the training script)::

    import importlib.util, sys, jax
    spec = importlib.util.spec_from_file_location("moe_transformer", "examples/moe_transformer.py")
    mt = sys.modules["moe_transformer"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)                     # (registered first: it has dataclasses)
    cfg = mt.Config()
    model = mt.make_model(cfg, mt.make_mesh(cfg))   # needs pipe * data * expert devices
    params = model.init(jax.random.key(cfg.seed))
    opt = mt.make_optimizer(cfg)
    step = mt.make_train_step(cfg, model, opt)
    data = mt.MarkovData(cfg)
    tokens, targets = model.place_batch(*data.batch(0))
    with jax.set_mesh(model.mesh):                  # optax makes arrays: give them the mesh
        opt_state = jax.jit(opt.init)(params)
        params, opt_state, loss = step(params, opt_state, tokens, targets)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec

import jaxops

AXES = ("pipe", "data", "expert")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data, mesh and optimizer settings (every field is a flag of train_moe.py)."""

    arch: str = "qwen3_moe"
    vocab: int = 64
    d_model: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 4
    experts: int = 4
    top_k: int = 2
    d_ff: int = 64
    seq_len: int = 32
    batch: int = 16
    microbatches: int = 4
    pipe: int = 2
    data: int = 2
    expert: int = 2
    fp8: bool = False
    precision: str = "fp32"
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 10
    clip: float = 1.0
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    steps: int = 100
    seed: int = 0
    markov_branch: int = 3

    def __post_init__(self):
        if self.layers % self.pipe:
            raise ValueError(f"layers ({self.layers}) must be a multiple of pipe ({self.pipe})")
        if self.d_model % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by heads ({self.heads}), and heads "
                f"by kv_heads ({self.kv_heads})"
            )
        if self.experts % self.expert:
            raise ValueError(
                f"experts ({self.experts}) must be divisible by expert ({self.expert})"
            )
        shards = self.data * self.expert
        if self.batch % (shards * self.microbatches):
            raise ValueError(
                f"batch ({self.batch}) must be a multiple of data * expert * microbatches "
                f"= {shards * self.microbatches}"
            )

    @property
    def devices(self) -> int:
        """Devices of the mesh."""
        return self.pipe * self.data * self.expert

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch."""
        return self.batch * self.seq_len


def decoder_config(cfg: Config) -> DecoderConfig:
    """The architecture: a Qwen3-MoE (q/k norms) or Mixtral style decoder of cfg's sizes."""
    return DecoderConfig(
        model_type=cfg.arch,
        vocab_size=cfg.vocab,
        hidden_size=cfg.d_model,
        num_layers=cfg.layers,
        attention=AttentionSpec(
            num_heads=cfg.heads,
            num_kv_heads=cfg.kv_heads,
            head_dim=cfg.d_model // cfg.heads,
            qk_norm=cfg.arch == "qwen3_moe",
        ),
        moe=MoESpec(num_experts=cfg.experts, top_k=cfg.top_k, expert_ffn=cfg.d_ff),
    )


def make_mesh(cfg: Config, devices: Any = None) -> jax.sharding.Mesh:
    """The ("pipe", "data", "expert") mesh (Explicit axes) over the first ``cfg.devices``."""
    kw = {} if devices is None else {"devices": devices}
    return jax.make_mesh((cfg.pipe, cfg.data, cfg.expert), AXES, **kw)


def make_model(cfg: Config, mesh: jax.sharding.Mesh) -> MoEDecoder:
    """The decoder on `mesh`: 1F1B stages over "pipe" with cfg.microbatches."""
    return MoEDecoder(
        decoder_config(cfg),
        mesh,
        num_microbatches=cfg.microbatches,
        schedule="1f1b",
        fp8="block" if cfg.fp8 else None,
        router_aux_loss_coef=cfg.aux_loss_coef,
        router_z_loss_coef=cfg.z_loss_coef,
    )


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """adamw with linear warm-up, cosine decay and global-norm clipping."""
    sched = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup, 1), max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay),
    )


def make_train_step(
    cfg: Config, model: MoEDecoder, optimizer: optax.GradientTransformation
) -> Callable:
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``, jitted."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, targets):
        with jaxops.precision(cfg.precision):
            loss, grads = model.loss_and_grads(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_grad_fn(cfg: Config, model: MoEDecoder) -> Callable:
    """``(params, tokens, targets) -> (loss, grads)`` of the pipelined model, jitted."""

    @jax.jit
    def fn(params, tokens, targets):
        with jaxops.precision(cfg.precision):
            return model.loss_and_grads(params, tokens, targets)

    return fn


def make_reference_grad_fn(cfg: Config) -> Callable:
    """``(params, tokens, targets) -> (loss, grads)`` of the same model on one device, jitted.

    The pipeline's microbatch i is local microbatch i of every batch shard, and the MoE layer's
    auxiliary losses are computed over it; here the batch is split the same way and the losses
    of the microbatches averaged.
    """
    single = dataclasses.replace(cfg, pipe=1, data=1, expert=1, microbatches=1)
    mesh = jax.make_mesh((1, 1, 1), AXES, devices=jax.devices()[:1])
    model = make_model(single, mesh)
    shards, m = cfg.data * cfg.expert, cfg.microbatches

    def split(a):
        b = a.shape[0] // (shards * m)
        a = a.reshape(shards, m, b, *a.shape[1:]).swapaxes(0, 1)
        return a.reshape(m, shards * b, *a.shape[3:])

    def loss(params, tokens, targets):
        parts = [
            model.loss(params, t, y) for t, y in zip(split(tokens), split(targets), strict=True)
        ]
        return sum(parts) / m

    @jax.jit
    def fn(params, tokens, targets):
        with jaxops.precision(cfg.precision):
            return jax.value_and_grad(loss)(params, tokens, targets)

    return fn


class MarkovData:
    """Sequences of a fixed random first-order Markov chain with few likely successors.

    Each token has ``markov_branch`` likely successors (90% of the mass) drawn from the seed;
    the best achievable loss is about the chain's entropy rate, far below ``log(vocab)``.
    Batch ``i`` is a deterministic function of (seed, i), the same on every process.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        rng = np.random.default_rng([cfg.seed, 12345])
        v, k = cfg.vocab, cfg.markov_branch
        trans = np.full((v, v), 0.1 / v)
        for a in range(v):
            nxt = rng.choice(v, size=k, replace=False)
            w = rng.dirichlet(np.ones(k)) * 0.9
            trans[a, nxt] += w
        self.trans = trans / trans.sum(axis=1, keepdims=True)
        self.cum = np.cumsum(self.trans, axis=1)

    def entropy_rate(self) -> float:
        """Conditional entropy per token under the uniform start (a loss floor), in nats."""
        h = -np.sum(self.trans * np.log(self.trans), axis=1)
        return float(h.mean())

    def batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets) int32 ``[batch, seq_len]``: targets are tokens shifted by one."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 777, i])
        n, s = cfg.batch, cfg.seq_len + 1
        seq = np.empty((n, s), np.int64)
        seq[:, 0] = rng.integers(0, cfg.vocab, n)
        u = rng.random((n, s))
        for t in range(1, s):
            seq[:, t] = (self.cum[seq[:, t - 1]] < u[:, t : t + 1]).sum(axis=1)
        seq = np.minimum(seq, cfg.vocab - 1).astype(np.int32)
        return seq[:, :-1], seq[:, 1:]


def param_count(params: Any) -> int:
    """Number of parameters."""
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


__all__ = [
    "AXES",
    "Config",
    "MarkovData",
    "decoder_config",
    "make_grad_fn",
    "make_mesh",
    "make_model",
    "make_optimizer",
    "make_reference_grad_fn",
    "make_train_step",
    "param_count",
]
