"""The modules of the installed jaxops, shared by the layout and docs tests."""

from __future__ import annotations

from pathlib import Path

import jaxops.models
import jaxops.parallel

import jaxops


def installed_modules() -> dict[str, Path]:
    """Every Python module of the installed package: dotted name -> file."""
    out = {}
    roots = [
        ("jaxops", Path(jaxops.__file__).parent),
        ("jaxops.parallel", Path(jaxops.parallel.__file__).parent),
        ("jaxops.models", Path(jaxops.models.__file__).parent),
    ]
    for prefix, root in roots:
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if prefix == "jaxops" and parts and parts[0] in ("parallel", "models"):
                continue  # a copy inside an installed tree is listed under its own root
            out[name] = path
    return out
