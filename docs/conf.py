"""Sphinx configuration of the jaxops documentation (docs/).

Build (from the repository root, with jaxops and the docs extra installed)::

    pip install '.[docs]'
    sphinx-build -W --keep-going -b html docs docs/_build/html

The API reference documents the *installed* jaxops (autodoc imports it), so build it in the
environment you installed jaxops into. The notebooks under ``examples/`` (``docs/examples`` is a
link to that folder) are executed during the build; the committed notebooks carry no outputs.
"""

from __future__ import annotations

import jaxops  # the installed package, for its version (autodoc imports the rest)

project = "jaxops"
author = "the jaxops developers"
copyright = "2026, the jaxops developers"
release = jaxops.__version__
version = release

extensions = [
    "myst_nb",  # Markdown (MyST) pages and executed notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

exclude_patterns = [
    "_build",
    "**/.ipynb_checkpoints",
    "**/__pycache__",
    "Thumbs.db",
    ".DS_Store",
]
# autosummary writes its generated pages (reStructuredText) with the first suffix.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# MyST: headings get anchors down to level 3 (links like guides/kernels.md#sharding).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks: executed on every build (they carry no committed outputs), a failing cell fails it.
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# API reference: one page per public name, generated from the docstrings.
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options: dict[str, object] = {}
templates_path = ["_templates"]
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
# An "Attributes:" section as a field list: the attributes themselves are documented by :members:.
napoleon_use_ivar = True

html_theme = "sphinx_book_theme"
html_title = f"jaxops {release}"
html_static_path = ["_static"]
html_css_files = ["front_page.css"]
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
