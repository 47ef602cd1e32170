"""Declarative name maps between our tree keys and Hugging Face tensor names."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

import numpy as np

from jaxops._errors import InvalidArgumentError

from ._format import _np_dtype

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

    Rotary embeddings (``rope``): two layouts of q/k rows are in use. Meta's original Llama code
    rotates the pairs ``(2i, 2i + 1)`` of each head together ("interleaved"), transformers rotates
    ``i`` with ``i + Dh/2`` ("rotate_half"). ``rope`` gives the head size ``Dh`` of each part
    (``None`` for a part without RoPE, such as v); each head's entries along ``axis`` of their
    layout (the rows of a torch Linear weight, or a bias) are then permuted from our layout
    ``rope_ours`` to the other one on export, and back on import. The attention scores are the
    same: RoPE commutes with the permutation, and q . k is invariant under permuting both alike.

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
      rope: the head size of each part whose entries along ``axis`` carry RoPE (``None``: no
        permutation for that part), or one int for every part; None: no permutation.
      rope_ours: our q/k layout, ``"interleaved"`` (default; theirs is then transformers'
        ``"rotate_half"``) or ``"rotate_half"`` (theirs interleaved, e.g. Meta's originals).
      squeeze: an axis of size 1 that each of their tensors has and ours lacks (e.g. ERNIE's
        ``e_score_correction_bias [1, E]`` for our ``[E]``), in their layout: added on export,
        removed on import; None: none.
      index: for a stacked placeholder, the number each of our indices stands for in their
        names, ``{"i": (3, 4, 5)}``: element 0 of our stacked axis is their ``3``, and so on
        (a stack of some of their layers, e.g. a model's MoE layers when its first layers are
        dense). Placeholders not named count from 0.

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
      >>> qk = Rule("q", ["q_proj.weight", "k_proj.weight"], axis=0, rope=4)  # one head each
      >>> [p.ravel().tolist() for _, p in qk.to_theirs("q", np.arange(8.0)[:, None])]
      [[0.0, 2.0, 1.0, 3.0], [4.0, 6.0, 5.0, 7.0]]
      >>> qk.our_shape([(4, 1), (4, 1)])
      (8, 1)
    """

    ours: str
    theirs: str | Sequence[str]
    transpose: Sequence[int] | None = None
    axis: int = 0
    sizes: Sequence[int] | None = None
    dtype: str | None = None
    stack: Sequence[str] = ()
    rope: int | Sequence[int | None] | None = None
    rope_ours: str = "interleaved"
    index: Mapping[str, Sequence[int]] | None = None
    squeeze: int | None = None

    def __post_init__(self):
        stack = (self.stack,) if isinstance(self.stack, str) else tuple(self.stack)
        object.__setattr__(self, "stack", stack)
        if self.index is not None:
            index = {k: tuple(int(i) for i in v) for k, v in dict(self.index).items()}
            if not set(index) <= set(stack) or any(
                min(v, default=0) < 0 or len(set(v)) != len(v) for v in index.values()
            ):
                raise InvalidArgumentError(
                    f"Rule({self.ours!r}): index must map stacked placeholders {stack} to "
                    f"distinct numbers >= 0, got {self.index!r}"
                )
            object.__setattr__(self, "index", tuple(sorted(index.items())))
        ours = {m.group(1) for m in _PLACEHOLDER.finditer(self.ours)}
        theirs = {m.group(1) for t in self._theirs for m in _PLACEHOLDER.finditer(t)}
        bad = [s for s in stack if s in ours or s not in theirs]
        if bad or len(set(stack)) != len(stack):
            raise InvalidArgumentError(
                f"Rule({self.ours!r}): stack {stack} must name distinct placeholders of theirs "
                f"that ours does not have; ours has {sorted(ours)}, theirs {sorted(theirs)}"
            )
        sq = self.squeeze
        if sq is not None and (isinstance(sq, bool) or not isinstance(sq, int) or sq < 0):
            raise InvalidArgumentError(
                f"Rule({self.ours!r}): squeeze must be an axis >= 0 or None, got {sq!r}"
            )
        if self.rope_ours not in ("interleaved", "rotate_half"):
            raise InvalidArgumentError(
                f"Rule({self.ours!r}): rope_ours must be 'interleaved' or 'rotate_half', "
                f"got {self.rope_ours!r}"
            )
        if self.rope is not None:
            dims = self._rope_dims
            if len(dims) != len(self._theirs) or any(
                d is not None and (not isinstance(d, int) or d <= 0 or d % 2) for d in dims
            ):
                raise InvalidArgumentError(
                    f"Rule({self.ours!r}): rope must be one positive even head size or one "
                    f"(or None) per part of theirs ({len(self._theirs)}), got {self.rope!r}"
                )

    @property
    def _theirs(self) -> tuple[str, ...]:
        return (self.theirs,) if isinstance(self.theirs, str) else tuple(self.theirs)

    @property
    def _rope_dims(self) -> tuple[int | None, ...]:
        if self.rope is None or isinstance(self.rope, int):
            return (self.rope,) * len(self._theirs)
        return tuple(self.rope)

    def _permute_rope(
        self, key: str, parts: list[np.ndarray], export: bool, shapes_only: bool = False
    ) -> list[np.ndarray]:
        """Each part's RoPE rows, per head: our layout -> theirs (`export`) or back.

        With `shapes_only`, the sizes are checked but the parts are returned as they are (the
        permutation keeps shapes).
        """
        if self.rope is None:
            return parts
        to_half = (self.rope_ours == "interleaved") == export
        out = []
        for part, dh in zip(parts, self._rope_dims, strict=True):
            if dh is not None:
                n = part.shape[self.axis]
                if n % dh:
                    raise InvalidArgumentError(
                        f"{key!r}: a RoPE part has {n} entries along axis {self.axis}, not a "
                        f"multiple of the head size {dh}"
                    )
                if not shapes_only:
                    part = np.take(part, _rope_order(n, dh, to_half), axis=self.axis)
            out.append(part)
        return out

    def our_shape(self, their_shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Import, shapes only: their tensors' shapes (in template order) -> our array's shape.

        For a stacked rule, the shape of one element (without the stacked axes).

        Raises:
          ValueError: the shapes do not fit the rule (ranks, fused sizes, the transpose).
        """
        shapes = [tuple(int(n) for n in s) for s in their_shapes]
        what = f"Rule({self.ours!r}): their shapes {[list(s) for s in shapes]}"
        if len(shapes) != len(self._theirs) or not shapes:
            raise InvalidArgumentError(f"{what}: expected {len(self._theirs)} tensors")
        if self.squeeze is not None:
            a = self.squeeze
            if any(not 0 <= a < len(s) or s[a] != 1 for s in shapes):
                raise InvalidArgumentError(f"{what} have no axis {a} of size 1 (squeeze={a})")
            shapes = [s[:a] + s[a + 1 :] for s in shapes]
        ndim = len(shapes[0])
        if len(shapes) > 1:
            rest = {s[: self.axis] + s[self.axis + 1 :] for s in shapes}
            if any(len(s) != ndim for s in shapes) or not 0 <= self.axis < ndim or len(rest) > 1:
                raise InvalidArgumentError(f"{what} do not concatenate along axis {self.axis}")
            if self.sizes is not None and [s[self.axis] for s in shapes] != list(self.sizes):
                raise InvalidArgumentError(f"{what} do not have the sizes {list(self.sizes)}")
        fused = list(shapes[0])
        if len(shapes) > 1:
            fused[self.axis] = sum(s[self.axis] for s in shapes)
        if self.transpose is None:
            return tuple(fused)
        if sorted(self.transpose) != list(range(ndim)):
            raise InvalidArgumentError(
                f"{what} have rank {ndim}; the transpose is {self.transpose}"
            )
        ours = [0] * ndim
        for k, t in enumerate(self.transpose):
            ours[t] = fused[k]
        return tuple(ours)

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
        index = dict(self.index or ())
        for s, n in zip(self.stack, stack_shape, strict=False):
            if s in index and n > len(index[s]):
                raise InvalidArgumentError(
                    f"Rule({self.ours!r}): {key!r} stacks {n} along {s!r} but index names "
                    f"{len(index[s])}"
                )
        out = []
        for idx in np.ndindex(*stack_shape) if self.stack else [()]:
            values = {
                **groups,
                **{
                    s: str(index[s][i] if s in index else i)
                    for s, i in zip(self.stack, idx, strict=True)
                },
            }
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
            raise InvalidArgumentError(
                f"Rule({self.ours!r}): {key!r} stacks {self.stack}; give stack_shape, the sizes "
                "of our leading axes"
            )
        return [n for _, names in self.elements(key, stack_shape) for n in names]

    def to_theirs(
        self, key: str, arr: np.ndarray, *, shapes_only: bool = False
    ) -> list[tuple[str, np.ndarray]]:
        """Export: our array -> their (name, tensor) pairs.

        With `shapes_only`, the tensors are read-only zero-stride views of the right shapes and
        dtypes, and nothing of their size is allocated or copied (for planning an export from a
        zero-stride probe of `arr`'s shape and dtype).
        """
        if self.stack:
            if arr.ndim < len(self.stack):
                raise InvalidArgumentError(
                    f"export: {key!r} has shape {list(arr.shape)}, fewer axes than the stacked "
                    f"placeholders {self.stack}"
                )
            pairs = []
            for idx, names in self.elements(key, arr.shape):
                pairs += self._element_to_theirs(key, names, arr[idx], shapes_only)
            return pairs
        names = self.their_names(key) or []
        return self._element_to_theirs(key, names, arr, shapes_only)

    def _element_to_theirs(
        self, key: str, names: list[str], arr: np.ndarray, shapes_only: bool = False
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
                raise InvalidArgumentError(
                    f"export: {key!r} has {n} along axis {self.axis}, which does not split into "
                    f"{len(names)} parts of sizes {sizes}"
                )
            parts = np.split(arr, np.cumsum(sizes)[:-1], axis=self.axis)
        parts = self._permute_rope(key, parts, export=True, shapes_only=shapes_only)
        if self.squeeze is not None:
            parts = [np.expand_dims(p, self.squeeze) for p in parts]
        dtype = _np_dtype(self.dtype) if self.dtype else None
        if shapes_only:
            return [
                (name, np.broadcast_to(np.zeros((), p.dtype if dtype is None else dtype), p.shape))
                for name, p in zip(names, parts, strict=True)
            ]
        return [
            (name, np.ascontiguousarray(p if dtype is None else p.astype(dtype)))
            for name, p in zip(names, parts, strict=True)
        ]

    def to_ours(self, parts: list[np.ndarray]) -> np.ndarray:
        """Import: their tensors (in template order) -> our array (before the dtype cast).

        For a stacked rule, `parts` are one element's tensors; see :meth:`elements`.
        """
        if self.squeeze is not None:
            parts = [np.squeeze(p, self.squeeze) for p in parts]
        parts = self._permute_rope(self.ours, list(parts), export=False)
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.axis)
        if self.transpose is not None:
            arr = np.transpose(arr, np.argsort(self.transpose))
        return arr


class Codec(Protocol):
    """How their tensors are stored, for ``codec=`` of import_safetensors / export_safetensors.

    The name maps (:class:`Rule`) say which of their tensors make our arrays; a codec says how
    such a tensor is stored, when that is more than one array in its dtype: for example a
    block-scaled FP8 checkpoint keeps ``X.weight`` as float8 with a float32
    ``X.weight_scale_inv`` beside it, and an MXFP4 one stores ``X`` as ``X_blocks`` and
    ``X_scales`` without any ``X``. The methods see one of their tensors at a time, so
    loading and writing keep streaming tensor by tensor.

    :meth:`stored` is optional: import looks it up with ``getattr`` and, without it, takes
    every tensor to be stored under its own name.
    """

    def stored(self, name: str, names: Collection[str]) -> tuple[str, ...]:
        """Import: the stored tensors that make their tensor `name`, given the files' `names`.

        Import checks these (rather than `name`) are in the files before reading anything,
        names their files in errors, and, for a tensor made of others (anything but
        ``(name,)``), takes the decoded tensor to be floating point in the cast check (the
        stored ones may be packed integers). Default: ``(name,)``, stored as it is.
        """
        return (name,)

    def decode(self, name: str, read: Callable[[str], np.ndarray]) -> np.ndarray:
        """Import: their tensor `name` from the stored ones (``read(n)``: stored tensor `n`).

        ``read`` raises ValueError for a name the files lack; a tensor stored as it is is
        ``read(name)``. Raise ValueError for stored tensors that do not fit (import reports it
        as a CheckpointError naming the key, the tensors and their files).
        """
        ...

    def encode(
        self, name: str, tensor: np.ndarray, *, shapes_only: bool = False
    ) -> list[tuple[str, np.ndarray]] | None:
        """Export: the stored ``(name, array)`` pairs of their tensor `name`; None: as it is.

        The arrays are written in their own dtypes (export's `dtype` applies to the tensors
        written as they are). With `shapes_only`, `tensor` is a zero-stride probe of the shape
        and dtype, and the arrays returned must be probes too (nothing of their size
        allocated), e.g. ``np.broadcast_to(np.zeros((), dtype), shape)``.
        """
        ...


def _rope_order(n: int, head_dim: int, to_half: bool) -> np.ndarray:
    """Indices taking `n` = heads * head_dim entries interleaved -> rotate_half, or back.

    Interleaved pairs ``(2i, 2i + 1)`` become ``(i, i + head_dim / 2)``: entry ``j`` of a head in
    the rotate_half layout is entry ``2j`` (first half) or ``2(j - head_dim/2) + 1`` (second).
    """
    within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    if not to_half:
        within = np.argsort(within)
    return (np.arange(n // head_dim)[:, None] * head_dim + within[None, :]).ravel()


def _rule_for(name_map: Sequence[Rule] | None, key: str) -> Rule:
    for rule in name_map or ():
        if rule.matches(key):
            return rule
    if "{" in key or "}" in key:
        raise InvalidArgumentError(
            f"key {key!r}: no rule of the name map matches it, and as its own name its '{{' or "
            "'}' would read as a placeholder; give it a Rule whose template matches it (e.g. "
            "{name:regex}) or rename the leaf"
        )
    return Rule(key, key.replace("/", "."))
