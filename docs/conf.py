# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Sphinx configuration of the nemo-patch documentation (Sphinx + MyST Markdown, NeMo's documentation toolchain).

Build (warnings are errors; what CI runs and ``tests/test_docs.py`` checks)::

    .venv/bin/sphinx-build -W --keep-going -b html docs build/docs

The reference pages are generated from the code: the API from the docstrings of ``nemo_patch.__all__`` (autodoc),
the CLI from ``nemo_patch.cli.nemo_consolidate.build_parser`` (sphinx-argparse-cli), and the strategy arguments, the
``ConsolidationConfig`` fields and the exit codes from ``nemo_patch.training.settings``, ``nemo_patch.training.config``
and ``nemo_patch.engine.errors`` (``_ext/nemo_patch_docs.py``).
"""

import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "nemo-patch"
# One place for the authorship: pyproject.toml's `authors`, read from the installed metadata; the footer's copyright
# line names the same. (The source files keep the Apache-2.0 headers they are written with to go upstream.)
author = metadata.metadata("nemo-patch")["Author"]
copyright = f"2026, {author}"
release = metadata.version("nemo-patch")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_argparse_cli",
    "sphinx_copybutton",
    "nemo_patch_docs",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "_ext",
    "_templates",
    "_static",
    "upstream",
]  # upstream/: the NeMo pull requests' texts, not pages

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # no bare entries for NeMo's undocumented arguments
autodoc_default_options = {"show-inheritance": True}  # members: only those docs/api.md lists
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The PyData theme: NeMo's own documentation theme (nvidia-sphinx-theme) is built on it, but comes under NVIDIA's
# proprietary licence, limited to NVIDIA's products. Navigation on the left, the page's own table of contents on the
# right, a fluid content column (no fixed 940 px body); wide tables scroll inside their own box, never the page
# (tests/test_docs.py opens every page in Chromium at 1280 px).
html_theme = "pydata_sphinx_theme"
html_title = f"nemo-patch {release}"
html_show_sourcelink = False
html_theme_options = {
    "secondary_sidebar_items": ["page-toc"],
    "show_toc_level": 2,
    "navigation_depth": 2,
    "show_nav_level": 1,
    "navbar_center": [],  # the pages are in the left sidebar, not in the header
    "footer_start": ["copyright"],
    "footer_center": [],
    "footer_end": ["sphinx-version", "theme-version"],
    "navbar_align": "left",
    "use_edit_page_button": False,
}
html_context = {"default_mode": "light"}
html_sidebars = {"**": ["sidebar-nav-all"]}  # _templates/: the whole navigation, not only the current section's
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["nemo-patch.css"]
html_js_files = [("nemo-patch-wrap.js", {"defer": "defer"})]  # break points in long literals (see the file)
# sphinx-copybutton: copy a block's commands without prompts or the output lines that follow a "$ " prompt.
copybutton_prompt_text = r"\$ |>>> "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = False
