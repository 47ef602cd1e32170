"""The gather exchange (``MoEConfig.exchange="gather"``): all-gathered in, reduce-scattered out.

Every device of the expert axis all-gathers the axis's tokens and their routing, permutes the
slots routed to its own experts (the others' slots are unused, id -1), runs its grouped FFN on
them, and sums each token's weighted outputs; one reduce-scatter (``psum_scatter``, float32)
then adds every device's part of each token and hands each device its own tokens back. Nothing
is sized for the worst case of another device's routing: the collectives move ``N * Tl`` token
rows whatever the routing, where the dense all_to_all form moves ``N * Tl * min(K, L)`` rows of
worst-case blocks, and neither the sender's packing nor the receiver's scatter runs. Autodiff
gives the backward: the all-gather's transpose is a reduce-scatter of the tokens' gradient, the
reduce-scatter's an all-gather of the output's.

With a capacity, the sender marks its slots beyond the capacity unused before they cross
(:func:`drop_beyond_capacity`), so the kept slots are those of every other exchange.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxops import fp8
from jaxops._sharding import cotangent_like

from ._config import FP8_BLOCK

__all__ = [
    "drop_beyond_capacity",
    "fp8_gather",
    "gather_routing",
    "local_ids",
    "round_cotangent",
]


def drop_beyond_capacity(ids: jax.Array, kept: jax.Array) -> jax.Array:
    """The ids ``[T, K]`` with each expert's slots after its first ``kept[e]`` set to -1.

    kept: int32 ``[E]``. Slot order is the permute's, ``t * K + k``; ids of -1 stay -1.
    """
    e = kept.shape[0]
    flat = ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, e)
    order = jnp.argsort(key, stable=True)
    ranked = key[order]
    first = jnp.searchsorted(ranked, ranked, side="left").astype(jnp.int32)
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.shape[0], dtype=jnp.int32) - first)
    limit = jnp.concatenate([kept.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])[key]
    return jnp.where(rank < limit, flat, -1).reshape(ids.shape)


def gather_routing(axis: str, ids: jax.Array, probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The expert axis's ``(ids, probs)``, ``[N * T, K]`` each, in one all-gather.

    The ids cross bitcast to float32 beside the float32 probs (no gradient reaches them).
    """
    k = ids.shape[1]
    both = jnp.concatenate(
        [probs.astype(jnp.float32), jax.lax.bitcast_convert_type(ids, jnp.float32)], axis=1
    )
    both = jax.lax.all_gather(both, axis, tiled=True)
    return jax.lax.bitcast_convert_type(both[:, k:], jnp.int32), both[:, :k]


def local_ids(ids: jax.Array, me, local: int) -> jax.Array:
    """Global expert ids ``[..., K]`` as this device's local ones: ``[0, L)``, else -1."""
    lid = ids - me * local  # an unused slot (-1) lands below 0 too
    return jnp.where((lid >= 0) & (lid < local), lid, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fp8_gather(axis: str, impl, tokens: jax.Array) -> jax.Array:
    """The FP8 dispatch of the gather exchange: float32 ``[N * T, H]`` from tokens ``[T, H]``.

    Each device quantizes its tokens once (1 x 128 groups, float8_e4m3fn, float32 scales); the
    FP8 bytes and their scales are all-gathered and dequantized. Backward: the gradient goes
    straight through the quantization and crosses back in tokens' dtype (a reduce-scatter).
    """
    return _fp8_gather_fwd(axis, impl, tokens)[0]


def _fp8_gather_fwd(axis: str, impl, tokens):
    q = fp8.quantize(tokens, block=(1, FP8_BLOCK), impl=impl)
    # The FP8 bytes cross as uint8: XLA:CPU would otherwise widen a float8 collective to f16.
    payload = jax.lax.all_gather(jax.lax.bitcast_convert_type(q.data, jnp.uint8), axis, tiled=True)
    data = jax.lax.bitcast_convert_type(payload, q.data.dtype)
    scales = jax.lax.all_gather(q.scale, axis, tiled=True)
    out = fp8.dequantize(fp8.QuantizedArray(data, scales, (1, FP8_BLOCK)), jnp.float32)
    return out, tokens[:0]


def _fp8_gather_bwd(axis: str, impl, like, d_out):
    d = jax.lax.psum_scatter(d_out.astype(like.dtype), axis, scatter_dimension=0, tiled=True)
    return (cotangent_like(d, like),)


fp8_gather.defvjp(_fp8_gather_fwd, _fp8_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def round_cotangent(x: jax.Array, dtype) -> jax.Array:
    """The identity on x; its cotangent rounded to `dtype` (and back to x's dtype).

    The FP8 dispatch's float32 rows get the gradient the compute-dtype rows of "dtype" get:
    each row's gradient rounded once before a token sums its K rows'.
    """
    return x


def _round_fwd(x, dtype):
    return x, None


def _round_bwd(dtype, _, g):
    return (g.astype(dtype).astype(g.dtype),)


round_cotangent.defvjp(_round_fwd, _round_bwd)
