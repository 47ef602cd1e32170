"""Group relative policy optimization: on-policy rollouts, GRPO / Dr. GRPO / DAPO and GSPO.

:func:`rollout` samples ``G`` completions of every prompt with jaxops' own
:func:`~jaxops.models.generate` (on the parameters being trained, on the same mesh: no weight
export, no second engine), scores them with a user's reward function, normalizes the rewards
within each group (:func:`group_advantages`) and scores the completions' tokens under the
policy that sampled them (and a reference, for the KL term): a :class:`Rollout`.
:func:`grpo_loss` is the clipped surrogate objective on per-token log-probabilities, with the
importance ratio per token (GRPO) or per sequence (GSPO) and the aggregations of GRPO, DAPO and
Dr. GRPO; :func:`grpo_step` the jitted training step, run several times per rollout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._errors import ArgumentTypeError, ConfigError, InvalidArgumentError

from .. import _objective, _train
from .._decoder import MoEDecoder, check_trainable
from .._generate import generate
from .._packing import IGNORE_INDEX
from ._dpo import PostStep
from ._scores import Scored, accumulated, check_model, check_scored, disabled_adapters, scores

__all__ = [
    "GRPO_AGGREGATIONS",
    "IMPORTANCE_LEVELS",
    "Rollout",
    "group_advantages",
    "grpo_loss",
    "grpo_step",
    "rollout",
]

#: How :func:`grpo_loss` averages the per-token terms: ``"sequence"`` (each sequence's mean over
#: its tokens, then the mean over sequences: GRPO), ``"token"`` (the mean over every token of the
#: batch: DAPO's token-level loss) or ``"constant"`` (the sum over tokens divided by the number of
#: sequences times the maximum completion length: Dr. GRPO).
GRPO_AGGREGATIONS = ("sequence", "token", "constant")

#: The importance ratio of :func:`grpo_loss`: ``"token"`` (each token's ``pi / pi_old``: GRPO)
#: or ``"sequence"`` (the geometric mean over the sequence's tokens: GSPO).
IMPORTANCE_LEVELS = ("token", "sequence")


def _number(op: str, name: str, value: Any, low: float, strict: bool = False) -> float:
    bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    if bad or value < low or (strict and value == low):
        relation = ">" if strict else ">="
        raise InvalidArgumentError(f"{op}: {name} must be a number {relation} {low}, got {value!r}")
    return float(value)


def group_advantages(rewards: Any, group_size: int, *, scale: bool = True) -> np.ndarray:
    """Group-normalized advantages: each reward less its group's mean, over its group's std.

    Rewards ``[N]`` in groups of `group_size` consecutive entries (the completions of one
    prompt). With `scale`, ``(r - mean) / (std + 1e-4)`` with the unbiased std (GRPO, as TRL
    computes it); without, ``r - mean`` (Dr. GRPO's unscaled advantages).

    Args:
      rewards: float ``[N]``, finite, N a multiple of `group_size`.
      group_size: G >= 2.
      scale: divide by the group's standard deviation.

    Returns:
      float32 ``[N]`` (NumPy).

    Raises:
      ValueError: G < 2, N not a multiple of G, a reward that is NaN or infinite.

    Example:
      >>> from jaxops.models.post import group_advantages
      >>> group_advantages([1.0, 0.0, 0.0, 0.0], 2, scale=False).tolist()
      [0.5, -0.5, 0.0, 0.0]
    """
    op = "jaxops.models.post.group_advantages"
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise InvalidArgumentError(
            f"{op}: group_size must be an int >= 2 (a group of one completion has no relative "
            f"advantage), got {group_size!r}"
        )
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % group_size or r.size == 0:
        raise InvalidArgumentError(
            f"{op}: rewards must be float [N], N a positive multiple of group_size={group_size}, "
            f"got shape {list(r.shape)}"
        )
    if not np.isfinite(r).all():
        i = int(np.argmax(~np.isfinite(r)))
        raise InvalidArgumentError(f"{op}: rewards[{i}] is {r[i]}: every reward must be finite")
    groups = r.reshape(-1, group_size)
    adv = groups - groups.mean(1, keepdims=True)
    if scale:
        adv = adv / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    return adv.reshape(-1).astype(np.float32)


def _shapes(op, shape, old_logprobs, advantages, ref_logprobs, beta) -> None:
    """Refuses per-token arrays not shaped ``[B, T]`` like the log-probabilities (`shape`)."""
    shaped = {"old_logprobs": old_logprobs}
    if ref_logprobs is not None:
        shaped["ref_logprobs"] = ref_logprobs
    for name, a in shaped.items():
        if tuple(np.shape(a)) != tuple(shape):
            raise InvalidArgumentError(
                f"{op}: {name} must be shaped like the log-probabilities {list(shape)}, got "
                f"{list(np.shape(a))}"
            )
    if tuple(np.shape(advantages)) != tuple(shape[:1]):
        raise InvalidArgumentError(
            f"{op}: advantages must be float [{shape[0]}] (one per sequence), got "
            f"{list(np.shape(advantages))}"
        )
    if beta > 0 and ref_logprobs is None:
        raise InvalidArgumentError(f"{op}: beta={beta} > 0 needs ref_logprobs (the KL term)")


def _check_objective(op, epsilon_low, epsilon_high, beta, importance, aggregation):
    low = _number(op, "epsilon_low", epsilon_low, 0.0, strict=True)
    if low >= 1:
        raise InvalidArgumentError(f"{op}: epsilon_low must be < 1, got {epsilon_low!r}")
    high = low if epsilon_high is None else _number(op, "epsilon_high", epsilon_high, 0, True)
    _number(op, "beta", beta, 0.0)
    if importance not in IMPORTANCE_LEVELS:
        raise InvalidArgumentError(
            f"{op}: importance must be one of {IMPORTANCE_LEVELS}, got {importance!r}"
        )
    if aggregation not in GRPO_AGGREGATIONS:
        raise InvalidArgumentError(
            f"{op}: aggregation must be one of {GRPO_AGGREGATIONS}, got {aggregation!r}"
        )
    return low, high


def grpo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logprobs: jax.Array | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    importance: str = "token",
    aggregation: str = "sequence",
    max_tokens: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped surrogate objective of GRPO (and GSPO), negated: a loss to minimize.

    Per token t of sequence i (``mask`` 1), with ratio ``w`` (``"token"``:
    ``exp(logprobs - old_logprobs)``; ``"sequence"``, GSPO: ``exp`` of the mean of that
    difference over the sequence's tokens) and advantage ``A_i``::

        l_it = -min(w A_i, clip(w, 1 - epsilon_low, 1 + epsilon_high) A_i) + beta kl_it
        kl_it = exp(ref - logprobs) - (ref - logprobs) - 1        (the k3 estimator)

    aggregated by `aggregation` (:data:`GRPO_AGGREGATIONS`). These are the formulas TRL's
    GRPOTrainer computes (its ``loss_type`` "grpo", "bnpo" / "dapo" and "dr_grpo", and
    ``importance_sampling_level``).

    Args:
      logprobs: float ``[B, T]``: the policy's log-probability of each token (differentiated).
      old_logprobs: float ``[B, T]``: the sampling policy's (constant).
      advantages: float ``[B]``: each sequence's advantage (:func:`group_advantages`).
      mask: ``[B, T]`` bool or 0/1: the completion tokens that count.
      ref_logprobs: float ``[B, T]``: the reference's, required when `beta` > 0.
      beta: the weight of the KL term (>= 0; 0 leaves the reference out).
      epsilon_low: the clip range below 1 (``(0, 1)``).
      epsilon_high: above 1 (None: `epsilon_low`; DAPO's clip-higher raises it).
      importance: one of :data:`IMPORTANCE_LEVELS`.
      aggregation: one of :data:`GRPO_AGGREGATIONS`.
      max_tokens: ``"constant"``'s length (None: T).

    Returns:
      ``(loss, metrics)``: the float32 loss and float32 scalars ``"kl"`` (the mean k3 over the
      counted tokens; 0 without a reference), ``"clip_ratio"`` (the fraction of counted tokens
      whose term is clipped) and ``"ratio"`` (the mean importance ratio).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.models.post import grpo_loss
      >>> lp = jnp.log(jnp.array([[0.5, 0.5]]))
      >>> loss, m = grpo_loss(lp, lp, jnp.array([2.0]), jnp.ones((1, 2)))
      >>> float(loss), float(m["ratio"])  # on-policy: -A
      (-2.0, 1.0)
    """
    op = "jaxops.models.post.grpo_loss"
    low, high = _check_objective(op, epsilon_low, epsilon_high, beta, importance, aggregation)
    lp = jnp.asarray(logprobs, jnp.float32)
    if lp.ndim != 2:
        raise InvalidArgumentError(f"{op}: logprobs must be float [B, T], got {list(lp.shape)}")
    if np.shape(mask) != lp.shape:
        raise InvalidArgumentError(
            f"{op}: mask must be shaped like logprobs {list(lp.shape)}, got {list(np.shape(mask))}"
        )
    _shapes(op, lp.shape, old_logprobs, advantages, ref_logprobs, beta)
    m = jnp.asarray(mask).astype(jnp.float32)
    terms = _terms(lp, old_logprobs, advantages, m, ref_logprobs, beta, low, high, importance)
    weights = _weights(m, aggregation, max_tokens)
    total = jnp.maximum(jnp.sum(m), 1.0)
    return jnp.sum(weights * terms["objective"]), _metrics(terms, m, total)


def _terms(lp, old_logprobs, advantages, m, ref_logprobs, beta, low, high, importance):
    """Per-token ``[B, T]`` arrays: the objective's terms, the k3 KL, clipped flags, ratios.

    The terms are 0 off the mask `m`; rows are whole sequences (GSPO's ratio is per row).
    """
    old = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
    adv = jnp.asarray(advantages, jnp.float32)[:, None]
    counts = jnp.sum(m, axis=1)
    log_ratio = jnp.where(m > 0, lp - old, 0.0)
    if importance == "sequence":
        log_ratio = (jnp.sum(log_ratio, 1) / jnp.maximum(counts, 1.0))[:, None]
    w = jnp.exp(log_ratio)
    clipped = jnp.clip(w, 1 - low, 1 + high)
    per_token = jnp.broadcast_to(-jnp.minimum(w * adv, clipped * adv), lp.shape)
    kl = jnp.zeros_like(lp)
    if beta > 0:
        d = jax.lax.stop_gradient(jnp.asarray(ref_logprobs, jnp.float32)) - lp
        kl = jnp.where(m > 0, jnp.exp(d) - d - 1, 0.0)
        per_token = per_token + beta * kl
    is_clipped = ((w < 1 - low) & (adv < 0)) | ((w > 1 + high) & (adv > 0))
    return {
        "objective": jnp.where(m > 0, per_token, 0.0),
        "kl": kl,
        "clipped": jnp.broadcast_to(is_clipped, lp.shape).astype(jnp.float32),
        "ratio": jnp.broadcast_to(w, lp.shape),
    }


def _weights(m: jax.Array, aggregation: str, max_tokens: int | None) -> jax.Array:
    """``[B, T]``: each counted token's weight in the loss under `aggregation`."""
    rows, length = m.shape
    if aggregation == "sequence":
        return m / (jnp.maximum(jnp.sum(m, 1), 1.0)[:, None] * rows)
    if aggregation == "token":
        return m / jnp.maximum(jnp.sum(m), 1.0)
    return m / (rows * (max_tokens or length))


def _metrics(terms: dict[str, jax.Array], m: jax.Array, total: jax.Array) -> dict[str, jax.Array]:
    """The metrics' shares of the counted tokens `m` (sums over `total` tokens), constant."""
    out = {k: jnp.sum(terms[k] * m) / total for k in ("kl", "ratio")}
    out["clip_ratio"] = jnp.sum(terms["clipped"] * m) / total
    return jax.tree.map(jax.lax.stop_gradient, out)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The completions of one rollout, scored: what :func:`grpo_step` trains on.

    N = P x G rows: the G completions of prompt p are rows ``p G .. p G + G - 1``.

    Attributes:
      batch: the sequences (:class:`~jaxops.models.post.Scored`, one per row: the prompt,
        left-padded, then the completion; its targets are the completion's tokens up to and
        including the first EOS).
      completions: int32 ``[N, T]``: the generated tokens (`pad_token_id` after an EOS).
      completion_mask: bool ``[N, T]``: the tokens that count (up to and including the EOS).
      rewards: float32 ``[N]``: the reward function's.
      advantages: float32 ``[N]``: :func:`group_advantages` of the rewards.
      old_logprobs: float32 ``[N, S]`` (the batch's layout): the log-probabilities of the
        targets under the parameters that sampled them.
      ref_logprobs: float32 ``[N, S]``: the reference's, or None.
    """

    batch: Scored
    completions: np.ndarray
    completion_mask: np.ndarray
    rewards: np.ndarray
    advantages: np.ndarray
    old_logprobs: jax.Array
    ref_logprobs: jax.Array | None

    def step_inputs(self) -> dict[str, Any]:
        """The keywords :func:`grpo_step`'s step takes after the batch."""
        out = {"old_logprobs": self.old_logprobs, "advantages": self.advantages}
        if self.ref_logprobs is not None:
            out["ref_logprobs"] = self.ref_logprobs
        return out


_token_scores = jax.jit(
    lambda layout, params, checked: scores(layout, params, checked)[0], static_argnums=0
)


def _prompts(op: str, prompts: Sequence[Any], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``[P, Sp]`` prompt ids and their 0/1 mask."""
    if not len(prompts):
        raise InvalidArgumentError(f"{op}: no prompt given")
    arrays = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise ArgumentTypeError(f"{op}: prompts[{i}] must hold int token ids, got {a.dtype}")
        if a.ndim != 1 or a.size == 0:
            raise InvalidArgumentError(
                f"{op}: prompts[{i}] must be a non-empty 1-D sequence of token ids, got shape "
                f"{list(a.shape)}"
            )
        arrays.append(a.astype(np.int32))
    width = max(a.size for a in arrays)
    ids = np.full((len(arrays), width), pad_id, np.int32)
    mask = np.zeros((len(arrays), width), np.int32)
    for i, a in enumerate(arrays):
        ids[i, width - a.size :], mask[i, width - a.size :] = a, 1
    return ids, mask


def rollout(
    model: MoEDecoder,
    params: dict[str, Any],
    prompts: Sequence[Any],
    *,
    group_size: int,
    max_new_tokens: int,
    reward_fn: Callable[[list[Any], list[Any]], Any],
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    decode: Callable[[list[int]], str] | None = None,
    scale_rewards: bool = True,
    reference: Any = None,
) -> Rollout:
    """Samples `group_size` completions of every prompt, rewards and scores them.

    The completions come from :func:`~jaxops.models.generate` on `params` (sampled at
    `temperature` after the `top_k` / `top_p` filters; each row its own draws; the same `key`
    gives the same rollout), a completion ending at its first `eos_token_id` (included). The
    rewards: ``reward_fn(prompts, completions)``, each a list of N entries (the prompt's ids
    and the completion's ids before its EOS, as lists of ints, or the strings `decode` makes of
    them), returning N finite floats. Then :func:`group_advantages` and the log-probabilities
    of the completions' tokens under `params` (the sampling policy, scored by a training
    forward: the old log-probabilities of the ratio) and, with `reference`, under the
    reference.

    Args:
      model: the decoder (a mesh without pipe or context axes, as generation; P x G a multiple
        of the batch
        devices).
      params: the parameters being trained.
      prompts: P non-empty 1-D sequences of token ids (left-padded here).
      group_size: G >= 2, the completions per prompt.
      max_new_tokens: T >= 1, the tokens generated per completion.
      reward_fn: ``(prompts, completions) -> [N]`` floats (see above).
      key: a ``jax.random`` key.
      temperature: > 0, the sampling temperature.
      top_k: :func:`~jaxops.models.generate`'s.
      top_p: :func:`~jaxops.models.generate`'s.
      eos_token_id: an id or ids that end a completion (None: every completion is T tokens).
      pad_token_id: the prompts' left padding and what follows an EOS.
      decode: None (the reward function gets token ids), or a callable turning a list of ids
        into text (a tokenizer's ``decode``): it gets strings.
      scale_rewards: :func:`group_advantages`'s `scale`.
      reference: None (no reference log-probabilities), ``"adapters"`` (with ``model.lora``:
        `params` with the adapters disabled, the base model) or a frozen copy of the
        parameters.

    Returns:
      A :class:`Rollout`.

    Raises:
      ValueError: a bad argument, a reward function returning other than N finite numbers.

    Example:
      >>> import jax
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
      >>> from jaxops.models.post import rollout
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=1,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
      >>> params = model.init(jax.random.key(0))
      >>> r = rollout(model, params, [[1, 2, 3], [4]], group_size=2, max_new_tokens=3,
      ...             reward_fn=lambda p, c: [float(7 in x) for x in c], key=jax.random.key(1))
      >>> r.completions.shape, r.batch.num_sequences, r.old_logprobs.shape
      ((4, 3), 4, (4, 5))
    """
    op = "jaxops.models.post.rollout"
    if isinstance(model, MoEDecoder) and (model.layout.pipe > 1 or model.layout.context > 1):
        raise ConfigError(
            f"{op}: generation runs without pipeline stages or a context axis "
            "(jaxops.models.generate): roll out with the model on a data x expert mesh "
            "(dataclasses.replace(model, mesh=...)); the updates may run on this mesh"
        )
    layout = check_model(op, model)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise InvalidArgumentError(
            f"{op}: group_size must be an int >= 2 (a group of one completion has no relative "
            f"advantage), got {group_size!r}"
        )
    _number(op, "temperature", temperature, 0.0, strict=True)
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or (max_new_tokens < 1)
    ):
        raise InvalidArgumentError(
            f"{op}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}"
        )
    if key is None:
        raise InvalidArgumentError(f"{op}: key is required (a jax.random key: rollouts sample)")
    if not callable(reward_fn):
        raise ArgumentTypeError(f"{op}: reward_fn must be callable, got {type(reward_fn).__name__}")
    ids, mask = _prompts(op, prompts, pad_token_id)
    ids, mask = np.repeat(ids, group_size, 0), np.repeat(mask, group_size, 0)
    n, width = ids.shape
    out = generate(
        model,
        params,
        ids,
        max_new_tokens,
        attention_mask=mask,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        key=key,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    out = np.asarray(out)
    completions = out[:, width:]
    eos = () if eos_token_id is None else np.atleast_1d(np.asarray(eos_token_id))
    is_eos = np.isin(completions, eos)
    # up to and including the first EOS: no EOS strictly before
    completion_mask = np.cumsum(is_eos, 1) - is_eos == 0
    lengths = completion_mask.sum(1) - (is_eos & completion_mask).sum(1)  # before the EOS
    prompt_lists = [ids[i][mask[i] > 0].tolist() for i in range(n)]
    completion_lists = [completions[i, : lengths[i]].tolist() for i in range(n)]
    if decode is not None:
        prompt_lists = [decode(p) for p in prompt_lists]
        completion_lists = [decode(c) for c in completion_lists]
    rewards = reward_fn(prompt_lists, completion_lists)
    try:
        rewards = np.asarray(rewards, np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"{op}: reward_fn must return {n} numbers (one per completion), got {rewards!r}"
        ) from e
    if rewards.shape != (n,):
        raise InvalidArgumentError(
            f"{op}: reward_fn must return {n} numbers (one per completion), got shape "
            f"{list(rewards.shape)}"
        )
    if not np.isfinite(rewards).all():
        i = int(np.argmax(~np.isfinite(rewards)))
        raise InvalidArgumentError(
            f"{op}: reward_fn returned {rewards[i]} for completion {i}: rewards must be finite"
        )
    advantages = group_advantages(rewards, group_size, scale=scale_rewards)

    tokens = out[:, :-1].astype(np.int32)
    targets = np.full(tokens.shape, IGNORE_INDEX, np.int32)
    scored = np.zeros(tokens.shape, bool)
    scored[:, width - 1 :] = completion_mask
    targets[scored] = out[:, 1:][scored]
    attention = np.concatenate([mask, np.ones((n, max_new_tokens - 1), np.int32)], 1)
    sequence_ids = np.where(scored, np.arange(n, dtype=np.int32)[:, None], -1).astype(np.int32)
    batch = Scored(tokens, targets, sequence_ids, n, attention_mask=attention)
    checked = check_scored(op, model, batch)
    with jax.set_mesh(layout.mesh):
        old = _token_scores(layout, params, checked)
        ref = None
        if isinstance(reference, str):
            if reference != "adapters" or layout.lora is None:
                raise ConfigError(
                    f"{op}: reference must be None, 'adapters' (with lora) or the reference's "
                    f"parameters, got {reference!r}" + (" without lora" if reference else "")
                )
            ref = _token_scores(layout, disabled_adapters(layout, params), checked)
        elif reference is not None:
            ref = _token_scores(layout, reference, checked)
    return Rollout(
        batch,
        completions.astype(np.int32),
        completion_mask,
        rewards.astype(np.float32),
        advantages,
        old,
        ref,
    )


def grpo_step(
    model: MoEDecoder,
    optimizer: Any,
    *,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    importance: str = "token",
    aggregation: str = "sequence",
    max_tokens: int | None = None,
    aux_weight: float = 1.0,
) -> PostStep:
    """A jitted GRPO / GSPO training step on a :class:`Rollout`.

    ``step(params, opt_state, batch, *, old_logprobs, advantages, ref_logprobs=None) ->
    (params, opt_state, metrics)`` (``step(params, opt_state, r.batch, **r.step_inputs())``):
    the policy's log-probabilities of the completions (with gradients), :func:`grpo_loss` plus
    `aux_weight` times the MoE aux losses, the gradients (with LoRA the adapters' only) and an
    optax update, laid out as :meth:`MoEDecoder.train_step`'s. Run it several times on one
    rollout (the ratio moves away from 1 and the clip applies); the first step on a fresh
    rollout is on-policy.

    Args:
      model: the decoder. With a context axis each sequence is split over its devices (ring
        attention), the log-probabilities put back in order. With ``num_microbatches`` M > 1 and
        no pipe axis the rollout's rows run in M microbatches one after another, the gradients
        accumulated (the aggregation's normalizers are the whole batch's). With a pipe axis
        the step is one pipeline schedule of M microbatches per data shard (roll out on a
        data x expert mesh: the rollout's arrays move onto this one), `aux_weight` must be 1,
        and the metrics come from a forward-only pipeline pass at the step's parameters.
      optimizer: an optax ``GradientTransformation``; its state from
        :meth:`MoEDecoder.init_optimizer`.
      beta: :func:`grpo_loss`'s (> 0 needs the rollout's reference log-probabilities).
      epsilon_low: :func:`grpo_loss`'s.
      epsilon_high: :func:`grpo_loss`'s.
      importance: :func:`grpo_loss`'s (``"sequence"``: GSPO).
      aggregation: :func:`grpo_loss`'s.
      max_tokens: :func:`grpo_loss`'s (``"constant"``: the rollout's ``max_new_tokens``;
        None: the batch's row length).
      aux_weight: the weight of the MoE aux losses (1 as the model's loss has them, 0 drops
        them).

    Returns:
      The step (:class:`~jaxops.models.post.PostStep`); ``metrics``: ``"loss"`` (the
      objective), ``"aux"`` and :func:`grpo_loss`'s metrics.

    Example:
      >>> import jax, optax
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
      >>> from jaxops.models.post import grpo_step, rollout
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=1,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
      >>> params = model.init(jax.random.key(0))
      >>> opt = optax.adam(1e-3)
      >>> state = model.init_optimizer(opt, params)
      >>> r = rollout(model, params, [[1, 2, 3], [4]], group_size=2, max_new_tokens=3,
      ...             reward_fn=lambda p, c: [float(7 in x) for x in c], key=jax.random.key(1))
      >>> step = grpo_step(model, opt)
      >>> params, state, m = step(params, state, r.batch, **r.step_inputs())
      >>> float(m["ratio"])  # the first step is on-policy
      1.0
    """
    op = "jaxops.models.post.grpo_step"
    layout = check_model(op, model, pipe=True, step=True)
    low, high = _check_objective(op, epsilon_low, epsilon_high, beta, importance, aggregation)
    _number(op, "aux_weight", aux_weight, 0.0)
    check_trainable(model, op)
    if layout.pipe > 1 and aux_weight != 1:
        raise ConfigError(
            f"{op}: on a mesh with a pipe axis the MoE aux losses enter the loss as the "
            f"model's own loss has them: aux_weight must be 1, got {aux_weight} (leave them out "
            "with the model's router_aux_loss_coef and router_z_loss_coef at 0)"
        )

    def step(params, opt_state, batch, old_logprobs, advantages, ref_logprobs=None):
        checked = check_scored(op, model, batch)
        mask = (jnp.asarray(batch.targets) != IGNORE_INDEX).astype(jnp.float32)
        _shapes(op, np.shape(batch.tokens), old_logprobs, advantages, ref_logprobs, beta)
        # the global normalizers, so that the microbatches' shares sum to the whole
        rows = {
            "weights": _weights(mask, aggregation, max_tokens),
            "mask": mask,
            "old": jnp.asarray(old_logprobs, jnp.float32),
            "advantages": jnp.asarray(advantages, jnp.float32),
        }
        if beta > 0:
            rows["ref"] = jnp.asarray(ref_logprobs, jnp.float32)
        total = jnp.maximum(jnp.sum(mask), 1.0)
        m = layout.num_microbatches

        def part(p, mb, r):
            lp, aux = scores(layout, p, mb)
            terms = _terms(lp, r["old"], r["advantages"], r["mask"], r.get("ref"), beta,
                           low, high, importance)  # fmt: skip
            value = jnp.sum(r["weights"] * terms["objective"])
            metrics = {**_metrics(terms, r["mask"], total), "loss": value, "aux": aux / m}
            return value + aux_weight * aux / m, metrics

        if layout.pipe > 1:
            metrics, grads = _pipelined(checked, params, rows, total)
        else:
            _, metrics, grads = accumulated(layout, params, checked, rows, part)
        params, opt_state = _train.apply_update(layout, optimizer, params, opt_state, grads)
        return params, opt_state, metrics

    def objective(head, h, r):  # a microbatch's share, on the last stage's device
        lp = 0.0 - layout.token_nll(head, h, r["targets"])
        terms = _terms(lp, r["old"], r["advantages"], r["mask"], r.get("ref"), beta, low, high,
                       importance)  # fmt: skip
        return jnp.sum(r["weights"] * terms["objective"])

    def _pipelined(checked, params, rows, total):
        """Through the pipeline schedule; the metrics from its forwards at these parameters."""
        _, targets = _objective.where_targets(checked)
        rows = {**rows, "targets": targets}
        loss, grads = _objective.pipeline_step(layout, params, checked, objective, rows)
        lp = scores(layout, jax.lax.stop_gradient(params), checked)[0]
        terms = _terms(lp, rows["old"], rows["advantages"], rows["mask"], rows.get("ref"), beta,
                       low, high, importance)  # fmt: skip
        value = jnp.sum(rows["weights"] * terms["objective"])
        metrics = {**_metrics(terms, rows["mask"], total), "loss": value, "aux": loss - value}
        return metrics, grads

    return PostStep(model, op, step)
