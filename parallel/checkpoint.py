"""Sharded checkpoints in the safetensors format, with resharding restore, async save and an EMA.

A checkpoint is a directory holding

- ``data-<p>-of-<n>.safetensors``: one file per process ``p`` that owns data (valid safetensors
  files: ``safetensors.safe_open`` reads them), holding the array blocks that process wrote;
- ``index.json``, written last by process 0: for every array its tree key, global shape and
  dtype, and for every stored block the region of the array it covers, its file, byte offset and
  CRC-32C checksums of its 1 MiB chunks; plus the step, the caller's metadata and the format
  version.

Each array block is written once. A block held by devices of one process is written by that
process; a replicated block is written by one of its holders, chosen deterministically so that
the bytes are spread evenly over the processes. No pickle anywhere: loading reads JSON and raw
little-endian bytes and never runs code.

Commit is atomic. Every process writes into ``.<name>.partial`` beside the final directory and
flushes (``fsync``) its file; process 0 waits for all of them (over ``jax.distributed``'s
key-value store), writes the index, flushes it and renames the directory into place. A crash
at any moment leaves either no checkpoint under the name or a complete one; a leftover
``.partial`` directory is never read and the next save of that name removes it.

Restore builds each process's target shards by reading only the byte ranges of stored blocks
that overlap them (rounded out to 1 MiB checksum chunks, every chunk read is verified), so it
reshards freely: another mesh, device count or process count, sharded to replicated and back.

Functions: :func:`save`, :func:`restore`, :func:`describe`, :class:`CheckpointManager` (steps,
retention, async save, host EMA), :func:`export_safetensors` / :func:`import_safetensors`
(Hugging Face layouts, with declarative :class:`Rule` name maps such as :data:`LLAMA_NAME_MAP`).

Example:
  >>> import tempfile, jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from jaxops.parallel import checkpoint
  >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
  >>> w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
  >>> d = tempfile.mkdtemp()
  >>> checkpoint.save(f"{d}/step_1", {"w": w, "step": np.int32(1)}, step=1)
  >>> other = jax.make_mesh((4, 2), ("data", "model"))
  >>> target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
  ...                                     sharding=NamedSharding(other, P(None, "data")))}
  >>> out = checkpoint.restore(f"{d}/step_1", target)
  >>> bool(np.array_equal(out["w"], w)), out["w"].sharding.spec
  (True, P(None, 'data'))
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxops import _jaxops_cpu

__all__ = [
    "LLAMA_NAME_MAP",
    "CheckpointError",
    "CheckpointManager",
    "Rule",
    "describe",
    "export_safetensors",
    "import_safetensors",
    "restore",
    "save",
]

FORMAT = "jaxops.checkpoint"
VERSION = 1
INDEX = "index.json"
CHUNK_BYTES = 1 << 20  # bytes of tensor data per CRC-32C
_WRITE_SLICE = 16 << 20  # bytes per os.write call
_BATCH_BYTES = 512 << 20  # host bytes restored per batch of leaves
_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")

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


# ----------------------------------------------------------------------------------------------
# Tree keys


def _key_part(entry: Any) -> str:
    if isinstance(entry, jax.tree_util.DictKey):
        return str(entry.key)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return str(entry.key)
    return str(entry)


def _flatten(op: str, tree: Any) -> tuple[list[str], list[Any], Any]:
    """Leaves of `tree` with their "/"-joined keys, and the treedef."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys, leaves = [], []
    seen: set[str] = set()
    for path, leaf in with_paths:
        parts = [_key_part(p) for p in path]
        for part in parts:
            if not part or "/" in part:
                raise ValueError(
                    f"{op}: tree key part {part!r} (at {jax.tree_util.keystr(path)}) must be "
                    "non-empty and must not contain '/'"
                )
        key = "/".join(parts) if parts else "value"
        if key in seen:
            raise ValueError(f"{op}: two leaves have the key {key!r}")
        seen.add(key)
        keys.append(key)
        leaves.append(leaf)
    return keys, leaves, treedef


def _prefixed(subtree: str | None, key: str) -> str:
    return f"{subtree.strip('/')}/{key}" if subtree else key


# ----------------------------------------------------------------------------------------------
# Processes: a key-value store over jax.distributed, or nothing for one process.


class _Coordinator:
    """Publishes and collects small strings between the processes of one save.

    Each instance takes the next number of a per-process counter for its keys: every process
    requests its saves in the same order, so the numbers agree.
    """

    _counter = 0
    _lock = threading.Lock()

    def __init__(self, timeout: float):
        self.num_processes = jax.process_count()
        self.process_id = jax.process_index()
        self.timeout_ms = int(timeout * 1000)
        with _Coordinator._lock:
            _Coordinator._counter += 1
            self.prefix = f"jaxops/checkpoint/{_Coordinator._counter}"
        self.client = None
        if self.num_processes > 1:
            from jax._src import distributed  # the coordination service's key-value store

            self.client = distributed.global_state.client
            if self.client is None:
                raise CheckpointError(
                    "checkpoint: jax.process_count() > 1 but jax.distributed is not initialized"
                )

    def publish(self, name: str, value: str) -> None:
        if self.client is not None:
            self.client.key_value_set(f"{self.prefix}/{name}/{self.process_id}", value)

    def collect(self, name: str) -> list[str]:
        """Every process's value of `name` (process 0 only)."""
        return [
            self.client.blocking_key_value_get(f"{self.prefix}/{name}/{p}", self.timeout_ms)
            for p in range(1, self.num_processes)
        ]

    def from_zero(self, name: str) -> str:
        return self.client.blocking_key_value_get(f"{self.prefix}/{name}/0", self.timeout_ms)


# ----------------------------------------------------------------------------------------------
# Which process writes which block


@dataclasses.dataclass(frozen=True)
class _Block:
    """A region of a global array: ``start`` and ``shape`` per dimension."""

    start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def name(self, key: str, global_shape: tuple[int, ...]) -> str:
        if self.shape == global_shape:
            return key
        return (
            key
            + "["
            + ",".join(f"{s}:{s + n}" for s, n in zip(self.start, self.shape, strict=True))
            + "]"
        )


def _as_block(index: tuple[slice, ...], shape: tuple[int, ...]) -> _Block:
    starts, sizes = [], []
    for sl, n in zip(index, shape, strict=True):
        lo, hi, _ = sl.indices(n)
        starts.append(lo)
        sizes.append(max(hi - lo, 0))
    return _Block(tuple(starts), tuple(sizes))


@dataclasses.dataclass
class _Owned:
    """A block this process writes: the array key, the block and where its data comes from."""

    key: str
    block: _Block
    source: Any  # a jax shard's data, a numpy array, or (after the snapshot) host bytes


def _assign(
    metas: list[tuple[tuple[int, ...], int, Any]], process_id: int
) -> list[tuple[int, _Block, Any]]:
    """The blocks this process writes: (leaf number, block, device holding it or None).

    `metas` holds (shape, itemsize, sharding or None for host values) per leaf. Every process
    computes the same assignment: a block held by one process is written by it, a block held by
    several (replicated) goes to the least loaded of them, largest blocks first, so the bytes
    are spread evenly; host values are written by process 0.
    """
    load: dict[int, int] = {}
    mine: list[tuple[int, _Block, Any]] = []
    shared: list[tuple[int, int, _Block, dict[int, Any]]] = []
    for i, (shape, itemsize, sharding) in enumerate(metas):
        if sharding is None:
            block = _Block((0,) * len(shape), shape)
            load[0] = load.get(0, 0) + block.size * itemsize
            if process_id == 0:
                mine.append((i, block, None))
            continue
        holders: dict[_Block, dict[int, Any]] = {}
        for device, index in sharding.devices_indices_map(shape).items():
            block = _as_block(index, shape)
            procs = holders.setdefault(block, {})
            if device.process_index not in procs or device.id < procs[device.process_index].id:
                procs[device.process_index] = device
        for block in sorted(holders, key=lambda b: b.start):
            procs = holders[block]
            if len(procs) == 1:
                ((owner, device),) = procs.items()
                load[owner] = load.get(owner, 0) + block.size * itemsize
                if owner == process_id:
                    mine.append((i, block, device))
            else:
                shared.append((i, block.size * itemsize, block, procs))
    for i, nbytes, block, procs in sorted(shared, key=lambda s: (-s[1], s[0], s[2].start)):
        owner = min(procs, key=lambda p: (load.get(p, 0), p))
        load[owner] = load.get(owner, 0) + nbytes
        if owner == process_id:
            mine.append((i, block, procs[owner]))
    mine.sort(key=lambda m: (m[0], m[1].start))
    return mine


def _meta(leaf: Any) -> tuple[tuple[int, ...], int, Any]:
    sharding = getattr(leaf, "sharding", None)
    return tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, sharding


def _plan(keys: list[str], leaves: list[Any], process_id: int) -> list[_Owned]:
    """The blocks this process writes, with the shard (or host array) holding each."""
    owned = []
    for i, block, device in _assign([_meta(leaf) for leaf in leaves], process_id):
        leaf = leaves[i]
        if device is None:
            owned.append(_Owned(keys[i], block, leaf))
        else:
            shard = next(s for s in leaf.addressable_shards if s.device == device)
            owned.append(_Owned(keys[i], block, shard))
    return owned


