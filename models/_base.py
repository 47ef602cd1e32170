"""The frozen base kept as shipped (block FP8, MXFP4 experts) on the device, dequantized per layer.

With ``MoEDecoder(base="fp8")`` the decoder layers' linear weights (:data:`BASE_WEIGHTS`: the
attention projections, the routed and shared experts' gate/up/down and the dense layers' MLPs)
are each two parameters: ``X``, the float8_e4m3fn values as their bytes (uint8: one byte a
parameter; ``jax.lax.bitcast_convert_type(X, jnp.float8_e4m3fn)`` are the values), laid out as
the unquantized weight, and ``X_scale_inv`` in float32, one per block of the published
checkpoint's ``weight_block_size``::

    W[..., i, o] = float32(fp8(X)[..., i, o]) * X_scale_inv[..., row[i], col[o]]

the published format's meaning (``weight = fp8 * weight_scale_inv`` per 128 x 128 block of the
torch ``[out, in]`` weight), carried over to our ``[in, out]`` layout. A layer dequantizes its
own weights where it starts (:func:`dequantized`, inside the layer's rematerialized body, named
:data:`DEQUANTIZED` so that no remat policy saves them): the float copy of a layer's weights
exists only while that layer runs, in the forward and again in the backward.

The blocks are those of the Hugging Face tensors: :func:`block_maps` follows each weight's
name-map rule (:func:`jaxops.models.name_map`), so a fused weight (q, k and v side by side; gate
and up) keeps each part's own blocks, partial last blocks included, and the RoPE row permutation
moves each row with its block's scale. Loading keeps a published FP8 checkpoint's bytes and
scales as they are (:class:`BaseCodec`); an unquantized checkpoint is quantized at load, tensor
by tensor on the host, with the same blocks (``scale = amax / 448``).

With ``MoEDecoder(base="mxfp4")`` the routed experts' ``w_in`` and ``w_out``
(:data:`MXFP4_WEIGHTS`) are gpt-oss's published MXFP4 (OCP Microscaling FP4) bytes, packed in
our ``[E, in, out]`` layout as ``[E, in / 2, out]`` (two E2M1 elements a byte along ``in``, the
low nibble first) with ``X_scales [E, in / 32, out]`` (E8M0 codes), read from the checkpoint's
``X_blocks`` and ``X_scales`` as stored (:class:`Mxfp4BaseCodec`) and dequantized per layer
(:func:`dequantize_mxfp4`) like the FP8 base.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel.checkpoint import HFTensor, Rule

from jaxops._errors import InvalidArgumentError

from ._quant import (
    Fp8Block,
    Fp8Codec,
    Mxfp4Codec,
    checked_scale,
    quantize_blocks,
    scale_name,
)

__all__ = [
    "BASES",
    "BASE_WEIGHTS",
    "DEQUANTIZED",
    "MXFP4_SCALES",
    "MXFP4_WEIGHTS",
    "Mxfp4BaseCodec",
    "SCALE",
    "BaseCodec",
    "as_bytes",
    "as_fp8",
    "block_maps",
    "dequantize",
    "dequantize_mxfp4",
    "dequantized",
    "mxfp4_rules",
    "mxfp4_shapes",
    "quantize",
    "quantize_mxfp4",
    "scale_rules",
    "scale_shape",
]

#: The ``base=`` formats: None (the weights in the parameters' dtype), "fp8" (block FP8) or
#: "mxfp4" (the routed experts as gpt-oss's published MXFP4 bytes).
BASES = (None, "fp8", "mxfp4")
#: The parameter tree keys of the weights a quantized base holds in FP8: the decoder layers'
#: linear weights (the attention projections, the routed and shared experts' and the dense
#: MLPs' gate/up/down; the MTP modules' layers' as the MoE layers'), the weights a published
#: FP8 checkpoint stores so. Not the embeddings, output head, norms, biases, sinks, router,
#: shared-expert gate or an MTP module's ``eh_proj``.
_ATTENTION = ("w_qkv", "w_o", "w_q", "w_q_a", "w_q_b", "w_kv_a", "w_kv_b")
_EXPERTS = ("moe/w_in", "moe/w_out", "moe/shared_w_in", "moe/shared_w_out")
BASE_WEIGHTS = frozenset(
    {
        *(f"{stack}/{k}" for stack in ("layers", "dense_layers") for k in _ATTENTION),
        *(f"{stack}/{k}" for stack in ("layers", "mtp/block") for k in _EXPERTS),
        *(f"mtp/block/{k}" for k in _ATTENTION),
        "dense_layers/mlp/w_in",
        "dense_layers/mlp/w_out",
    }
)
#: The suffix of a quantized weight's scale parameter (``w_qkv`` -> ``w_qkv_scale_inv``).
SCALE = "_scale_inv"
#: The routed experts' weights an MXFP4 base holds packed (``[E, in, out]`` as ``[E, in / 2,
#: out]`` bytes, two E2M1 elements each, and ``X_scales [E, in / 32, out]``, E8M0 codes).
MXFP4_WEIGHTS = frozenset({"layers/moe/w_in", "layers/moe/w_out"})
#: The suffix of an MXFP4 weight's scales (``w_in`` -> ``w_in_scales``).
MXFP4_SCALES = "_scales"
MXFP4_BLOCK = 32
#: The checkpoint name of a layer's dequantized weights: never saved for the backward.
DEQUANTIZED = "base_dequantized"
_E4M3 = jnp.float8_e4m3fn
_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-30

# A map per dimension of one layer's weight: the scale index of each entry (None: one scale
# per entry, as along the experts).
Maps = tuple[np.ndarray | None, ...]


def _get(tree: Mapping[str, Any], key: str) -> Any:
    for part in key.split("/"):
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _rule(rules: Sequence[Rule], key: str) -> Rule | None:
    return next((r for r in rules if r.theirs and r.matches(key)), None)


def _part_sizes(rule: Rule, fused: int) -> list[int]:
    n = len(rule.theirs) if not isinstance(rule.theirs, str) else 1
    if n == 1:
        return [fused]
    if rule.sizes is not None:
        return [int(s) for s in rule.sizes]
    return [fused // n] * n


def block_maps(
    shapes: Mapping[str, Any], rules: Sequence[Rule], block: tuple[int, int]
) -> dict[str, Maps]:
    """Per base weight present in `shapes` (its tree key), the maps of one layer's array.

    Args:
      shapes: the parameter tree's shapes (stacked ``[L, ...]``), unquantized.
      rules: the model's name map; a weight without a rule gets blocks of its own last two
        dimensions (``[in, out]``: ``block[1]`` rows, ``block[0]`` columns).
      block: ``(rows, cols)`` of a scale's tile of a torch ``[out, in]`` weight.

    Returns:
      ``{key: maps}``, one map per dimension of a layer's array (``shape[1:]``): an int32
      vector of each entry's scale index along that dimension, or None where every entry has
      its own (the experts of a stacked rule, the leading dimensions of a fused one).
    """
    out: dict[str, Maps] = {}
    for key in sorted(BASE_WEIGHTS):
        shape = _get(shapes, key)
        if shape is None:
            continue
        layer = tuple(shape[1:])
        rule = _rule(rules, key)
        if rule is None:
            lead: Maps = (None,) * (len(layer) - 2)
            out[key] = (*lead, _ids(layer[-2], block[1]), _ids(layer[-1], block[0]))
            continue
        out[key] = _rule_maps(rule, layer, block)
    return out


def _ids(n: int, b: int) -> np.ndarray:
    return (np.arange(n) // b).astype(np.int32)


def _rule_maps(rule: Rule, layer: tuple[int, ...], block: tuple[int, int]) -> Maps:
    """The maps of a layer's array mapped by `rule` (their tensors ``[..., out, in]``)."""
    extra = len(rule.stack) - 1  # stacked dimensions after the layer's (the experts)
    element = layer[extra:]
    nd = len(element)
    perm = tuple(rule.transpose) if rule.transpose is not None else tuple(range(nd))
    fused = [element[perm[k]] for k in range(nd)]  # their layout, the parts side by side
    sizes = {nd - 2: block[0], nd - 1: block[1]}
    maps: list[np.ndarray | None] = [None] * nd
    for k in range(nd):
        b = sizes.get(k, 1)
        if k != rule.axis or (len(_part_sizes(rule, fused[k])) == 1 and rule.rope is None):
            maps[perm[k]] = _ids(fused[k], b) if b > 1 else None
            continue
        # along the fused axis: each part's blocks after the previous parts', through the
        # rule's own import (its RoPE permutation included), on vectors of block indices
        parts, offset = [], 0
        for s in _part_sizes(rule, fused[k]):
            ids = offset + np.arange(s) // b
            offset += math.ceil(s / b)
            parts.append(ids.reshape([s if d == k else 1 for d in range(nd)]))
        ours = rule.to_ours(parts)
        maps[perm[k]] = ours.reshape(-1).astype(np.int32)
    return (None,) * extra + tuple(maps)


