"""The safetensors file format: dtype codes, header writing, and header parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxops._errors import ArgumentTypeError, JaxopsError

# numpy dtype name <-> safetensors dtype code. float8 names are ml_dtypes'.
_ST_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


_ST_DTYPES = {code: name for name, code in _ST_CODES.items()}


# Bits per element of every dtype code the safetensors format defines. Headers are validated
# against all of them; jaxops reads the tensors whose codes are in _ST_DTYPES.
_ST_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


_MAX_HEADER = 100 << 20  # bytes; the limit the safetensors library applies too


class CheckpointError(JaxopsError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the restore target."""


def _np_dtype(name: str) -> np.dtype:
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _is_float(dtype: np.dtype) -> bool:
    """Floating point, including ml_dtypes' bfloat16 and float8 (numpy's kind is "V" there)."""
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


def _dtype_name(op: str, what: str, dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in _ST_CODES:
        raise ArgumentTypeError(
            f"{op}: {what} has dtype {name}; supported dtypes: {', '.join(_ST_CODES)}"
        )
    return name


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], meta: dict[str, str]):
    """Header for tensors (name, dtype name, shape, nbytes) stored back to back, in order."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {
            "dtype": _ST_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def _show(value: Any, limit: int = 80) -> str:
    """`repr` of an untrusted value for an error message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value: Any) -> bool:
    """A JSON non-negative integer (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counts(value: Any, n: int | None = None) -> bool:
    """A JSON list of non-negative integers, of length `n` if given."""
    return (
        isinstance(value, list)
        and (n is None or len(value) == n)
        and all(_is_count(v) for v in value)
    )


def _too_large(shape: list[int]) -> bool:
    """More than 2**60 elements with zero dimensions counted as one.

    numpy cannot make such an array (a zero-size array with a dimension of 2**62 included), and no
    real tensor is that large.
    """
    return _capped_prod([max(d, 1) for d in shape], 1 << 60) > 1 << 60


def _little_endian(arr: np.ndarray) -> np.ndarray:
    """`arr` with little-endian bytes (safetensors stores little-endian; numpy can hold either)."""
    if arr.dtype.byteorder == ">":
        return arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def _capped_prod(values: list[int], cap: int) -> int:
    """prod(values), or some number above `cap` once the product exceeds it (stays cheap)."""
    if 0 in values:
        return 0
    out = 1
    for v in values:
        out *= v
        if out > cap:
            return cap + 1
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An `object_pairs_hook` for json: refuses a key given twice (which one would count?)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _parse_json(path: Path, what: str, raw: bytes) -> Any:
    """UTF-8 JSON text without duplicate keys; CheckpointError naming `path` otherwise."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_object)
    except _DuplicateKey as e:
        raise CheckpointError(f"{path}: {what} has the key {e.key!r} twice") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: {what} is not valid JSON: {_show(str(e), 200)}") from None


def _check_header(path: Path, header: Any, data_size: int) -> None:
    """Checks a parsed safetensors header against the `data_size` bytes that follow it.

    As the safetensors format requires: ``__metadata__`` (optional, may be null) maps strings to
    strings; every other key names a tensor whose entry is an object with a known ``dtype`` code,
    a ``shape`` list of non-negative integers and ``data_offsets`` ``[begin, end]``, integers with
    ``0 <= begin <= end <= data_size`` and ``end - begin`` the tensor's byte size; the tensors
    tile the data exactly: no overlap, no gap, no bytes after the last one.

    Raises:
      CheckpointError: naming `path`, the tensor, what was expected and what the header holds.
    """
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: safetensors header is a JSON {type(header).__name__}, expected an object"
        )
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise CheckpointError(
            f"{path}: __metadata__ must be an object of strings to strings, got {_show(meta)}"
        )
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(
                f"{where}: expected an object with dtype, shape and data_offsets, "
                f"got {_show(entry)}"
            )
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise CheckpointError(f"{where}: expected dtype, shape and data_offsets; no {missing}")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or code not in _ST_BITS:
            raise CheckpointError(
                f"{where}: dtype must be a safetensors dtype code ({', '.join(_ST_BITS)}), "
                f"got {_show(code)}"
            )
        if not _counts(shape):
            raise CheckpointError(
                f"{where}: shape must be a list of non-negative integers, got {_show(shape)}"
            )
        if _too_large(shape):
            raise CheckpointError(
                f"{where}: shape {_show(shape)} is too large (more than 2**60 elements with a zero "
                "dimension counted as one)"
            )
        if not (_counts(offsets, 2) and offsets[0] <= offsets[1] <= data_size):
            raise CheckpointError(
                f"{where}: data_offsets must be [begin, end], integers with 0 <= begin <= end <= "
                f"{data_size} (the data size), got {_show(offsets)}"
            )
        elements = _capped_prod(shape, 8 * data_size)
        bits = elements * _ST_BITS[code]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            if elements > 8 * data_size:
                need = f"more than the {data_size} data"
            elif bits % 8:
                need = f"{bits / 8:g} (not a whole number of)"
            else:
                need = str(bits // 8)
            raise CheckpointError(
                f"{where}: {code}{_show(shape)} takes {need} bytes, data_offsets {offsets} hold "
                f"{offsets[1] - offsets[0]}"
            )
        spans.append((offsets[0], offsets[1], name))
    pos, last = 0, None
    for begin, end, name in sorted(spans):
        if begin < pos:
            raise CheckpointError(
                f"{path}: tensor {name!r} (data_offsets [{begin}, {end}]) overlaps tensor "
                f"{last!r} (ending at {pos}); expected tensors that do not share bytes"
            )
        if begin > pos:
            raise CheckpointError(
                f"{path}: tensor {name!r}: the data bytes [{pos}, {begin}) before it belong to "
                "no tensor; expected tensors stored back to back"
            )
        pos, last = end, name
    if pos != data_size:
        raise CheckpointError(
            f"{path}: {data_size - pos} data bytes after the last tensor ({last!r} ends at "
            f"{pos}, the data is {data_size} bytes); expected none"
        )


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The validated JSON header of a safetensors file and the byte offset where its data starts.

    Every entry has been checked by :func:`_check_header` against the file's size.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > _MAX_HEADER:
            raise CheckpointError(
                f"{path}: safetensors header of {n} bytes is implausible "
                f"(expected at most {_MAX_HEADER})"
            )
        if n > size - 8:
            raise CheckpointError(
                f"{path}: truncated: the safetensors header should have {n} bytes, the file has "
                f"{size - 8} after the length"
            )
        text = f.read(n)
    if len(text) != n:
        raise CheckpointError(f"{path}: truncated safetensors header")
    header = _parse_json(path, "the safetensors header", text)
    _check_header(path, header, size - 8 - n)
    return header, 8 + n