def _to_host(owned: list[_Owned], copy: bool) -> list[np.ndarray]:
    """Host copies of the owned blocks (device-to-host copies all started before any is waited).

    With `copy`, blocks that could alias device memory (CPU devices, numpy leaves) are copied,
    several at once: numpy copies release the GIL, so the copy runs on every core.
    """
    for o in owned:
        if isinstance(o.source, jax.Shard):
            o.source.data.copy_to_host_async()

    def host(o: _Owned) -> np.ndarray:
        if isinstance(o.source, jax.Shard):
            data = o.source.data
            # On CPU devices np.asarray may alias the device buffer, which a donating step reuses.
            must_copy = copy and data.devices().pop().platform == "cpu"
            return np.array(data, copy=True) if must_copy else np.asarray(data)
        return np.array(o.source, copy=True) if copy else np.asarray(o.source)

    if not copy or len(owned) < 2:
        return [host(o) for o in owned]
    with cf.ThreadPoolExecutor(min(len(owned), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(host, owned))


# ----------------------------------------------------------------------------------------------
# The safetensors file format: 8-byte little-endian header length, JSON header, raw data.


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


def _crc32c(view: memoryview, chunk: int) -> list[int]:
    """CRC-32C of each `chunk`-byte piece of `view` (native, SSE4.2 where available, no GIL)."""
    return _jaxops_cpu.crc32c_chunks(np.frombuffer(view, np.uint8), chunk)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _byte_view(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _write_safetensors(
    path: Path,
    entries: list[tuple[str, str, tuple[int, ...], int]],
    arrays: Iterable[np.ndarray],
    meta: dict[str, str],
    pool: cf.Executor,
    progress: Callable[[int], None],
) -> list[tuple[int, int, list[int]]]:
    """Writes and fsyncs a safetensors file; returns (offset, nbytes, chunk CRCs) per tensor.

    `entries` are (name, dtype name, shape, nbytes) and `arrays` yields the tensors in the same
    order, so a caller can produce them one at a time. CRCs are computed on `pool` while this
    thread writes, so they cost no time when the disk is the bottleneck.
    """
    header = _header_bytes(entries, meta)
    step = CHUNK_BYTES * max(1, _WRITE_SLICE // CHUNK_BYTES)  # whole chunks per write
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(header))
        offset = len(header)
        placed = []
        for (name, dtype, shape, nbytes), arr in zip(entries, arrays, strict=True):
            if arr.dtype.name != dtype or tuple(arr.shape) != shape:
                raise ValueError(f"{name}: got {arr.dtype.name}{list(arr.shape)}")
            view = _byte_view(arr)
            crcs = []
            for i in range(0, len(view), step):
                piece = view[i : i + step]
                crcs.append(pool.submit(_crc32c, piece, CHUNK_BYTES))
                _write_all(fd, piece)
                progress(len(piece))
            placed.append((offset, nbytes, crcs))
            offset += nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    return [(off, n, [c for f in crcs for c in f.result()]) for off, n, crcs in placed]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _progress_bar(enabled: bool | None, total: int, desc: str):
    """A tqdm bar shown after one second on a terminal (process 0 only), or None."""
    if enabled is False or total <= 0 or jax.process_index() != 0:
        return None
    if enabled is None and not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=1.0, leave=False)


# ----------------------------------------------------------------------------------------------
# Save


@dataclasses.dataclass
class _Snapshot:
    """What one process writes for one save: its blocks on the host and the array metadata."""

    arrays: dict[str, dict[str, Any]]  # key -> {"shape", "dtype"} for every leaf of the tree
    owned: list[_Owned]  # .source are host numpy arrays


def _snapshot(op: str, tree: Any, *, copy: bool, prefix: str | None = None) -> _Snapshot:
    keys, leaves, _ = _flatten(op, tree)
    arrays: dict[str, dict[str, Any]] = {}
    host_leaves = []
    for key, leaf in zip(keys, leaves, strict=True):
        if not isinstance(leaf, jax.Array):
            if not isinstance(leaf, (np.ndarray, np.generic, int, float, bool)):
                raise TypeError(
                    f"{op}: leaf {key!r} must be a jax.Array, numpy array or Python scalar, "
                    f"got {type(leaf).__name__}"
                )
            leaf = np.asarray(leaf)
        host_leaves.append(leaf)
        arrays[_prefixed(prefix, key)] = {
            "shape": list(leaf.shape),
            "dtype": _dtype_name(op, f"leaf {key!r}", leaf.dtype),
        }
    owned = _plan(keys, host_leaves, jax.process_index())
    for o, data in zip(owned, _to_host(owned, copy), strict=True):
        o.source = data
        o.key = _prefixed(prefix, o.key)
    return _Snapshot(arrays, owned)


def _data_file(process_id: int, num_processes: int) -> str:
    return f"data-{process_id:05d}-of-{num_processes:05d}.safetensors"


def _write_checkpoint(
    path: Path,
    snap: _Snapshot,
    *,
    step: int | None,
    metadata: Mapping[str, Any] | None,
    progress: bool | None,
    coord: _Coordinator,
) -> None:
    """Writes `snap` (every process its own) and commits the directory atomically.

    `coord` is created in the calling thread when the save is requested, so that saves get the
    same coordination keys on every process even when some are written in the background.
    """
    pid, nproc = coord.process_id, coord.num_processes
    tmp = path.parent / f".{path.name}.partial"

    # 1. Process 0 checks the name and prepares an empty temporary directory.
    if pid == 0:
        try:
            if path.exists():
                raise FileExistsError(f"checkpoint.save: {path} already exists")
            path.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except Exception as e:
            coord.publish("ready", f"!{type(e).__name__}: {e}")
            raise
        coord.publish("ready", "ok")
    else:
        status = coord.from_zero("ready")
        if status != "ok":
            raise CheckpointError(f"checkpoint.save: process 0 could not start: {status[1:]}")

    # 2. Every process writes and flushes its own file, then reports its blocks.
    fragment: dict[str, list[dict[str, Any]]] = {}
    try:
        if snap.owned:
            fname = _data_file(pid, nproc)
            tensors = [
                (o.block.name(o.key, tuple(snap.arrays[o.key]["shape"])), o.source)
                for o in snap.owned
            ]
            total = sum(a.nbytes for _, a in tensors)
            bar = _progress_bar(progress, total, f"save {path.name}")
            workers = max(1, min(4, (os.cpu_count() or 2) - 1))
            entries = [(n, a.dtype.name, tuple(a.shape), a.nbytes) for n, a in tensors]
            with cf.ThreadPoolExecutor(workers) as pool:
                placed = _write_safetensors(
                    tmp / fname,
                    entries,
                    (a for _, a in tensors),
                    {"format": FORMAT},
                    pool,
                    bar.update if bar is not None else (lambda n: None),
                )
            if bar is not None:
                bar.close()
            for o, (name, _), (offset, nbytes, crcs) in zip(
                snap.owned, tensors, placed, strict=True
            ):
                fragment.setdefault(o.key, []).append(
                    {
                        "start": list(o.block.start),
                        "shape": list(o.block.shape),
                        "file": fname,
                        "name": name,
                        "offset": offset,
                        "nbytes": nbytes,
                        "crc32c": crcs,
                    }
                )
    except Exception as e:
        coord.publish("written", f"!process {pid}: {type(e).__name__}: {e}")
        if pid == 0:
            _abort(coord, tmp, f"process 0: {type(e).__name__}: {e}")
        raise
    coord.publish("written", json.dumps(fragment))

    # 3. Process 0 collects every process's blocks, writes the index last and commits.
    if pid != 0:
        status = coord.from_zero("committed")
        if status != "ok":
            raise CheckpointError(f"checkpoint.save: {path} was not committed: {status[1:]}")
        return
    try:
        for text in coord.collect("written"):
            if text.startswith("!"):
                raise CheckpointError(f"checkpoint.save: {text[1:]}")
            for key, blocks in json.loads(text).items():
                fragment.setdefault(key, []).extend(blocks)
        index = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "metadata": dict(metadata or {}),
            "num_processes": nproc,
            "checksum": "crc32c",
            "chunk_bytes": CHUNK_BYTES,
            "created": time.time(),
            "arrays": {
                key: {**info, "blocks": sorted(fragment.get(key, []), key=lambda b: b["start"])}
                for key, info in snap.arrays.items()
            },
        }
        for key, info in index["arrays"].items():  # every element stored exactly once
            stored = sum(math.prod(b["shape"]) for b in info["blocks"])
            if stored != math.prod(info["shape"]):
                raise CheckpointError(
                    f"checkpoint.save: blocks of {key!r} cover {stored} of "
                    f"{math.prod(info['shape'])} elements"
                )
        data = json.dumps(index, indent=1).encode()
        fd = os.open(tmp / INDEX, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(tmp)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        _abort(coord, tmp, f"{type(e).__name__}: {e}")
        raise
    coord.publish("committed", "ok")


def _abort(coord: _Coordinator, tmp: Path, why: str) -> None:
    coord.publish("committed", f"!{why}")
    shutil.rmtree(tmp, ignore_errors=True)


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    timeout: float = 600.0,
) -> None:
    """Saves a tree of (sharded) arrays as a checkpoint directory, atomically.

    Every process calls it with the same tree (same structure, shapes, dtypes and shardings);
    each writes the blocks it owns. It returns when the checkpoint is committed.

    Args:
      path: the checkpoint directory to create; it must not exist. Its parent is created.
      tree: a pytree whose leaves are ``jax.Array`` (any sharding, also spanning processes),
        numpy arrays or Python scalars (those are written by process 0). Dtypes: bool, int8-64,
        uint8-64, float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2. Tree keys
        are joined with "/" (``{"a": [x, y]}`` stores ``a/0`` and ``a/1``).
      step: an integer stored in the index.
      metadata: a JSON-serializable mapping stored in the index (see :func:`describe`).
      progress: a tqdm progress bar for saves longer than a second; ``None`` shows it only when
        stderr is a terminal.
      timeout: seconds a process waits for the others before failing.

    Raises:
      FileExistsError: `path` exists.
      TypeError: a leaf has an unsupported type or dtype.
      ValueError: two leaves map to the same key, or a key contains "/".
      CheckpointError: another process failed; nothing was committed.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from jaxops.parallel import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> checkpoint.save(f"{d}/ckpt", {"w": jnp.ones((2, 3), jnp.bfloat16)}, step=7)
      >>> checkpoint.describe(f"{d}/ckpt")["arrays"]
      {'w': {'shape': (2, 3), 'dtype': 'bfloat16'}}
    """
    if metadata is not None:
        json.dumps(dict(metadata))  # raises TypeError early for non-JSON metadata
    snap = _snapshot("checkpoint.save", tree, copy=False)
    coord = _Coordinator(timeout)
    _write_checkpoint(
        Path(path), snap, step=step, metadata=metadata, progress=progress, coord=coord
    )


