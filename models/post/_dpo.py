"""Direct preference optimization: DPO (sigmoid, conservative) and IPO on preference pairs.

:func:`preference_batch` lays out pairs of responses to one prompt (chosen, rejected) as a
:class:`~jaxops.models.post.Scored` batch, sequence ``2i`` the chosen and ``2i + 1`` the rejected
response of pair ``i``: packed several documents to a row, or one per row. :func:`dpo_loss` is
the loss of the papers on sequence log-probabilities; :func:`dpo_step` the jitted training step
(the policy's log-probabilities, the reference's, the loss, the gradients and an optax update)
and :func:`reference_logprobs` the reference's log-probabilities, precomputed once per batch.

The reference: with LoRA, the same model with its adapters disabled (their B matrices zero, so
the frozen base's function, with no second copy of its weights); else a frozen copy of the
parameters, or log-probabilities computed beforehand.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops._errors import ArgumentTypeError, ConfigError, InvalidArgumentError

from .. import _objective, _train
from .._decoder import MoEDecoder, check_trainable
from .._packing import IGNORE_INDEX
from ._scores import (
    Scored,
    accumulated,
    check_model,
    check_scored,
    disabled_adapters,
    per_sequence,
    scores,
)

__all__ = [
    "DPO_LOSSES",
    "PostStep",
    "dpo_loss",
    "dpo_step",
    "preference_batch",
    "reference_logprobs",
]

#: The ``loss_type`` values of :func:`dpo_loss`.
DPO_LOSSES = ("sigmoid", "ipo")


def _positive(op: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidArgumentError(f"{op}: {name} must be a number > 0, got {value!r}")
    return float(value)


def _check_loss(op: str, beta: Any, label_smoothing: Any, loss_type: Any) -> None:
    _positive(op, "beta", beta)
    if loss_type not in DPO_LOSSES:
        raise InvalidArgumentError(
            f"{op}: loss_type must be one of {DPO_LOSSES}, got {loss_type!r}"
        )
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, int | float)
        or not 0 <= label_smoothing < 0.5
    ):
        raise InvalidArgumentError(
            f"{op}: label_smoothing must be a number in [0, 0.5), got {label_smoothing!r}"
        )
    if loss_type == "ipo" and label_smoothing:
        raise InvalidArgumentError(
            f"{op}: label_smoothing applies to loss_type='sigmoid' only, got {label_smoothing} "
            "with 'ipo'"
        )


def dpo_loss(
    chosen: jax.Array,
    rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of P preference pairs from their sequence log-probabilities.

    With ``h = (chosen - ref_chosen) - (rejected - ref_rejected)``, per pair:

    - ``"sigmoid"`` (Rafailov et al. 2023; with ``label_smoothing`` eps, conservative DPO):
      ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
    - ``"ipo"`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``.

    The loss is the mean over the pairs.

    Args:
      chosen: float ``[P]``: the policy's log-probabilities of the chosen responses.
      rejected: float ``[P]``: of the rejected ones.
      ref_chosen: float ``[P]``: the reference model's of the chosen responses.
      ref_rejected: float ``[P]``: of the rejected ones.
      beta: the inverse temperature (> 0): the strength of the pull to the reference.
      label_smoothing: the probability that a pair's preference is flipped (``[0, 0.5)``,
        ``"sigmoid"`` only).
      loss_type: one of :data:`DPO_LOSSES`.

    Returns:
      ``(loss, metrics)``: the float32 loss and float32 scalars ``"rewards/chosen"`` (the mean
      of ``beta (chosen - ref_chosen)``), ``"rewards/rejected"``, ``"rewards/margins"`` (their
      difference) and ``"rewards/accuracies"`` (the fraction of pairs whose chosen reward is
      above the rejected one), as TRL reports them.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.models.post import dpo_loss
      >>> loss, m = dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]),
      ...                    jnp.array([-2.0]), beta=0.5)
      >>> round(float(loss), 4), float(m["rewards/accuracies"])  # -log sigmoid(1)
      (0.3133, 1.0)
    """
    op = "jaxops.models.post.dpo_loss"
    _check_loss(op, beta, label_smoothing, loss_type)
    arrays = [jnp.asarray(a, jnp.float32) for a in (chosen, rejected, ref_chosen, ref_rejected)]
    names = ("chosen", "rejected", "ref_chosen", "ref_rejected")
    for name, a in zip(names, arrays, strict=True):
        if a.ndim != 1 or a.shape != arrays[0].shape:
            raise InvalidArgumentError(
                f"{op}: {name} must be float [P] like chosen {list(arrays[0].shape)}, got "
                f"{list(a.shape)}"
            )
    losses, chosen_rewards, rejected_rewards = _pair_terms(
        *arrays, beta, label_smoothing, loss_type
    )
    return jnp.mean(losses), _reward_metrics(chosen_rewards, rejected_rewards, None, len(losses))


