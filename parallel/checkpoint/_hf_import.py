"""Hugging Face import: safetensors files read into a sharded target tree."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxops._errors import ArgumentTypeError, InvalidArgumentError, named_errors

from ._format import (
    _ST_DTYPES,
    CheckpointError,
    _is_float,
    _np_dtype,
    _parse_json,
    _read_header,
    _show,
)
from ._index import _plain_file_name
from ._io import _progress_bar
from ._rules import Codec, Rule, _rule_for
from ._tree import _flatten, _target_of

_HF_INDEX = "model.safetensors.index.json"


def _weight_map(src: Path) -> dict[str, str]:
    """The validated weight_map of ``src/model.safetensors.index.json``: tensor -> file name."""
    file = src / _HF_INDEX
    index = _parse_json(file, "the file", file.read_bytes())
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        got = _show(weight_map) if isinstance(index, dict) else f"a JSON {type(index).__name__}"
        raise CheckpointError(
            f"{file}: expected an object with a weight_map object (tensor name -> file), got {got}"
        )
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not _plain_file_name(fname):
            raise CheckpointError(
                f"{file}: tensor {name!r}: refusing file name {_show(fname)}; expected the name of "
                f"a *.safetensors file in {src}"
            )
        if not (src / fname).is_file():
            raise CheckpointError(
                f"{file}: tensor {name!r} is in {fname}, but {src} has no such file"
            )
    return weight_map


def _hf_tensors(src: Path) -> dict[str, tuple[Path, dict[str, Any], int]]:
    """Name -> (file, header entry, data start) for a HF file, directory or sharded index.

    Every header is validated (:func:`_read_header`); with an index, every tensor it maps must be
    in its file, and tensors it does not map are not read. A tensor in several files that no
    index assigns is an error: which is meant?
    """
    weight_map: dict[str, str] = {}
    if src.is_file():
        files = [src]
    elif (src / _HF_INDEX).is_file():
        weight_map = _weight_map(src)
        files = [src / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{src}: no .safetensors files")
    table: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for f in files:
        header, start = _read_header(f)
        for name, entry in header.items():
            # With an index, it is the authority: a tensor it does not list is not read.
            if name == "__metadata__" or (
                src.is_dir() and weight_map and weight_map.get(name) != f.name
            ):
                continue
            if name in table:
                raise CheckpointError(
                    f"{f}: tensor {name!r} is also in {table[name][0]}; expected each tensor in "
                    "one file"
                )
            table[name] = (f, entry, start)
    for name, fname in weight_map.items():
        if name not in table:
            header, _ = _read_header(src / fname)
            have = [n for n in header if n != "__metadata__"][:5]
            raise CheckpointError(
                f"{src / _HF_INDEX}: the weight_map puts tensor {name!r} in {fname}, but that "
                f"file holds no such tensor (it has e.g. {have})"
            )
    return table


class HFTensor(NamedTuple):
    """One tensor of a Hugging Face safetensors checkpoint, as its validated header states it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


@named_errors("jaxops.parallel.checkpoint.hf_tensors")
def hf_tensors(src: str | os.PathLike) -> dict[str, HFTensor]:
    """The tensors of a Hugging Face checkpoint, read from the headers only (no tensor data).

    Args:
      src: a ``.safetensors`` file, or a directory of them (with
        ``model.safetensors.index.json``, which is then the authority on which tensor is where).

    Returns:
      Tensor name -> :class:`HFTensor` (file, safetensors dtype code such as ``"BF16"``, shape).

    Raises:
      CheckpointError: a malformed header or index, a tensor in several files no index
        assigns, an index entry its file does not hold, a directory without .safetensors files.

    Example:
      >>> import tempfile, numpy as np
      >>> from safetensors.numpy import save_file
      >>> from jaxops.parallel.checkpoint import hf_tensors
      >>> d = tempfile.mkdtemp()
      >>> save_file({"w": np.zeros((2, 3), np.float32)}, f"{d}/model.safetensors")
      >>> t = hf_tensors(d)["w"]
      >>> t.dtype, t.shape
      ('F32', (2, 3))
    """
    table = _hf_tensors(Path(src))
    return {
        name: HFTensor(file, entry["dtype"], tuple(entry["shape"]))
        for name, (file, entry, _) in table.items()
    }


def _read_hf_tensor(name: str, file: Path, entry: dict[str, Any], start: int) -> np.ndarray:
    """A tensor of a safetensors file; `entry` comes from a header `_read_header` validated."""
    code = entry["dtype"]
    if code not in _ST_DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name!r} has dtype {code}; supported: {', '.join(_ST_DTYPES)}"
        )
    dtype = _np_dtype(_ST_DTYPES[code])
    shape = tuple(entry["shape"])
    lo, hi = entry["data_offsets"]
    buf = np.empty(hi - lo, np.uint8)
    with open(file, "rb") as f:
        f.seek(start + lo)
        if f.readinto(memoryview(buf)) != hi - lo:
            raise CheckpointError(f"{file}: truncated (tensor {name!r})")
    return buf.view(dtype).reshape(shape)


