"""Hugging Face import: safetensors files read into a sharded target tree."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._format import _ST_DTYPES, CheckpointError, _np_dtype, _read_header
from ._index import _safe_file
from ._io import _progress_bar
from ._rules import Rule, _rule_for
from ._tree import _flatten, _target_of


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
