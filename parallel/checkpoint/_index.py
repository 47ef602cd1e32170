"""The checkpoint index (index.json): constants, loading and validation, safe file names."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from stat import S_ISREG
from typing import Any

import numpy as np

from jaxops._errors import InvalidArgumentError

from ._format import (
    _ST_CODES,
    CheckpointError,
    _capped_prod,
    _counts,
    _is_count,
    _np_dtype,
    _parse_json,
    _show,
    _too_large,
)

FORMAT = "jaxops.checkpoint"
VERSION = 1
INDEX = "index.json"
CHUNK_BYTES = 1 << 20  # bytes of tensor data per CRC-32C
_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")
_MAX_CHUNK = 1 << 30  # the largest chunk_bytes an index may give
_MAX_ELEMENTS = 1 << 60  # elements of one array; more is a corrupt index (and overflows int64)
_MAX_PAIRWISE = 4096  # blocks of one array checked pair by pair when they do not form a grid


def _load_index(path: Path) -> dict[str, Any]:
    """The validated index of the checkpoint directory `path`.

    Everything restore relies on is checked, so a damaged or hostile index raises
    CheckpointError (naming the file, the array and what was expected) rather than another
    exception or wrong data: the header fields, and per array its dtype and shape, and per block
    its region (inside the array; the blocks of an array tile it exactly), file (a plain name of
    an existing file in `path`), tensor name (the one :func:`save` gives that region), byte
    range (inside the file; the blocks of a file never share bytes), size and CRC count.
    """
    file = path / INDEX
    if not file.is_file():
        raise CheckpointError(f"{path} is not a committed checkpoint (no {INDEX})")
    index = _parse_json(file, "the file", file.read_bytes())
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} index")
    version = index.get("version")
    if not _is_count(version) or version != VERSION:
        raise CheckpointError(f"{file}: format version {_show(version)}, expected {VERSION}")
    if index.get("checksum") != "crc32c":
        raise CheckpointError(f"{file}: unknown checksum {_show(index.get('checksum'))}")
    chunk = index.get("chunk_bytes")
    if not _is_count(chunk) or not 1 <= chunk <= _MAX_CHUNK:
        raise CheckpointError(
            f"{file}: chunk_bytes must be an integer in [1, {_MAX_CHUNK}], got {_show(chunk)}"
        )
    step, nproc = index.get("step"), index.get("num_processes")
    if "step" not in index or (step is not None and (type(step) is not int)):
        raise CheckpointError(f"{file}: step must be an integer or null, got {_show(step)}")
    if not _is_count(nproc) or nproc < 1:
        raise CheckpointError(
            f"{file}: num_processes must be a positive integer, got {_show(nproc)}"
        )
    if not isinstance(index.get("metadata"), dict):
        raise CheckpointError(
            f"{file}: metadata must be an object, got {_show(index.get('metadata'))}"
        )
    created = index.get("created")
    if created is not None and (isinstance(created, bool) or not isinstance(created, (int, float))):
        raise CheckpointError(f"{file}: created must be a number, got {_show(created)}")
    arrays = index.get("arrays")
    if not isinstance(arrays, dict):
        raise CheckpointError(f"{file}: no 'arrays' object")
    for key in arrays:
        # A key that is a "/" prefix of another would be both a leaf and a subtree.
        parts = key.split("/")
        for n in range(1, len(parts)):
            if "/".join(parts[:n]) in arrays:
                raise CheckpointError(
                    f"{file}: array keys {'/'.join(parts[:n])!r} and {key!r}: the first would "
                    "be both an array and a subtree; expected keys of leaves only"
                )
    sizes: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for key, info in arrays.items():
        _check_entry(file, key, info, chunk)
        for i, b in enumerate(info["blocks"]):
            where = f"{file}: array {key!r} block {i} ({b['name']!r})"
            name = b["file"]
            if name not in sizes:
                try:
                    stat = os.stat(_safe_file(path, name))
                except OSError as e:
                    raise CheckpointError(f"{where}: cannot open its file {name}: {e}") from None
                if not S_ISREG(stat.st_mode):
                    raise CheckpointError(f"{where}: {name} is not a regular file")
                sizes[name] = stat.st_size
            end = b["offset"] + b["nbytes"]
            if end > sizes[name]:
                raise CheckpointError(
                    f"{where}: the index says it ends at byte {end} of {name}, which has "
                    f"{sizes[name]} bytes (truncated file or corrupt index)"
                )
            if b["nbytes"]:
                spans.setdefault(name, []).append((b["offset"], end, f"{key!r} block {i}"))
    for name, ranges in spans.items():
        ranges.sort()
        for (_, end, what), (begin, _, other) in itertools.pairwise(ranges):
            if begin < end:
                raise CheckpointError(
                    f"{file}: {what} and {other} share bytes {begin}..{end} of {name}; expected "
                    "every block stored once"
                )
    return index


def _block_name(key: str, start: list[int], shape: list[int], global_shape: list[int]) -> str:
    """The tensor name save gives a block: ``key``, or ``key[s:e,...]`` for part of the array.

    The same rule as ``_plan._Block.name`` (the writer); the index is checked against it.
    """
    if shape == global_shape:
        return key
    return key + "[" + ",".join(f"{s}:{s + n}" for s, n in zip(start, shape, strict=True)) + "]"


def _check_entry(file: Path, key: str, info: Any, chunk: int) -> None:
    """An index entry has the fields and types restore relies on; CheckpointError otherwise.

    Messages start with "malformed entry for <key>" and say which field and what was expected.
    """
    bad = f"{file}: malformed entry for {key!r}"
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{bad}: expected an object with dtype, shape, blocks, got {_show(info)}"
        )
    dtype, shape, blocks = info.get("dtype"), info.get("shape"), info.get("blocks")
    if not isinstance(dtype, str) or dtype not in _ST_CODES:
        raise CheckpointError(
            f"{bad}: dtype must be one of {', '.join(_ST_CODES)}, got {_show(dtype)}"
        )
    if not _counts(shape):
        raise CheckpointError(
            f"{bad}: shape must be a list of non-negative integers, got {_show(shape)}"
        )
    if not isinstance(blocks, list):
        raise CheckpointError(f"{bad}: blocks must be a list, got {_show(blocks)}")
    if _too_large(shape):
        raise CheckpointError(
            f"{bad}: shape {_show(shape)} has more than 2**60 elements (a zero dimension counted "
            "as one)"
        )
    ndim, itemsize = len(shape), _np_dtype(dtype).itemsize
    for i, b in enumerate(blocks):
        at = f"{bad}: blocks[{i}]"
        if not isinstance(b, dict):
            raise CheckpointError(f"{at} must be an object, got {_show(b)}")
        for field in ("start", "shape"):
            if not _counts(b.get(field), ndim):
                raise CheckpointError(
                    f"{at}.{field} must be {ndim} non-negative integers (the array has shape "
                    f"{_show(shape)}), got {_show(b.get(field))}"
                )
        if any(s + n > d for s, n, d in zip(b["start"], b["shape"], shape, strict=True)):
            raise CheckpointError(
                f"{at}: region start={_show(b['start'])} shape={_show(b['shape'])} lies outside "
                f"the array's shape {_show(shape)}"
            )
        for field in ("offset", "nbytes"):
            if not _is_count(b.get(field)):
                raise CheckpointError(
                    f"{at}.{field} must be a non-negative integer, got {_show(b.get(field))}"
                )
        if not isinstance(b.get("file"), str):
            raise CheckpointError(f"{at}.file must be a file name, got {_show(b.get('file'))}")
        if not _plain_file_name(b["file"]):
            raise CheckpointError(f"{at}: refusing file name {b['file']!r} from the index")
        name = _block_name(key, b["start"], b["shape"], shape)
        if b.get("name") != name:
            raise CheckpointError(
                f"{at}.name must be {name!r} (the name of that region), got {_show(b.get('name'))}"
            )
        want = _capped_prod(b["shape"], _MAX_ELEMENTS) * itemsize  # inside shape: <= 2**60
        if b["nbytes"] != want:
            raise CheckpointError(
                f"{at}.nbytes must be {want} ({dtype}{_show(b['shape'])}), got {b['nbytes']}"
            )
        crcs, n_crcs = b.get("crc32c"), -(-want // chunk)
        if not (_counts(crcs, n_crcs) and all(c < 1 << 32 for c in crcs)):
            raise CheckpointError(
                f"{at}.crc32c must be {n_crcs} integers in [0, 2**32) (one per {chunk} bytes), "
                f"got {_show(crcs)}"
            )
    _check_tiling(bad, shape, blocks)


def _check_tiling(bad: str, shape: list[int], blocks: list[dict[str, Any]]) -> None:
    """The blocks' regions (inside `shape`) cover the array exactly once."""
    size = _capped_prod(shape, _MAX_ELEMENTS)  # the caller checked: at most 2**60
    covered = sum(_capped_prod(b["shape"], _MAX_ELEMENTS) for b in blocks)
    if covered != size:
        raise CheckpointError(
            f"{bad}: the blocks hold {covered} elements, the array {size}; expected blocks "
            "covering it exactly once"
        )
    full = [i for i, b in enumerate(blocks) if _capped_prod(b["shape"], _MAX_ELEMENTS)]
    if len(full) < 2:  # empty blocks cover nothing
        return
    # With the sizes equal, the tiling is exact when no two regions intersect. A non-empty array
    # has no dimension above its size, 2**60, so int64 holds every start and end.
    lo = np.array([blocks[i]["start"] for i in full], np.int64).reshape(len(full), len(shape))
    hi = lo + np.array([blocks[i]["shape"] for i in full], np.int64).reshape(lo.shape)
    # The blocks save writes are the cells of a grid (the shards of one sharding): along every
    # axis each block spans one interval between consecutive boundaries. Then two blocks
    # intersect exactly when they are the same cell, which sorting finds in n log n.
    cells, grid = [], True
    for d in range(len(shape)):
        bounds = np.unique(np.concatenate([lo[:, d], hi[:, d]]))
        cell = np.searchsorted(bounds, lo[:, d])
        grid = grid and bool(np.all(bounds[np.minimum(cell + 1, len(bounds) - 1)] == hi[:, d]))
        cells.append(cell)
    if grid:
        order = np.lexsort(cells[::-1]) if cells else np.arange(len(full))
        keys = np.stack(cells, 1)[order] if cells else np.zeros((len(full), 0), np.int64)
        same = np.flatnonzero(np.all(keys[1:] == keys[:-1], axis=1))
        if same.size:
            a, b = full[int(order[same[0]])], full[int(order[same[0] + 1])]
            _overlap(bad, blocks, a, b)
        return
    if len(full) > _MAX_PAIRWISE:
        raise CheckpointError(
            f"{bad}: {len(full)} blocks that do not form a grid (regions of one sharding); "
            f"expected a grid, or at most {_MAX_PAIRWISE} blocks"
        )
    for r in range(0, len(full), 256):  # rows of the pairwise test, in bounded memory
        meet = np.all((lo[r : r + 256, None] < hi[None]) & (lo[None] < hi[r : r + 256, None]), -1)
        meet[np.arange(meet.shape[0]), np.arange(r, r + meet.shape[0])] = False
        if meet.any():
            a, b = (full[int(j)] for j in np.argwhere(meet)[0] + (r, 0))
            _overlap(bad, blocks, a, b)


