"""Quantized Hugging Face checkpoints: the block-scaled FP8 format, read and written.

Published FP8 checkpoints (DeepSeek-V3/R1, Kimi K2, Qwen3-30B-A3B-FP8, ...) store each quantized
linear weight ``X.weight`` (torch layout ``[out, in]``) as F8_E4M3 with a float32
``X.weight_scale_inv`` of shape ``[ceil(out / 128), ceil(in / 128)]`` beside it
(``quant_method: "fp8"``, ``weight_block_size: [128, 128]``)::

    weight[r, c] = float32(fp8[r, c]) * weight_scale_inv[r // 128, c // 128]

(the last row and column blocks are partial when a size is not a multiple of 128).

- :func:`read_quantization`: the config's ``quantization_config``: that format, or None;
  every other ``quant_method`` is refused by name.
- :class:`Fp8Codec`: the checkpoint codec (``codec=`` of ``import_safetensors`` /
  ``export_safetensors``) that dequantizes tensor by tensor on import and quantizes the
  tensors it is given on export, with jaxops' own block quantization (:func:`jaxops.fp8.quantize`).
- :func:`fp8_scale_names`: the header checks of ``from_pretrained`` (every float8 weight has a
  scale of the right shape) before anything is read.

gpt-oss (openai/gpt-oss-20b, -120b) ships its expert weights in OCP Microscaling MXFP4
(``quant_method: "mxfp4"``): each expert tensor ``X`` (``model.layers.{i}.mlp.experts.gate_up_proj``
or ``.down_proj``, module layout ``[E, in, out]``) is stored as two uint8 tensors,
``X_blocks [E, out, in / 32, 16]`` (FP4 E2M1 elements, two per byte, the low nibble first) and
``X_scales [E, out, in / 32]`` (one E8M0 scale per block of 32 elements along ``in``)::

    v[e, o, 32 g + 2 j + h] = e2m1(nibble h of blocks[e, o, g, j]) * 2 ** (scales[e, o, g] - 127)
    X = v.transpose(0, 2, 1)   # h = 0: the low nibble

- :class:`Mxfp4`: that format (``read_quantization``'s result for ``quant_method: "mxfp4"``).
- :class:`Mxfp4Codec`: the import codec that dequantizes such tensors, bit-exact, to float32
  (export writes every tensor as it is: jaxops does not write MXFP4).
- :func:`mxfp4_check`: the header checks of ``from_pretrained`` (dtypes and shapes of the
  blocks and scales) before anything is read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel.checkpoint import CheckpointError, HFTensor

import jaxops
from jaxops._errors import ConfigError, InvalidArgumentError

__all__ = [
    "Fp8Block",
    "Fp8Codec",
    "Mxfp4",
    "Mxfp4Codec",
    "checked_scale",
    "fp8_scale_names",
    "mxfp4_check",
    "read_quantization",
    "scale_name",
]

_E4M3 = np.dtype(jnp.float8_e4m3fn)
# float8 dtype codes of safetensors: only E4M3 holds the weights of this format.
_F8_CODES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
_SCALE_CODES = ("F32", "BF16", "F16", "F64")
# Each block uses the whole e4m3 range: scale = amax / 448 (jaxops' smallest amax floor).
_AMAX_FLOOR = 1e-30


@dataclasses.dataclass(frozen=True)
class Fp8Block:
    """Block-scaled FP8 weights: ``weight = fp8 * weight_scale_inv`` per ``block`` tile.

    Attributes:
      block: ``(rows, cols)`` of a scale's tile of the torch ``[out, in]`` weight.
      fmt: the FP8 format ("e4m3").
    """

    block: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The ``weight_scale_inv`` shape of a ``[out, in]`` weight: ``ceil`` of each / block."""
        return tuple(math.ceil(n / b) for n, b in zip(shape, self.block, strict=True))

    def to_hf(self, modules_to_not_convert: Collection[str] | None = None) -> dict[str, Any]:
        """The ``quantization_config`` of config.json (transformers' ``FineGrainedFP8Config``).

        Args:
          modules_to_not_convert: the torch Linear modules stored unquantized (transformers
            matches each as a module-name suffix); None: transformers' default (lm_head).

        Example:
          >>> from jaxops.models._quant import Fp8Block
          >>> Fp8Block().to_hf(["lm_head"])
          ... # doctest: +NORMALIZE_WHITESPACE
          {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
           'weight_block_size': [128, 128], 'modules_to_not_convert': ['lm_head']}
        """
        out = {
            "quant_method": "fp8",
            "fmt": self.fmt,
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
        }
        if modules_to_not_convert is not None:
            out["modules_to_not_convert"] = list(modules_to_not_convert)
        return out


