"""The documentation (docs/) against the installed package: every public name of every public
module is on that module's API reference page, and nothing else is; the core package's docstring
examples run (those of jaxops.parallel and jaxops.models run in their own test files); the README
links only to pages that exist.

The Sphinx build itself (warnings as errors, the notebooks executed) runs in CI after the tests
(README "Documentation").
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import jaxops.models
import jaxops.parallel
import pytest
from _package import installed_modules

import jaxops
from jaxops import testing

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api"

# Public module -> its API reference page (docs/api/<stem>.md).
PAGES = {
    "jaxops": "jaxops",
    "jaxops.fp8": "fp8",
    "jaxops.moe": "moe",
    "jaxops.testing": "testing",
    "jaxops.parallel": "parallel",
    "jaxops.parallel.expert": "parallel.expert",
    "jaxops.parallel.pipeline": "parallel.pipeline",
    "jaxops.parallel.checkpoint": "parallel.checkpoint",
    "jaxops.models": "models",
    "jaxops.models.plan": "models.plan",
    "jaxops.models.post": "models.post",
}


def _public_modules() -> set[str]:
    """Every module of the installed package with no underscore-prefixed part in its name."""
    return {m for m in installed_modules() if not any(p.startswith("_") for p in m.split("."))}


def _resolve(entry: str, current: str):
    """The object an autosummary entry names (``~`` and a leading module path allowed)."""
    entry = entry.lstrip("~")
    module, _, name = entry.rpartition(".")
    if module.startswith("jaxops"):
        return getattr(importlib.import_module(module), name)
    return getattr(importlib.import_module(current), entry)


def _documented(page: Path) -> list[tuple[str, object]]:
    """(name, object) of every autosummary entry on an API page."""
    out = []
    current = None
    in_autosummary = False
    for line in page.read_text().splitlines():
        stripped = line.strip()
        if m := re.match(r"\.\. (?:current)?module:: (\S+)", stripped):
            current = m.group(1)
        if stripped.startswith(".. autosummary::"):
            in_autosummary = True
            continue
        if in_autosummary:
            if stripped.startswith("```") or (stripped and not line.startswith("   ")):
                in_autosummary = False
            elif stripped and not stripped.startswith(":"):
                assert current is not None, f"{page.name}: autosummary before any module"
                out.append((stripped.lstrip("~").rpartition(".")[2], _resolve(stripped, current)))
    return out


def test_every_public_module_has_an_api_page():
    assert _public_modules() == set(PAGES)
    pages = {p.stem for p in API.glob("*.md")} - {"index"}
    assert pages == set(PAGES.values())
    index = (API / "index.md").read_text()
    for stem in PAGES.values():
        assert re.search(rf"^{re.escape(stem)}$", index, re.M), f"api/index.md lacks {stem}"


@pytest.mark.parametrize("module", sorted(PAGES))
def test_api_page_documents_exactly_the_public_names(module):
    mod = importlib.import_module(module)
    documented = _documented(API / f"{PAGES[module]}.md")
    names = [name for name, _ in documented]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"docs/api/{PAGES[module]}.md lists these twice: {twice}"
    missing = sorted(set(mod.__all__) - set(names))
    extra = sorted(set(names) - set(mod.__all__))
    assert not missing, f"docs/api/{PAGES[module]}.md lacks public names of {module}: {missing}"
    assert not extra, f"docs/api/{PAGES[module]}.md lists names not in {module}.__all__: {extra}"
    for name, obj in documented:
        assert obj is getattr(mod, name), f"{name} on the page is not {module}.{name}"


def test_core_docstring_examples():
    """The examples in the docstrings of the core package (jaxops/, private modules included)."""
    attempted = testing.run_docstring_examples(jaxops, skip=("jaxops.parallel", "jaxops.models"))
    assert attempted >= 100


def test_readme_links_point_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 15
    for link in links:
        assert not link.startswith("http"), link
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def _fenced_after(text: str, marker: str) -> str:
    """The first line of the first fenced block after `marker`."""
    block = text[text.index(marker) :].split("```", 2)[1]
    return block.splitlines()[1]


def test_commands_quoted_in_the_docs_are_the_readmes():
    """The test and docs commands are quoted in the contributor guide as CI runs them."""
    readme = (ROOT / "README.md").read_text()
    contributing = (DOCS / "contributing.md").read_text()
    test_command = _fenced_after(readme, "<!-- test-command")
    assert test_command.startswith("python3 -m venv .venv && ")
    assert test_command in contributing
    docs_command = _fenced_after(readme, "<!-- docs-command")
    assert "sphinx-build -W" in docs_command and docs_command.split(" && ")[-1] in contributing


def _example(name: str):
    """examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_tutorial_{name}", ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tutorial_commands() -> list[tuple[str, str, list[str]]]:
    """``(page, script, arguments)`` of every ``python examples/X.py ...`` line of the
    tutorials' bash blocks (continuation lines joined, comments dropped)."""
    commands = []
    for page in sorted((DOCS / "tutorials").glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:1] == ["python"] and words[1].startswith("examples/"):
                    commands.append((page.name, words[1].removeprefix("examples/"), words[2:]))
    return commands


def test_tutorial_commands_parse():
    """Every command a tutorial shows names a script that exists and flags it takes (a launch
    line's flags after ``--`` are train_moe.py's); the tutorials' code comes from the scripts
    by markers that Sphinx (-W) fails on when they are missing."""
    commands = _tutorial_commands()
    assert len(commands) >= 12
    for page, script, args in commands:
        assert (ROOT / "examples" / script).is_file(), f"{page}: no examples/{script}"
        if script == "launch_local.py":
            script, args = "train_moe.py", args[args.index("--") + 1 :]
        try:
            _example(script).parse_args(args)
        except SystemExit as e:
            raise AssertionError(f"{page}: {script} {shlex.join(args)} does not parse") from e