def scale_shape(layer: tuple[int, ...], maps: Maps) -> tuple[int, ...]:
    """The scale array's shape for a layer's array of shape `layer`."""
    return tuple(
        n if m is None else (int(m.max()) + 1 if m.size else 0)
        for n, m in zip(layer, maps, strict=True)
    )


def scale_rules(
    shapes: Mapping[str, Any], rules: Sequence[Rule], block: tuple[int, int]
) -> list[Rule]:
    """The name-map rules of the base weights' scales (``X.weight_scale_inv``).

    Each is its weight's rule on the scale tensors: the same stacking, fusing axis and
    transpose, the parts' sizes in blocks, no RoPE permutation (the weight's rows move with
    their block index in :func:`block_maps`; the scales stay).

    Args:
      shapes: the parameter tree's shapes, unquantized (as for :func:`block_maps`).
      rules: the model's name map.
      block: ``(rows, cols)`` of a scale's tile of a torch ``[out, in]`` weight.
    """
    out = []
    for key in sorted(BASE_WEIGHTS):
        shape = _get(shapes, key)
        rule = None if shape is None else _rule(rules, key)
        if rule is None:
            continue
        theirs = (rule.theirs,) if isinstance(rule.theirs, str) else tuple(rule.theirs)
        nd = len(shape) - len(rule.stack)  # their tensors' rank
        b = {nd - 2: block[0], nd - 1: block[1]}.get(rule.axis, 1)
        sizes = None if rule.sizes is None else [math.ceil(s / b) for s in rule.sizes]
        scales = tuple(scale_name(t) for t in theirs)
        out.append(
            dataclasses.replace(
                rule,
                ours=key + SCALE,
                theirs=scales if len(scales) > 1 else scales[0],
                sizes=sizes,
                rope=None,
                dtype=None,
            )
        )
    return out


