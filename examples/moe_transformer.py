"""A small decoder-only MoE transformer in plain JAX on jaxops, pipelined with 1F1B.

The model: token + position embeddings, then ``layers`` blocks of::

    h = rms_norm(x)                                   jaxops.rms_norm
    a = attention(h)                                  fused qkv [D, 3D] + output projection:
                                                      jaxops.gemm (bias epilogue) or
                                                      jaxops.fp8.linear with cfg.fp8
    y, x = add_rms_norm(a, x)                         jaxops.add_rms_norm (residual + norm)
    x = x + moe(y)                                    jaxops.parallel.expert.moe_layer

and a head: ``rms_norm`` then ``jaxops.gemm`` to the vocabulary, cross-entropy. The blocks are
split into ``pipe`` pipeline stages (``layers / pipe`` blocks each) and trained with
``jaxops.parallel.pipeline.pipeline_step(schedule="1f1b")`` on a mesh
``("pipe", "data", "expert")``: the batch is split over ``data`` and ``expert``, the experts over
``expert``; the MoE layer's load-balancing and z losses are added through ``has_aux``. The
embedding runs before the pipeline and is differentiated with ``jax.vjp`` from the pipeline's
input gradients; the head and the loss are the pipeline's ``loss_fn`` with ``loss_params``.
Matmul precision comes from ``jaxops.precision(cfg.precision)``; optax adamw updates it all.

:func:`reference_loss` is the same model on one device (a plain loop over the stages and layers
with the dense ``moe_layer_reference``), the oracle of ``tests/test_e2e.py``.

Usage (a library module; ``examples/train_moe.py`` is the training script)::

    import importlib.util, sys, jax
    spec = importlib.util.spec_from_file_location("moe_transformer", "examples/moe_transformer.py")
    mt = sys.modules["moe_transformer"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)                     # (registered first: it has dataclasses)
    cfg = mt.Config()
    mesh = mt.make_mesh(cfg)                        # needs pipe * data * expert devices
    params = mt.place_params(mt.init_params(jax.random.key(cfg.seed), cfg), cfg, mesh)
    opt = mt.make_optimizer(cfg)
    step = mt.make_train_step(cfg, mesh, opt)
    data = mt.MarkovData(cfg)
    tokens, targets = mt.place_batch(*data.batch(0), cfg, mesh)
    with jax.set_mesh(mesh):                        # optax makes arrays: give them the mesh
        opt_state = jax.jit(opt.init)(params)
        params, opt_state, loss = step(params, opt_state, tokens, targets)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.parallel import expert as ep
from jaxops.parallel import pipeline as pl

import jaxops

AXES = ("pipe", "data", "expert")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data, mesh and optimizer settings (every field is a flag of train_moe.py)."""

    vocab: int = 64
    d_model: int = 64
    heads: int = 4
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
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads")
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
    def layers_per_stage(self) -> int:
        """Blocks per pipeline stage."""
        return self.layers // self.pipe

    @property
    def devices(self) -> int:
        """Devices of the mesh."""
        return self.pipe * self.data * self.expert

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch."""
        return self.batch * self.seq_len


def moe_config(cfg: Config) -> ep.MoEConfig:
    """The MoE layer's config: experts over "expert", tokens over ("data", "expert")."""
    return ep.MoEConfig(
        num_experts=cfg.experts,
        top_k=cfg.top_k,
        hidden=cfg.d_model,
        ffn_hidden=cfg.d_ff,
        activation="swiglu",
        aux_loss_coef=cfg.aux_loss_coef,
        z_loss_coef=cfg.z_loss_coef,
        expert_axis="expert",
        data_axes=("data",),
        dtype=jnp.float32,
        fp8="block" if cfg.fp8 else None,
    )


# -------------------------------------------------------------------------------------------------
# Parameters.


