"""Import targets from Hugging Face files: our tree's shapes and shardings, from their headers."""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxops._errors import ArgumentTypeError, InvalidArgumentError, named_errors

from ._format import _ST_DTYPES, CheckpointError, _is_float, _np_dtype
from ._hf_import import _hf_tensors
from ._rules import _PLACEHOLDER, Rule, _fill_template, _rule_for, _template_regex

# Buffers of old exports that are not weights (rotary caches); never part of a target.
_BUFFERS = re.compile(r".*\.rotary_emb\.inv_freq")

_MISSING = object()

Specs = Mapping[str, Any] | Callable[[str], Any] | PartitionSpec | None


@named_errors("jaxops.parallel.checkpoint.hf_target")
def hf_target(
    src: str | os.PathLike,
    name_map: Sequence[Rule] | None,
    mesh: jax.sharding.Mesh | None = None,
    specs: Specs = None,
    dtype: Any = None,
    *,
    unmapped: str = "error",
) -> dict[str, Any]:
    """The target tree for :func:`import_safetensors`, built from the files' headers.

    Each rule of `name_map` is inverted over the tensor names and shapes in `src` (only the
    headers are read): the placeholders of their names give our keys, fused parts are
    concatenated along the rule's ``axis``, transposes undone, and stacked placeholders
    (``stack``) become our leading axes, sized by the largest index found (every index below it
    must be present). Two rules may read one tensor (tied embeddings): each gives its own leaf.
    As in import, the first rule that matches a key is the one that counts.

    Args:
      src: a ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` or
        ``.safetensors`` files.
      name_map: the :class:`Rule` s, as given to :func:`import_safetensors`.
      mesh: the mesh of the shardings; None: leaves without sharding (one device).
      specs: a ``PartitionSpec`` per leaf: a callable ``key -> spec``; a dict keyed like our
        tree (nested dicts, or "/"-joined keys, or key templates such as
        ``"layers/{i}/attn/qkv/kernel"``; exact keys first, then templates in order); or one
        ``PartitionSpec`` for every leaf. None (or a spec of None): replicated.
      dtype: the dtype of floating-point leaves (default: the files' dtype).
      unmapped: tensors no rule reads: ``"error"`` (raise), ``"skip"``, or ``"keep"`` (leaves
        named by their names with "." replaced by "/", as import looks them up). Rotary caches
        (``*.rotary_emb.inv_freq``) are always skipped.

    Returns:
      A nested dict of ``jax.ShapeDtypeStruct`` (with ``NamedSharding`` s on `mesh`).

    Raises:
      CheckpointError: fused parts or stacked elements missing or of mismatched shapes, or
        tensors no rule reads (with ``unmapped="error"``).
      ValueError: a leaf without a spec, or a spec with more axes than the leaf.

    Example:
      >>> import tempfile, jax, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> from safetensors.numpy import save_file
      >>> from jaxops.parallel.checkpoint import Rule, hf_target, import_safetensors
      >>> f = tempfile.mkdtemp() + "/model.safetensors"
      >>> save_file({f"h.{i}.{n}.weight": np.ones((6, 4), np.float32)
      ...            for i in range(3) for n in ("up", "gate")}, f)
      >>> rules = [Rule("ffn/w_in", ["h.{i}.gate.weight", "h.{i}.up.weight"], transpose=(1, 0),
      ...               stack=("i",))]
      >>> mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
      >>> target = hf_target(f, rules, mesh, {"ffn/w_in": P(None, None, "model")})
      >>> target["ffn"]["w_in"].shape, target["ffn"]["w_in"].sharding.spec
      ((3, 4, 12), P(None, None, 'model'))
      >>> import_safetensors(f, target, name_map=rules)["ffn"]["w_in"].sharding.spec
      P(None, None, 'model')
    """
    op = "jaxops.parallel.checkpoint.hf_target"
    if unmapped not in ("error", "skip", "keep"):
        raise InvalidArgumentError(
            f"{op}: unmapped must be 'error', 'skip' or 'keep', got {unmapped!r}"
        )
    table = _hf_tensors(Path(src))
    headers = {name: _header_of(op, name, entry) for name, (_, entry, _) in table.items()}
    leaves: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    used: set[str] = set()
    for rule in name_map or ():
        for key, shape, dt, names in _invert(op, rule, name_map, headers):
            leaves.setdefault(key, (shape, dt))
            used.update(names)
    rest = sorted(n for n in headers if n not in used and not _BUFFERS.fullmatch(n))
    if rest and unmapped == "error":
        raise CheckpointError(
            f"{op}: {len(rest)} tensor(s) in {src} no rule reads, e.g. {rest[:5]}; extend the "
            "name map, or pass unmapped='skip' (leave them out) or 'keep'"
        )
    if unmapped == "keep":
        for name in rest:
            key = name.replace(".", "/")
            if "{" in name or "}" in name or any(not part for part in key.split("/")):
                raise CheckpointError(
                    f"{op}: tensor {name!r} cannot be kept as a tree key (a key part would be "
                    "empty or hold '{' or '}'); map it with a Rule or pass unmapped='skip'"
                )
            rule = _rule_for(name_map, key)
            if rule.stack or rule.their_names(key) != [name] or key in leaves:
                raise CheckpointError(
                    f"{op}: {name!r} kept as {key!r}, which a rule maps to another name"
                )
            leaves[key] = headers[name]
    want = None if dtype is None else np.dtype(jnp.dtype(dtype))
    tree: dict[str, Any] = {}
    spec_of = _spec_lookup(op, specs)
    if mesh is not None and isinstance(specs, Mapping):
        missing = [key for key in leaves if spec_of(key) is _MISSING]
        if missing:
            raise InvalidArgumentError(
                f"{op}: no spec for {len(missing)} key(s), e.g. {missing[:5]}; give every leaf a "
                "spec, a template such as 'layers/{i}/...', or pass a callable"
            )
    for key, (shape, dt) in leaves.items():
        if want is not None and _is_float(dt):
            dt = want
        sharding = None
        if mesh is not None:
            spec = spec_of(key)
            spec = PartitionSpec() if spec is None else spec
            if not isinstance(spec, PartitionSpec) or len(spec) > len(shape):
                raise InvalidArgumentError(
                    f"{op}: the spec of {key!r} (shape {list(shape)}) must be a PartitionSpec "
                    f"with at most {len(shape)} entries, got {spec!r}"
                )
            sharding = NamedSharding(mesh, spec)
        _insert(op, tree, key, jax.ShapeDtypeStruct(shape, dt, sharding=sharding))
    return tree