# ----------------------------------------------------------------------------------------------
# Restore


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


class _Reader:
    """Reads verified byte ranges of stored blocks; one per restore, with cached file handles."""

    def __init__(self, root: Path, index: dict[str, Any]):
        self.root = root
        self.chunk = int(index.get("chunk_bytes", CHUNK_BYTES))
        self.fds: dict[str, int] = {}
        self.headers: dict[str, tuple[dict[str, Any], int]] = {}  # file -> (header, data start)
        self.lock = threading.Lock()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def _fd(self, name: str) -> int:
        with self.lock:
            if name not in self.fds:
                self.fds[name] = os.open(_safe_file(self.root, name), os.O_RDONLY)
            return self.fds[name]

    def check_header(self, key: str, block: dict[str, Any], dtype: str) -> None:
        """The file's own header agrees with the index about this block."""
        with self.lock:
            cached = self.headers.get(block["file"])
        if cached is None:  # each file's header is read and parsed once per restore
            cached = _read_header(_safe_file(self.root, block["file"]))
            with self.lock:
                self.headers[block["file"]] = cached
        header, data_start = cached
        entry = header.get(block["name"])
        expect = {
            "dtype": _ST_CODES[dtype],
            "shape": list(block["shape"]),
            "data_offsets": [
                block["offset"] - data_start,
                block["offset"] + block["nbytes"] - data_start,
            ],
        }
        if entry != expect:
            raise CheckpointError(
                f"{self.root}: {block['file']} stores {block['name']!r} as {entry}, "
                f"the index says {expect} (array {key!r})"
            )

    def read(self, buf: memoryview, block: dict[str, Any], lo: int) -> None:
        """Reads bytes [lo, lo + len(buf)) of a stored block into `buf`."""
        fd = self._fd(block["file"])
        pos = block["offset"] + lo
        view = buf
        while view:
            n = os.preadv(fd, [view], pos)
            if n == 0:
                raise CheckpointError(
                    f"{self.root}: {block['file']} is truncated ({block['name']!r})"
                )
            view = view[n:]
            pos += n

    def verify(self, buf: memoryview, block: dict[str, Any], lo: int) -> None:
        """Checks the CRCs of the chunks in `buf`: bytes [lo, lo + len(buf)), lo chunk aligned."""
        first = lo // self.chunk
        got = _crc32c(buf, self.chunk)
        want = block["crc32c"][first : first + len(got)]
        if got != want:
            c = first + next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
            raise CheckpointError(
                f"{self.root}: checksum mismatch in {block['file']} ({block['name']!r}, "
                f"bytes {c * self.chunk}..{min((c + 1) * self.chunk, block['nbytes'])}): "
                "the checkpoint is corrupt"
            )


