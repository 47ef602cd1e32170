"""The installed package's layout: three tiers, no import running up a tier, no private name
crossing one, no import circle within one, no module of ``jaxops.models`` reading another's
private names, modules of a readable size.

The tiers: ``jaxops`` (core: kernels, precision, sharding helpers) < ``jaxops.parallel`` (from the
repository's ``parallel/``) < ``jaxops.models`` (from ``models/``). Read from the installed files
(an AST scan of every module, imports inside functions included).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import jaxops.models
import jaxops.parallel
import pytest
from _package import installed_modules

import jaxops

TIERS = {"core": 0, "parallel": 1, "models": 2}
# A ceiling, not a target: a module is one concern and splits when a second one appears, not
# when it passes a line count.
MAX_LINES = 1000
# The one reference from a lower tier to a higher one: the deprecated alias of the Llama name map
# (moved from jaxops.parallel.checkpoint to jaxops.models), imported lazily on first use of the
# old name only, never at import; it goes with the alias in the next release.
ALLOWED_UP = {("jaxops.parallel.checkpoint", "jaxops.models")}


def _tier(module: str) -> str:
    if module == "jaxops.models" or module.startswith("jaxops.models."):
        return "models"
    if module == "jaxops.parallel" or module.startswith("jaxops.parallel."):
        return "parallel"
    return "core"


MODULES = installed_modules()


def _source(name: str, node: ast.ImportFrom, path: Path) -> str:
    """The absolute name of the module a ``from ... import`` statement of `name` reads."""
    base = node.module or ""
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _imports(name: str, path: Path):
    """(imported module, imported names) of every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            yield _source(name, node, path), tuple(a.name for a in node.names)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def test_the_three_tiers_are_installed_from_their_folders():
    assert set(TIERS) == {_tier(m) for m in MODULES}
    assert Path(jaxops.parallel.__file__).parent.name == "parallel"
    assert Path(jaxops.models.__file__).parent.name == "models"
    assert len([m for m in MODULES if _tier(m) == "models"]) >= 5


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_up_a_tier_and_no_private_name_crosses_one(module):
    own = _tier(module)
    for target, names in _imports(module, MODULES[module]):
        if not target.startswith("jaxops"):
            continue
        where = _tier(target)
        if TIERS[where] > TIERS[own]:
            assert (module, target) in ALLOWED_UP, f"{module} imports {target} from a higher tier"
        if where == own:
            continue
        for n in names:
            if n.startswith("_") and not _is_module(f"{target}.{n}"):
                pytest.fail(f"{module} imports the private name {n} of {target} across tiers")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_of_a_readable_size(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines (the limit is {MAX_LINES})"


def _graph(tier: str) -> dict[str, set[str]]:
    """module -> the modules of its own tier it imports (every import, wherever it sits).

    ``from package import name`` is an edge to ``package.name`` where that is a module, else
    to ``package`` (whose ``__init__`` runs the import).
    """
    own = {m for m in MODULES if _tier(m) == tier}
    graph: dict[str, set[str]] = {m: set() for m in own}
    for module in own:
        for target, names in _imports(module, MODULES[module]):
            targets = [target] if not names else []
            for n in names:
                sub = f"{target}.{n}"
                targets.append(sub if sub in MODULES else target)
            graph[module].update(t for t in targets if t in own and t != module)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_no_import_circle_within_a_tier(tier):
    cycle = _cycle(_graph(tier))
    assert cycle is None, f"import circle in the {tier} tier: {' -> '.join(cycle)}"


def test_the_circle_finder_finds_circles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_reads(name: str, path: Path) -> list[str]:
    """Where module `name` reads a private name of another module or of an object.

    ``from x import _y`` of a `_y` that is not a module; ``x._y`` where ``x`` is neither
    ``self`` nor ``cls`` nor a module (a module's private submodule is fine: ``jaxops._checks``),
    and ``m._y`` of a module ``m`` whose `_y` is not a submodule. Dunders are public.
    """
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # name bound in the file -> the module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _source(name, node, path)
            for a in node.names:
                if _is_module(f"{source}.{a.name}"):
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source(name, node, path)
            found += [
                f"line {node.lineno}: from {source} import {a.name}"
                for a in node.names
                if _private(a.name) and not _is_module(f"{source}.{a.name}")
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base in ("self", "cls"):
                continue
            if base in aliases and _is_module(f"{aliases[base]}.{node.attr}"):
                continue
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _tier(m) == "models"))
def test_no_model_module_reads_another_modules_private_names(module):
    found = _private_reads(module, MODULES[module])
    assert not found, f"{module} reads private names: " + "; ".join(found)


def test_the_private_read_finder_finds_them(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "from jaxops import _checks\n"
        "from jaxops._checks import _hidden\n"
        "import numpy as np\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        return self._x, other._x, _checks.check_int, _checks._y, np.__name__\n"
    )
    found = _private_reads("jaxops.models.probe", path)
    assert [f.partition(": ")[2] for f in found] == [
        "from jaxops._checks import _hidden",
        "other._x",
        "_checks._y",
    ]