def read_quantization(cfg: dict[str, Any]) -> Fp8Block | Mxfp4 | None:
    """The checkpoint's quantization (None: not quantized); ConfigError for any other kind.

    ``quant_method: "fp8"`` (block-scaled FP8) gives an :class:`Fp8Block`, ``"mxfp4"``
    (gpt-oss) an :class:`Mxfp4`.
    """
    quant = cfg.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method == "mxfp4":
        return _read_mxfp4(quant)
    if method != "fp8":
        raise ConfigError(
            f"config.json: quantization_config.quant_method {method!r} is not supported; "
            "supported: 'fp8' (block-scaled, weight_block_size [128, 128]), 'mxfp4' (OCP "
            "microscaling FP4, as gpt-oss ships)"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 spells it the torch way
        raise ConfigError(f"config.json: quantization_config.fmt {fmt!r} is not supported: e4m3")
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(
            "config.json: quantization_config.weight_block_size must be two positive ints "
            f"(per-block scales), got {block!r}"
        )
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"config.json: quantization_config.activation_scheme {scheme!r} is not supported; "
            "supported: 'dynamic'"
        )
    for key, ok in (("scale_fmt", "float"), ("expert_dtype", "fp8")):
        value = quant.get(key)
        if value not in (None, ok):
            raise ConfigError(
                f"config.json: quantization_config.{key} {value!r} is not supported; "
                f"supported: {ok!r}"
            )
    return Fp8Block(tuple(block), "e4m3")


def scale_name(name: str) -> str:
    """The scale tensor of weight `name`: ``X.weight`` -> ``X.weight_scale_inv``."""
    return name + "_scale_inv"


def dequantize_blocks(data: np.ndarray, scale: np.ndarray, block: Fp8Block) -> np.ndarray:
    """``float32(data) * scale`` per block, float32 ``[out, in]``; ValueError if they do not fit.

    One row block at a time: nothing beyond the float32 result is allocated at full size.

    Raises:
      ValueError: `data` not 2-d, `scale` not of the block grid's shape, or a scale that is NaN,
        infinite, zero or negative (a weight of NaN or of flipped sign: the file is corrupt).
    """
    if data.ndim != 2:
        raise InvalidArgumentError(
            f"a block-scaled weight must be 2-d [out, in], got shape {list(data.shape)}"
        )
    want = block.scale_shape(data.shape)
    if tuple(scale.shape) != want:
        raise InvalidArgumentError(
            f"the scale has shape {list(scale.shape)}; a {list(data.shape)} weight in "
            f"{list(block.block)} blocks needs {list(want)}"
        )
    scale = checked_scale(scale, "the scale")
    out = data.astype(np.float32)
    rows, cols = block.block
    for i in range(want[0]):
        out[i * rows : (i + 1) * rows] *= np.repeat(scale[i], cols)[: data.shape[1]]
    return out


def checked_scale(scale: np.ndarray, what: str) -> np.ndarray:
    """`scale` as float32; ValueError naming `what` if a block's is NaN, infinite, zero or < 0."""
    scale = scale.astype(np.float32, copy=False)
    bad = np.flatnonzero(~(np.isfinite(scale) & (scale > 0)))
    if bad.size:
        at = [int(i) for i in np.unravel_index(bad[0], scale.shape)]
        raise InvalidArgumentError(
            f"{what} must be finite and > 0 in every block, got {scale.flat[bad[0]]} at {at} "
            f"({bad.size} block(s)); refusing to load NaN, infinite, zero or negative weights"
        )
    return scale