_SEGMENT_BYTES = 8 << 20  # bytes of a stored block read, verified and scattered as one piece
_READ_BUFFERS = 6  # reusable segment buffers in flight


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """np.empty, 64-byte aligned: jax.device_put on CPU then adopts the buffer without a copy."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass
class _Region:
    """A region of an array this process needs, and how many of its elements were filled."""

    start: tuple[int, ...]
    dest: np.ndarray
    filled: int = 0


@dataclasses.dataclass
class _Segment:
    """Rows [r0, r1) (first dim) of a stored block and the region boxes that lie in them.

    ``boxes`` holds (region, lo, hi): the box in block coordinates, rows clipped to the segment.
    ``lo``/``hi`` are the byte range of the block to read (chunk aligned, spanning every chunk
    the boxes touch) and ``span`` the byte range the buffer covers (also the whole rows).
    """

    key: str
    block: dict[str, Any]
    r0: int
    r1: int
    boxes: list[tuple[_Region, list[int], list[int]]]
    reads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    span: tuple[int, int] = (0, 0)


def _box_runs(shape: tuple[int, ...], lo: list[int], hi: list[int], itemsize: int):
    """Byte offsets of the contiguous runs of box [lo, hi) in a row-major block, and run length."""
    # The box is contiguous along the trailing dims it covers fully; k is the first dim (from the
    # end) it does not, so each run spans (hi[k] - lo[k]) * prod(shape[k+1:]) elements.
    k = len(shape) - 1
    while k > 0 and lo[k] == 0 and hi[k] == shape[k]:
        k -= 1
    run = (hi[k] - lo[k]) * math.prod(shape[k + 1 :]) * itemsize
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    grids = np.meshgrid(*[np.arange(lo[d], hi[d]) for d in range(k)], indexing="ij")
    starts = lo[k] * strides[k] + sum(
        (g.reshape(-1).astype(np.int64) * strides[d] for d, g in enumerate(grids)),
        start=np.zeros(1, np.int64),
    )
    return starts, run


def _segments(key: str, info: dict[str, Any], regions: list[_Region], chunk: int):
    """The segments of the stored blocks of one array that overlap `regions`."""
    itemsize = _np_dtype(info["dtype"]).itemsize
    out = []
    for block in info["blocks"]:
        bstart, bshape = tuple(block["start"]), tuple(block["shape"])
        boxes = []
        for region in regions:
            if region.dest.size == 0:
                continue
            shape = region.dest.shape
            lo = [max(a, b) - b for a, b in zip(region.start, bstart, strict=True)]
            hi = [
                min(a + n, b + m) - b
                for a, n, b, m in zip(region.start, shape, bstart, bshape, strict=True)
            ]
            if all(h > low for low, h in zip(lo, hi, strict=True)):
                boxes.append((region, lo or [0], hi or [1]))  # a scalar: a block of one element
        if not boxes:
            continue
        shape = bshape or (1,)
        row = math.prod(shape[1:]) * itemsize
        per = max(1, _SEGMENT_BYTES // max(row, 1))
        first = min(lo[0] for _, lo, _ in boxes)
        last = max(hi[0] for _, _, hi in boxes)
        for r0 in range(first, last, per):
            r1 = min(r0 + per, last)
            clipped = [
                (region, [max(lo[0], r0), *lo[1:]], [min(hi[0], r1), *hi[1:]])
                for region, lo, hi in boxes
                if lo[0] < r1 and hi[0] > r0
            ]
            if not clipped:
                continue
            seg = _Segment(key, block, r0, r1, clipped)
            # The chunks holding bytes of any box, merged into contiguous reads.
            c0, c1 = r0 * row // chunk, -(-r1 * row // chunk)
            need = np.zeros(c1 - c0 + 1, np.int64)
            for _, lo, hi in clipped:
                starts, run = _box_runs(shape, lo, hi, itemsize)
                np.add.at(need, starts // chunk - c0, 1)
                np.add.at(need, (starts + run - 1) // chunk + 1 - c0, -1)
            wanted = np.cumsum(need)[:-1] > 0
            edges = np.flatnonzero(np.diff(np.concatenate([[0], wanted.astype(np.int8), [0]])))
            seg.reads = [
                ((c0 + int(a)) * chunk, min((c0 + int(b)) * chunk, block["nbytes"]))
                for a, b in zip(edges[::2], edges[1::2], strict=True)
            ]
            seg.span = (
                min(seg.reads[0][0], r0 * row),
                max(seg.reads[-1][1], r1 * row),
            )
            out.append(seg)
    return out


def _scatter(reader: _Reader, seg: _Segment, buf: np.ndarray, dtype: np.dtype) -> None:
    """Verifies the chunks read for `seg` and copies its boxes into their regions."""
    base = seg.span[0]
    view = memoryview(buf)
    for a, b in seg.reads:
        reader.verify(view[a - base : b - base], seg.block, a)
    shape = tuple(seg.block["shape"]) or (1,)
    row = math.prod(shape[1:]) * dtype.itemsize
    rows = buf[seg.r0 * row - base : seg.r1 * row - base].view(dtype)
    rows = rows.reshape((seg.r1 - seg.r0, *shape[1:]))
    bstart = seg.block["start"]
    for region, lo, hi in seg.boxes:
        src = rows[(slice(lo[0] - seg.r0, hi[0] - seg.r0), *map(slice, lo[1:], hi[1:]))]
        if region.dest.ndim == 0:
            region.dest[()] = src.reshape(())
        else:
            at = tuple(
                slice(b + low - s, b + h - s)
                for low, h, b, s in zip(lo, hi, bstart, region.start, strict=True)
            )
            region.dest[at] = src
        with reader.lock:
            region.filled += src.size


def _run_segments(
    reader: _Reader,
    segments: list[tuple[_Segment, np.dtype]],
    pool: cf.Executor | None,
    progress: Callable[[int], None],
) -> None:
    """Reads the segments in file order on this thread; `pool` verifies and scatters them.

    One sequential stream of reads keeps the disk busy (concurrent reads were slower here), and
    reusable buffers avoid fresh page faults for every piece.
    """
    segments = sorted(segments, key=lambda s: (s[0].block["file"], s[0].block["offset"], s[0].r0))
    cap = _SEGMENT_BYTES + 2 * reader.chunk
    free: list[np.ndarray] = []
    slots = threading.Semaphore(_READ_BUFFERS)
    futures = []

    def work(seg: _Segment, buf: np.ndarray, dtype: np.dtype, raw: np.ndarray | None) -> None:
        try:
            _scatter(reader, seg, buf, dtype)
        finally:
            if raw is not None:
                with reader.lock:
                    free.append(raw)
                slots.release()

    for seg, dtype in segments:
        size = seg.span[1] - seg.span[0]
        raw = None
        if pool is not None and size <= cap:
            slots.acquire()
            with reader.lock:
                raw = free.pop() if free else np.empty(cap, np.uint8)
            buf = raw[:size]
        else:
            buf = np.empty(size, np.uint8)
        try:
            view = memoryview(buf)
            for a, b in seg.reads:
                reader.read(view[a - seg.span[0] : b - seg.span[0]], seg.block, a)
        except BaseException:
            if raw is not None:
                with reader.lock:
                    free.append(raw)
                slots.release()
            for f in futures:  # let the workers finish before the caller closes the files
                f.exception()
            raise
        progress(sum(b - a for a, b in seg.reads))
        if pool is None:
            _scatter(reader, seg, buf, dtype)
        else:
            futures.append(pool.submit(work, seg, buf, dtype, raw))
    for f in futures:
        f.result()


def _check_filled(root: Path, key: str, regions: list[_Region]) -> None:
    for r in regions:
        if r.filled != r.dest.size:
            raise CheckpointError(
                f"{root}: the stored blocks of {key!r} cover {r.filled} of the {r.dest.size} "
                f"elements of region start={list(r.start)} shape={list(r.dest.shape)}"
            )


def _read_region(
    reader: _Reader, key: str, info: dict[str, Any], start: tuple[int, ...], shape: tuple[int, ...]
) -> np.ndarray:
    """The region [start, start + shape) of a stored array, from every block overlapping it."""
    dtype = _np_dtype(info["dtype"])
    region = _Region(start, _aligned_empty(shape, dtype))
    for block in info["blocks"]:
        reader.check_header(key, block, info["dtype"])
    segs = _segments(key, info, [region], reader.chunk)
    _run_segments(reader, [(s, dtype) for s in segs], None, lambda n: None)
    _check_filled(reader.root, key, [region])
    return region.dest


def _lookup(index: dict[str, Any], root: Path, key: str) -> dict[str, Any]:
    arrays = index["arrays"]
    if key not in arrays:
        top = key.split("/")[0]
        near = [k for k in arrays if k.split("/")[0] == top][:5] or list(arrays)[:5]
        raise CheckpointError(f"{root}: no array {key!r} in the checkpoint; it has e.g. {near}")
    return arrays[key]


def _target_of(op: str, key: str, leaf: Any) -> tuple[tuple[int, ...], np.dtype, Any]:
    """(shape, dtype, sharding or None for a numpy result) of a restore target leaf."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = leaf.sharding
        if sharding is None:
            if jax.process_count() > 1:
                raise ValueError(
                    f"{op}: target {key!r} has no sharding; with several processes every "
                    "target needs one"
                )
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return tuple(leaf.shape), np.dtype(leaf.dtype), sharding
    if isinstance(leaf, (np.ndarray, np.generic)):
        return tuple(leaf.shape), leaf.dtype, None
    raise TypeError(
        f"{op}: target leaf {key!r} must be a jax.ShapeDtypeStruct, jax.Array or numpy array, "
        f"got {type(leaf).__name__}"
    )


def _restore_leaves(
    op: str,
    root: Path,
    index: dict[str, Any],
    keys: list[str],
    targets: list[tuple[tuple[int, ...], np.dtype, Any]],
    progress: bool | None,
) -> list[Any]:
    infos = []
    for key, (shape, dtype, _) in zip(keys, targets, strict=True):
        info = _lookup(index, root, key)
        if tuple(info["shape"]) != shape or info["dtype"] != dtype.name:
            raise CheckpointError(
                f"{op}: {key!r} is stored as {info['dtype']}{list(info['shape'])}, the target "
                f"is {dtype.name}{list(shape)}"
            )
        infos.append(info)

    # Unique regions this process needs, per leaf, and the devices that want each.
    jobs: list[list[tuple[_Block, list[Any]]]] = []
    for shape, _, sharding in targets:
        if sharding is None:
            jobs.append([(_Block((0,) * len(shape), shape), [None])])
            continue
        regions: dict[_Block, list[Any]] = {}
        for device, idx in sharding.addressable_devices_indices_map(shape).items():
            regions.setdefault(_as_block(idx, shape), []).append(device)
        jobs.append(list(regions.items()))
    total = sum(
        b.size * t[1].itemsize for t, job in zip(targets, jobs, strict=True) for b, _ in job
    )
    bar = _progress_bar(progress, total, f"restore {root.name}")
    reader = _Reader(root, index)
    out: list[Any] = []
    workers = max(1, min(4, (os.cpu_count() or 2)))
    try:
        with cf.ThreadPoolExecutor(workers) as pool:
            i = 0
            while i < len(keys):  # batches of leaves, so host memory stays bounded
                j, size = i, 0
                while j < len(keys) and (j == i or size < _BATCH_BYTES):
                    size += sum(b.size * targets[j][1].itemsize for b, _ in jobs[j])
                    j += 1
                batch: list[list[_Region]] = []
                segments: list[tuple[_Segment, np.dtype]] = []
                for n in range(i, j):
                    dtype = targets[n][1]
                    regions_n = [
                        _Region(b.start, _aligned_empty(b.shape, dtype)) for b, _ in jobs[n]
                    ]
                    batch.append(regions_n)
                    for block in infos[n]["blocks"]:
                        reader.check_header(keys[n], block, infos[n]["dtype"])
                    segs = _segments(keys[n], infos[n], regions_n, reader.chunk)
                    segments.extend((seg, dtype) for seg in segs)
                _run_segments(
                    reader, segments, pool, bar.update if bar is not None else (lambda n: None)
                )
                for n, regions_n in zip(range(i, j), batch, strict=True):
                    _check_filled(root, keys[n], regions_n)
                    shape, _, sharding = targets[n]
                    if sharding is None:
                        out.append(regions_n[0].dest)
                        continue
                    arrays = [
                        jax.device_put(r.dest, d)
                        for r, (_, devs) in zip(regions_n, jobs[n], strict=True)
                        for d in devs
                    ]
                    out.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
                i = j
    finally:
        reader.close()
        if bar is not None:
            bar.close()
    return out


