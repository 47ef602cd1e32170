"""Collective traffic of one run of a compiled program, read from its HLO text.

Every collective instruction counts once per execution: a ``while`` body as many times as XLA's
known trip count says (a loop without one counts once, and the result says so), the branches
of a conditional at their largest, fusions and calls once per call.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["COLLECTIVES", "Traffic", "collective_traffic"]

#: The HLO collectives counted (async ``-start`` / ``-done`` pairs count once, at ``-done``).
COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTR = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+([a-z\-]+)\(")
_CALLEE = re.compile(r"\b(body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16}
_BITS.update({"bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64})


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        bits = 8 if dtype.startswith("f8") else _BITS.get(dtype, 0)
        total += size * bits // 8
    return total


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes of the collectives' results on one device in one run, and their counts.

    Attributes:
      bytes: kind -> bytes (an all-gather counts what it assembles, an all-reduce its buffer).
      counts: kind -> executions.
      unknown_loops: while loops without a known trip count (each counted once).
    """

    bytes: dict[str, int]
    counts: dict[str, int]
    unknown_loops: int

    @property
    def total(self) -> int:
        """All collectives' bytes."""
        return sum(self.bytes.values())


def collective_traffic(hlo_text: str) -> Traffic:
    """The collectives one run of the compiled module `hlo_text` executes on one device.

    Example:
      >>> from jaxops.models._hlo import collective_traffic
      >>> trips = 'backend_config={"known_trip_count":{"n":"3"}}'
      >>> text = f'''
      ... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {{
      ...   %ar = f32[8]{{0}} all-reduce(f32[8]{{0}} %x), to_apply=%add
      ... }}
      ... ENTRY %main (a: f32[8]) -> f32[8] {{
      ...   %w = (s32[], f32[8]) while(%t), condition=%c, body=%body, {trips}
      ...   %ag = f32[16]{{0}} all-gather(f32[8]{{0}} %a), dimensions={{0}}
      ... }}
      ... '''
      >>> t = collective_traffic(text)
      >>> sorted(t.bytes.items()), sorted(t.counts.items()), t.total
      ([('all-gather', 64), ('all-reduce', 96)], [('all-gather', 1), ('all-reduce', 3)], 160)
    """
    own: dict[str, list[tuple[str, int]]] = {}
    calls: dict[str, list[tuple[str, int | None]]] = {}  # None: a loop of unknown trip count
    branches: dict[str, list[list[str]]] = {}
    entry = None
    name = None
    for line in hlo_text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = _HEADER.match(line.strip())
            if m:
                name = m.group(1)
                own[name], calls[name], branches[name] = [], [], []
                if line.startswith("ENTRY"):
                    entry = name
            continue
        if name is None or "=" not in line:
            continue
        line = _COMMENT.sub("", line)
        m = _INSTR.search(line)
        if not m:
            continue
        shape, op = m.groups()
        kind = op[: -len("-done")] if op.endswith("-done") else op
        if kind in COLLECTIVES and not op.endswith("-start"):
            own[name].append((kind, _bytes(shape)))
        if op == "while":
            trips = _TRIPS.search(line)
            body = re.search(r"\bbody=%?([\w.\-]+)", line)
            if body:
                calls[name].append((body.group(1), int(trips.group(1)) if trips else None))
        elif op == "conditional":
            found = _BRANCHES.search(line)
            targets = (
                [t.strip().lstrip("%") for t in found.group(1).split(",")]
                if found
                else [c for k, c in _CALLEE.findall(line) if k.endswith("_computation")]
            )
            branches[name].append(targets)
        else:
            for key, callee in _CALLEE.findall(line):
                if key == "calls":
                    calls[name].append((callee, 1))
    if entry is None:
        raise ValueError("collective_traffic: no ENTRY computation in the HLO text")

    memo: dict[str, tuple[dict[str, int], dict[str, int], int]] = {}

    def visit(comp: str) -> tuple[dict[str, int], dict[str, int], int]:
        if comp in memo:
            return memo[comp]
        size: dict[str, int] = {}
        count: dict[str, int] = {}
        loops = 0

        def add(sub: tuple[dict[str, int], dict[str, int], int], times: int) -> None:
            nonlocal loops
            for k, v in sub[0].items():
                size[k] = size.get(k, 0) + v * times
            for k, v in sub[1].items():
                count[k] = count.get(k, 0) + v * times
            loops += sub[2]

        for kind, b in own.get(comp, ()):
            size[kind] = size.get(kind, 0) + b
            count[kind] = count.get(kind, 0) + 1
        for callee, times in calls.get(comp, ()):
            if callee in own:
                sub = visit(callee)
                if times is None and sub[1]:  # collectives in a loop of unknown length
                    loops += 1
                add(sub, 1 if times is None else times)
        for targets in branches.get(comp, ()):
            subs = [visit(t) for t in targets if t in own]
            if subs:
                add(max(subs, key=lambda s: sum(s[0].values())), 1)
        memo[comp] = (size, count, loops)
        return memo[comp]

    size, count, loops = visit(entry)
    return Traffic(bytes=size, counts=count, unknown_loops=loops)
