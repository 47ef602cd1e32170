"""The output head's cross-entropy in vocabulary chunks, without the ``[..., V]`` logits.

:func:`head_losses` is the decoder's loss term: the final norm, the output projection and the
summed cross-entropy of the counted targets. Unchunked it computes the float32 logits
``[..., V]`` whole (:func:`~jaxops.models._layers.head`) and keeps them and the softmax for the
backward; with ``vocab_chunk`` it runs over ``vocab_chunk`` columns of the projection at a
time, in a loop whose only carries are per-token statistics (a running maximum, the sum of
exponentials and the target's logit), and its ``custom_vjp`` recomputes each chunk's logits in
the backward, so that no more than ``[..., vocab_chunk]`` of them exists at once (the way
MaxText's vocabulary tiling and Liger's fused linear cross-entropy bound the logits).

The logits round to the compute dtype as the unchunked head's GEMM output does; the softmax,
the log-sum-exp and the gradient of the logits are float32; the projection's gradient is
accumulated in float32 over the tokens of a chunk and rounded once. The last chunk, where
``vocab_chunk`` does not divide V, ends at V and leaves out the columns its predecessor took.
:func:`head_nll` is the same per target (the log-probabilities post-training scores sequences
by), its backward taking one cotangent per target.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import jaxops
from jaxops._precision import current_precision, dot_precision
from jaxops._sharding import result_sharding

from . import _layers

if TYPE_CHECKING:
    from ._config import DecoderConfig

__all__ = ["chunked_token_losses", "chunked_token_nll", "head_losses", "head_nll"]


def head_nll(
    ops: _layers.Ops,
    c: DecoderConfig,
    params: dict[str, Any],
    h: jax.Array,
    targets: jax.Array,
    vocab_chunk: int | None,
) -> jax.Array:
    """The cross-entropy of each target under :func:`~jaxops.models._layers.head`'s logits.

    Args:
      ops: the compute settings.
      c: the decoder config (its norm epsilon).
      params: ``final_norm [D]`` and ``lm_head [D, V]``, or ``embed [V, D]`` (tied).
      h: the last layer's output ``[..., D]`` (compute dtype).
      targets: int ``[...]``; :data:`~jaxops.models._layers.IGNORE_INDEX` counts for nothing.
      vocab_chunk: None (the logits whole) or the columns of the projection per step.

    Returns:
      float32 ``[...]``: each target's cross-entropy (its log-probability negated), 0 where it
      is ignored, as :func:`~jaxops.models._layers.token_nll` of the whole logits.
    """
    tied = "lm_head" not in params
    w = params["embed"] if tied else params["lm_head"]
    vocab = w.shape[0] if tied else w.shape[1]
    if vocab_chunk is None or vocab_chunk >= vocab:
        return _layers.token_nll(_layers.head(ops, c, params, h), targets)
    h = jaxops.rms_norm(h, params["final_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    return chunked_token_nll(h, w.astype(ops.dtype), targets, vocab_chunk, tied)


def head_losses(
    ops: _layers.Ops,
    c: DecoderConfig,
    params: dict[str, Any],
    h: jax.Array,
    targets: jax.Array,
    vocab_chunk: int | None,
) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)`` of :func:`head_nll` (the arguments are its own).

    Returns:
      float32 scalars: the summed cross-entropy and the number of counted targets, as
      :func:`~jaxops.models._layers.token_losses` of the whole logits.
    """
    total = jnp.sum(head_nll(ops, c, params, h, targets, vocab_chunk))
    return total, jnp.sum(targets != _layers.IGNORE_INDEX, dtype=jnp.float32)


def chunked_token_losses(
    h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int, tied: bool
) -> jax.Array:
    """The summed cross-entropy of the logits ``h @ w`` (``h @ w.T`` if `tied`), by chunks.

    The sum of :func:`chunked_token_nll` (the arguments are its own): a float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.models._loss import chunked_token_losses
      >>> h, w = jnp.ones((2, 3, 4)), jnp.zeros((4, 10))
      >>> round(float(chunked_token_losses(h, w, jnp.zeros((2, 3), int), 4, False)), 4)
      13.8155
    """
    return jnp.sum(chunked_token_nll(h, w, targets, chunk, tied))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_token_nll(
    h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int, tied: bool
) -> jax.Array:
    """Each target's cross-entropy under the logits ``h @ w`` (``h @ w.T`` if `tied`), by chunks.

    Args:
      h: ``[..., D]`` (compute dtype).
      w: ``[D, V]``, or ``[V, D]`` with `tied` (the compute dtype).
      targets: int ``[...]``; :data:`~jaxops.models._layers.IGNORE_INDEX` counts for nothing,
        another id outside ``[0, V)`` gives NaN.
      chunk: columns of the logits per step (``1 <= chunk < V``).
      tied: whether `w` is the embedding table ``[V, D]``.

    Returns:
      float32 ``[...]``, 0 at ignored targets. Its backward takes a cotangent per target.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.models._loss import chunked_token_nll
      >>> h, w = jnp.ones((1, 2, 4)), jnp.zeros((4, 10))
      >>> [round(float(x), 4) for x in chunked_token_nll(h, w, jnp.array([[0, -100]]), 4, False)[0]]
      [2.3026, 0.0]
    """
    return _forward(h, w, targets, chunk, tied)[0]


