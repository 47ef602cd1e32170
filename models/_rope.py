"""Rotary position embeddings: the variants of transformers' ``rope_parameters``, read and applied.

:class:`Rope` says which RoPE a model uses: the kind (``"default"``, ``"linear"``, ``"dynamic"``,
``"yarn"``, ``"llama3"``), its base and scaling parameters, the rotated fraction of each head
(``partial_rotary_factor``) and the layout of the rotated pairs (rotate-half, or DeepSeek's
interleaved pairs). :func:`read_rope` reads it from a ``config.json`` (``rope_parameters`` of
transformers 5, or the older ``rope_scaling`` and ``rope_theta``), :func:`rope_to_hf` writes it
back, :func:`inv_freq_and_scale` computes the frequencies and the attention scaling of each kind
as transformers' ``ROPE_INIT_FUNCTIONS`` do, :func:`apply_rotary` rotates queries or keys, and
:func:`softmax_scale_factor` is YaRN's correction of the softmax scale in DeepSeek's attention.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxops.models._rope import Rope, apply_rotary
  >>> rope = Rope("yarn", 10000.0, factor=4.0, original_max_position_embeddings=8)
  >>> apply_rotary(jnp.ones((1, 24, 2, 16)), rope, jnp.arange(24)[None]).shape
  (1, 24, 2, 16)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._errors import ConfigError

__all__ = [
    "ROPE_KINDS",
    "Rope",
    "apply_rotary",
    "inv_freq_and_scale",
    "read_rope",
    "rope_to_hf",
    "rotary_dim",
    "softmax_scale_factor",
]

#: The ``rope_type`` values :class:`Rope` takes (transformers' names).
ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")

# The scaling fields each kind reads; every other scaling field stays at its default.
_USES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
_SCALING = tuple(dict.fromkeys(f for uses in _USES.values() for f in uses))


@dataclasses.dataclass(frozen=True, repr=False)
class Rope:
    """A rotary position embedding (hashable: it is a field of the frozen model configs).

    Attributes:
      kind: one of :data:`ROPE_KINDS` (transformers' ``rope_type``).
      theta: the base (``rope_theta``).
      factor: the context extension factor (every kind but "default").
      original_max_position_embeddings: the pretraining length ("yarn", "llama3").
      max_position_embeddings: the length past which "dynamic" rescales the base (transformers'
        top-level ``max_position_embeddings``).
      attention_factor: "yarn": the scale of cos and sin; None: from `factor`, `mscale` and
        `mscale_all_dim` as transformers infers it.
      beta_fast, beta_slow: "yarn": the rotation counts bounding its frequency ramp.
      mscale, mscale_all_dim: "yarn": DeepSeek's magnitude scales (None: unset).
      truncate: "yarn": round the ramp's bounds to whole dimensions.
      low_freq_factor, high_freq_factor: "llama3": the wavelength band that is smoothed.
      partial_rotary_factor: the rotated fraction of each head: the first
        ``int(head_dim * partial_rotary_factor)`` dims rotate, the rest pass unchanged.
      interleave: the rotated pairs are dims ``(2i, 2i+1)`` (DeepSeek's ``rope_interleave``)
        instead of ``(i, i + d/2)`` (rotate-half, transformers' default layout).

    Raises:
      ConfigError (a ValueError): a kind not supported, a value out of range, a scaling field
        the kind does not read, or a required one missing.

    Example:
      >>> from jaxops.models._rope import Rope
      >>> Rope("linear", 1e6, factor=2.0)
      Rope(kind='linear', theta=1000000.0, factor=2.0)
      >>> Rope(theta=1e4) == Rope()
      True
    """

    kind: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    partial_rotary_factor: float = 1.0
    interleave: bool = False

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        _validate(values, lambda field: f"jaxops.models.Rope: {field}")
        for name, value in values.items():
            if isinstance(value, int) and not isinstance(value, bool) and name in _FLOATS:
                object.__setattr__(self, name, float(value))

    def __repr__(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name in ("kind", "theta") or getattr(self, f.name) != f.default
        ]
        return f"Rope({', '.join(shown)})"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Rope)}
_FLOATS = (
    "theta",
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
    "partial_rotary_factor",
)


def _reads(kind: str) -> tuple[str, ...]:
    """The ``rope_parameters`` keys transformers reads for `kind` (besides rope_type)."""
    uses = (f for f in _USES[kind] if f != "max_position_embeddings")  # a top-level key
    return ("rope_theta", "partial_rotary_factor", *uses)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _validate(values: dict[str, Any], name: Callable[[str], str]) -> None:
    """Raises ConfigError for the first bad field of `values`; `name(field)` says where it is."""
    kind = values["kind"]
    if kind not in ROPE_KINDS:
        supported = ", ".join(repr(k) for k in ROPE_KINDS)
        raise ConfigError(f"{name('kind')} = {kind!r} is not supported; supported: {supported}")

    def bad(field: str, requirement: str) -> ConfigError:
        return ConfigError(f"{name(field)} must be {requirement}, got {values[field]!r}")

    for field in _SCALING:
        if field not in _USES[kind] and values[field] != _DEFAULTS[field]:
            raise ConfigError(
                f"{name(field)} = {values[field]!r} is not used by rope_type {kind!r} "
                f"(it reads: {', '.join(_reads(kind))})"
            )
    for field in _REQUIRED.get(kind, ()):
        if values[field] is None:
            raise ConfigError(f"{name(field)} is missing (rope_type {kind!r} needs it)")
    if not (_is_number(values["theta"]) and values["theta"] > 0):
        raise bad("theta", "a finite positive number")
    p = values["partial_rotary_factor"]
    if not (_is_number(p) and 0 < p <= 1):
        raise bad("partial_rotary_factor", "a number in (0, 1]")
    positive = ("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor")
    for field in positive:
        value = values[field]
        if value is not None and not (_is_number(value) and value > 0):
            raise bad(field, "a finite positive number")
    for field in ("mscale", "mscale_all_dim"):
        if values[field] is not None and not _is_number(values[field]):
            raise bad(field, "a finite number or None")
    high = values["high_freq_factor"]
    if high is not None and not (_is_number(high) and high > values["low_freq_factor"]):
        raise bad("high_freq_factor", f"a number > low_freq_factor ({values['low_freq_factor']})")
    for field in ("original_max_position_embeddings", "max_position_embeddings"):
        value = values[field]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad(field, "an int >= 1")
        if value is not None and value < 1:
            raise bad(field, "an int >= 1")
    for field in ("truncate", "interleave"):
        if not isinstance(values[field], bool):
            raise bad(field, "a bool")


def rotary_dim(rope: Rope, head_dim: int) -> int:
    """The rotated width of a head: ``int(head_dim * rope.partial_rotary_factor)``.

    Raises:
      ConfigError: the width is odd, under 2, or (for "dynamic", whose base exponent is
        ``d / (d - 2)``) under 4.

    Example:
      >>> from jaxops.models._rope import Rope, rotary_dim
      >>> rotary_dim(Rope(partial_rotary_factor=0.5), 128)
      64
    """
    dim = int(head_dim * rope.partial_rotary_factor)
    least = 4 if rope.kind == "dynamic" else 2
    if dim % 2 or dim < least:
        raise ConfigError(
            f"jaxops.models.rotary_dim: head_dim {head_dim} with partial_rotary_factor "
            f"{rope.partial_rotary_factor} rotates {dim} dims; RoPE {rope.kind!r} needs an even "
            f"number >= {least}"
        )
    return dim


# -------------------------------------------------------------------------------------------------
# config.json


def read_rope(
    hf: dict[str, Any],
    head_dim: int,
    default_theta: float = 10000.0,
    *,
    default_max_positions: int | None = None,
    interleave: bool = False,
) -> Rope:
    """The :class:`Rope` of a Hugging Face config dict, read as transformers 5 reads it.

    The parameters come from ``rope_scaling`` when it is a non-empty object (older files; it wins
    over ``rope_parameters`` as in transformers), else from ``rope_parameters``; ``rope_theta`` and
    ``partial_rotary_factor`` there, else at the top level, else `default_theta` and 1.0. The kind
    is ``rope_type`` (or the older ``type``), "default" when absent. "yarn" and "llama3" take
    ``original_max_position_embeddings`` from the parameters, else the top-level
    ``max_position_embeddings``; "dynamic" takes the top-level ``max_position_embeddings``;
    either falls back to `default_max_positions` (the model type's transformers default).

    Args:
      hf: the config.json dict.
      head_dim: the width of each attention head (checks the rotated width).
      default_theta: the model type's ``rope_theta`` when the file has none.
      default_max_positions: the model type's ``max_position_embeddings`` when the file has none.
      interleave: the model's pair layout (DeepSeek's ``rope_interleave``; not read here since
        its default depends on the model type).

    Raises:
      ConfigError (a ValueError) naming the key and its value: a rope type other than
        :data:`ROPE_KINDS` (e.g. 'longrope', 'proportional'), a key the type does not read, a
        missing required key, a value out of range.

    Example:
      >>> from jaxops.models._rope import read_rope
      >>> read_rope({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}}, 64)
      Rope(kind='linear', theta=500000.0, factor=2.0)
      >>> try:
      ...     read_rope({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, 64)
      ... except ValueError as e:
      ...     print(e)
      config.json: rope_parameters.rope_type = 'longrope' is not supported;
      supported: 'default', 'linear', 'dynamic', 'yarn', 'llama3'
    """
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json: {key!r} must be an object, got {value!r}")
    source = "rope_scaling" if scaling else "rope_parameters"
    d: dict[str, Any] = dict(scaling or params or {})
    keys = {f: f"{source}.{f}" for f in _DEFAULTS}  # where each field was read, for errors
    keys["kind"] = f"{source}.{'type' if 'rope_type' not in d and 'type' in d else 'rope_type'}"
    kind = d.pop("rope_type", d.get("type", "default"))
    d.pop("type", None)
    values: dict[str, Any] = {"kind": kind, "interleave": interleave}
    for field, key, default in (
        ("theta", "rope_theta", default_theta),
        ("partial_rotary_factor", "partial_rotary_factor", 1.0),
    ):
        if d.get(key) is not None:
            values[field], keys[field] = d.pop(key), f"{source}.{key}"
        else:
            d.pop(key, None)
            values[field] = hf[key] if hf.get(key) is not None else default
            keys[field] = key
    max_positions = hf.get("max_position_embeddings")
    max_positions = default_max_positions if max_positions is None else max_positions
    keys["max_position_embeddings"] = "max_position_embeddings"
    if kind in ROPE_KINDS:
        for key, value in d.items():
            if value is not None and key not in _reads(kind):  # null: transformers' default
                raise ConfigError(
                    f"config.json: {source}.{key} = {value!r} is not supported for rope_type "
                    f"{kind!r} (it reads: {', '.join(_reads(kind))})"
                )
        values.update((key, value) for key, value in d.items() if key in _reads(kind))
        if kind in ("yarn", "llama3") and values.get("original_max_position_embeddings") is None:
            values["original_max_position_embeddings"] = max_positions
            keys["original_max_position_embeddings"] = "max_position_embeddings"
        if kind == "dynamic":
            values["max_position_embeddings"] = max_positions
        if kind == "yarn":
            # transformers: a null factor is max_position_embeddings / the original length.
            if values.get("factor") is None and _is_number(max_positions):
                original = values["original_max_position_embeddings"]
                if _is_number(original) and original > 0:
                    values["factor"] = max_positions / original
            values["beta_fast"] = values.get("beta_fast") or 32.0  # transformers: `or 32`
            values["beta_slow"] = values.get("beta_slow") or 1.0
    full = {**_DEFAULTS, **values}
    _validate(full, lambda field: f"config.json: {keys[field]}")
    rope = Rope(**full)
    try:
        rotary_dim(rope, head_dim)
    except ConfigError as e:
        raise ConfigError(f"config.json: {keys['partial_rotary_factor']}: {e}") from None
    return rope


def rope_to_hf(rope: Rope) -> dict[str, Any]:
    """The config.json keys that say `rope` (transformers 5).

    ``rope_parameters``, and the top-level ``max_position_embeddings`` for "dynamic"
    (transformers reads it there).

    ``rope_parameters`` always holds ``partial_rotary_factor`` (some model types default it to
    another value, e.g. GLM-4-MoE's 0.5). The pair layout is not written: DeepSeek's
    ``rope_interleave`` is the model's key, written by its config.

    Example:
      >>> from jaxops.models._rope import Rope, read_rope, rope_to_hf
      >>> rope = Rope("llama3", 5e5, factor=8.0, original_max_position_embeddings=8192,
      ...             low_freq_factor=1.0, high_freq_factor=4.0)
      >>> rope_to_hf(rope)["rope_parameters"]["rope_type"], read_rope(rope_to_hf(rope), 64) == rope
      ('llama3', True)
    """
    params: dict[str, Any] = {
        "rope_type": rope.kind,
        "rope_theta": rope.theta,
        "partial_rotary_factor": rope.partial_rotary_factor,
    }
    for field in _USES[rope.kind]:
        value = getattr(rope, field)
        if field != "max_position_embeddings" and value is not None:
            params[field] = value
    out: dict[str, Any] = {"rope_parameters": params}
    if rope.kind == "dynamic":
        out["max_position_embeddings"] = rope.max_position_embeddings
    return out


def softmax_scale_factor(rope: Rope) -> float:
    """What DeepSeek's attention multiplies its softmax scale by (YaRN's correction).

    ``mscale(factor, mscale_all_dim) ** 2`` for a "yarn" rope with a nonzero ``mscale_all_dim``
    (transformers' DeepseekV3Attention scaling), else 1.0. Not applied by :func:`apply_rotary`:
    multi-head latent attention uses it.

    Example:
      >>> from jaxops.models._rope import Rope, softmax_scale_factor
      >>> rope = Rope("yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
      ...             mscale_all_dim=1.0)
      >>> round(softmax_scale_factor(rope), 6)
      1.873854
    """
    if rope.kind != "yarn" or not rope.mscale_all_dim:
        return 1.0
    return _mscale(rope.factor, rope.mscale_all_dim) ** 2


# -------------------------------------------------------------------------------------------------
# Frequencies


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """``1 / theta ** (2i / dim)``, float32 as transformers computes it."""
    return np.float32(1.0) / _powers(theta, dim)


def _powers(theta: float, dim: int) -> np.ndarray:
    """``theta ** (2i / dim)`` in float32.

    float32 exponents, the power rounded from float64: the nearest to transformers' torch
    float32 ``pow`` (which differs from numpy's float32 ``pow`` by an ulp here and there).
    """
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return np.power(np.float64(theta), exponents.astype(np.float64)).astype(np.float32)


def _yarn(rope: Rope, dim: int) -> tuple[np.ndarray, float]:
    factor = rope.factor
    if rope.attention_factor is not None:
        scale = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        scale = _mscale(factor, rope.mscale) / _mscale(factor, rope.mscale_all_dim)
    else:
        scale = _mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        length = rope.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    ramp = ramp.astype(np.float32)
    powers = _powers(rope.theta, dim)
    extrapolated = np.float32(1.0) / powers
    interpolated = np.float32(1.0) / (np.float32(factor) * powers)
    keep = np.float32(1.0) - ramp  # the share of the extrapolated (unscaled) frequency
    return interpolated * (1 - keep) + extrapolated * keep, scale


def _llama3(rope: Rope, dim: int) -> np.ndarray:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old, low, high = (
        rope.original_max_position_embeddings,
        rope.low_freq_factor,
        rope.high_freq_factor,
    )
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / np.float32(rope.factor), inv_freq)
    smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def inv_freq_and_scale(
    rope: Rope, rotary_dim: int, positions: jax.Array | None = None
) -> tuple[jax.Array, float]:
    """The inverse frequencies ``[rotary_dim / 2]`` (float32) and the cos/sin scale of `rope`.

    As transformers' ``ROPE_INIT_FUNCTIONS`` (and its models' default) compute them. "dynamic"
    depends on the sequence length, ``max(positions) + 1`` over all of `positions` (a traced
    value under jit, as transformers' ``torch.max(position_ids) + 1``): past
    ``max_position_embeddings`` the base grows, else the default frequencies. transformers keeps
    the grown frequencies between calls until a sequence shorter than max_position_embeddings
    resets them; here each call computes its own (a fresh transformers model's first forward). A
    pipeline's microbatches each see only their rows' positions.

    Args:
      rope: the rotary embedding.
      rotary_dim: the rotated width (:func:`rotary_dim`).
      positions: int ``[b, s]`` positions (only "dynamic" reads them; None: the length is taken
        as max_position_embeddings).

    Returns:
      ``(inv_freq, attention_scaling)``: float32 ``[rotary_dim // 2]`` and a Python float.

    Example:
      >>> from jaxops.models._rope import Rope, inv_freq_and_scale
      >>> inv, scale = inv_freq_and_scale(Rope("linear", 100.0, factor=2.0), 4)
      >>> inv.tolist(), scale
      ([0.5, 0.05000000074505806], 1.0)
    """
    if rope.kind == "yarn":
        inv_freq, scale = _yarn(rope, rotary_dim)
        return jnp.asarray(inv_freq, jnp.float32), float(scale)
    if rope.kind == "llama3":
        return jnp.asarray(_llama3(rope, rotary_dim)), 1.0
    inv_freq = _base_inv_freq(rope.theta, rotary_dim)
    if rope.kind == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    if rope.kind != "dynamic" or positions is None:
        return jnp.asarray(inv_freq, jnp.float32), 1.0
    limit = rope.max_position_embeddings
    seq = jnp.maximum(jnp.max(positions).astype(jnp.int32) + 1, limit).astype(jnp.float32)
    factor = np.float32(rope.factor)
    grown = (factor * seq / np.float32(limit) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    base = np.float32(rope.theta) * grown
    exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
    dynamic = 1.0 / base**exponents
    return jnp.where(seq > limit, dynamic, jnp.asarray(inv_freq)), 1.0


# -------------------------------------------------------------------------------------------------
# Rotation


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: jax.Array, rope: Rope, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding of ``x [b, s, heads, Dh]`` at int ``positions [b, s]``.

    The first :func:`rotary_dim` dims of each head rotate (the rest pass unchanged) by float32
    angles ``position * inv_freq``; cos and sin, times the attention scaling, are cast to x's
    dtype before they multiply x, as in transformers. Rotate-half layout: dim ``i`` pairs with
    ``i + d/2`` (``apply_rotary_pos_emb``). Interleaved (``rope.interleave``): dim ``2i`` pairs
    with ``2i + 1``, and the rotated dims come out de-interleaved, the rotated even dims then the
    rotated odd ones, as transformers' DeepSeek ``apply_rotary_pos_emb_interleave`` returns them
    (q and k alike, so their dot products are those of the interleaved rotation).

    Args:
      x: ``[b, s, heads, Dh]`` queries or keys.
      rope: the rotary embedding.
      positions: int ``[b, s]`` (transformers' position_ids); None: ``0 .. s-1``.

    Returns:
      ``[b, s, heads, Dh]`` in x's dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.models._rope import Rope, apply_rotary
      >>> x = jnp.array([[[[1.0, 0.0, 0.0, 0.0]]]])
      >>> y = apply_rotary(x, Rope(theta=1.0), jnp.array([[1]]))  # cos 1, sin 1
      >>> [round(v, 4) for v in y[0, 0, 0].tolist()]
      [0.5403, 0.0, 0.8415, 0.0]
    """
    s, dh = x.shape[1], x.shape[-1]
    dim = rotary_dim(rope, dh)
    if positions is None:
        positions = jnp.arange(s, dtype=jnp.int32)[None, :]
    inv_freq, scale = inv_freq_and_scale(rope, dim, positions)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, dim / 2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos = cos.astype(x.dtype)[:, :, None, :]
    sin = sin.astype(x.dtype)[:, :, None, :]
    rot = x[..., :dim]
    if rope.interleave:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rot = jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    else:
        cos, sin = jnp.concatenate([cos, cos], -1), jnp.concatenate([sin, sin], -1)
        rot = rot * cos + _rotate_half(rot) * sin
    return rot if dim == dh else jnp.concatenate([rot, x[..., dim:]], axis=-1)
