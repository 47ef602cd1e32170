"""The installed package's layout: three tiers, no import running up a tier, no private name
crossing one, modules of a readable size.

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


def _imports(name: str, path: Path):
    """(imported module, imported names) of every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


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
