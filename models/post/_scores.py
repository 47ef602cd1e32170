"""Log-probabilities of the scored tokens of a batch, and their sums per sequence.

Post-training scores sequences by the log-probability the model gives their response tokens:
:class:`Scored` is a batch (the decoder's inputs, the targets to score, and which sequence each
target belongs to, so that sequences may be packed several to a row or placed one per row),
:func:`token_logprobs` the log-probability of every target (over vocabulary chunks with the
decoder's ``vocab_chunk``, never the whole ``[tokens, V]`` logits), :func:`sequence_logprobs`
their sums per sequence. The private :func:`scores` is the differentiable form the objectives
of :mod:`~jaxops.models.post` build on: the log-probabilities and the MoE aux losses.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxops._errors import ConfigError, InvalidArgumentError

from .. import _batch, _context, _layers, _objective, _run
from .._adapters import adapters_of, with_frozen
from .._decoder import MoEDecoder, check_batch
from .._layout import Layout

__all__ = [
    "Scored",
    "accumulated",
    "check_model",
    "check_scored",
    "disabled_adapters",
    "per_sequence",
    "scores",
    "sequence_logprobs",
    "token_logprobs",
]


@dataclasses.dataclass(frozen=True)
class Scored:
    """A batch of sequences to score: the decoder's inputs and what each target belongs to.

    Attributes:
      tokens: int ``[B, S]`` inputs.
      targets: int ``[B, S]``: ``targets[b, i]`` is the token after ``tokens[b, i]`` whose
        log-probability is scored, -100 where nothing is (prompts, padding).
      sequence_ids: int ``[B, S]``: the sequence (``0 .. num_sequences - 1``) each scored target
        belongs to, -1 where none is (it must be -1 exactly where `targets` is -100).
      num_sequences: N, the number of sequences (a static int).
      attention_mask: ``[B, S]`` 0 at padding, or None (as :meth:`MoEDecoder.logits`).
      positions: int ``[B, S]`` rotary positions, or None.
      segment_ids: int ``[B, S]`` packed documents (1, 2, ...; 0 padding), or None.
    """

    tokens: Any
    targets: Any
    sequence_ids: Any
    num_sequences: int
    attention_mask: Any = None
    positions: Any = None
    segment_ids: Any = None

    def model_inputs(self) -> dict[str, Any]:
        """The keywords of :meth:`MoEDecoder.logits` (masks that are not None)."""
        masks = {
            "attention_mask": self.attention_mask,
            "positions": self.positions,
            "segment_ids": self.segment_ids,
        }
        return {k: v for k, v in masks.items() if v is not None}


jax.tree_util.register_dataclass(
    Scored,
    data_fields=[
        "tokens",
        "targets",
        "sequence_ids",
        "attention_mask",
        "positions",
        "segment_ids",
    ],
    meta_fields=["num_sequences"],
)


def check_model(op: str, model: Any, pipe: bool = False, step: bool = False) -> Layout:
    """The layout of a decoder post-training can run on (refusing what it cannot).

    `pipe`: whether `op` runs on a mesh with a pipe axis; `step`: whether it trains (the
    objectives have no multi-token-prediction term: a model that trains the MTP modules on
    its own loss is refused, not given zero or stale gradients for them).
    """
    if not isinstance(model, MoEDecoder):
        raise InvalidArgumentError(
            f"{op}: model must be a jaxops.models.MoEDecoder, got {type(model).__name__}"
        )
    layout = model.layout
    if not pipe and layout.pipe > 1:
        raise ConfigError(
            f"{op}: a mesh with a pipe axis of size {layout.pipe} is not supported here"
        )
    if layout.context > 1 and layout.num_microbatches > 1:
        raise ConfigError(
            f"{op}: a context axis together with num_microbatches={layout.num_microbatches} is "
            "not supported by post-training yet (either alone is)"
        )
    if step and layout.mtp_trained:
        raise ConfigError(
            f"{op}: the model trains its multi-token-prediction modules on its own loss "
            f"(mtp_loss_weight={layout.mtp_loss_weight}); this objective has no MTP term: "
            "build it with mtp_loss_weight=0 (the modules stay frozen, saved as loaded)"
        )
    return layout


def check_scored(op: str, model: MoEDecoder, batch: Any) -> _batch.Batch:
    """`batch` (a :class:`Scored`) validated as the decoder's batch, and its sequence ids."""
    if not isinstance(batch, Scored):
        raise InvalidArgumentError(
            f"{op}: batch must be a jaxops.models.post.Scored, got {type(batch).__name__}"
        )
    n = batch.num_sequences
    if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(f"{op}: num_sequences must be an int >= 1, got {n!r}")
    checked = check_batch(
        model,
        op,
        batch.tokens,
        batch.targets,
        batch.attention_mask,
        batch.positions,
        batch.segment_ids,
    )
    ids = batch.sequence_ids
    if np.shape(ids) != np.shape(batch.tokens):
        raise InvalidArgumentError(
            f"{op}: sequence_ids must be shaped like tokens {list(np.shape(batch.tokens))}, "
            f"got {list(np.shape(ids))}"
        )
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise InvalidArgumentError(
            f"{op}: sequence_ids must be integers, got {jnp.result_type(ids)}"
        )
    if not isinstance(ids, jax.core.Tracer) and not isinstance(batch.targets, jax.core.Tracer):
        host_ids, targets = np.asarray(ids), np.asarray(batch.targets)
        scored = targets != _layers.IGNORE_INDEX
        if ((host_ids >= 0) != scored).any():
            where = tuple(int(i) for i in np.argwhere((host_ids >= 0) != scored)[0])
            raise InvalidArgumentError(
                f"{op}: sequence_ids must be >= 0 exactly where targets are scored (not -100); "
                f"at {where} the target is {int(targets[where])} and the id {int(host_ids[where])}"
            )
        if (host_ids >= n).any():
            raise InvalidArgumentError(
                f"{op}: sequence_ids must be < num_sequences ({n}), got {int(host_ids.max())}"
            )
    return checked


