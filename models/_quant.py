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
from jaxops._errors import ConfigError

__all__ = ["Fp8Block", "Fp8Codec", "fp8_scale_names", "read_quantization", "scale_name"]

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


def read_quantization(cfg: dict[str, Any]) -> Fp8Block | None:
    """The checkpoint's quantization (None: not quantized); ConfigError for any other kind."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"config.json: quantization_config.quant_method {method!r} is not supported; "
            "supported: 'fp8' (block-scaled, weight_block_size [128, 128])"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
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
    return Fp8Block(tuple(block), fmt)


def scale_name(name: str) -> str:
    """The scale tensor of weight `name`: ``X.weight`` -> ``X.weight_scale_inv``."""
    return name + "_scale_inv"


def dequantize_blocks(data: np.ndarray, scale: np.ndarray, block: Fp8Block) -> np.ndarray:
    """``float32(data) * scale`` per block, float32 ``[out, in]``; ValueError if they do not fit.

    One row block at a time: nothing beyond the float32 result is allocated at full size.
    """
    if data.ndim != 2:
        raise ValueError(
            f"a block-scaled weight must be 2-d [out, in], got shape {list(data.shape)}"
        )
    want = block.scale_shape(data.shape)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"the scale has shape {list(scale.shape)}; a {list(data.shape)} weight in "
            f"{list(block.block)} blocks needs {list(want)}"
        )
    out = data.astype(np.float32)
    scale = scale.astype(np.float32, copy=False)
    rows, cols = block.block
    for i in range(want[0]):
        out[i * rows : (i + 1) * rows] *= np.repeat(scale[i], cols)[: data.shape[1]]
    return out


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
                raise ValueError(
                    f"{name!r} is stored as {data.dtype.name}; quantization_config says e4m3"
                )
            return data
        try:
            scale = read(scale_name(name))
        except ValueError as e:
            raise ValueError(f"{name!r} is float8_e4m3fn but its scale is missing: {e}") from None
        try:
            return dequantize_blocks(data, scale, self.block)
        except ValueError as e:
            raise ValueError(f"{scale_name(name)!r}: {e}") from None

    def encode(
        self, name: str, tensor: np.ndarray, *, shapes_only: bool = False
    ) -> list[tuple[str, np.ndarray]] | None:
        if name not in self.quantize:
            return None
        if tensor.ndim != 2:
            raise ValueError(f"{name!r}: only 2-d [out, in] weights quantize in blocks")
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
