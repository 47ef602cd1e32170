"""Coordination between processes and the atomic commit of a checkpoint directory."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from . import _index
from ._format import CheckpointError
from ._index import FORMAT, INDEX, VERSION
from ._io import _fsync_dir, _progress_bar, _write_all, _write_safetensors
from ._plan import _Snapshot


class _Coordinator:
    """Publishes and collects small strings between the processes of one save.

    Each instance takes the next number of a per-process counter for its keys: every process
    requests its saves in the same order, so the numbers agree.
    """

    _counter = 0
    _lock = threading.Lock()

    def __init__(self, timeout: float, op: str = "jaxops.parallel.checkpoint.save"):
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
                    f"{op}: jax.process_count() > 1 but jax.distributed is not initialized"
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
                raise FileExistsError(f"jaxops.parallel.checkpoint.save: {path} already exists")
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
            raise CheckpointError(
                f"jaxops.parallel.checkpoint.save: process 0 could not start: {status[1:]}"
            )

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
            raise CheckpointError(
                f"jaxops.parallel.checkpoint.save: {path} was not committed: {status[1:]}"
            )
        return
    try:
        for text in coord.collect("written"):
            if text.startswith("!"):
                raise CheckpointError(f"jaxops.parallel.checkpoint.save: {text[1:]}")
            for key, blocks in json.loads(text).items():
                fragment.setdefault(key, []).extend(blocks)
        index = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "metadata": dict(metadata or {}),
            "num_processes": nproc,
            "checksum": "crc32c",
            "chunk_bytes": _index.CHUNK_BYTES,
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
                    f"jaxops.parallel.checkpoint.save: blocks of {key!r} cover {stored} of "
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