def _pair_terms(c, r, rc, rr, beta, label_smoothing, loss_type):
    """``(losses [P], chosen rewards [P], rejected rewards [P])`` of :func:`dpo_loss`."""
    h = (c - rc) - (r - rr)
    if loss_type == "sigmoid":
        eps = label_smoothing
        losses = -(1 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    return losses, beta * jax.lax.stop_gradient(c - rc), beta * jax.lax.stop_gradient(r - rr)


def _reward_metrics(chosen, rejected, present, pairs) -> dict[str, jax.Array]:
    """The rewards' metrics: sums over the `present` pairs (all: None) over `pairs`."""
    keep = jnp.ones_like(chosen) if present is None else present.astype(jnp.float32)
    return {
        "rewards/chosen": jnp.sum(keep * chosen) / pairs,
        "rewards/rejected": jnp.sum(keep * rejected) / pairs,
        "rewards/margins": jnp.sum(keep * (chosen - rejected)) / pairs,
        "rewards/accuracies": jnp.sum(keep * (chosen > rejected)) / pairs,
    }


def _ids(op: str, name: str, seq: Any, i: int, allow_empty: bool) -> np.ndarray:
    a = np.asarray(seq)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ArgumentTypeError(
            f"{op}: {name}[{i}] must hold int token ids, got {a.dtype}{list(a.shape)}"
        )
    if a.ndim != 1:
        raise InvalidArgumentError(
            f"{op}: {name}[{i}] must be a 1-D sequence of int token ids, got "
            f"{a.dtype}{list(a.shape)}"
        )
    if not allow_empty and a.size == 0:
        raise InvalidArgumentError(
            f"{op}: {name}[{i}] is empty: a response needs at least one token to score"
        )
    return a.astype(np.int64)


def preference_batch(
    prompts: Sequence[Any],
    chosen: Sequence[Any],
    rejected: Sequence[Any],
    seq_len: int,
    *,
    pack: bool = True,
    row_multiple: int = 1,
    pad_id: int = 0,
) -> Scored:
    """P preference pairs as a :class:`~jaxops.models.post.Scored` batch of 2P sequences.

    Sequence ``2i`` is ``prompts[i] + chosen[i]``, sequence ``2i + 1`` is ``prompts[i] +
    rejected[i]``; only the response tokens are scored (each is the target of the token
    before it; the prompt's are not).

    Args:
      prompts: P 1-D sequences of token ids (a prompt may be empty if its responses are not).
      chosen: P non-empty 1-D sequences: the preferred responses.
      rejected: P non-empty 1-D sequences: the others.
      seq_len: S, the row length.
      pack: True: each pair's two sequences side by side in one row as two documents (each
        attends to itself only, positions restart), the pairs packed into rows first-fit
        decreasing (longest first, each into the first row with room); False: one sequence per
        row, right-padded (rows ``2i`` and ``2i + 1`` the pair).
      row_multiple: the rows rounded up to a multiple of it (the batch devices of the mesh);
        rows added are padding.
      pad_id: the token id of padding.

    Returns:
      A Scored batch with ``num_sequences = 2P`` (NumPy int32 arrays).

    Raises:
      ValueError: lists of different lengths, no pair, an empty response, a sequence (with
        `pack` a pair) longer than `seq_len` (naming it).

    Example:
      >>> from jaxops.models.post import preference_batch
      >>> b = preference_batch([[1, 2]], [[3, 4]], [[5]], seq_len=8)
      >>> b.num_sequences, b.tokens.tolist(), b.sequence_ids.tolist()
      (2, [[1, 2, 3, 4, 1, 2, 5, 0]], [[-1, 0, 0, -1, -1, 1, -1, -1]])
    """
    op = "jaxops.models.post.preference_batch"
    if not (len(prompts) == len(chosen) == len(rejected)):
        raise InvalidArgumentError(
            f"{op}: prompts, chosen and rejected must be as many, got {len(prompts)}, "
            f"{len(chosen)} and {len(rejected)}"
        )
    if not prompts:
        raise InvalidArgumentError(f"{op}: no preference pair given")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise InvalidArgumentError(f"{op}: seq_len must be an int >= 2, got {seq_len!r}")
    docs, masks = [], []
    for i, p in enumerate(prompts):
        p = _ids(op, "prompts", p, i, allow_empty=True)
        for name, resp in (("chosen", chosen[i]), ("rejected", rejected[i])):
            r = _ids(op, name, resp, i, allow_empty=False)
            doc = np.concatenate([p, r])
            if doc.size > seq_len:
                raise InvalidArgumentError(
                    f"{op}: prompts[{i}] + {name}[{i}] has {doc.size} tokens, more than "
                    f"seq_len={seq_len}"
                )
            if p.size == 0 and r.size == 1:
                raise InvalidArgumentError(
                    f"{op}: {name}[{i}] has one token and prompts[{i}] none: its first token "
                    "has nothing before it to be predicted from"
                )
            docs.append(doc)
            masks.append(np.r_[np.zeros(p.size, bool), np.ones(r.size, bool)])
    if pack:
        return _packed_pairs(op, docs, masks, seq_len, row_multiple, pad_id)
    rows = -(-len(docs) // row_multiple) * row_multiple
    arrays = _Arrays(rows, seq_len, pad_id)
    for k, (doc, m) in enumerate(zip(docs, masks, strict=True)):
        arrays.place(k, 0, doc, m, k, segment=None)
    return arrays.scored(len(docs), packed=False)


class _Arrays:
    """The ``[B, S]`` arrays of a Scored batch, filled one sequence at a time."""

    def __init__(self, rows: int, seq_len: int, pad_id: int):
        shape = (rows, seq_len)
        self.tokens = np.full(shape, pad_id, np.int32)
        self.targets = np.full(shape, IGNORE_INDEX, np.int32)
        self.ids = np.full(shape, -1, np.int32)
        self.mask = np.zeros(shape, np.int32)
        self.segments = np.zeros(shape, np.int32)
        self.positions = np.zeros(shape, np.int32)

    def place(self, row: int, col: int, doc: np.ndarray, m: np.ndarray, k: int, segment):
        """Sequence `k` (`doc`, its scored tokens `m`) at ``[row, col:]``."""
        end = col + doc.size
        self.tokens[row, col:end] = doc
        self.mask[row, col:end] = 1
        self.positions[row, col:end] = np.arange(doc.size)
        if segment is not None:
            self.segments[row, col:end] = segment
        scored = np.flatnonzero(m[1:])  # token j + 1 is scored: the target at j
        self.targets[row, col + scored] = doc[scored + 1]
        self.ids[row, col + scored] = k

    def scored(self, n: int, packed: bool) -> Scored:
        if packed:
            return Scored(self.tokens, self.targets, self.ids, n, positions=self.positions,
                          segment_ids=self.segments)  # fmt: skip
        return Scored(self.tokens, self.targets, self.ids, n, attention_mask=self.mask)


def _packed_pairs(op, docs, masks, seq_len, row_multiple, pad_id) -> Scored:
    """Each pair's two sequences side by side in one row, the pairs first-fit decreasing."""
    lengths = np.array([docs[2 * i].size + docs[2 * i + 1].size for i in range(len(docs) // 2)])
    if (lengths > seq_len).any():
        i = int(np.argmax(lengths > seq_len))
        raise InvalidArgumentError(
            f"{op}: pair {i} has {lengths[i]} tokens (prompt twice, both responses), more than "
            f"seq_len={seq_len} (pack=False places its sequences in rows of their own)"
        )
    fill: list[int] = []
    where = {}
    for i in np.argsort(-lengths, kind="stable"):  # longest first, each into the first row
        row = next((r for r, f in enumerate(fill) if f + lengths[i] <= seq_len), len(fill))
        if row == len(fill):
            fill.append(0)
        where[int(i)] = (row, fill[row])
        fill[row] += int(lengths[i])
    rows = -(-len(fill) // row_multiple) * row_multiple
    arrays = _Arrays(rows, seq_len, pad_id)
    documents = [0] * rows  # documents placed so far per row (segment ids 1, 2, ...)
    for i in range(len(lengths)):  # in input order within a row
        row, col = where[i]
        for k in (2 * i, 2 * i + 1):
            documents[row] += 1
            arrays.place(row, col, docs[k], masks[k], k, segment=documents[row])
            col += docs[k].size
    return arrays.scored(len(docs), packed=True)


class PostStep:
    """A jitted post-training step under the decoder's mesh, its batch checked first.

    ``step(params, opt_state, batch, **references) -> (params, opt_state, metrics)``; the
    parameters and the optimizer state are donated (the batch is checked on the host before
    the call, as the decoder's methods check theirs).
    """

    def __init__(self, model: MoEDecoder, op: str, fn: Any, check: Any = None):
        self._model, self._op, self._extra = model, op, check
        self._step = _train.TrainStep(model.layout.mesh, fn)

    def __call__(self, params: Any, opt_state: Any, batch: Scored, **references: Any) -> Any:
        check_scored(self._op, self._model, batch)
        if self._extra is not None:
            self._extra(batch)
        references = {k: self._onto_mesh(v, batch) for k, v in references.items()}
        return self._step(params, opt_state, batch, **references)

    def _onto_mesh(self, a: Any, batch: Scored) -> Any:
        """A device array on another mesh, moved onto the model's (a rollout's on data x expert).

        Split over the model's batch axes if it has a row per batch row, else replicated.
        """
        sharding = getattr(a, "sharding", None)
        layout = self._model.layout
        if not isinstance(sharding, NamedSharding) or sharding.mesh == layout.mesh:
            return a
        rows = a.ndim >= 1 and a.shape[0] == np.shape(batch.tokens)[0]
        spec = P(layout.input_axes) if rows else P()
        return jax.device_put(a, NamedSharding(layout.mesh, spec))


def _pairs_whole(op: str, layout: Any, batch: Scored) -> None:
    """Refuses a host batch whose pairs straddle microbatches (their loss needs both halves)."""
    m = layout.num_microbatches
    ids = batch.sequence_ids
    if m == 1 or isinstance(ids, jax.Array):
        return
    ids = np.asarray(ids)
    rows = ids.shape[0]
    per_shard = rows // layout.batch_devices
    # split_microbatches: microbatch i takes the i-th slice of every device's rows
    micro = (np.arange(rows) % per_shard) // (per_shard // m)
    where = np.full(batch.num_sequences, -1)
    for r in range(rows):
        for k in np.unique(ids[r][ids[r] >= 0]):
            where[k] = micro[r]
    split = np.flatnonzero(where[0::2] != where[1::2])
    if split.size:
        i = int(split[0])
        raise InvalidArgumentError(
            f"{op}: pair {i}'s chosen and rejected sequences fall in microbatches "
            f"{where[2 * i]} and {where[2 * i + 1]} of {m}: with num_microbatches > 1 keep each "
            "pair in one row (preference_batch(pack=True))"
        )


def _reference(
    op: str, layout: Any, params: Any, checked: Any, batch: Scored, ref_params: Any
) -> jax.Array:
    """The reference's sequence log-probabilities ``[N]`` of `batch` (no gradient).

    `checked`: `batch` validated as the decoder's batch.
    """
    if ref_params is None:
        if layout.lora is None:
            raise ConfigError(
                f"{op}: without lora the reference needs ref_logprobs (precomputed) or "
                "ref_params (a frozen copy of the parameters)"
            )
        ref_params = disabled_adapters(layout, params)
    lp = scores(layout, jax.lax.stop_gradient(ref_params), checked)[0]
    ids = jnp.asarray(batch.sequence_ids)
    return jax.lax.stop_gradient(per_sequence(lp, ids, batch.num_sequences, layout.mesh))


@functools.partial(jax.jit, static_argnums=0)
def _reference_jit(model: MoEDecoder, params: Any, batch: Scored, ref_params: Any) -> jax.Array:
    """:func:`reference_logprobs` compiled once per model and shapes (not on every call)."""
    op = "jaxops.models.post.reference_logprobs"
    checked = check_scored(op, model, batch)
    return _reference(op, model.layout, params, checked, batch, ref_params)


def reference_logprobs(
    model: MoEDecoder, params: dict[str, Any], batch: Scored, *, ref_params: Any = None
) -> jax.Array:
    """float32 ``[N]``: the reference model's sequence log-probabilities of `batch`.

    The reference is `ref_params` (a frozen copy: the same model's parameters before
    training), or with ``model.lora`` and no `ref_params` the same `params` with every adapter
    disabled (the base model). Computed once per batch, it is :func:`dpo_step`'s
    ``ref_logprobs``. Call it under ``jax.jit`` (``static_argnums=0``) or as is.

    Example:
      >>> import jax, numpy as np
      >>> from jaxops import Lora
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
      >>> from jaxops.models.post import preference_batch, reference_logprobs
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=1,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)),
      ...                    lora=Lora(rank=2, alpha=4, targets=("q_proj",)))
      >>> params = model.add_adapters(model.init(jax.random.key(0)), jax.random.key(1))
      >>> batch = preference_batch([[1, 2]], [[3, 4]], [[5]], seq_len=8)
      >>> reference_logprobs(model, params, batch).shape
      (2,)
    """
    op = "jaxops.models.post.reference_logprobs"
    layout = check_model(op, model, pipe=True)
    check_scored(op, model, batch)

    with jax.set_mesh(layout.mesh):
        return _reference_jit(model, params, batch, ref_params)


def dpo_step(
    model: MoEDecoder,
    optimizer: Any,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    aux_weight: float = 1.0,
) -> PostStep:
    """A jitted DPO / IPO training step on preference pairs (:func:`preference_batch`).

    ``step(params, opt_state, batch, *, ref_logprobs=None, ref_params=None) -> (params,
    opt_state, metrics)``: the policy's sequence log-probabilities of the 2P sequences (with
    gradients), the reference's (`ref_logprobs` ``[2P]`` given, else from `ref_params`, else
    with ``model.lora`` from the same parameters with the adapters disabled), :func:`dpo_loss`
    of the pairs (sequence ``2i`` chosen, ``2i + 1`` rejected) plus `aux_weight` times the MoE
    aux losses, its gradients (with LoRA the adapters' only) and an optax update, laid out as
    :meth:`MoEDecoder.train_step`'s. With ``"ipo"`` each sequence's log-probability is the
    mean over its scored tokens (as the IPO paper's length-normalized form and TRL compute it);
    with ``"sigmoid"`` the sum.

    Args:
      model: the decoder. With a context axis each sequence is split over its devices (ring
        attention), the log-probabilities put back in order. With ``num_microbatches`` M > 1 and
        no pipe axis the batch's rows run in M microbatches one after another, the gradients
        accumulated (each pair must lie in one microbatch: ``preference_batch(pack=True)``
        keeps a pair in one row; the reference's forward runs per microbatch too). With a pipe
        axis the step is one pipeline schedule of M microbatches per data shard: each pair
        must lie in one row, `aux_weight` must be 1, the reference's log-probabilities come
        from a forward-only pipeline pass, and the metrics from another at the step's
        parameters.
      optimizer: an optax ``GradientTransformation``; its state from
        :meth:`MoEDecoder.init_optimizer`.
      beta: :func:`dpo_loss`'s.
      label_smoothing: :func:`dpo_loss`'s.
      loss_type: :func:`dpo_loss`'s.
      aux_weight: the weight of the MoE aux losses (load balancing, z-loss) in the loss: 1
        keeps them as the model's loss has them, 0 drops them, another value reweights them.

    Returns:
      The step (:class:`PostStep`). ``metrics``: ``"loss"`` (the DPO loss), ``"aux"`` (the
      aux losses, unweighted) and :func:`dpo_loss`'s metrics.

    Example:
      >>> import jax, optax
      >>> from jaxops import Lora
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
      >>> from jaxops.models.post import dpo_step, preference_batch
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=1,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)),
      ...                    lora=Lora(rank=2, alpha=4, targets=("q_proj",)))
      >>> params = model.add_adapters(model.init(jax.random.key(0)), jax.random.key(1))
      >>> opt = optax.adam(1e-2)
      >>> state = model.init_optimizer(opt, params)
      >>> batch = preference_batch([[1, 2]], [[3, 4]], [[5]], seq_len=8)
      >>> params, state, m = dpo_step(model, opt, beta=0.1)(params, state, batch)
      >>> round(float(m["loss"]), 4)  # log 2: the policy starts as the reference
      0.6931
    """
    op = "jaxops.models.post.dpo_step"
    layout = check_model(op, model, pipe=True, step=True)
    _check_loss(op, beta, label_smoothing, loss_type)
    if isinstance(aux_weight, bool) or not isinstance(aux_weight, int | float) or aux_weight < 0:
        raise InvalidArgumentError(f"{op}: aux_weight must be a number >= 0, got {aux_weight!r}")
    check_trainable(model, op)
    if layout.pipe > 1 and aux_weight != 1:
        raise ConfigError(
            f"{op}: on a mesh with a pipe axis the MoE aux losses enter the loss as the "
            f"model's own loss has them: aux_weight must be 1, got {aux_weight} (leave them out "
            "with the model's router_aux_loss_coef and router_z_loss_coef at 0)"
        )
    lora = layout.lora is not None
    ipo = loss_type == "ipo"

    def step(params, opt_state, batch, ref_logprobs=None, ref_params=None):
        checked = check_scored(op, model, batch)
        n = batch.num_sequences
        if n % 2:
            raise InvalidArgumentError(
                f"{op}: the batch must hold pairs (2P sequences: 2i chosen, 2i + 1 rejected), "
                f"got num_sequences={n}"
            )
        ids = jnp.asarray(batch.sequence_ids)
        counts = per_sequence(jnp.ones(ids.shape, jnp.float32), ids, n, layout.mesh)
        norm = jnp.maximum(counts, 1.0) if ipo else jnp.ones((n,), jnp.float32)
        given = None
        if ref_logprobs is not None:
            given = jax.lax.stop_gradient(jnp.asarray(ref_logprobs, jnp.float32))
            if given.shape != (n,):
                raise InvalidArgumentError(
                    f"{op}: ref_logprobs must be float [{n}] (one per sequence), got "
                    f"{list(given.shape)}"
                )
        if given is None and ref_params is None and not lora:
            raise ConfigError(
                f"{op}: without lora the reference needs ref_logprobs (precomputed) or "
                "ref_params (a frozen copy of the parameters)"
            )
        m, pairs = layout.num_microbatches, n // 2

        def part(p, mb, rows):  # a microbatch's share: its whole pairs over all P
            mb_ids = rows["ids"]
            lp, aux = scores(layout, p, mb)
            seq = per_sequence(lp, mb_ids, n, layout.mesh) / norm
            here = per_sequence(jnp.ones(mb_ids.shape, jnp.float32), mb_ids, n, layout.mesh)
            present = (here[0::2] > 0) & (here[1::2] > 0)
            if given is None:
                reference = disabled_adapters(layout, p) if ref_params is None else ref_params
                ref_lp = scores(layout, jax.lax.stop_gradient(reference), mb)[0]
                ref = jax.lax.stop_gradient(per_sequence(ref_lp, mb_ids, n, layout.mesh))
            else:
                ref = given
            ref = ref / norm
            losses, chosen, rejected = _pair_terms(
                seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta, label_smoothing, loss_type
            )
            value = jnp.sum(jnp.where(present, losses, 0.0)) / pairs
            metrics = {**_reward_metrics(chosen, rejected, present, pairs), "loss": value}
            return value + aux_weight * aux / m, {**metrics, "aux": aux / m}

        if layout.pipe > 1:
            metrics, grads = _pipelined(params, checked, ids, n, norm, given, ref_params)
        else:
            _, metrics, grads = accumulated(layout, params, checked, {"ids": ids}, part)
        params, opt_state = _train.apply_update(layout, optimizer, params, opt_state, grads)
        return params, opt_state, metrics

    def _pipelined(params, checked, ids, n, norm, given, ref_params):
        """``(metrics, grads)`` through the pipeline schedule.

        Each microbatch's pairs (whole in its rows) are scored on the last stage's device; the
        metrics come from the pipeline's forwards at these parameters.
        """
        _, targets = _objective.where_targets(checked)
        safe = jnp.maximum(ids, 0)
        norm_tok = jnp.where(ids >= 0, norm[safe], 1.0)
        if given is None:
            reference = disabled_adapters(layout, params) if ref_params is None else ref_params
            ref_tok = scores(layout, jax.lax.stop_gradient(reference), checked)[0]
        else:  # each sequence's whole value on its first scored token
            first = (ids >= 0) & (ids != jnp.pad(ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1])
            ref_tok = jnp.where(first, given[safe], 0.0)
        rows = {"targets": targets, "ids": ids, "norm": norm_tok, "ref": ref_tok / norm_tok}

        def objective(head, h, r):  # local rows: a plain scatter onto the N sequences
            lp = 0.0 - layout.token_nll(head, h, r["targets"])
            seq, ref, here = (
                jnp.zeros((n,), jnp.float32).at[r["ids"]].add(v, mode="drop")
                for v in (lp / r["norm"], r["ref"], jnp.ones_like(lp))
            )
            present = (here[0::2] > 0) & (here[1::2] > 0)
            losses = _pair_terms(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta,
                                 label_smoothing, loss_type)[0]  # fmt: skip
            return jnp.sum(jnp.where(present, losses, 0.0)) / (n // 2)

        rows["ids"] = jnp.where(ids >= 0, ids, n)  # -1: dropped by the scatter
        loss, grads = _objective.pipeline_step(layout, params, checked, objective, rows)
        lp = scores(layout, jax.lax.stop_gradient(params), checked)[0]
        seq = per_sequence(lp, ids, n, layout.mesh) / norm
        ref = per_sequence(rows["ref"], ids, n, layout.mesh)
        losses, chosen, rejected = _pair_terms(
            seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta, label_smoothing, loss_type
        )
        value = jnp.mean(losses)
        metrics = {**_reward_metrics(chosen, rejected, None, n // 2), "loss": value}
        return {**metrics, "aux": loss - value}, grads

    def check(batch):
        _pairs_whole(op, layout, batch)
        if layout.pipe > 1:
            _pairs_in_rows(op, batch)

    return PostStep(model, op, step, check=check)


def _pairs_in_rows(op: str, batch: Scored) -> None:
    """Refuses a host batch whose pairs are not each in one row (a pipe mesh's requirement)."""
    ids = batch.sequence_ids
    if isinstance(ids, jax.Array):
        return
    ids = np.asarray(ids)
    row_of = np.full(batch.num_sequences, -1)
    for r in range(ids.shape[0]):
        row_of[np.unique(ids[r][ids[r] >= 0])] = r
    split = np.flatnonzero(row_of[0::2] != row_of[1::2])
    if split.size:
        i = int(split[0])
        raise InvalidArgumentError(
            f"{op}: on a mesh with a pipe axis each pair must lie in one row (its loss is "
            f"computed on the device holding it); pair {i} spans rows {row_of[2 * i]} and "
            f"{row_of[2 * i + 1]}: use preference_batch(pack=True)"
        )