def _expand(scale: jax.Array, maps: Maps, ndim: int) -> jax.Array:
    """`scale` indexed by `maps` along its last dimensions: one entry per weight entry."""
    first = ndim - len(maps)
    for axis, m in enumerate(maps):
        if m is not None:
            scale = jnp.take(scale, jnp.asarray(m), axis=first + axis)
    return scale


def as_bytes(tree: Any) -> Any:
    """`tree` with its float8_e4m3fn leaves as their bytes (uint8), each buffer donated.

    The base is stored so: XLA:CPU moves float8 arrays as float16 (a layer scan slicing a
    float8 stack converted the whole stack first, and a bitcast of the stack copied it;
    measured in the compiled step's temporaries), bytes it moves as they are.
    """
    bitcast = jax.jit(lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8), donate_argnums=0)
    return jax.tree.map(lambda a: bitcast(a) if a.dtype == _E4M3 else a, tree)


def as_fp8(tree: Any) -> Any:
    """An abstract tree (``jax.ShapeDtypeStruct`` s) with its uint8 leaves as float8_e4m3fn."""

    def one(a):
        if a.dtype != np.uint8:
            return a
        return jax.ShapeDtypeStruct(a.shape, _E4M3, sharding=a.sharding)

    return jax.tree.map(one, tree)