def restore(
    path: str | os.PathLike,
    target: Any = None,
    *,
    subtree: str | None = None,
    progress: bool | None = None,
) -> Any:
    """Restores a checkpoint into the shardings of `target`, reading only what is needed.

    Each process reads the byte ranges of the stored blocks that overlap its addressable shards
    of each target (every chunk read is checksum-verified), so the target may use another mesh,
    device count, process count or sharding than the save did.

    Args:
      path: a checkpoint directory written by :func:`save`.
      target: a pytree whose leaves are ``jax.ShapeDtypeStruct`` with a sharding (or no sharding
        in a single process: device 0), ``jax.Array`` (its shape, dtype and sharding are used,
        its values are not) or numpy arrays (restored as numpy arrays, read whole). Its keys
        name the stored arrays. ``None`` restores every array as numpy, as nested dicts.
      subtree: a "/"-separated key prefix: restore the stored arrays under it (for example
        ``"params"`` with a target shaped like the params subtree only).
      progress: a tqdm progress bar for restores longer than a second; ``None`` shows it only
        when stderr is a terminal.

    Returns:
      A tree like `target` of ``jax.Array`` (numpy arrays for numpy targets).

    Raises:
      CheckpointError: the directory is not a committed checkpoint, a key is missing, a shape or
        dtype differs from the target, or the data is corrupt (checksum mismatch, truncated file,
        index and file headers disagree).

    Example:
      >>> import tempfile, jax, jax.numpy as jnp
      >>> from jaxops.parallel import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> checkpoint.save(f"{d}/c", {"params": {"w": jnp.arange(4.0)}, "opt": jnp.zeros(2)})
      >>> checkpoint.restore(f"{d}/c", {"w": jax.ShapeDtypeStruct((4,), jnp.float32)},
      ...                    subtree="params")["w"]
      Array([0., 1., 2., 3.], dtype=float32)
    """
    op = "checkpoint.restore"
    root = Path(path)
    index = _load_index(root)
    if target is None:
        prefix = f"{subtree.strip('/')}/" if subtree else ""
        keys = [k for k in index["arrays"] if k.startswith(prefix)]
        if not keys:
            raise CheckpointError(f"{root}: no arrays under {subtree!r}")
        info = index["arrays"]
        targets = [(tuple(info[k]["shape"]), _np_dtype(info[k]["dtype"]), None) for k in keys]
        values = _restore_leaves(op, root, index, keys, targets, progress)
        nested: dict[str, Any] = {}
        for key, value in zip(keys, values, strict=True):
            *parents, last = key[len(prefix) :].split("/")
            node = nested
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        return nested
    keys, leaves, treedef = _flatten(op, target)
    targets = [_target_of(op, k, leaf) for k, leaf in zip(keys, leaves, strict=True)]
    full = [_prefixed(subtree, k) for k in keys]
    values = _restore_leaves(op, root, index, full, targets, progress)
    return jax.tree_util.tree_unflatten(treedef, values)


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """The step, metadata and arrays (shape, dtype) of a checkpoint, from its index.

    Example:
      >>> import tempfile, numpy as np
      >>> from jaxops.parallel import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> checkpoint.save(f"{d}/c", {"x": np.zeros(3, np.int8)}, step=3, metadata={"lr": 0.1})
      >>> info = checkpoint.describe(f"{d}/c")
      >>> info["step"], info["metadata"], info["arrays"]["x"]
      (3, {'lr': 0.1}, {'shape': (3,), 'dtype': 'int8'})
    """
    index = _load_index(Path(path))
    return {
        "step": index["step"],
        "metadata": index["metadata"],
        "num_processes": index["num_processes"],
        "arrays": {
            k: {"shape": tuple(v["shape"]), "dtype": v["dtype"]} for k, v in index["arrays"].items()
        },
    }


# ----------------------------------------------------------------------------------------------
# CheckpointManager