def scores(layout: Layout, params: dict[str, Any], batch: _batch.Batch):
    """``(log-probabilities [B, S], aux)``: each target's, 0 where ignored, and the aux losses.

    Differentiable; `batch` validated (a target at padding is ignored; with a context axis its
    rows, the log-probabilities put back in sequence order). With a pipe axis: the pipeline's
    forwards (aux 0: the steps there take their gradients through the schedule).
    """
    if layout.pipe > 1:
        _, targets = _objective.where_targets(batch)
        h = _objective.hidden(layout, params, batch)
        nll = layout.token_nll(layout.head_params(params), h, targets)
        return 0.0 - nll, jnp.zeros((), jnp.float32)
    x, where, targets = _objective.inputs(layout, params, batch)
    h, aux = _run.run_all(layout, params, x, where)
    lp = 0.0 - layout.token_nll(layout.head_params(params), h, targets)
    if layout.context > 1:  # the context axis's rows back in sequence order, [B, S]
        lp = _context.from_rows(layout, lp)
    return lp, jnp.sum(aux.loss)  # (0, not -0, where ignored)


def accumulated(
    layout: Layout,
    params: dict[str, Any],
    batch: _batch.Batch,
    rows: dict[str, jax.Array],
    part: Callable[..., tuple[jax.Array, dict[str, jax.Array]]],
):
    """``(loss, metric sums, grads of trainable(params))``: `part` summed over microbatches.

    ``part(params, batch, rows) -> (loss, metrics)`` is a microbatch's share of the objective
    (its terms over the global normalizers, so that the shares sum to the whole) and of each
    metric; `rows` are per-row arrays ``[B, ...]`` split with the batch. With
    ``num_microbatches`` M > 1 the microbatches run one after another (their activations live
    one at a time), the gradients accumulated in float32; with LoRA the adapters' only.
    """
    m = layout.num_microbatches
    wrt = layout.trainable(params)

    def one(wrt, mb, mb_rows):
        return part(layout.with_trained(wrt, params), mb, mb_rows)

    grad = jax.value_and_grad(one, has_aux=True)
    if m == 1:
        (loss, metrics), g = grad(wrt, batch, rows)
        return loss, metrics, g
    parts = _batch.split_microbatches((batch, rows), m, (layout.mesh, layout.batch_axes))

    def body(acc, x):
        (loss, metrics), g = grad(wrt, *x)
        add = functools.partial(jax.tree.map, lambda a, b: a + b.astype(jnp.float32))
        return (acc[0] + loss, add(acc[1], metrics), add(acc[2], g)), None

    shapes = jax.eval_shape(lambda: one(wrt, *jax.tree.map(lambda a: a[0], parts))[1])
    metrics = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), shapes)
    grads = jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), wrt)  # laid out as wrt
    init = (jnp.zeros((), jnp.float32), metrics, grads)
    (loss, metrics, g), _ = jax.lax.scan(body, init, parts)
    return loss, metrics, jax.tree.map(lambda a, p: a.astype(p.dtype), g, wrt)