def init_params(key: jax.Array, cfg: Config) -> dict[str, Any]:
    """float32 parameters; stage leaves are stacked ``[pipe, layers_per_stage, ...]``."""
    d, v = cfg.d_model, cfg.vocab
    mcfg = moe_config(cfg)
    k_embed, k_pos, k_head, k_layers = jax.random.split(key, 4)

    out_scale = 1.0 / math.sqrt(d * 2 * cfg.layers)  # residual branches scaled down by depth

    def layer(k):
        kq, ko, km = jax.random.split(k, 3)
        return {
            "attn_norm": jnp.ones((d,), jnp.float32),
            "w_qkv": jax.random.normal(kq, (d, 3 * d), jnp.float32) / math.sqrt(d),
            "b_qkv": jnp.zeros((3 * d,), jnp.float32),
            "w_o": jax.random.normal(ko, (d, d), jnp.float32) * out_scale,
            "b_o": jnp.zeros((d,), jnp.float32),
            "moe_norm": jnp.ones((d,), jnp.float32),
            "moe": ep.init_moe_params(km, mcfg),
        }

    layers = [layer(k) for k in jax.random.split(k_layers, cfg.layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    stages = jax.tree.map(
        lambda a: a.reshape(cfg.pipe, cfg.layers_per_stage, *a.shape[1:]), stacked
    )
    return {
        "embed": {
            "tok": jax.random.normal(k_embed, (v, d), jnp.float32) * 0.5,
            "pos": jax.random.normal(k_pos, (cfg.seq_len, d), jnp.float32) * 0.1,
        },
        "stages": stages,
        "head": {
            "norm": jnp.ones((d,), jnp.float32),
            "w": jax.random.normal(k_head, (d, v), jnp.float32) / math.sqrt(d),
        },
    }


def stage_param_specs(cfg: Config) -> dict[str, Any]:
    """Specs of one stage's params after the stage axis (the pipeline's ``param_specs``)."""
    moe = {k: P(None, *s) for k, s in ep.moe_param_specs(moe_config(cfg)).items()}
    rest = ("attn_norm", "w_qkv", "b_qkv", "w_o", "b_o", "moe_norm")
    return {**{k: P() for k in rest}, "moe": moe}


def param_specs(cfg: Config) -> dict[str, Any]:
    """Global PartitionSpecs of :func:`init_params`' tree on the ("pipe", "data", "expert") mesh."""
    stages = jax.tree.map(
        lambda s: P("pipe", *s), stage_param_specs(cfg), is_leaf=lambda s: isinstance(s, P)
    )
    return {
        "embed": {"tok": P(), "pos": P()},
        "stages": stages,
        "head": {"norm": P(), "w": P()},
    }


def make_mesh(cfg: Config, devices: Any = None) -> jax.sharding.Mesh:
    """The ("pipe", "data", "expert") mesh (Explicit axes) over the first ``cfg.devices``."""
    kw = {} if devices is None else {"devices": devices}
    return jax.make_mesh((cfg.pipe, cfg.data, cfg.expert), AXES, **kw)


def shardings(tree_specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """NamedShardings from a pytree of PartitionSpecs."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), tree_specs, is_leaf=lambda s: isinstance(s, P)
    )


def to_global(tree: Any, tree_shardings: Any) -> Any:
    """Host values (the same on every process) as global arrays; works multi-process too."""

    def put(a, s):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree.map(put, tree, tree_shardings)


def place_params(params: Any, cfg: Config, mesh: jax.sharding.Mesh) -> Any:
    """`params` (host or single-device values) placed on the mesh as :func:`param_specs`."""
    return to_global(params, shardings(param_specs(cfg), mesh))


def batch_spec() -> P:
    """The batch axis split over the data and expert axes (the pipeline's data axes)."""
    return P(("data", "expert"))


def place_batch(
    tokens: np.ndarray, targets: np.ndarray, cfg: Config, mesh: jax.sharding.Mesh
) -> tuple[jax.Array, jax.Array]:
    """The global batch as arrays sharded over ("data", "expert"); each process feeds its part."""
    s = NamedSharding(mesh, batch_spec())
    return to_global((tokens, targets), (s, s))


# -------------------------------------------------------------------------------------------------
# The model.


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None, cfg: Config) -> jax.Array:
    """``x @ w + b``: jaxops.gemm (bias in the epilogue), or jaxops.fp8.linear with cfg.fp8."""
    if cfg.fp8:
        return jaxops.fp8.linear(x, w, b, recipe="block")
    return jaxops.gemm(x, w, b)


def attention(p: dict[str, jax.Array], h: jax.Array, cfg: Config) -> jax.Array:
    """Causal multi-head self-attention, fused qkv projection ``[D, 3D]``; h ``[b, S, D]``."""
    b, s, d = h.shape
    nh, hd = cfg.heads, d // cfg.heads
    qkv = dense(h, p["w_qkv"], p["b_qkv"], cfg).reshape(b, s, 3, nh, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return dense(out, p["w_o"], p["b_o"], cfg)


MoEFn = Callable[[dict[str, jax.Array], jax.Array], tuple[jax.Array, ep.MoEAux]]


def block(
    p: dict[str, Any], x: jax.Array, cfg: Config, moe_fn: MoEFn
) -> tuple[jax.Array, jax.Array]:
    """One transformer block; returns (x, the MoE aux loss)."""
    h = jaxops.rms_norm(x, p["attn_norm"])
    a = attention(p, h, cfg)
    y, x = jaxops.add_rms_norm(a, x, p["moe_norm"])  # x <- x + a, y = rms_norm(x)
    m, aux = moe_fn(p["moe"], y)
    return x + m, aux.loss


def embed(e: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
    """Token + position embeddings, ``[B, S] -> [B, S, D]``.

    On an Explicit mesh the gather's output keeps the tokens' batch sharding (the table is
    replicated), which jax wants spelled out.
    """
    sharding = jax.typeof(tokens).sharding
    if any(s is not None for s in sharding.spec):
        out = NamedSharding(sharding.mesh, P(*sharding.spec, None))
        rows = e["tok"].at[tokens].get(out_sharding=out)
    else:
        rows = jnp.take(e["tok"], tokens, axis=0)
    return rows + e["pos"][None, : tokens.shape[1]]


def head_loss(head: dict[str, jax.Array], x: jax.Array, targets: jax.Array) -> jax.Array:
    """Final rms_norm, vocabulary projection (jaxops.gemm) and mean cross-entropy."""
    h = jaxops.rms_norm(x, head["norm"])
    logits = jaxops.gemm(h, head["w"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def stage_fn(cfg: Config, mesh: jax.sharding.Mesh) -> Callable:
    """A pipeline stage: ``layers_per_stage`` blocks on this device's shards -> (x, aux)."""
    mcfg = moe_config(cfg)

    def moe(p, y):
        return ep.moe_layer(p, y, mcfg, mesh=mesh)

    def fn(sp, x):
        aux = jnp.zeros((), jnp.float32)
        for i in range(cfg.layers_per_stage):
            x, a = block(jax.tree.map(lambda t, i=i: t[i], sp), x, cfg, moe)
            aux = aux + a
        return x, aux

    return fn


def loss_and_grads(
    params: dict[str, Any],
    tokens: jax.Array,
    targets: jax.Array,
    cfg: Config,
    mesh: jax.sharding.Mesh,
) -> tuple[jax.Array, dict[str, Any]]:
    """Loss and gradients of the pipelined model (1F1B), under jit."""
    x, embed_vjp = jax.vjp(lambda e: embed(e, tokens), params["embed"])
    loss, g = pl.pipeline_step(
        stage_fn(cfg, mesh),
        params["stages"],
        x,
        targets=targets,
        loss_params=params["head"],
        loss_fn=head_loss,
        mesh=mesh,
        num_microbatches=cfg.microbatches,
        axis="pipe",
        data_axes=("data", "expert"),
        schedule="1f1b",
        has_aux=True,
        param_specs=stage_param_specs(cfg),
    )
    (d_embed,) = embed_vjp(g.inputs)
    return loss, {"embed": d_embed, "stages": g.stage_params, "head": g.loss_params}


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
    cfg: Config, mesh: jax.sharding.Mesh, optimizer: optax.GradientTransformation
) -> Callable:
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``, jitted."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, targets):
        with jaxops.precision(cfg.precision):
            loss, grads = loss_and_grads(params, tokens, targets, cfg, mesh)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_grad_fn(cfg: Config, mesh: jax.sharding.Mesh) -> Callable:
    """``(params, tokens, targets) -> (loss, grads)`` of the pipelined model, jitted."""

    @jax.jit
    def fn(params, tokens, targets):
        with jaxops.precision(cfg.precision):
            return loss_and_grads(params, tokens, targets, cfg, mesh)

    return fn


# -------------------------------------------------------------------------------------------------
# The single-device reference.


def reference_loss(
    params: dict[str, Any], tokens: jax.Array, targets: jax.Array, cfg: Config
) -> jax.Array:
    """The same model and loss on one device: a loop over microbatches, stages and layers.

    The pipeline's microbatch i is local microbatch i of every batch shard (the MoE aux losses
    are computed over it), so the batch is split the same way here; the dense
    ``moe_layer_reference`` replaces the expert-parallel layer.
    """
    mcfg = moe_config(cfg)
    shards, m = cfg.data * cfg.expert, cfg.microbatches
    b = tokens.shape[0] // (shards * m)

    def split(a):
        a = a.reshape(shards, m, b, *a.shape[1:]).swapaxes(0, 1)
        return a.reshape(m, shards * b, *a.shape[3:])

    def moe(p, y):
        return ep.moe_layer_reference(p, y, mcfg)

    x = embed(params["embed"], tokens)
    total = jnp.zeros((), jnp.float32)
    for xi, ti in zip(split(x), split(targets), strict=True):
        for s in range(cfg.pipe):
            for i in range(cfg.layers_per_stage):
                p = jax.tree.map(lambda t, s=s, i=i: t[s, i], params["stages"])
                xi, aux = block(p, xi, cfg, moe)
                total = total + aux / m
        total = total + head_loss(params["head"], xi, ti) / m
    return total


def make_reference_grad_fn(cfg: Config) -> Callable:
    """``(params, tokens, targets) -> (loss, grads)`` of :func:`reference_loss`, jitted."""

    @jax.jit
    def fn(params, tokens, targets):
        with jaxops.precision(cfg.precision):
            return jax.value_and_grad(reference_loss)(params, tokens, targets, cfg)

    return fn


# -------------------------------------------------------------------------------------------------
# Synthetic data.


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