def _to_ours(
    op: str, key: str, rule: Rule, names: Sequence[str], table, codec: Codec | None = None
) -> np.ndarray:
    """Their tensors `names`, read (through `codec`, if any) and mapped by `rule` to our layout.

    Tensors that do not fit the rule (ranks, fused sizes, the transpose, RoPE head sizes) or the
    codec raise CheckpointError naming the key, the tensors and their files.
    """
    try:
        if codec is None:
            parts = [_read_hf_tensor(name, *table[name]) for name in names]
        else:
            parts = [codec.decode(name, lambda n: _read_stored(n, table)) for name in names]
        rule.our_shape([p.shape for p in parts])  # checks what the mapping assumes
        return rule.to_ours(parts)
    except ValueError as e:
        files = _files(names, table, codec)
        raise CheckpointError(f"{op}: {key!r} from {list(names)} in {files}: {e}") from None


def _stored(codec: Codec | None, name: str, table) -> tuple[str, ...]:
    """The stored tensors that make their tensor `name` (``codec.stored``; default itself)."""
    stored = getattr(codec, "stored", None)
    if stored is None:
        return (name,)
    out = tuple(stored(name, table))
    if not out or not all(isinstance(n, str) for n in out):
        raise ArgumentTypeError(
            f"{type(codec).__name__}.stored({name!r}) must give tensor names, got {out!r}"
        )
    return out


def _missing(names: Sequence[str], table, codec: Codec | None) -> list[str]:
    """The stored tensors making `names` that the files lack, in order, once each."""
    out = [s for name in names for s in _stored(codec, name, table) if s not in table]
    return list(dict.fromkeys(out))


def _files(names: Sequence[str], table, codec: Codec | None) -> str:
    """The files holding the stored tensors of `names`, sorted and comma-separated."""
    stored = {s for name in names for s in _stored(codec, name, table)}
    return ", ".join(sorted({str(table[s][0]) for s in stored if s in table})) or "(none)"


def _read_stored(name: str, table) -> np.ndarray:
    """A codec's read: stored tensor `name`; ValueError if the files lack it."""
    if name not in table:
        raise InvalidArgumentError(f"the files hold no tensor {name!r}")
    return _read_hf_tensor(name, *table[name])


def _kind(dtype: np.dtype) -> str:
    """bool, int, uint or float (bfloat16 and float8 included)."""
    if dtype == np.bool_:
        return "bool"
    if _is_float(dtype):
        return "float"
    return "uint" if np.issubdtype(dtype, np.unsignedinteger) else "int"


def _check_cast(
    op: str,
    key: str,
    names: Sequence[str],
    table: dict[str, tuple[Path, dict[str, Any], int]],
    dtype: np.dtype,
    cast: bool,
    codec: Codec | None = None,
) -> None:
    """Refuses, unless `cast`, tensors whose kind (bool, int, uint, float) the target changes.

    A tensor the codec makes of other stored tensors (say, uint8 MXFP4 blocks and scales) is
    decoded to floating point: its kind is float, whatever the stored ones' dtypes.
    """
    if cast:
        return
    for name in names:
        stored = _stored(codec, name, table)
        file, entry, _ = table[stored[0]]
        code = entry["dtype"]
        if stored != (name,):
            if _kind(dtype) == "float":
                continue
            code = "F32"
        if code not in _ST_DTYPES:
            continue  # reading it raises
        have = _np_dtype(_ST_DTYPES[code])
        if _kind(have) != _kind(dtype):
            raise CheckpointError(
                f"{op}: {key!r} is {dtype.name}, but {name!r} in {file} is {have.name}: "
                f"converting {_kind(have)} to {_kind(dtype)} changes values; pass cast=True to "
                "convert anyway"
            )


