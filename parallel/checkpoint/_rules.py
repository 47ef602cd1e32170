"""Declarative name maps between our tree keys and Hugging Face tensor names."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import numpy as np

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