def quantize_blocks(weight: np.ndarray, block: Fp8Block) -> tuple[np.ndarray, np.ndarray]:
    """``(fp8 [out, in], float32 scale [ceil(out/b0), ceil(in/b1)])`` of a float weight.

    :func:`jaxops.fp8.quantize` with ``(G, G)`` blocks, on the host's CPU device when there is
    one: per block ``scale = amax / 448`` (amax the largest finite ``|w|`` of the block, floored
    at 1e-30) and ``fp8 = e4m3(w / scale)`` rounded to nearest even.
    """
    try:
        device = jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS): the default device
        device = jax.devices()[0]
    with jax.default_device(device):
        q = jaxops.fp8.quantize(
            jnp.asarray(weight), block=tuple(block.block), amax_floor=_AMAX_FLOOR, impl="xla"
        )
        return np.asarray(q.data), np.asarray(q.scale)


class Fp8Codec:
    """The checkpoint codec of block-scaled FP8 files (``codec=`` of the safetensors import/export).

    Import: a tensor stored as float8 e4m3 is read with its ``weight_scale_inv`` and
    dequantized to float32 (the import then casts to the target's dtype); others are read as
    they are. Export: the tensors named in `quantize` are written as F8_E4M3 and a float32
    scale; the others as they are.

    Args:
      block: the format.
      quantize: the tensor names that export quantizes.

    Example:
      >>> import numpy as np
      >>> from jaxops.models._quant import Fp8Block, Fp8Codec
      >>> codec = Fp8Codec(Fp8Block(), quantize={"w.weight"})
      >>> stored = dict(codec.encode("w.weight", np.full((130, 4), 0.5, np.float32)))
      >>> {n: (a.dtype.name, a.shape) for n, a in stored.items()}
      {'w.weight': ('float8_e4m3fn', (130, 4)), 'w.weight_scale_inv': ('float32', (2, 1))}
      >>> codec.decode("w.weight", stored.__getitem__).max()
      np.float32(0.5)
    """

    def __init__(self, block: Fp8Block, quantize: Collection[str] = ()):
        self.block = block
        self.quantize = frozenset(quantize)

    def decode(self, name: str, read: Callable[[str], np.ndarray]) -> np.ndarray:
        data = read(name)
        if data.dtype != _E4M3:
            if data.dtype.name.startswith("float8"):
                raise InvalidArgumentError(
                    f"{name!r} is stored as {data.dtype.name}; quantization_config says e4m3"
                )
            return data
        try:
            scale = read(scale_name(name))
        except ValueError as e:
            raise InvalidArgumentError(
                f"{name!r} is float8_e4m3fn but its scale is missing: {e}"
            ) from None
        try:
            return dequantize_blocks(data, scale, self.block)
        except ValueError as e:
            raise InvalidArgumentError(f"{scale_name(name)!r}: {e}") from None

    def encode(
        self, name: str, tensor: np.ndarray, *, shapes_only: bool = False
    ) -> list[tuple[str, np.ndarray]] | None:
        if name not in self.quantize:
            return None
        if tensor.ndim != 2:
            raise InvalidArgumentError(f"{name!r}: only 2-d [out, in] weights quantize in blocks")
        if shapes_only:
            data = np.broadcast_to(np.zeros((), _E4M3), tensor.shape)
            scale = np.broadcast_to(np.zeros((), np.float32), self.block.scale_shape(tensor.shape))
        else:
            data, scale = quantize_blocks(tensor, self.block)
        return [(name, data), (scale_name(name), scale)]


