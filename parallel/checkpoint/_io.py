"""Bytes in and out: safetensors files with chunk CRCs, verified reads, buffers, threads."""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxops._errors import InvalidArgumentError
from jaxops._ffi import crc32c_chunks

from . import _index
from ._format import (
    _ST_CODES,
    CheckpointError,
    _header_bytes,
    _little_endian,
    _np_dtype,
    _read_header,
)
from ._index import _safe_file
from ._plan import _SEGMENT_BYTES, _Owned, _Region, _Segment, _segments

_WRITE_SLICE = 16 << 20  # bytes per os.write call


def _crc32c(view: memoryview, chunk: int) -> list[int]:
    """CRC-32C of each `chunk`-byte piece of `view` (native, SSE4.2 where available, no GIL)."""
    return crc32c_chunks(view, chunk)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _byte_view(arr: np.ndarray) -> memoryview:
    """The bytes safetensors stores for `arr`: C order, little-endian."""
    return memoryview(np.ascontiguousarray(_little_endian(arr)).reshape(-1).view(np.uint8))


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
    step = _index.CHUNK_BYTES * max(1, _WRITE_SLICE // _index.CHUNK_BYTES)  # whole chunks per write
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(header))
        offset = len(header)
        placed = []
        for (name, dtype, shape, nbytes), arr in zip(entries, arrays, strict=True):
            if arr.dtype.name != dtype or tuple(arr.shape) != shape:
                raise InvalidArgumentError(f"{name}: got {arr.dtype.name}{list(arr.shape)}")
            view = _byte_view(arr)
            crcs = []
            for i in range(0, len(view), step):
                piece = view[i : i + step]
                crcs.append(pool.submit(_crc32c, piece, _index.CHUNK_BYTES))
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


class _Reader:
    """Reads verified byte ranges of stored blocks; one per restore, with cached file handles."""

    def __init__(self, root: Path, index: dict[str, Any]):
        self.root = root
        self.chunk = int(index.get("chunk_bytes", _index.CHUNK_BYTES))
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


_READ_BUFFERS = 6  # reusable segment buffers in flight


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """np.empty, 64-byte aligned: jax.device_put on CPU then adopts the buffer without a copy."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


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
