"""Hugging Face export: a checkpoint or sharded tree written as safetensors shards + index."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxops._errors import ArgumentTypeError, InvalidArgumentError, named_errors

from ._format import _dtype_name, _is_float, _little_endian, _np_dtype
from ._index import _load_index
from ._io import (
    _fsync_dir,
    _progress_bar,
    _read_region,
    _Reader,
    _write_safetensors,
)
from ._rules import Codec, Rule, _rule_for
from ._tree import _flatten


def _parse_size(op: str, size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if m is None:
        raise InvalidArgumentError(
            f"{op}: max_shard_size must be bytes or like '5GB' / '500MiB', got {size!r}"
        )
    unit = m.group(2)
    power = " KMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)


@named_errors("jaxops.parallel.checkpoint.export_safetensors")
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
    codec: Codec | None = None,
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
      codec: how their tensors are stored, if not each as one array in its dtype: a
        :class:`Codec` whose ``encode(name, tensor)`` gives the stored tensors of each (e.g.
        block-scaled FP8 weights with their ``weight_scale_inv``), written in their own dtypes
        (`dtype` applies to the tensors it leaves as they are). One tensor at a time.

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
    op = "jaxops.parallel.checkpoint.export_safetensors"
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

    planned = _plan(op, items, name_map, cast, codec)
    # Tensor names that several keys produce (tied weights): the first writes, the others are
    # compared with it; `kept` holds it until then (the plan puts them right after it).
    waiting = Counter(name for p in planned for name in p.aliased)
    kept: dict[str, tuple[str, np.ndarray]] = {}
    files: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(planned):
        n = sum(e[3] for e in p.written)
        if n and size and size + n > limit:  # a key writing nothing never opens a file
            files.append([])
            size = 0
        files[-1].append(i)
        size += n
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
    total = sum(e[3] for p in planned for e in p.written)
    bar = _progress_bar(progress, total, f"export {out.name}")
    names: list[str] = []
    weight_map: dict[str, str] = {}
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            for fname, members in zip(fnames, files, strict=True):
                entries = [e for i in members for e in planned[i].written]

                def produce(members=members):
                    for i in members:
                        key, rule, outs = planned[i].key, planned[i].rule, planned[i].outs
                        if not outs:  # dropped (theirs=()): nothing to read or gather
                            continue
                        arr = items[planned[i].item][3]()
                        if arr is None:
                            continue
                        for (name, want, _, _), (_, part, _) in zip(
                            outs, _encoded(codec, rule.to_theirs(key, arr)), strict=True
                        ):
                            if part.dtype.name != want:
                                part = part.astype(_np_dtype(want))
                            if name in planned[i].aliased:
                                first_key, first = kept[name]
                                if not _same_bits(first, part):
                                    raise InvalidArgumentError(
                                        f"{op}: {key!r} and {first_key!r} both map to {name!r} "
                                        "but their tensors differ; two keys may share a name "
                                        "only when the tensors written are bitwise equal (tied "
                                        "weights)"
                                    )
                                waiting[name] -= 1
                                if not waiting[name]:
                                    del kept[name]
                                continue
                            if waiting.get(name):
                                kept[name] = (key, part)
                            yield part

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
                params = sum(math.prod(e[2]) for p in planned for e in p.written)
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


class _Planned(NamedTuple):
    item: int  # index into the items
    key: str
    rule: Rule
    outs: list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype name, shape, nbytes)
    aliased: frozenset[str]  # names an earlier key writes: compared, not written
    written: list[tuple[str, str, tuple[int, ...], int]]  # outs minus aliased


def _encoded(
    codec: Codec | None, pairs: list[tuple[str, np.ndarray]], shapes_only: bool = False
) -> Iterator[tuple[str, np.ndarray, bool]]:
    """``(name, tensor, coded)``: their tensors `pairs` as stored, through `codec` if any.

    Lazily, so that the writer holds one tensor's encoding at a time.
    """
    for name, arr in pairs:
        coded = None if codec is None else codec.encode(name, arr, shapes_only=shapes_only)
        if coded is None:
            yield name, arr, False
        else:
            yield from ((n, a, True) for n, a in coded)


def _plan(
    op: str, items: list, name_map: Sequence[Rule] | None, cast, codec: Codec | None = None
) -> list[_Planned]:
    """The tensors each key writes, from shapes alone, in the order to process the keys.

    A key whose tensor names an earlier key already produces (tied weights) must produce the
    same shapes and dtypes there; it is moved right after that key, so that the comparison of
    the values holds one extra tensor only briefly.
    """
    first: dict[str, tuple[int, tuple]] = {}  # name -> (item, its (dtype, shape))
    plans: list[_Planned] = []
    anchored: dict[int, list[int]] = {}
    for i, (key, shape, dt, _) in enumerate(items):
        rule = _rule_for(name_map, key)
        probe = np.lib.stride_tricks.as_strided(np.zeros((), dt), shape, [0] * len(shape))
        outs, aliased, anchor = [], set(), -1
        for name, arr, coded in _encoded(
            codec, rule.to_theirs(key, probe, shapes_only=True), shapes_only=True
        ):
            out_dt = arr.dtype
            if cast is not None and rule.dtype is None and not coded and _is_float(out_dt):
                out_dt = cast
            if name == "__metadata__":
                raise InvalidArgumentError(
                    f"{op}: {key!r} maps to the tensor name '__metadata__', which is the "
                    "safetensors header's own entry; rename the leaf or map it with a Rule"
                )
            entry = (name, _dtype_name(op, f"tensor {name!r}", out_dt), tuple(arr.shape))
            if name in first:
                j, (dt_j, shape_j) = first[name]
                if (entry[1], entry[2]) != (dt_j, shape_j):
                    raise InvalidArgumentError(
                        f"{op}: {key!r} and {items[j][0]!r} both map to {name!r}, as "
                        f"{entry[1]}{list(entry[2])} and {dt_j}{list(shape_j)}; two keys may "
                        "share a name only when the tensors written are bitwise equal (tied "
                        "weights)"
                    )
                if any(name == e[0] for e in outs):
                    raise InvalidArgumentError(f"{op}: {key!r} maps two of its parts to {name!r}")
                aliased.add(name)
                anchor = max(anchor, j)
            else:
                first[name] = (i, entry[1:])
            outs.append((*entry, arr.size * out_dt.itemsize))
        written = [e for e in outs if e[0] not in aliased]
        plans.append(_Planned(i, key, rule, outs, frozenset(aliased), written))
        if aliased:
            anchored.setdefault(anchor, []).append(i)
    order: list[int] = []
    moved = {i for later in anchored.values() for i in later}

    def place(i: int) -> None:
        order.append(i)
        for later in anchored.get(i, ()):
            place(later)

    for i in range(len(items)):
        if i not in moved:
            place(i)
    return [plans[i] for i in order]


def _same_bits(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 24) -> bool:
    """Bitwise equality of two C-contiguous arrays, compared a chunk of bytes at a time."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = (np.ascontiguousarray(_little_endian(v)).reshape(-1).view(np.uint8) for v in (a, b))
    return all(np.array_equal(x[k : k + chunk], y[k : k + chunk]) for k in range(0, x.size, chunk))


def _config_dict(op: str, name: str, value: Any) -> dict[str, Any]:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(
            f"{op}: the value for {name} must be a dict, got {type(value).__name__}"
        )
    try:
        json.dumps(dict(value))
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError(
            f"{op}: the value for {name} is not JSON-serializable: {e}"
        ) from None
    return dict(value)
