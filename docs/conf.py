"""Sphinx configuration of the gpu-quota-ext documentation (MyST Markdown, pydata-sphinx-theme).

Build it with `python -m sphinx docs docs/_build/html` from a clone, in an environment that has the package
and its `docs` extra (`pip install -e ".[docs]"`). The reference tables come from the code at build time
(docs/_ext/gpu_quota_docs.py), so the package must be importable: the clone's own copy is put first on the path.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

from gpu_quota_ext import __version__  # noqa: E402  (after the path is set)

project = "gpu-quota-ext"
author = "the gpu-quota-ext developers"
copyright = "the gpu-quota-ext developers"
version = release = __version__

extensions = ["myst_parser", "gpu_quota_docs"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext", "_templates"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Every cross-reference must resolve ({setting}`name` included): a dangling one is a warning, and the build
# in the test command fails on warnings.
nitpicky = True

html_theme = "pydata_sphinx_theme"
html_title = "gpu-quota-ext"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
# The left navigation: none on the home page (its "Where to start" list is one), the whole site everywhere else
# (docs/_templates/sidebar-site-nav.html). The theme's default shows only the pages below the current top-level
# page, which left Getting started, Measured, Contributing... with an empty sidebar.
html_sidebars = {"index": [], "**": ["sidebar-site-nav"]}
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["gpu-quota.css"]
