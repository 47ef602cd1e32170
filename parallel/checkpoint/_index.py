"""The checkpoint index (index.json): constants, loading and validation, safe file names."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ._format import _ST_CODES, CheckpointError, _np_dtype

FORMAT = "jaxops.checkpoint"


VERSION = 1


INDEX = "index.json"


CHUNK_BYTES = 1 << 20  # bytes of tensor data per CRC-32C


_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")


def _load_index(path: Path) -> dict[str, Any]:
    file = path / INDEX
    if not file.is_file():
        raise CheckpointError(f"{path} is not a committed checkpoint (no {INDEX})")
    try:
        index = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{file}: format version {index.get('version')}, expected {VERSION}")
    if index.get("checksum") != "crc32c" or not isinstance(index.get("chunk_bytes"), int):
        raise CheckpointError(f"{file}: unknown checksum {index.get('checksum')!r}")
    arrays = index.get("arrays")
    if not isinstance(arrays, dict):
        raise CheckpointError(f"{file}: no 'arrays' object")
    for key, info in arrays.items():
        if not _valid_entry(info):
            raise CheckpointError(f"{file}: malformed entry for {key!r}")
    return index


def _ints(value: Any, n: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(v, int) and v >= 0 for v in value)
        and (n is None or len(value) == n)
    )


def _valid_entry(info: Any) -> bool:
    """An index entry has the fields and types restore relies on."""
    if not isinstance(info, dict) or info.get("dtype") not in _ST_CODES:
        return False
    if not _ints(info.get("shape")) or not isinstance(info.get("blocks"), list):
        return False
    ndim = len(info["shape"])
    for b in info["blocks"]:
        if not isinstance(b, dict) or not _ints(b.get("start"), ndim):
            return False
        if not _ints(b.get("shape"), ndim) or not _ints(b.get("crc32c")):
            return False
        if not all(isinstance(b.get(k), int) for k in ("offset", "nbytes")):
            return False
        if not isinstance(b.get("file"), str) or not isinstance(b.get("name"), str):
            return False
        if b["nbytes"] != math.prod(b["shape"]) * _np_dtype(info["dtype"]).itemsize:
            return False
    return True


def _safe_file(root: Path, name: Any) -> Path:
    """`root / name` for a plain file name inside `root`; refuses anything that could escape."""
    if not isinstance(name, str) or not _FILE_RE.fullmatch(name) or ".." in name:
        raise CheckpointError(f"{root}: refusing file name {name!r} from the index")
    return root / name


def _lookup(index: dict[str, Any], root: Path, key: str) -> dict[str, Any]:
    arrays = index["arrays"]
    if key not in arrays:
        top = key.split("/")[0]
        near = [k for k in arrays if k.split("/")[0] == top][:5] or list(arrays)[:5]
        raise CheckpointError(f"{root}: no array {key!r} in the checkpoint; it has e.g. {near}")
    return arrays[key]