def _overlap(bad: str, blocks: list[dict[str, Any]], a: int, b: int) -> None:
    raise CheckpointError(
        f"{bad}: blocks[{a}] and blocks[{b}] overlap (starts {_show(blocks[a]['start'])} "
        f"and {_show(blocks[b]['start'])}); expected blocks covering the array exactly once"
    )


def _step_value(op: str, step: Any, *, none_ok: bool) -> int | None:
    """`step` as a Python int (numpy integers and 0-d integer arrays accepted); ValueError else."""
    if step is None and none_ok:
        return None
    dtype = getattr(step, "dtype", None)
    integral = isinstance(step, int) and not isinstance(step, bool)
    if not integral and getattr(step, "shape", None) == () and dtype is not None:
        integral = np.issubdtype(dtype, np.integer)  # numpy or jax integer scalars
    if integral and int(step) >= 0:
        return int(step)
    raise InvalidArgumentError(
        f"{op}: step must be a non-negative integer{' or None' if none_ok else ''}, got {step!r}"
    )


def _plain_file_name(name: str) -> bool:
    """A plain ``*.safetensors`` file name: no directory part, nothing that could escape."""
    return bool(_FILE_RE.fullmatch(name)) and ".." not in name


def _safe_file(root: Path, name: Any) -> Path:
    """`root / name` for a plain file name inside `root`; refuses anything that could escape."""
    if not isinstance(name, str) or not _plain_file_name(name):
        raise CheckpointError(f"{root}: refusing file name {name!r} from the index")
    return root / name


def _lookup(index: dict[str, Any], root: Path, key: str) -> dict[str, Any]:
    arrays = index["arrays"]
    if key not in arrays:
        top = key.split("/")[0]
        near = [k for k in arrays if k.split("/")[0] == top][:5] or list(arrays)[:5]
        raise CheckpointError(f"{root}: no array {key!r} in the checkpoint; it has e.g. {near}")
    return arrays[key]