def _columns(w: jax.Array, start: jax.Array, chunk: int, tied: bool) -> jax.Array:
    """``chunk`` columns of the projection from `start`: ``[D, chunk]``."""
    if tied:
        return jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=0).T
    return jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=1)


def _precision(h: jax.Array) -> Any:
    """The matmul precision jaxops' policy gives the head's GEMM (``jaxops.precision``)."""
    return dot_precision(current_precision(), h.dtype)


def _steps(w: jax.Array, chunk: int, tied: bool) -> tuple[int, int]:
    vocab = w.shape[0] if tied else w.shape[1]
    return vocab, -(-vocab // chunk)


def _chunk_logits(h, w, i, chunk, tied):
    """``(logits [..., chunk] float32, columns [chunk], new [chunk])`` of chunk `i`.

    The chunk starts at ``i * chunk``, or at ``V - chunk`` for the last; `new` marks the columns
    no earlier chunk took (the logits of the others are -inf).
    """
    vocab, _ = _steps(w, chunk, tied)
    start = jnp.minimum(i * chunk, vocab - chunk)
    cols = start + jnp.arange(chunk)
    new = cols >= i * chunk
    out = jnp.einsum(
        "...d,dv->...v",
        h,
        _columns(w, start, chunk, tied),
        preferred_element_type=jnp.float32,
        precision=_precision(h),
    )
    logits = out.astype(h.dtype).astype(jnp.float32)  # as the head's GEMM output rounds
    return jnp.where(new, logits, -jnp.inf), cols, new, start


def _forward(h, w, targets, chunk, tied):
    vocab, steps = _steps(w, chunk, tied)

    def body(i, carry):
        top, sums, picked = carry
        logits, cols, new, _ = _chunk_logits(h, w, i, chunk, tied)
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        sums = sums * jnp.exp(top - new_top) + jnp.sum(
            jnp.exp(logits - new_top[..., None]), axis=-1
        )
        hit = (cols == targets[..., None]) & new
        picked = picked + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        return new_top, sums, picked

    zeros = jnp.zeros_like(targets, jnp.float32)  # laid out as the targets
    start = jnp.full_like(zeros, -jnp.inf)
    top, sums, picked = jax.lax.fori_loop(0, steps, body, (start, zeros, zeros))
    lse = top + jnp.log(sums)
    keep = targets != _layers.IGNORE_INDEX
    known = (targets >= 0) & (targets < vocab)
    picked = jnp.where(known, picked, jnp.nan)
    return jnp.where(keep, lse - picked, 0.0), lse


def _fwd(h, w, targets, chunk, tied):
    nll, lse = _forward(h, w, targets, chunk, tied)
    return nll, (h, w, targets, lse)


def _bwd(chunk, tied, res, ct):
    h, w, targets, lse = res
    _, steps = _steps(w, chunk, tied)
    scale = jnp.where(targets != _layers.IGNORE_INDEX, ct, 0.0).astype(jnp.float32)
    batch = "".join(chr(ord("a") + k) for k in range(targets.ndim))
    summed = result_sharding(w)  # an Explicit mesh's type of the summed weight gradient

    def body(i, carry):
        dh, dw = carry
        logits, cols, new, start = _chunk_logits(h, w, i, chunk, tied)
        probs = jnp.exp(logits - lse[..., None])  # 0 on the columns an earlier chunk took
        hit = (cols == targets[..., None]) & new
        dlogits = ((probs - hit) * scale[..., None]).astype(h.dtype)
        dh = dh + jnp.einsum(
            "...v,dv->...d",
            dlogits,
            _columns(w, start, chunk, tied),
            preferred_element_type=jnp.float32,
            precision=_precision(h),
        )
        # the weight's gradient: [chunk, D] rows of the table, or [D, chunk] columns
        spec, pair, axis = (
            (f"{batch}v,{batch}d->vd", (dlogits, h), 0)
            if tied
            else (f"{batch}d,{batch}v->dv", (h, dlogits), 1)
        )
        part = jnp.einsum(
            spec,
            *pair,
            preferred_element_type=jnp.float32,
            precision=_precision(h),
            out_sharding=summed,
        )
        old = jax.lax.dynamic_slice_in_dim(dw, start, chunk, axis=axis)
        # each column's one product, rounded once (the last chunk adds 0 to those it repeats)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, old + part.astype(dw.dtype), start, axis=axis)
        return dh, dw

    init = (jnp.zeros_like(h, jnp.float32), jnp.zeros_like(w))
    dh, dw = jax.lax.fori_loop(0, steps, body, init)
    return dh.astype(h.dtype), dw, None


chunked_token_nll.defvjp(_fwd, _bwd)