def dequantize(data: jax.Array, scale: jax.Array, maps: Maps, dtype: Any) -> jax.Array:
    """``float32(data) * scale`` per block, in `dtype` (`maps`: :func:`block_maps`' of it).

    `data`: float8_e4m3fn, or its bytes as uint8 (as the parameters hold it). It may carry
    leading dimensions `maps` does not (stacked layers), `scale` them too.
    """
    if data.dtype == jnp.uint8:
        data = jax.lax.bitcast_convert_type(data, _E4M3)
    w = data.astype(jnp.float32) * _expand(scale.astype(jnp.float32), maps, data.ndim)
    return w.astype(dtype)


def _block_max(a: jax.Array, ids: np.ndarray, axis: int) -> jax.Array:
    """The max of `a` over each block of `axis` (``ids``: each entry's block), as one gather.

    The blocks' members side by side, a short block padded with its own first member, then
    the max over them (a gather of static indices, which any sharding of the other axes keeps).
    """
    counts = np.bincount(ids)
    order = np.argsort(ids, kind="stable")
    members = np.zeros((len(counts), int(counts.max())), np.int32)
    start = 0
    for b, c in enumerate(counts):
        members[b] = order[start] if c else 0
        members[b, :c] = order[start : start + c]
        start += c
    return jnp.max(jnp.take(a, jnp.asarray(members), axis=axis), axis=axis + 1)


def quantize(w: jax.Array, maps: Maps) -> tuple[jax.Array, jax.Array]:
    """``(float8_e4m3fn data, float32 scale)`` of `w` in the blocks of `maps`.

    Per block ``scale = amax / 448`` (amax the largest ``|w|``, floored at 1e-30) and ``data =
    e4m3(w / scale)``, rounded to nearest even: what a published checkpoint holds.
    """
    a = jnp.abs(w.astype(jnp.float32))
    first = w.ndim - len(maps)
    amax = a
    for axis, m in enumerate(maps):
        if m is not None and m.size:
            amax = _block_max(amax, m, first + axis)
    scale = jnp.maximum(amax / _E4M3_MAX, _AMAX_FLOOR)
    full = _expand(scale, maps, w.ndim)
    data = jnp.clip(w.astype(jnp.float32) / full, -_E4M3_MAX, _E4M3_MAX).astype(_E4M3)
    return data, scale


def dequantized(p: Mapping[str, Any], maps: Mapping[str, Maps], dtype: Any, prefix: str) -> dict:
    """One layer's parameters `p` (of the stack `prefix`) with its FP8 weights dequantized.

    Each ``X`` with an ``X_scale_inv`` (block FP8) or ``X_scales`` (MXFP4) beside it becomes the
    `dtype` weight (named :data:`DEQUANTIZED`) and its scales leave the tree; the rest is as it
    was.
    """
    out = {}
    for k, v in p.items():
        if k.endswith(SCALE) or (k.endswith(MXFP4_SCALES) and k[: -len(MXFP4_SCALES)] in p):
            continue
        key = f"{prefix}/{k}"
        if isinstance(v, Mapping):
            out[k] = dequantized(v, maps, dtype, key)
        elif k + SCALE in p:
            w = dequantize(v, p[k + SCALE], maps[key], dtype)
            out[k] = jax.ad_checkpoint.checkpoint_name(w, DEQUANTIZED)
        elif k + MXFP4_SCALES in p:
            w = dequantize_mxfp4(v, p[k + MXFP4_SCALES], dtype)
            out[k] = jax.ad_checkpoint.checkpoint_name(w, DEQUANTIZED)
        else:
            out[k] = v
    return out


# -------------------------------------------------------------------------------------------------
# MXFP4: gpt-oss's experts as published (OCP Microscaling FP4: E2M1 elements, an E8M0 scale per
# 32 along the input dimension), packed in our [E, in, out] layout.