def per_sequence(
    values: jax.Array, sequence_ids: jax.Array, n: int, mesh: jax.sharding.Mesh
) -> jax.Array:
    """float32 ``[n]``: the sums of ``values [B, S]`` per sequence id (-1: counted nowhere).

    Replicated on `mesh` (the decoder's): every device holds every sequence's sum.
    """
    ids = jnp.where(sequence_ids >= 0, sequence_ids, n).reshape(-1)
    onto = jnp.zeros((n,), jnp.float32)
    flat = values.astype(jnp.float32).reshape(-1)
    replicated = jax.sharding.NamedSharding(mesh, P())
    return onto.at[ids].add(flat, mode="drop", out_sharding=replicated)


def disabled_adapters(layout: Layout, params: dict[str, Any]) -> dict[str, Any]:
    """`params` with every LoRA adapter's B zero: the base model's function, no second copy.

    (``x + scaling * (x A) 0`` is ``x`` exactly; the A matrices and the frozen base are the
    arrays `params` holds.)
    """
    if layout.lora is None:
        return params
    zeros = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.zeros_like(a) if _name(path).endswith("_lora_b") else None,
        adapters_of(params),
    )
    return with_frozen(zeros, params)


def _name(path: tuple) -> str:
    return str(getattr(path[-1], "key", ""))


def token_logprobs(model: MoEDecoder, params: dict[str, Any], batch: Scored) -> jax.Array:
    """float32 ``[B, S]``: the log-probability of each scored target, 0 elsewhere.

    With the decoder's ``vocab_chunk`` the logits are computed ``vocab_chunk`` columns at a
    time and never whole. Differentiable; call it under ``jax.jit``.

    Args:
      model: the decoder, on any mesh it runs on (a pipe axis: the pipeline's forwards; a
        context axis: the log-probabilities put back in sequence order).
      params: its parameters.
      batch: the sequences (:class:`Scored`).

    Returns:
      float32 ``[B, S]``, batch-sharded as the tokens.

    Example:
      >>> import jax, numpy as np
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
      >>> from jaxops.models.post import Scored, token_logprobs
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=1,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
      >>> params = model.init(jax.random.key(0))
      >>> tokens = np.array([[1, 2, 3, 4]]); targets = np.array([[-100, 3, 4, 5]])
      >>> batch = Scored(tokens, targets, np.where(targets >= 0, 0, -1), num_sequences=1)
      >>> lp = jax.jit(token_logprobs, static_argnums=0)(model, params, batch)
      >>> lp.shape, float(lp[0, 0]), bool((lp[0, 1:] < 0).all())
      ((1, 4), 0.0, True)
    """
    op = "jaxops.models.post.token_logprobs"
    layout = check_model(op, model, pipe=True)
    checked = check_scored(op, model, batch)
    return scores(layout, params, checked)[0]


def sequence_logprobs(model: MoEDecoder, params: dict[str, Any], batch: Scored) -> jax.Array:
    """float32 ``[N]``: each sequence's summed log-probability of its scored targets.

    The arguments are :func:`token_logprobs`'s; a sequence with no scored target sums to 0.

    Example:
      >>> import jax, numpy as np
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
      >>> from jaxops.models.post import Scored, sequence_logprobs
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=1,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
      >>> params = model.init(jax.random.key(0))
      >>> tokens = np.array([[1, 2, 3, 4]]); targets = np.array([[2, 3, 4, 5]])
      >>> batch = Scored(tokens, targets, np.array([[0, 0, 1, 1]]), num_sequences=2)
      >>> jax.jit(sequence_logprobs, static_argnums=0)(model, params, batch).shape
      (2,)
    """
    op = "jaxops.models.post.sequence_logprobs"
    layout = check_model(op, model, pipe=True)
    checked = check_scored(op, model, batch)
    lp = scores(layout, params, checked)[0]
    return per_sequence(lp, jnp.asarray(batch.sequence_ids), batch.num_sequences, layout.mesh)