def fp8_scale_names(
    op: str, block: Fp8Block, tensors: Mapping[str, HFTensor], names: Collection[str]
) -> set[str]:
    """The scales of the float8 tensors among `names`, checked from the headers alone.

    Raises:
      CheckpointError: a float8 tensor of another format, or one whose scale is missing, not
        float, or of another shape; the message names the tensor and its file.
    """
    scales = set()
    for name in sorted(names):
        t = tensors.get(name)
        if t is None or t.dtype not in _F8_CODES:
            continue
        if t.dtype != "F8_E4M3":
            raise CheckpointError(
                f"{op}: {name!r} in {t.file} is {t.dtype}; quantization_config says e4m3 (F8_E4M3)"
            )
        s = tensors.get(scale_name(name))
        want = block.scale_shape(t.shape) if len(t.shape) == 2 else None
        if s is None or s.dtype not in _SCALE_CODES or s.shape != want:
            got = "is missing" if s is None else f"is {s.dtype}{list(s.shape)} (in {s.file})"
            need = f"F32{list(want)}" if want else "a 2-d weight"
            raise CheckpointError(
                f"{op}: {name!r} in {t.file} is F8_E4M3{list(t.shape)}, but its scale "
                f"{scale_name(name)!r} {got}; {list(block.block)} blocks need {need}"
            )
        scales.add(scale_name(name))
    return scales


# -------------------------------------------------------------------------------------------------
# MXFP4 (OCP Microscaling Formats v1.0): gpt-oss's expert weights.

MXFP4_BLOCK = 32  # elements per E8M0 scale
_MXFP4_KEYS = ("quant_method", "modules_to_not_convert", "dequantize")
# The 16 FP4 E2M1 codes: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa;
# exponent 0 is subnormal (0 and 0.5). transformers' FP4_VALUES are the same list.
_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# A byte's two elements, the low nibble first, as the 8 bytes of two float32s: one uint64
# gather per byte decodes both.
_E2M1_PAIRS = np.ascontiguousarray(
    np.stack([_E2M1[np.arange(256) & 15], _E2M1[np.arange(256) >> 4]], axis=-1)
).view(np.uint64)[:, 0]
_ROWS_PER_CHUNK = 1 << 14  # blocks dequantized per step: 2 MiB of float32


@dataclasses.dataclass(frozen=True)
class Mxfp4:
    """OCP Microscaling MXFP4 tensors (``quant_method: "mxfp4"``), as gpt-oss ships its experts.

    A tensor ``X`` is stored as ``X_blocks`` (uint8 ``[..., out, in / 32, 16]``: 32 FP4 E2M1
    elements per block, two per byte, the low nibble first) and ``X_scales`` (uint8
    ``[..., out, in / 32]``: the block's E8M0 scale, ``2 ** (code - 127)``).

    Attributes:
      modules_to_not_convert: the config's list (modules transformers keeps unquantized), or
        None. Informational: which tensors are MXFP4 is read from the files' names.
    """

    modules_to_not_convert: tuple[str, ...] | None = None

    @staticmethod
    def blocks_name(name: str) -> str:
        """``X`` -> ``X_blocks``."""
        return name + "_blocks"

    @staticmethod
    def scales_name(name: str) -> str:
        """``X`` -> ``X_scales``."""
        return name + "_scales"


