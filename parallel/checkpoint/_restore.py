"""restore() and describe(): resharding reads of a committed checkpoint."""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxops._errors import named_errors

from ._format import CheckpointError, _np_dtype
from ._index import _load_index, _lookup
from ._io import (
    _aligned_empty,
    _check_filled,
    _progress_bar,
    _Reader,
    _run_segments,
)
from ._plan import _as_block, _Block, _Region, _Segment, _segments
from ._tree import _flatten, _prefixed, _target_of

_BATCH_BYTES = 512 << 20  # host bytes restored per batch of leaves


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


@named_errors("jaxops.parallel.checkpoint.restore")
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
    op = "jaxops.parallel.checkpoint.restore"
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


@named_errors("jaxops.parallel.checkpoint.describe")
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
