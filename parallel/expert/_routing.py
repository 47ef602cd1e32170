"""Routing: the router's choice and weights, the auxiliary losses, the correction bias update.

Shared by the expert-parallel layer and its dense reference: :func:`check_token_mask` (the
``token_mask=`` argument), :func:`route` (float32 logits with an optional learned bias, softmax
or sigmoid scores, correction bias, group-limited choice, top-k weights; masked-out tokens
routed nowhere), :func:`router_sums` and :func:`aux_from_sums` (:class:`MoEAux` from global sums
over the unmasked tokens) and :func:`update_router_bias` (DeepSeek-V3's auxiliary-loss-free
balancing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import _checks
from jaxops._errors import InvalidArgumentError
from jaxops._gemm import gemm

from ._config import MoEAux, MoEConfig

__all__ = [
    "aux_from_sums",
    "check_token_mask",
    "mask_tokens",
    "route",
    "router_sums",
    "slot_counts",
    "update_router_bias",
]

_COUNT_DTYPES = tuple(np.dtype(d) for d in ("int32", "int64", "uint32", "float32"))
_MASK_DTYPES = tuple(
    np.dtype(d)
    for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
)


def check_token_mask(op: str, token_mask, x: jax.Array) -> jax.Array | None:
    """None, or `token_mask` as a bool array of x's leading shape ``x.shape[:-1]``.

    Integer masks are read as ``!= 0``; another dtype is a TypeError, another shape a ValueError
    (both messages start with `op`).
    """
    if token_mask is None:
        return None
    mask = _checks.check_array(op, "token_mask", token_mask, dtypes=_MASK_DTYPES)
    if tuple(mask.shape) != tuple(x.shape[:-1]):
        raise InvalidArgumentError(
            f"{op}: token_mask must have x's leading shape {tuple(x.shape[:-1])} (x: "
            f"{tuple(x.shape)}), got {tuple(mask.shape)}"
        )
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def mask_tokens(tokens: jax.Array, valid: jax.Array | None) -> jax.Array:
    """`tokens` ``[T, H]`` with the rows of masked-out tokens (valid ``[T]`` False) zeroed.

    Masked rows are never read after this (no value, NaN included, and no gradient crosses).
    """
    return tokens if valid is None else jnp.where(valid[:, None], tokens, 0)


def slot_counts(ids: jax.Array, num_experts: int, masked: bool = False) -> jax.Array:
    """int32 ``[E]``: the slots of ids ``[T, K]`` routed to each expert.

    masked: ids may hold -1 (a masked-out token's slots): those count nowhere.
    """
    counts = jnp.zeros((num_experts,), jnp.int32)
    if not masked:
        return counts.at[ids.reshape(-1)].add(1)
    # .at[] would wrap -1 to expert E - 1: a masked slot adds 0 there.
    return counts.at[ids.reshape(-1)].add((ids.reshape(-1) >= 0).astype(jnp.int32))


def route(
    cfg: MoEConfig,
    tokens: jax.Array,
    w_router: jax.Array,
    bias=None,
    valid=None,
    logit_bias=None,
    params=None,
):
    """(logits, probabilities over experts, expert_ids [T, K], their weights [T, K]), float32.

    The logits are ``tokens @ w_router (+ logit_bias)`` in float32; scores are their softmax or
    sigmoid. The choice: the scores plus the correction bias (no gradient), limited to each
    token's `topk_group` best groups (a group's score: the sum of its two best), then the top k.
    The weights: the chosen experts' raw scores, normalized to sum 1 if asked (sigmoid: the sum
    plus 1e-20, as DeepSeek-V3), times routed_scaling_factor. With router="softmax" and
    normalize_topk the weights are the softmax over the k chosen logits (gpt-oss's router): the
    full softmax's partition function cancels in the renormalization.

    Args:
      cfg: the layer's config.
      tokens: ``[T, H]``, any float dtype.
      w_router: ``[H, E]``.
      bias: None or float32 ``[E]``, the correction bias (choice only, no gradient).
      valid: None or bool ``[T]``: a False token gets expert ids -1 (no expert) and weights 0.
      logit_bias: None or ``[E]``, the learned logit bias (MoEConfig.router_logit_bias), added
        to the float32 logits (with a gradient).
      params: the layer's parameters, read for the router's LoRA adapter (``router_lora_a
        [H, r]``, ``router_lora_b [r, E]``) when cfg.lora targets "router": the logits add
        ``scaling * (tokens @ A) @ B``, in float32.
    """
    # Full float32 products on every platform (never TF32); jaxops.gemm's twin, whose weight
    # gradient XLA:CPU runs as a plain GEMM.
    x = tokens.astype(jnp.float32)
    logits = gemm(x, w_router.astype(jnp.float32), precision="fp32", impl="xla")
    if cfg.lora is not None and "router" in cfg.lora.targets:
        a, b = params["router_lora_a"], params["router_lora_b"]
        t = gemm(x, a.astype(jnp.float32), precision="fp32", impl="xla")
        logits = logits + cfg.lora.scaling * gemm(
            t, b.astype(jnp.float32), precision="fp32", impl="xla"
        )
    if logit_bias is not None:
        logits = logits + logit_bias.astype(jnp.float32)
    if cfg.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        dist = scores
    else:
        scores = jax.nn.sigmoid(logits)
        # Every score can underflow to 0 for very negative logits: then dist is 0, not 0 / 0,
        # and so is its gradient (a safe denominator, not a where around the quotient).
        total = jnp.sum(scores, axis=-1, keepdims=True)
        dist = scores / jnp.where(total > 0, total, 1.0)
    choice = scores
    if bias is not None:
        choice = choice + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        t, g = tokens.shape[0], cfg.n_group
        grouped = choice.reshape(t, g, cfg.num_experts // g)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        kept = jnp.any(keep[:, :, None] == jnp.arange(g)[None, None, :], axis=1)  # [T, G]
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, cfg.num_experts)
    if bias is None and choice is scores:
        top, ids = jax.lax.top_k(scores, cfg.top_k)
    else:
        _, ids = jax.lax.top_k(jax.lax.stop_gradient(choice), cfg.top_k)
        top = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.normalize_topk:
        total = jnp.sum(top, axis=-1, keepdims=True)
        if cfg.router == "softmax":
            top = top / total
        else:  # DeepSeek-V3's + 1e-20; all-zero scores stay 0 (with a finite gradient)
            top = top / jnp.where(total > 0, total + 1e-20, 1.0)
    if cfg.routed_scaling_factor != 1.0:
        top = top * cfg.routed_scaling_factor
    ids = ids.astype(jnp.int32)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, -1)
        top = jnp.where(valid[:, None], top, 0.0)
    return logits, dist, ids, top


def router_sums(logits: jax.Array, dist: jax.Array, valid: jax.Array | None = None):
    """(dist summed over the tokens [E], logsumexp(logits)^2 summed []) over the valid tokens.

    logits, dist: float32 ``[T, E]`` from :func:`route`; valid: None (all) or bool ``[T]``.
    """
    if valid is None:
        return jnp.sum(dist, axis=0), jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
    lse_sq = jax.nn.logsumexp(logits, axis=-1) ** 2
    dist_sum = jnp.sum(jnp.where(valid[:, None], dist, 0.0), axis=0)
    return dist_sum, jnp.sum(jnp.where(valid, lse_sq, 0.0))


def aux_from_sums(cfg: MoEConfig, counts, dist_sum, lse_sq_sum, dropped, num_tokens) -> MoEAux:
    """MoEAux from global sums: counts [E] int32, dist_sum [E], lse_sq_sum [] (float32).

    num_tokens: the tokens the sums are over, a static int or (with a token mask) a traced int
    scalar; then no token at all gives zero losses with zero gradients (denominator max(n, 1)).
    """
    if not isinstance(num_tokens, int):
        num_tokens = jnp.maximum(num_tokens, 1).astype(jnp.float32)
    f = counts.astype(jnp.float32) / (num_tokens * cfg.top_k)
    p = dist_sum / num_tokens
    lb = cfg.num_experts * jnp.sum(f * p)
    z = lse_sq_sum / num_tokens
    loss = cfg.router_aux_loss_coef * lb + cfg.router_z_loss_coef * z
    return MoEAux(loss, lb, z, counts, dropped)


def update_router_bias(
    bias: jax.Array, tokens_per_expert: jax.Array, rate: float = 1e-3
) -> jax.Array:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): one update of the correction bias.

    ``bias + rate * sign(mean(load) - load)``: experts that received more than the mean number of
    slots this step become less likely to be chosen, the others more. Jittable; works on stacked
    layers (``[..., E]``, the mean taken over the last axis). Use it with
    ``MoEConfig(router_bias=True)`` and ``MoEAux.tokens_per_expert`` (global counts), outside the
    gradient (the bias has none).

    Args:
      bias: float32 ``[..., E]``, ``params["router_bias"]``.
      tokens_per_expert: int ``[..., E]`` slots routed to each expert (before drops).
      rate: the update speed gamma (DeepSeek-V3 used 1e-3).

    Returns:
      The updated bias, float32 ``[..., E]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.parallel.expert import update_router_bias
      >>> update_router_bias(jnp.zeros(4), jnp.array([10, 2, 2, 2]), rate=0.1).tolist()
      [-0.10000000149011612, 0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    op = "jaxops.parallel.expert.update_router_bias"
    bias = _checks.check_array(op, "bias", bias, min_rank=1)
    load = _checks.check_array(
        op, "tokens_per_expert", tokens_per_expert, dtypes=_COUNT_DTYPES, min_rank=1
    )
    if load.shape != bias.shape:
        raise InvalidArgumentError(
            f"{op}: tokens_per_expert must have bias's shape "
            f"{tuple(bias.shape)}, got {tuple(load.shape)}"
        )
    load = load.astype(jnp.float32)
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return (bias + rate * step).astype(bias.dtype)