def _import_stacked(op, src, table, key, rule: Rule, shape, dtype, sharding, cast, codec):
    """One stacked target leaf: each process reads only the elements its shards hold."""
    n = len(rule.stack)
    if len(shape) < n:
        raise CheckpointError(
            f"{op}: {key!r} stacks {rule.stack} but the target has shape {list(shape)}"
        )
    elements = dict(rule.elements(key, shape[:n]))
    all_names = [name for names in elements.values() for name in names]
    missing = _missing(all_names, table, codec)
    if missing:
        raise CheckpointError(
            f"{op}: {key!r} needs {missing[:3]}{' ...' if len(missing) > 3 else ''} "
            f"({len(missing)} missing) in {src}; it has e.g. {list(table)[:5]}"
        )
    _check_cast(op, key, all_names, table, dtype, cast, codec)

    def element(idx: tuple) -> np.ndarray:
        names = elements[idx]
        arr = _to_ours(op, key, rule, names, table, codec)
        if tuple(arr.shape) != tuple(shape[n:]):
            raise CheckpointError(
                f"{op}: {key!r}[{', '.join(map(str, idx))}] from {names} has shape "
                f"{list(arr.shape)}, the target element {list(shape[n:])}"
            )
        return arr  # cast to dtype part by part, as it is copied into the blocks

    def normalize(index: tuple[slice, ...]) -> tuple[range, ...]:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        return tuple(range(*sl.indices(dim)) for sl, dim in zip(index, shape, strict=True))

    # The distinct blocks this process's devices hold (replicas share one), filled element by
    # element: each element is read once, copied into every block holding part of it and
    # dropped, so the host holds this process's share of the leaf and one element.
    index_map = (
        {None: (slice(None),) * len(shape)}
        if sharding is None
        else sharding.addressable_devices_indices_map(shape)
    )
    blocks: dict[tuple[range, ...], np.ndarray] = {}
    uses: dict[tuple, list[tuple[np.ndarray, tuple, tuple[slice, ...]]]] = {}
    for index in index_map.values():
        ranges = normalize(index)
        if ranges in blocks:
            continue
        blocks[ranges] = out = np.empty([len(r) for r in ranges], dtype)
        rest = tuple(slice(r.start, r.stop, r.step) for r in ranges[n:])
        for pos in np.ndindex(*[len(r) for r in ranges[:n]]):
            idx = tuple(r[i] for r, i in zip(ranges[:n], pos, strict=True))
            uses.setdefault(idx, []).append((out, pos, rest))
    for idx in sorted(uses):
        arr = element(idx)
        for out, pos, rest in uses.pop(idx):
            out[pos] = arr[rest]
        del arr

    if sharding is None:
        return next(iter(blocks.values()))
    return jax.make_array_from_callback(shape, sharding, lambda index: blocks[normalize(index)])


@named_errors("jaxops.parallel.checkpoint.import_safetensors")
def import_safetensors(
    src: str | os.PathLike,
    target: Any,
    *,
    name_map: Sequence[Rule] | None = None,
    progress: bool | None = None,
    cast: bool = False,
    codec: Codec | None = None,
) -> Any:
    """Loads Hugging Face-style safetensors files into a (sharded) target tree.

    Each target leaf's tensors are found through `name_map` (the same :class:`Rule` s as
    :func:`export_safetensors`, applied backwards: fused parts concatenated, transposes undone,
    converted to the target dtype, see `cast`), read and placed on the target's sharding. One
    array at a time is held on the host. Files are untrusted: a damaged or hostile one raises
    CheckpointError.

    Args:
      src: a ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` or
        ``.safetensors`` files.
      target: a pytree of ``jax.ShapeDtypeStruct`` (with shardings), ``jax.Array`` or numpy
        arrays, as for :func:`restore`.
      name_map: the rules; keys no rule matches are looked up with "/" replaced by ".".
      progress: a tqdm progress bar (None: only on a terminal).
      cast: also convert between kinds of dtype (bool, signed int, unsigned int, float), for
        example int32 tensors into a float32 target, with numpy's ``astype``. Without it such a
        tensor raises CheckpointError; precision changes within a kind (bfloat16 -> float32,
        float32 -> bfloat16, int8 -> int32) are always made.
      codec: how their tensors are stored, if not each as one array (e.g. block-scaled FP8
        weights with their ``weight_scale_inv``, MXFP4 ``X_blocks`` and ``X_scales`` for an
        ``X`` the files lack): a :class:`Codec`. It reads what it needs per tensor, so the
        import still reads, per process, only the tensors its shards hold. A tensor counts as
        present when the files hold what the codec's ``stored`` says makes it. The cast check
        (`cast`) looks at the stored dtype of the tensors the rules name; one the codec makes of
        others counts as float.

    Returns:
      A tree like `target`.

    Raises:
      CheckpointError: a file or ``model.safetensors.index.json`` is malformed (every header is
        validated as the safetensors format requires), a tensor is missing, its shape after the
        mapping differs from the target's, or its dtype is of another kind and `cast` is False.

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
    op = "jaxops.parallel.checkpoint.import_safetensors"
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
                values.append(
                    _import_stacked(op, src, table, key, rule, shape, dtype, sharding, cast, codec)
                )
                if bar is not None:
                    bar.update(math.prod(shape) * dtype.itemsize)
                continue
            names = rule.their_names(key) or []
            missing = _missing(names, table, codec)
            if not names or missing:
                raise CheckpointError(
                    f"{op}: {key!r} needs {missing or names} in {src}; "
                    f"it has e.g. {list(table)[:5]}"
                )
            _check_cast(op, key, names, table, dtype, cast, codec)
            arr = _to_ours(op, key, rule, names, table, codec)
            if tuple(arr.shape) != shape:
                raise CheckpointError(
                    f"{op}: {key!r} from {names} has shape {list(arr.shape)}, "
                    f"the target {list(shape)}"
                )
            arr = arr.astype(dtype, copy=False)
            arr = np.ascontiguousarray(arr).reshape(arr.shape)  # which makes scalars 1-d
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