class CheckpointManager:
    """Numbered checkpoints in one directory: async saves, retention and a host-side EMA.

    Step ``s`` lives in ``directory/<s>`` (a :func:`save` checkpoint). Every process creates
    the manager and calls :meth:`save` with the same steps and trees.

    - ``async_save=True``: :meth:`save` returns once this process's own shards are copied to
      host memory; writing and committing run in a background thread. The next :meth:`save`
      waits for the previous one. A failed background save raises on the next call of
      :meth:`save`, :meth:`wait`, :meth:`restore`, :meth:`all_steps` or :meth:`latest_step`.
      The snapshot is a copy, so the caller may donate or overwrite the arrays right away.
    - Retention after each commit: the newest ``max_to_keep`` steps are kept, and every step
      that is a multiple of ``keep_every``; the others are removed (``None``: keep all).
    - ``ema_decay``: the manager keeps an exponential moving average of the saved floating-point
      leaves (those under ``ema_subtree`` when given) on the host, in float32, updated from each
      snapshot in the background: ``ema = decay * ema + (1 - decay) * value``, starting from the
      first snapshot. It costs no device memory: each process averages only the blocks it
      writes. It is saved in the same checkpoint under the ``"ema"`` key prefix; read it with
      ``restore(step, target, ema=True)``. :meth:`restore` of a step that holds an EMA also
      reloads it, so the average continues across restarts.

    Args:
      directory: where the step directories live (created by process 0).
      max_to_keep: how many of the newest steps to keep, or None for all.
      keep_every: also keep every step divisible by this, or None.
      async_save: write in a background thread (see above).
      ema_decay: the EMA decay in [0, 1), or None for no EMA.
      ema_subtree: a "/"-separated key prefix: average only the leaves under it.
      progress: tqdm progress bars (None: only on a terminal).
      timeout: seconds a process waits for the others during a save.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp
      >>> from jaxops.parallel.checkpoint import CheckpointManager
      >>> mgr = CheckpointManager(tempfile.mkdtemp(), max_to_keep=2, ema_decay=0.5)
      >>> for step in range(3):
      ...     mgr.save(step, {"w": jnp.full((4,), float(step))})
      >>> mgr.wait(); mgr.all_steps()
      [1, 2]
      >>> target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
      >>> mgr.restore(2, target)["w"], mgr.restore(2, target, ema=True)["w"]
      (Array([2., 2., 2., 2.], dtype=float32), Array([1.25, 1.25, 1.25, 1.25], dtype=float32))
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        ema_decay: float | None = None,
        ema_subtree: str | None = None,
        progress: bool | None = None,
        timeout: float = 600.0,
    ):
        op = "CheckpointManager"
        for name, value in (("max_to_keep", max_to_keep), ("keep_every", keep_every)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{op}: {name} must be None or an int >= 1, got {value!r}")
        if ema_decay is not None and not (
            isinstance(ema_decay, (int, float)) and 0.0 <= float(ema_decay) < 1.0
        ):
            raise ValueError(
                f"{op}: ema_decay must be None or a float in [0, 1), got {ema_decay!r}"
            )
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.keep_every = keep_every
        self.async_save = bool(async_save)
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.ema_subtree = ema_subtree.strip("/") if ema_subtree else None
        self.progress = progress
        self.timeout = timeout
        self._ema: dict[tuple[str, tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="jaxops-checkpoint")
        self._pending: cf.Future | None = None
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for leftover in self.directory.glob(".*.partial"):  # from a crashed save
                shutil.rmtree(leftover, ignore_errors=True)
            for leftover in self.directory.glob(".*.deleting"):
                shutil.rmtree(leftover, ignore_errors=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Waits for a pending save (raising its error) and stops the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def step_path(self, step: int) -> Path:
        """The directory of `step`."""
        return self.directory / str(step)

    def wait(self) -> None:
        """Blocks until the pending save is committed; raises the error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _raise_failed(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def all_steps(self) -> list[int]:
        """The committed steps, ascending."""
        self._raise_failed()
        if not self.directory.is_dir():
            return []
        return sorted(
            int(p.name)
            for p in self.directory.iterdir()
            if p.name.isdigit() and (p / INDEX).is_file()
        )

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, tree: Any, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Saves `tree` as `step` (asynchronously with ``async_save``).

        Args:
          step: a non-negative int, not saved before.
          tree: as for :func:`save`.
          metadata: JSON-serializable, stored in the index.
        """
        op = "CheckpointManager.save"
        self.wait()
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"{op}: step must be a non-negative int, got {step!r}")
        step = int(step)
        if self.step_path(step).exists():
            raise FileExistsError(f"{op}: step {step} exists in {self.directory}")
        if metadata is not None:
            json.dumps(dict(metadata))
        if self.ema_decay is not None and any(
            k == "ema" or k.startswith("ema/") for k in _flatten(op, tree)[0]
        ):
            raise ValueError(f"{op}: with ema_decay the tree must not have a top-level 'ema' key")
        snap = _snapshot(op, tree, copy=self.async_save)
        coord = _Coordinator(self.timeout)
        if self.async_save:
            self._pending = self._executor.submit(self._write, step, snap, metadata, coord)
        else:
            self._write(step, snap, metadata, coord)

    def _ema_key(self, key: str) -> bool:
        sub = self.ema_subtree
        return sub is None or key == sub or key.startswith(sub + "/")

    def _write(
        self,
        step: int,
        snap: _Snapshot,
        metadata: Mapping[str, Any] | None,
        coord: _Coordinator,
    ) -> None:
        if self.ema_decay is not None:
            self._update_ema(snap)
        _write_checkpoint(
            self.step_path(step),
            snap,
            step=step,
            metadata=metadata,
            progress=self.progress,
            coord=coord,
        )
        if jax.process_index() == 0:
            self._prune()

    def _update_ema(self, snap: _Snapshot) -> None:
        """Folds the snapshot into the host EMA and adds the EMA's blocks to the snapshot."""
        decay = self.ema_decay
        for key, info in list(snap.arrays.items()):
            if self._ema_key(key) and _is_float(_np_dtype(info["dtype"])):
                snap.arrays["ema/" + key] = {"shape": info["shape"], "dtype": "float32"}
        extra = []
        for o in snap.owned:
            if "ema/" + o.key not in snap.arrays:
                continue
            tag = (o.key, o.block.start, o.block.shape)
            value = o.source.astype(np.float32)  # a fresh array (astype copies)
            ema = self._ema.get(tag)
            if ema is None:
                ema = self._ema[tag] = value
            else:
                ema *= decay
                ema += (1.0 - decay) * value
            extra.append(_Owned("ema/" + o.key, o.block, ema))
        snap.owned.extend(extra)

    def _prune(self) -> None:
        steps = self.all_steps()
        keep = set(steps if self.max_to_keep is None else steps[-self.max_to_keep :])
        if self.keep_every is not None:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                doomed = self.directory / f".{s}.deleting"
                os.rename(self.step_path(s), doomed)  # gone from all_steps at once
                shutil.rmtree(doomed, ignore_errors=True)

    def restore(
        self, step: int | None, target: Any, *, ema: bool = False, subtree: str | None = None
    ) -> Any:
        """Restores `step` (None: the latest) into `target`; see :func:`restore`.

        Args:
          step: the step, or None for the latest.
          target: as for :func:`restore`.
          ema: restore the EMA of the target's leaves instead, cast to the target's dtypes
            (leaves without an EMA, such as integers, get their saved values).
          subtree: as for :func:`restore`.
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"CheckpointManager.restore: no checkpoint in {self.directory}"
                )
        path = self.step_path(step)
        if ema:
            return self._restore_ema(path, target, subtree)
        out = restore(path, target, subtree=subtree, progress=self.progress)
        if self.ema_decay is not None:
            self._reload_ema(path, subtree, target)
        return out

    def _restore_ema(self, path: Path, target: Any, subtree: str | None) -> Any:
        """The EMA of each target leaf that has one (cast to its dtype), else its saved value."""
        op = "CheckpointManager.restore"
        index = _load_index(path)
        keys, leaves, treedef = _flatten(op, target)
        full, targets = [], []
        for key, leaf in zip(keys, leaves, strict=True):
            shape, dtype, sharding = _target_of(op, key, leaf)
            stored = _prefixed(subtree, key)
            if "ema/" + stored in index["arrays"]:
                full.append("ema/" + stored)
                targets.append((shape, np.dtype(np.float32), sharding))
            else:
                full.append(stored)
                targets.append((shape, dtype, sharding))
        values = _restore_leaves(op, path, index, full, targets, self.progress)
        values = [
            v.astype(_target_of(op, k, leaf)[1]) if k.startswith("ema/") else v
            for v, k, leaf in zip(values, full, leaves, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, values)

    def _reload_ema(self, path: Path, subtree: str | None, target: Any) -> None:
        """Loads the EMA blocks this process will write, as the saved sharding assigns them."""
        index = _load_index(path)
        keys, leaves, _ = _flatten("CheckpointManager.restore", target)
        keys = [_prefixed(subtree, k) for k in keys]
        if not any("ema/" + k in index["arrays"] for k in keys):
            return
        reader = _Reader(path, index)
        try:
            for i, block, _ in _assign([_meta(leaf) for leaf in leaves], jax.process_index()):
                info = index["arrays"].get("ema/" + keys[i])
                if info is not None:
                    self._ema[(keys[i], block.start, block.shape)] = _read_region(
                        reader, "ema/" + keys[i], info, block.start, block.shape
                    )
        finally:
            reader.close()


# ----------------------------------------------------------------------------------------------
# Hugging Face safetensors layouts


_PLACEHOLDER = re.compile(r"\{(\w+)(?::([^{}]+))?\}")


def _template_regex(template: str, sep: str) -> re.Pattern[str]:
    parts, pos = [], 0
    for m in _PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[pos : m.start()]))
        parts.append(f"(?P<{m.group(1)}>{m.group(2) or f'[^{re.escape(sep)}]+'})")
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("".join(parts))


def _fill_template(template: str, groups: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: groups[m.group(1)], template)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One line of a declarative name map between our tree keys and Hugging Face tensor names.

    Templates hold literal text and ``{name}`` placeholders (matching a run of characters
    without "/" in our keys and without "." in their names; ``{name:regex}`` gives the regex).
    Both directions use the same rule:

    - export: our array (key matching ``ours``) is transposed by ``transpose``, split along
      ``axis`` into one part per ``theirs`` template (equal parts, or ``sizes``) and cast to
      ``dtype``;
    - import: their tensors are concatenated along ``axis``, transposed back and cast to the
      target's dtype.

    ``theirs=()`` drops the array on export (and nothing imports it).

    Stacking (``stack``): placeholders of ``theirs`` that ``ours`` lacks, enumerated by our
    array's leading axes. A Mixture-of-Experts model keeps one HF tensor per layer and expert but
    one array ``[L, E, ...]`` per weight: ``stack=("i", "e")`` maps element ``[i, e]`` (our array
    with the stacked axes indexed away) to the names with ``{i}`` and ``{e}`` filled in decimal.
    ``transpose``, ``axis`` and ``sizes`` then apply to each element. Import takes the stacked
    sizes from the target's shape and reads, per process, only the elements its shards hold.

    Attributes:
      ours: template of our "/"-separated tree key, e.g. ``"layers/{i}/attn/qkv/kernel"``.
      theirs: one template or several (a fused weight), e.g.
        ``"model.layers.{i}.self_attn.q_proj.weight"``.
      transpose: the axis permutation from our layout to theirs, e.g. ``(1, 0)`` for a dense
        kernel ``[in, out]`` stored as a torch Linear weight ``[out, in]``.
      axis: the axis (in their layout) along which fused parts are split and concatenated.
      sizes: sizes of the parts along ``axis`` (default: equal parts).
      dtype: dtype name written on export (e.g. ``"bfloat16"``); None keeps ours.
      stack: placeholders of ``theirs`` enumerated by our leading axes, outermost first.

    Example:
      >>> from jaxops.parallel.checkpoint import Rule
      >>> rule = Rule("layers/{i}/mlp/gate_up/kernel",
      ...             ["model.layers.{i}.mlp.gate_proj.weight",
      ...              "model.layers.{i}.mlp.up_proj.weight"],
      ...             transpose=(1, 0))
      >>> rule.their_names("layers/3/mlp/gate_up/kernel")
      ['model.layers.3.mlp.gate_proj.weight', 'model.layers.3.mlp.up_proj.weight']
      >>> experts = Rule("layers/moe/w_out", "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
      ...                transpose=(1, 0), stack=("i", "e"))
      >>> experts.their_names("layers/moe/w_out", stack_shape=(2, 2))[-1]
      'model.layers.1.mlp.experts.1.down_proj.weight'
    """

    ours: str
    theirs: str | Sequence[str]
    transpose: Sequence[int] | None = None
    axis: int = 0
    sizes: Sequence[int] | None = None
    dtype: str | None = None
    stack: Sequence[str] = ()

    def __post_init__(self):
        stack = (self.stack,) if isinstance(self.stack, str) else tuple(self.stack)
        object.__setattr__(self, "stack", stack)
        ours = {m.group(1) for m in _PLACEHOLDER.finditer(self.ours)}
        theirs = {m.group(1) for t in self._theirs for m in _PLACEHOLDER.finditer(t)}
        bad = [s for s in stack if s in ours or s not in theirs]
        if bad or len(set(stack)) != len(stack):
            raise ValueError(
                f"Rule({self.ours!r}): stack {stack} must name distinct placeholders of theirs "
                f"that ours does not have; ours has {sorted(ours)}, theirs {sorted(theirs)}"
            )

    @property
    def _theirs(self) -> tuple[str, ...]:
        return (self.theirs,) if isinstance(self.theirs, str) else tuple(self.theirs)

    def matches(self, key: str) -> bool:
        """Whether our `key` is this rule's."""
        return _template_regex(self.ours, "/").fullmatch(key) is not None

    def elements(self, key: str, stack_shape: Sequence[int] = ()) -> list[tuple[tuple, list[str]]]:
        """``(index into our stacked axes, their names for that element)`` pairs, in order."""
        m = _template_regex(self.ours, "/").fullmatch(key)
        if m is None:
            return []
        groups = m.groupdict()
        stack_shape = tuple(stack_shape)[: len(self.stack)]
        out = []
        for idx in np.ndindex(*stack_shape) if self.stack else [()]:
            values = {**groups, **{s: str(i) for s, i in zip(self.stack, idx, strict=True)}}
            out.append((tuple(idx), [_fill_template(t, values) for t in self._theirs]))
        return out

    def their_names(self, key: str, stack_shape: Sequence[int] = ()) -> list[str] | None:
        """Their tensor names for our `key`, or None if this rule does not match it.

        For a stacked rule: the names of every element of an array whose leading (stacked) axes
        have the sizes `stack_shape`, element by element.
        """
        if not self.matches(key):
            return None
        if self.stack and len(tuple(stack_shape)) < len(self.stack):
            raise ValueError(
                f"Rule({self.ours!r}): {key!r} stacks {self.stack}; give stack_shape, the sizes "
                "of our leading axes"
            )
        return [n for _, names in self.elements(key, stack_shape) for n in names]

    def to_theirs(self, key: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """Export: our array -> their (name, tensor) pairs."""
        if self.stack:
            if arr.ndim < len(self.stack):
                raise ValueError(
                    f"export: {key!r} has shape {list(arr.shape)}, fewer axes than the stacked "
                    f"placeholders {self.stack}"
                )
            pairs = []
            for idx, names in self.elements(key, arr.shape):
                pairs += self._element_to_theirs(key, names, arr[idx])
            return pairs
        names = self.their_names(key) or []
        return self._element_to_theirs(key, names, arr)

    def _element_to_theirs(
        self, key: str, names: list[str], arr: np.ndarray
    ) -> list[tuple[str, np.ndarray]]:
        if not names:
            return []
        if self.transpose is not None:
            arr = np.transpose(arr, self.transpose)
        if len(names) == 1:
            parts = [arr]
        else:
            n = arr.shape[self.axis]
            sizes = list(self.sizes) if self.sizes is not None else [n // len(names)] * len(names)
            if len(sizes) != len(names) or sum(sizes) != n:
                raise ValueError(
                    f"export: {key!r} has {n} along axis {self.axis}, which does not split into "
                    f"{len(names)} parts of sizes {sizes}"
                )
            parts = np.split(arr, np.cumsum(sizes)[:-1], axis=self.axis)
        dtype = _np_dtype(self.dtype) if self.dtype else None
        return [
            (name, np.ascontiguousarray(p if dtype is None else p.astype(dtype)))
            for name, p in zip(names, parts, strict=True)
        ]

    def to_ours(self, parts: list[np.ndarray]) -> np.ndarray:
        """Import: their tensors (in template order) -> our array (before the dtype cast).

        For a stacked rule, `parts` are one element's tensors; see :meth:`elements`.
        """
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.axis)
        if self.transpose is not None:
            arr = np.transpose(arr, np.argsort(self.transpose))
        return arr


def _rule_for(name_map: Sequence[Rule] | None, key: str) -> Rule:
    for rule in name_map or ():
        if rule.matches(key):
            return rule
    return Rule(key, key.replace("/", "."))


LLAMA_NAME_MAP: tuple[Rule, ...] = (
    Rule("embed/embedding", "model.embed_tokens.weight"),
    Rule("layers/{i}/attn_norm/scale", "model.layers.{i}.input_layernorm.weight"),
    Rule(
        "layers/{i}/attn/qkv/kernel",
        [
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ],
        transpose=(1, 0),
    ),
    Rule(
        "layers/{i}/attn/out/kernel", "model.layers.{i}.self_attn.o_proj.weight", transpose=(1, 0)
    ),
    Rule("layers/{i}/mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
    Rule(
        "layers/{i}/mlp/gate_up/kernel",
        ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
        transpose=(1, 0),
    ),
    Rule("layers/{i}/mlp/down/kernel", "model.layers.{i}.mlp.down_proj.weight", transpose=(1, 0)),
    Rule("final_norm/scale", "model.norm.weight"),
    Rule("lm_head/kernel", "lm_head.weight", transpose=(1, 0)),
)
"""Our Llama-style tree <-> Hugging Face ``LlamaForCausalLM`` names (multi-head attention).

Our layout: ``embed/embedding [V, D]``, per layer ``i``: ``attn_norm/scale [D]``,
``attn/qkv/kernel [D, 3D]`` (q, k, v fused), ``attn/out/kernel [D, D]``,
``mlp_norm/scale [D]``, ``mlp/gate_up/kernel [D, 2F]`` (gate, up fused),
``mlp/down/kernel [F, D]``; then ``final_norm/scale [D]`` and ``lm_head/kernel [D, V]``. Dense
kernels are ``[in, out]``; Hugging Face stores torch Linear weights ``[out, in]``, hence the
transposes. For grouped-query attention give the qkv rule ``sizes=(H*Dh, K*Dh, K*Dh)``.
"""


def _parse_size(op: str, size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if m is None:
        raise ValueError(
            f"{op}: max_shard_size must be bytes or like '5GB' / '500MiB', got {size!r}"
        )
    unit = m.group(2)
    power = " KMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)


def export_safetensors(
    source: str | os.PathLike | Any,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    name_map: Sequence[Rule] | None = None,
    dtype: str | None = None,
    progress: bool | None = None,
    config: Any = None,
    generation_config: Any = None,
) -> list[str]:
    """Writes a consolidated Hugging Face safetensors layout from a checkpoint or a sharded tree.

    Writes ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json`` (or a
    single ``model.safetensors`` when everything fits in one shard), with ``{"format": "pt"}``
    metadata so ``transformers`` loads it. Streams: one array is consolidated on process 0 at a
    time (read from the checkpoint files, or gathered from the devices), so no process holds the
    whole model. Process 0 writes; with a tree every process must call it (the gathers are
    collective). Files go to a temporary directory renamed to `out_dir` at the end. With
    `config`, ``config.json`` is written too (and ``generation_config.json`` with
    `generation_config`), so ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` works;
    the index's metadata holds ``total_size`` and ``total_parameters`` as transformers writes them.

    Args:
      source: a checkpoint directory (from :func:`save`) or a pytree of arrays.
      out_dir: the output directory; must not exist, or be an empty directory.
      max_shard_size: bytes per file, an int or a string like ``"5GB"`` or ``"500MiB"``.
      name_map: :class:`Rule` s mapping our keys to their names (first match wins); keys no
        rule matches are written with "/" replaced by ".".
      dtype: cast floating-point tensors that no rule gives a dtype to this dtype.
      progress: a tqdm progress bar (None: only on a terminal).
      config: a Hugging Face config (a dict, or an object with ``to_dict()``) for config.json.
      generation_config: likewise, for generation_config.json.

    Returns:
      The tensor names written, in order.

    Example:
      >>> import tempfile, numpy as np
      >>> from safetensors.numpy import load_file
      >>> from jaxops.parallel.checkpoint import export_safetensors, Rule
      >>> out = tempfile.mkdtemp() + "/hf"
      >>> tree = {"dense": {"kernel": np.arange(6.0, dtype=np.float32).reshape(2, 3)}}
      >>> rules = [Rule("dense/kernel", "proj.weight", transpose=(1, 0))]
      >>> export_safetensors(tree, out, name_map=rules)
      ['proj.weight']
      >>> load_file(out + "/model.safetensors")["proj.weight"].shape
      (3, 2)
    """
    op = "export_safetensors"
    limit = _parse_size(op, max_shard_size)
    out = Path(out_dir)
    cast = _np_dtype(dtype) if dtype else None
    # (key, shape, dtype, fetch) per array, fetch called in order by every process.
    items: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray | None]]] = []
    reader = None
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        index = _load_index(root)
        reader = _Reader(root, index)
        for key, info in index["arrays"].items():
            shape = tuple(info["shape"])

            def fetch(key=key, info=info, shape=shape):
                if jax.process_index() != 0:
                    return None
                return _read_region(reader, key, info, (0,) * len(shape), shape)

            items.append((key, shape, _np_dtype(info["dtype"]), fetch))
    else:
        keys, leaves, _ = _flatten(op, source)
        for key, leaf in zip(keys, leaves, strict=True):

            def fetch(leaf=leaf):
                if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                    from jax.experimental import multihost_utils

                    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
                return np.asarray(leaf)

            items.append(
                (
                    key,
                    tuple(np.shape(leaf)),
                    np.asarray(leaf).dtype if not hasattr(leaf, "dtype") else np.dtype(leaf.dtype),
                    fetch,
                )
            )

    # Plan the files from shapes alone: names, shapes and dtypes of their tensors.
    planned: list[tuple[str, Rule, list[tuple[str, str, tuple[int, ...], int]]]] = []
    seen: dict[str, str] = {}
    for key, shape, dt, _ in items:
        rule = _rule_for(name_map, key)
        probe = np.lib.stride_tricks.as_strided(np.zeros((), dt), shape, [0] * len(shape))
        outs = []
        for name, arr in rule.to_theirs(key, probe):
            out_dt = arr.dtype
            if cast is not None and rule.dtype is None and _is_float(out_dt):
                out_dt = cast
            name_dt = _dtype_name(op, f"tensor {name!r}", out_dt)
            if name in seen:
                raise ValueError(f"{op}: {key!r} and {seen[name]!r} both map to {name!r}")
            seen[name] = key
            outs.append((name, name_dt, tuple(arr.shape), arr.size * out_dt.itemsize))
        planned.append((key, rule, outs))
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, _, outs) in enumerate(planned):
        n = sum(e[3] for e in outs)
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += n
    files = [f for f in files if any(planned[i][2] for i in f)] or [[]]
    count = len(files)
    fnames = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    )
    writer = jax.process_index() == 0
    tmp = out.parent / f".{out.name}.partial"
    configs = {
        name: _config_dict(op, name, value)
        for name, value in (("config.json", config), ("generation_config.json", generation_config))
        if value is not None
    }
    if writer:
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise FileExistsError(f"{op}: {out} already exists and is not an empty directory")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    total = sum(e[3] for _, _, outs in planned for e in outs)
    bar = _progress_bar(progress, total, f"export {out.name}")
    names: list[str] = []
    weight_map: dict[str, str] = {}
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            for fname, members in zip(fnames, files, strict=True):
                entries = [e for i in members for e in planned[i][2]]

                def produce(members=members):
                    for i in members:
                        key, rule, outs = planned[i]
                        arr = items[i][3]()
                        if arr is None:
                            continue
                        for (_, want, _, _), (_, part) in zip(
                            outs, rule.to_theirs(key, arr), strict=True
                        ):
                            yield part if part.dtype.name == want else part.astype(_np_dtype(want))

                if writer:
                    _write_safetensors(
                        tmp / fname,
                        entries,
                        produce(),
                        {"format": "pt"},
                        pool,
                        bar.update if bar is not None else (lambda n: None),
                    )
                else:
                    for _ in produce():  # the collective gathers, in the same order
                        pass
                names.extend(e[0] for e in entries)
                weight_map.update({e[0]: fname for e in entries})
        if writer:
            if count > 1:
                params = sum(math.prod(e[2]) for _, _, outs in planned for e in outs)
                index_json = {
                    "metadata": {"total_parameters": params, "total_size": total},
                    "weight_map": weight_map,
                }
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
            for name, value in configs.items():
                (tmp / name).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
            _fsync_dir(tmp)
            if out.exists():  # an empty directory: replace it
                out.rmdir()
            os.rename(tmp, out)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if reader is not None:
            reader.close()
        if bar is not None:
            bar.close()
    return names