def _header_of(op: str, name: str, entry: Any) -> tuple[tuple[int, ...], np.dtype]:
    code = entry.get("dtype") if isinstance(entry, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if code not in _ST_DTYPES or not isinstance(shape, list):
        raise CheckpointError(f"{op}: tensor {name!r} has a malformed header entry {entry!r}")
    return tuple(int(n) for n in shape), _np_dtype(_ST_DTYPES[code])


def _invert(op, rule: Rule, name_map, headers):
    """(our key, shape, dtype, their names) of every leaf `rule` makes of the tensors."""
    templates = rule._theirs
    if not templates:
        return []
    ours = {m.group(1) for m in _PLACEHOLDER.finditer(rule.ours)}
    first = {m.group(1) for m in _PLACEHOLDER.finditer(templates[0])}
    if not ours <= first:
        raise InvalidArgumentError(
            f"{op}: Rule({rule.ours!r}): {sorted(ours - first)} not in {templates[0]}"
        )
    pattern = _template_regex(templates[0], ".")
    inverse = {s: {n: i for i, n in enumerate(ns)} for s, ns in (rule.index or ())}
    found: dict[str, dict[tuple[int, ...], dict[str, str]]] = {}
    for name in headers:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        groups = m.groupdict()
        values = [groups[s] for s in rule.stack]
        if not all(v.isdigit() and str(int(v)) == v for v in values):
            continue  # stacked placeholders are decimal indices
        ours_at = [int(v) for v in values]
        for a, s in enumerate(rule.stack):
            if s in inverse:  # their number -> our index (Rule.index)
                ours_at[a] = inverse[s].get(ours_at[a], -1)
        if min(ours_at, default=0) < 0:
            continue  # an element of another rule's stack
        key = _fill_template(rule.ours, groups)
        if _rule_for(name_map, key) is not rule:
            continue  # an earlier rule owns this key
        found.setdefault(key, {})[tuple(ours_at)] = groups
    out = []
    for key, elements in found.items():
        grid = tuple(max(idx[a] for idx in elements) + 1 for a in range(len(rule.stack)))
        missing = []
        if math.prod(grid) != len(elements):  # a few are enough to name (the grid may be huge)
            missing = list(itertools.islice(_absent(grid, elements), 4))
        if missing:
            raise CheckpointError(
                f"{op}: {key!r} stacks {rule.stack} up to {[n - 1 for n in grid]} but the "
                f"elements {missing[:3]}{' ...' if len(missing) > 3 else ''} are missing"
            )
        shape, dtypes, names = None, set(), []
        for idx in np.ndindex(*grid):
            parts = [_fill_template(t, elements[idx]) for t in templates]
            absent = [p for p in parts if p not in headers]
            if absent:
                raise CheckpointError(f"{op}: {key!r} needs {absent}, not in the files")
            try:
                element = rule.our_shape([headers[p][0] for p in parts])
            except ValueError as e:
                raise CheckpointError(f"{op}: {key!r}: {e}") from None
            if shape is not None and element != shape:
                raise CheckpointError(
                    f"{op}: {key!r}: element {list(idx)} has shape {list(element)}, the first "
                    f"{list(shape)}"
                )
            shape = element
            dtypes.update(headers[p][1] for p in parts)
            names += parts
        dt = dtypes.pop() if len(dtypes) == 1 else np.dtype(jnp.result_type(*dtypes))
        out.append((key, grid + shape, dt, names))
    return out


def _absent(grid: tuple[int, ...], present: Mapping[tuple[int, ...], Any]):
    """Indices of `grid` not in `present`, in C order, lazily.

    Reaching the k-th takes at most ``len(present) + k`` steps however large the grid
    (np.ndindex would build every range first).
    """
    for flat in range(math.prod(grid)):
        idx, rest = [], flat
        for n in reversed(grid):
            rest, i = divmod(rest, n)
            idx.append(i)
        if (idx := tuple(reversed(idx))) not in present:
            yield idx


def _spec_lookup(op: str, specs: Specs) -> Callable[[str], Any]:
    if specs is None or isinstance(specs, PartitionSpec):
        return lambda key: specs
    if callable(specs) and not isinstance(specs, Mapping):
        return specs
    if not isinstance(specs, Mapping):
        raise ArgumentTypeError(f"{op}: specs must be a dict, a callable or a PartitionSpec")
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Mapping) -> None:
        for k, v in node.items():
            path = f"{prefix}/{k}" if prefix else str(k)
            if isinstance(v, Mapping):
                walk(path, v)
            else:
                flat[path] = v

    walk("", specs)
    templates = [(_template_regex(k, "/"), v) for k, v in flat.items() if "{" in k]

    def lookup(key: str) -> Any:
        if key in flat:
            return flat[key]
        for pattern, spec in templates:
            if pattern.fullmatch(key):
                return spec
        return _MISSING

    return lookup


def _insert(op: str, tree: dict[str, Any], key: str, leaf: Any) -> None:
    *parents, last = key.split("/")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise InvalidArgumentError(f"{op}: {key!r} lies under another leaf")
    if last in node:
        raise InvalidArgumentError(f"{op}: {key!r} is both a leaf and a subtree")
    node[last] = leaf