_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def mxfp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The packed bytes' and the scales' shapes of an ``[..., in, out]`` weight."""
    *lead, n_in, n_out = shape
    return (*lead, n_in // 2, n_out), (*lead, n_in // MXFP4_BLOCK, n_out)


def _e2m1(code: jax.Array) -> jax.Array:
    """float32 values of E2M1 codes, elementwise.

    Bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa; exponent 0 subnormal. No table
    lookup: a gather would need the codes' sharding.
    """
    e = ((code >> 1) & 3).astype(jnp.int32)
    m = (code & 1).astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * m, jnp.ldexp(1.0 + 0.5 * m, e - 1))
    return jnp.where(code & 8, -magnitude, magnitude)


def dequantize_mxfp4(data: jax.Array, codes: jax.Array, dtype: Any) -> jax.Array:
    """The weight ``[..., in, out]`` in `dtype` of packed MXFP4 `data` and E8M0 `codes`.

    `data` ``[..., in / 2, out]`` uint8: entry ``2 j`` in the low nibble of byte ``j``, ``2 j +
    1`` in the high one; `codes` ``[..., in / 32, out]``: ``2 ** (code - 127)`` per 32 inputs.
    """
    pairs = jnp.stack([_e2m1(data & 15), _e2m1(data >> 4)], axis=-2)  # [..., in/2, 2, out]
    values = pairs.reshape(*data.shape[:-2], 2 * data.shape[-2], data.shape[-1])
    scale = jnp.ldexp(jnp.ones((), jnp.float32), codes.astype(jnp.int32) - 127)
    scale = jnp.repeat(scale, MXFP4_BLOCK, axis=-2)
    return (values * scale).astype(dtype)


def quantize_mxfp4(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(packed uint8 [..., in / 2, out], E8M0 codes uint8 [..., in / 32, out])`` of `w`.

    Per 32 entries along ``in``: the scale ``2 ** e`` with the smallest ``e`` that brings the
    block's largest magnitude within E2M1's 6, each entry the nearest E2M1 value of ``w / 2 **
    e`` (ties to the first in code order).
    """
    *lead, n_in, n_out = w.shape
    x = w.astype(jnp.float32).reshape(*lead, n_in // MXFP4_BLOCK, MXFP4_BLOCK, n_out)
    amax = jnp.max(jnp.abs(x), axis=-2, keepdims=True)
    e = jnp.ceil(jnp.log2(jnp.maximum(amax, 2.0**-126) / 6.0))
    e = jnp.clip(e, -127, 127)
    scaled = x / jnp.ldexp(jnp.ones((), jnp.float32), e.astype(jnp.int32))
    code = jnp.argmin(jnp.abs(scaled[..., None] - jnp.asarray(_E2M1)), axis=-1).astype(jnp.uint8)
    code = code.reshape(*lead, n_in, n_out)
    packed = code[..., 0::2, :] | (code[..., 1::2, :] << 4)
    return packed, (e[..., 0, :] + 127).astype(jnp.uint8)


def mxfp4_rules(rules: Sequence[Rule]) -> list[Rule]:
    """`rules` with the MXFP4 weights' rules reading what is stored.

    ``X_blocks`` into ``X`` (packed) and ``X_scales`` into ``X_scales``
    (:class:`Mxfp4BaseCodec` lays both out as ours).
    """
    out = []
    for rule in rules:
        if rule.ours not in MXFP4_WEIGHTS or not isinstance(rule.theirs, str):
            out.append(rule)
            continue
        out.append(dataclasses.replace(rule, theirs=rule.theirs + "_blocks"))
        out.append(
            dataclasses.replace(rule, ours=rule.ours + MXFP4_SCALES, theirs=rule.theirs + "_scales")
        )
    return out


class Mxfp4BaseCodec:
    """The import codec of an MXFP4 base: the experts' blocks and scales as stored, in our layout.

    ``X_blocks`` (uint8 ``[E, out, in / 32, 16]``) of a base weight becomes its packed bytes
    ``[E, in / 2, out]``, ``X_scales`` (``[E, out, in / 32]``) the codes ``[E, in / 32, out]``
    (a code 255, E8M0's NaN, is refused naming the tensor); every other tensor is read as the
    dequantizing :class:`~jaxops.models._quant.Mxfp4Codec` reads it.

    Args:
      weights: the stored names of the MXFP4 base weights (``X``, without a suffix).
    """

    def __init__(self, weights: Collection[str]):
        self.weights = frozenset(weights)
        self.fallback = Mxfp4Codec()

    def stored(self, name: str, names: Collection[str]) -> tuple[str, ...]:
        if name.removesuffix("_blocks") in self.weights or name.removesuffix("_scales") in (
            self.weights
        ):
            return (name,)
        return self.fallback.stored(name, names)

    def decode(self, name: str, read: Any) -> np.ndarray:
        if name.removesuffix("_blocks") in self.weights and name.endswith("_blocks"):
            blocks = read(name)
            if blocks.dtype != np.uint8 or blocks.ndim != 4 or blocks.shape[-1] != 16:
                raise InvalidArgumentError(
                    f"{name!r} is {blocks.dtype.name}{list(blocks.shape)}; MXFP4 expert blocks "
                    "are uint8 [experts, out, in / 32, 16]"
                )
            packed = blocks.reshape(*blocks.shape[:2], -1)  # [E, out, in / 2]
            return np.ascontiguousarray(packed.swapaxes(-1, -2))
        if name.removesuffix("_scales") in self.weights and name.endswith("_scales"):
            codes = read(name)
            nan = np.flatnonzero(codes.reshape(-1) == 255)
            if nan.size:
                at = [int(i) for i in np.unravel_index(nan[0], codes.shape)]
                raise InvalidArgumentError(
                    f"{name!r} holds the scale code 255 (NaN in E8M0) at {at} ({nan.size} "
                    "block(s)); refusing to load NaN weights"
                )
            return np.ascontiguousarray(codes.swapaxes(-1, -2))
        return self.fallback.decode(name, read)

    def encode(self, name: str, tensor: np.ndarray, *, shapes_only: bool = False) -> None:
        return None


class BaseCodec:
    """The import codec of a quantized base: FP8 bytes and scales as stored, or made at load.

    For the base weights' tensors (`weights`, their names) and their scales
    (``X.weight_scale_inv``): a tensor stored as float8 e4m3 is read as it is, with its stored
    scale (every block finite and > 0, else ValueError naming it); one stored in a float dtype
    is quantized on the host (:func:`jaxops.models._quant.quantize_blocks`, per block of the
    last two dimensions) and gives its bytes and scale. Every other tensor is read as the
    dequantizing :class:`~jaxops.models._quant.Fp8Codec` reads it.

    Args:
      block: the blocks (a published checkpoint's ``weight_block_size``).
      weights: the stored names of the base weights.
      tensors: the files' tensors (``hf_tensors``), for the stored dtypes.
    """

    def __init__(self, block: Fp8Block, weights: Collection[str], tensors: Mapping[str, HFTensor]):
        self.block = block
        self.weights = frozenset(weights)
        self.scales = {scale_name(w): w for w in self.weights}
        self.tensors = tensors
        self.fallback = Fp8Codec(block)

    def _stored_fp8(self, weight: str) -> bool:
        t = self.tensors.get(weight)
        return t is not None and t.dtype == "F8_E4M3"

    def stored(self, name: str, names: Collection[str]) -> tuple[str, ...]:
        weight = self.scales.get(name)
        if weight is not None and not self._stored_fp8(weight):
            return (weight,)  # made at load from the weight itself
        return (name,)

    def _quantized(self, tensor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if tensor.ndim < 2:
            raise InvalidArgumentError(f"a base weight must be at least 2-d, got {tensor.shape}")
        lead = tensor.shape[:-2]
        pairs = [quantize_blocks(tensor[i], self.block) for i in np.ndindex(*lead)]
        data = np.stack([d for d, _ in pairs]).reshape(*lead, *tensor.shape[-2:])
        scale = np.stack([s for _, s in pairs]).reshape(*lead, *pairs[0][1].shape)
        return data, scale

    def decode(self, name: str, read: Any) -> np.ndarray:
        weight = self.scales.get(name)
        if weight is not None:  # a scale
            if not self._stored_fp8(weight):
                return self._quantized(read(weight))[1]
            return checked_scale(read(name), repr(name))
        if name in self.weights:
            if self._stored_fp8(name):
                return read(name)
            return self._quantized(read(name))[0]
        return self.fallback.decode(name, read)

    def encode(self, name: str, tensor: np.ndarray, *, shapes_only: bool = False) -> None:
        return None
