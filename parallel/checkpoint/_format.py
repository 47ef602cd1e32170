"""The safetensors file format: dtype codes, header writing, and header parsing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

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


class CheckpointError(RuntimeError):
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
        raise TypeError(f"{op}: {what} has dtype {name}; supported dtypes: {', '.join(_ST_CODES)}")
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


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > 100 << 20:
            raise CheckpointError(f"{path}: safetensors header of {n} bytes is implausible")
        text = f.read(n)
    if len(text) != n:
        raise CheckpointError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n