def _config_dict(op: str, name: str, value: Any) -> dict[str, Any]:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise TypeError(f"{op}: the value for {name} must be a dict, got {type(value).__name__}")
    try:
        json.dumps(dict(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{op}: the value for {name} is not JSON-serializable: {e}") from None
    return dict(value)


def _hf_tensors(src: Path) -> dict[str, tuple[Path, dict[str, Any], int]]:
    """Name -> (file, header entry, data start) for a HF file, directory or sharded index."""
    if src.is_file():
        files = [src]
    elif (src / "model.safetensors.index.json").is_file():
        weight_map = json.loads((src / "model.safetensors.index.json").read_text()).get(
            "weight_map"
        )
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{src}: model.safetensors.index.json has no weight_map")
        files = [_safe_file(src, f) for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{src}: no .safetensors files")
    table: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for f in files:
        header, start = _read_header(f)
        for name, entry in header.items():
            if name != "__metadata__":
                table[name] = (f, entry, start)
    return table


def _read_hf_tensor(name: str, file: Path, entry: dict[str, Any], start: int) -> np.ndarray:
    code = entry.get("dtype")
    if code not in _ST_DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name!r} has dtype {code}; supported: {', '.join(_ST_DTYPES)}"
        )
    dtype = _np_dtype(_ST_DTYPES[code])
    shape = tuple(int(n) for n in entry["shape"])
    lo, hi = (int(v) for v in entry["data_offsets"])
    if hi - lo != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(
            f"{file}: tensor {name!r} has {hi - lo} bytes for {dtype}{list(shape)}"
        )
    buf = np.empty(hi - lo, np.uint8)
    with open(file, "rb") as f:
        f.seek(start + lo)
        if f.readinto(memoryview(buf)) != hi - lo:
            raise CheckpointError(f"{file}: truncated (tensor {name!r})")
    return buf.view(dtype).reshape(shape)


def _import_stacked(op, src, table, key, rule: Rule, shape, dtype, sharding):
    """One stacked target leaf: each process reads only the elements its shards hold."""
    n = len(rule.stack)
    if len(shape) < n:
        raise CheckpointError(
            f"{op}: {key!r} stacks {rule.stack} but the target has shape {list(shape)}"
        )
    elements = dict(rule.elements(key, shape[:n]))
    missing = [name for names in elements.values() for name in names if name not in table]
    if missing:
        raise CheckpointError(
            f"{op}: {key!r} needs {missing[:3]}{' ...' if len(missing) > 3 else ''} "
            f"({len(missing)} missing) in {src}; it has e.g. {list(table)[:5]}"
        )
    cache: dict[tuple, np.ndarray] = {}

    def element(idx: tuple) -> np.ndarray:
        if idx not in cache:
            names = elements[idx]
            arr = rule.to_ours([_read_hf_tensor(name, *table[name]) for name in names])
            if tuple(arr.shape) != tuple(shape[n:]):
                raise CheckpointError(
                    f"{op}: {key!r}[{', '.join(map(str, idx))}] from {names} has shape "
                    f"{list(arr.shape)}, the target element {list(shape[n:])}"
                )
            cache[idx] = arr.astype(dtype, copy=False)
        return cache[idx]

    def block(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = [range(*sl.indices(dim)) for sl, dim in zip(index[:n], shape[:n], strict=True)]
        out = np.empty([len(r) for r in ranges] + [len(range(*sl.indices(d))) for sl, d in
                       zip(index[n:], shape[n:], strict=True)], dtype)  # fmt: skip
        for pos in np.ndindex(*[len(r) for r in ranges]):
            idx = tuple(r[i] for r, i in zip(ranges, pos, strict=True))
            out[pos] = element(idx)[index[n:]]
        return out

    if sharding is None:
        return block((slice(None),) * len(shape))
    return jax.make_array_from_callback(shape, sharding, block)


def import_safetensors(
    src: str | os.PathLike,
    target: Any,
    *,
    name_map: Sequence[Rule] | None = None,
    progress: bool | None = None,
) -> Any:
    """Loads Hugging Face-style safetensors files into a (sharded) target tree.

    Each target leaf's tensors are found through `name_map` (the same :class:`Rule` s as
    :func:`export_safetensors`, applied backwards: fused parts concatenated, transposes undone,
    cast to the target dtype), read and placed on the target's sharding. One array at a time is
    held on the host.

    Args:
      src: a ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` or
        ``.safetensors`` files.
      target: a pytree of ``jax.ShapeDtypeStruct`` (with shardings), ``jax.Array`` or numpy
        arrays, as for :func:`restore`.
      name_map: the rules; keys no rule matches are looked up with "/" replaced by ".".
      progress: a tqdm progress bar (None: only on a terminal).

    Returns:
      A tree like `target`.

    Raises:
      CheckpointError: a tensor is missing, or its shape after the mapping differs from the
        target's.

    Example:
      >>> import tempfile, jax, numpy as np
      >>> from safetensors.numpy import save_file
      >>> from jaxops.parallel.checkpoint import import_safetensors, Rule
      >>> f = tempfile.mkdtemp() + "/model.safetensors"
      >>> save_file({"proj.weight": np.arange(6, dtype=np.float32).reshape(3, 2)}, f)
      >>> target = {"dense": {"kernel": jax.ShapeDtypeStruct((2, 3), np.float32)}}
      >>> rules = [Rule("dense/kernel", "proj.weight", transpose=(1, 0))]
      >>> out = import_safetensors(f, target, name_map=rules)
      >>> out["dense"]["kernel"].tolist()
      [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    """
    op = "import_safetensors"
    table = _hf_tensors(Path(src))
    keys, leaves, treedef = _flatten(op, target)
    targets = [_target_of(op, k, leaf) for k, leaf in zip(keys, leaves, strict=True)]
    total = sum(math.prod(t[0]) * t[1].itemsize for t in targets)
    bar = _progress_bar(progress, total, f"import {Path(src).name}")
    values = []
    try:
        for key, (shape, dtype, sharding) in zip(keys, targets, strict=True):
            rule = _rule_for(name_map, key)
            if rule.stack:
                values.append(_import_stacked(op, src, table, key, rule, shape, dtype, sharding))
                if bar is not None:
                    bar.update(math.prod(shape) * dtype.itemsize)
                continue
            names = rule.their_names(key) or []
            missing = [n for n in names if n not in table]
            if not names or missing:
                raise CheckpointError(
                    f"{op}: {key!r} needs {missing or names} in {src}; "
                    f"it has e.g. {list(table)[:5]}"
                )
            arr = rule.to_ours([_read_hf_tensor(n, *table[n]) for n in names])
            if tuple(arr.shape) != shape:
                raise CheckpointError(
                    f"{op}: {key!r} from {names} has shape {list(arr.shape)}, "
                    f"the target {list(shape)}"
                )
            arr = np.ascontiguousarray(arr.astype(dtype, copy=False))
            if sharding is None:
                values.append(arr)
            else:
                values.append(
                    jax.make_array_from_callback(shape, sharding, lambda idx, a=arr: a[idx])
                )
            if bar is not None:
                bar.update(arr.nbytes)
    finally:
        if bar is not None:
            bar.close()
    return jax.tree_util.tree_unflatten(treedef, values)
