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
author = "nemo-patch developers"
copyright = "2026, NVIDIA CORPORATION"
release = metadata.version("nemo-patch")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_argparse_cli",
    "nemo_patch_docs",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "upstream"]  # upstream/: the NeMo pull requests' texts, not pages

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # no bare entries for NeMo's undocumented arguments
autodoc_default_options = {"show-inheritance": True}  # members: only those docs/api.md lists
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"nemo-patch {release}"
html_theme_options = {"description": "When NeMo 2.x consolidates its distributed checkpoints", "fixed_sidebar": True}