def _read_mxfp4(quant: dict[str, Any]) -> Mxfp4:
    unknown = sorted(set(quant) - set(_MXFP4_KEYS))
    if unknown:
        raise ConfigError(
            f"config.json: quantization_config (mxfp4) has unsupported key(s) {unknown}; "
            f"supported: {list(_MXFP4_KEYS)}"
        )
    skip = quant.get("modules_to_not_convert")
    if skip is not None and (
        not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip)
    ):
        raise ConfigError(
            "config.json: quantization_config.modules_to_not_convert must be a list of module "
            f"names, got {skip!r}"
        )
    dequantize = quant.get("dequantize", False)
    if not isinstance(dequantize, bool):  # transformers' loading option; jaxops always does
        raise ConfigError(
            f"config.json: quantization_config.dequantize must be a bool, got {dequantize!r}"
        )
    return Mxfp4(None if skip is None else tuple(skip))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The values of MXFP4 `blocks` and `scales`: float32 ``[..., out, in]``, bit-exact.

    ``out[..., r, 32 g + 2 j + h] = e2m1(nibble h of blocks[..., r, g, j]) * 2 ** (scales[..., r,
    g] - 127)`` (h = 0 the low nibble), exact in float32 (subnormal down to ``0.5 * 2**-127``)
    except where the value exceeds float32's range (scale codes 253 and 254 with large
    elements), which is +-inf as IEEE rounding makes it. One float32 result is allocated; the
    temporaries are one chunk of blocks.

    Raises:
      ValueError: blocks or scales not uint8, blocks' last axis not 16, scales' shape not
        ``blocks.shape[:-1]``, or a scale code 255 (E8M0's NaN).
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise InvalidArgumentError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype.name} and "
            f"{scales.dtype.name}"
        )
    if blocks.ndim < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise InvalidArgumentError(
            f"MXFP4 blocks must have shape [..., out, in / {MXFP4_BLOCK}, {MXFP4_BLOCK // 2}] "
            f"({MXFP4_BLOCK} FP4 elements in {MXFP4_BLOCK // 2} bytes per block), got "
            f"{list(blocks.shape)}"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise InvalidArgumentError(
            f"MXFP4 scales have shape {list(scales.shape)}; blocks {list(blocks.shape)} need one "
            f"per block, {list(blocks.shape[:-1])}"
        )
    nan = np.flatnonzero(scales.reshape(-1) == 255)
    if nan.size:
        raise InvalidArgumentError(
            f"MXFP4 scale code 255 (NaN in E8M0) at "
            f"{[int(i) for i in np.unravel_index(nan[0], scales.shape)]} ({nan.size} block(s)); "
            "refusing to load NaN weights"
        )
    rows = scales.size
    out = np.empty((rows, MXFP4_BLOCK), np.float32)
    flat_blocks = blocks.reshape(rows, MXFP4_BLOCK // 2)
    flat_scales = scales.reshape(rows)
    with np.errstate(over="ignore"):  # +-inf beyond float32's range, as IEEE rounds
        for r in range(0, rows, _ROWS_PER_CHUNK):
            chunk = out[r : r + _ROWS_PER_CHUNK]
            # mode="clip": no bounds checks to buffer for (a byte indexes 256 entries)
            np.take(_E2M1_PAIRS, flat_blocks[r : r + _ROWS_PER_CHUNK], mode="clip",
                    out=chunk.view(np.uint64))  # fmt: skip
            exponent = flat_scales[r : r + _ROWS_PER_CHUNK].astype(np.int32) - 127
            np.ldexp(chunk, exponent[:, None], out=chunk)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


class Mxfp4Codec:
    """The checkpoint codec of MXFP4 files (``codec=`` of ``import_safetensors``), gpt-oss's.

    Import: their tensor ``X`` (an expert weight in transformers' module layout ``[E, in,
    out]``, e.g. ``model.layers.3.mlp.experts.gate_up_proj``, ``[E, hidden, 2 * intermediate]``)
    is read, when the files store it so, from ``X_blocks`` (uint8 ``[E, out, in / 32, 16]``) and
    ``X_scales`` (uint8 ``[E, out, in / 32]``), dequantized bit-exactly to float32
    (:func:`dequantize_mxfp4`) and transposed to ``[E, in, out]``: the tensor an unquantized
    (bf16) gpt-oss checkpoint stores as ``X``. Other tensors are read as they are. Export:
    every tensor as it is (jaxops writes no MXFP4).

    Example:
      >>> import numpy as np
      >>> from jaxops.models._quant import Mxfp4Codec
      >>> stored = {"w_blocks": np.full((1, 2, 1, 16), 0x72, np.uint8),  # elements 1.0, 6.0
      ...           "w_scales": np.array([[[127], [128]]], np.uint8)}  # 2**0, 2**1 per row
      >>> codec = Mxfp4Codec()
      >>> codec.stored("w", stored)
      ('w_blocks', 'w_scales')
      >>> w = codec.decode("w", stored.__getitem__)  # [E, in, out]
      >>> w.shape, w[0, :4].tolist()
      ((1, 32, 2), [[1.0, 2.0], [6.0, 12.0], [1.0, 2.0], [6.0, 12.0]])
    """

    def __init__(self, fmt: Mxfp4 | None = None):
        self.fmt = Mxfp4() if fmt is None else fmt

    def stored(self, name: str, names: Collection[str]) -> tuple[str, ...]:
        """The stored tensors that make `name`: its blocks and scales if `names` has either."""
        blocks, scales = Mxfp4.blocks_name(name), Mxfp4.scales_name(name)
        if blocks in names or scales in names:
            return (blocks, scales)
        return (name,)

    def decode(self, name: str, read: Callable[[str], np.ndarray]) -> np.ndarray:
        blocks_name, scales_name = Mxfp4.blocks_name(name), Mxfp4.scales_name(name)
        try:
            blocks = read(blocks_name)
        except ValueError:  # not MXFP4: stored as it is
            return read(name)
        try:
            scales = read(scales_name)
        except ValueError as e:
            raise InvalidArgumentError(
                f"{blocks_name!r} is stored but its scales are missing: {e}"
            ) from None
        if blocks.ndim != 4:
            raise InvalidArgumentError(
                f"{blocks_name!r} has shape {list(blocks.shape)}; MXFP4 expert weights are "
                f"[experts, out, in / {MXFP4_BLOCK}, {MXFP4_BLOCK // 2}]"
            )
        try:
            values = dequantize_mxfp4(blocks, scales)
        except ValueError as e:
            raise InvalidArgumentError(
                f"{name!r} ({blocks_name!r}, {scales_name!r}): {e}"
            ) from None
        return values.swapaxes(-1, -2)  # [E, out, in] -> the module layout [E, in, out]

    def encode(
        self, name: str, tensor: np.ndarray, *, shapes_only: bool = False
    ) -> list[tuple[str, np.ndarray]] | None:
        return None


def mxfp4_check(op: str, tensors: Mapping[str, HFTensor], names: Collection[str]) -> set[str]:
    """The blocks and scales of the MXFP4 tensors among `names`, checked from the headers alone.

    Returns:
      The stored names (``X_blocks``, ``X_scales``) of each of `names` stored as MXFP4.

    Raises:
      CheckpointError: blocks without scales or scales without blocks, either not U8, blocks
        not ``[E, out, in / 32, 16]`` or scales not ``[E, out, in / 32]``; the message names
        the tensor and its file.
    """
    stored = set()
    for name in sorted(names):
        b = tensors.get(Mxfp4.blocks_name(name))
        s = tensors.get(Mxfp4.scales_name(name))
        if b is None and s is None:
            continue
        what = f"{op}: {name!r} is stored as MXFP4"
        if b is None or s is None:
            have, lack = (s, Mxfp4.blocks_name(name)) if b is None else (b, Mxfp4.scales_name(name))
            raise CheckpointError(f"{what} ({have.file}), but {lack!r} is missing")
        half = MXFP4_BLOCK // 2
        if b.dtype != "U8" or len(b.shape) != 4 or b.shape[-1] != half:
            raise CheckpointError(
                f"{what}: {Mxfp4.blocks_name(name)!r} in {b.file} is {b.dtype}{list(b.shape)}; "
                f"expected U8[experts, out, in / {MXFP4_BLOCK}, {half}]"
            )
        if s.dtype != "U8" or s.shape != b.shape[:-1]:
            raise CheckpointError(
                f"{what}: {Mxfp4.scales_name(name)!r} in {s.file} is {s.dtype}{list(s.shape)}; "
                f"its blocks {list(b.shape)} (in {b.file}) need U8{list(b.shape[:-1])}"
            )
        stored |= {Mxfp4.blocks_name(name), Mxfp4.scales_name(name)}
    return stored
