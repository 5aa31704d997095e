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

"""The upstream series' generator stops, naming the anchor and the module, whenever a change no longer fits the
overlay's code (``scripts/upstream/transforms.py``, ``nemo_edits.py``), and its checks of each stage's tree catch
what a change could leave behind. Quick: no NeMo tree is patched (``tests/test_upstream_patch.py`` does that)."""

import shutil
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import make_upstream_patch  # noqa: E402
from upstream import changes, nemo_edits  # noqa: E402
from upstream.transforms import (  # noqa: E402
    Drop,
    DropArgument,
    DropKeyword,
    Edit,
    Replace,
    TransformError,
    apply_changes,
    drop_argument,
    drop_keyword,
)

pytestmark = pytest.mark.matrix

MODULE = '''"""A module."""

from typing import Optional


def f(
    a: int,
    best: Optional[int] = None,
) -> int:
    """F.

    Args:
        a: a number.
        best: what was best,
            over two lines.
    """
    return a


class C:
    z = 1

    def g(self, x: int, y: int = 0) -> int:
        return x + y


X = setting(1, help="x", cli=Option("--x"))
'''

NEVER = lambda until: False  # noqa: E731 - no stage has landed: every change is in force


@pytest.mark.parametrize(
    "change, named",
    [
        (Edit("m.py", "text that is not there", "x"), "text that is not there"),
        (Drop("m.py", ("h",)), "'h'"),
        (Drop("m.py", ("C.h",)), "'C.h'"),
        (Replace("m.py", "D", "class D: ..."), "'D'"),
        (DropArgument("m.py", "f", "worst"), "'worst'"),
        (DropArgument("m.py", "C.h", "x"), "'C.h'"),
        (DropKeyword("m.py", "setting", "doc"), "doc="),
    ],
)
def test_a_change_that_finds_nothing_stops_naming_its_anchor_and_module(change, named):
    with pytest.raises(TransformError) as raised:
        apply_changes(MODULE, "m.py", [change], NEVER)
    assert "m.py" in str(raised.value) and named in str(raised.value)


def test_the_transforms_remove_what_they_name():
    text = drop_argument(MODULE, "f", "best")
    assert "best" not in text and "a: a number." in text
    assert "y: int" not in drop_argument(MODULE, "C.g", "y")
    assert "cli=" not in drop_keyword(MODULE, "setting", "cli")
    text = apply_changes(MODULE, "m.py", [Drop("m.py", ("C.g",)), Replace("m.py", "X", "X = 2")], NEVER)
    assert "def g" not in text and "X = 2\n" in text


def test_an_overlay_module_that_moved_on_stops_the_series_naming_it():
    """The retention stage's change of ``consolidate_checkpoint(best=...)`` no longer finds its parameter."""
    source = (REPO / "nemo_patch" / "engine" / "consolidate.py").read_text()
    moved_on = source.replace("    best: Optional[Mapping[str, Any]] = None,\n", "    record=None,\n")
    with pytest.raises(TransformError, match=r"engine/consolidate.py \(a change until 'retention'\).*'best'"):
        apply_changes(moved_on, "engine/consolidate.py", changes.CHANGES, NEVER)


def test_a_nemo_file_without_its_anchor_stops_naming_the_file():
    with pytest.raises(SystemExit, match="megatron_strategy.py: expected the anchor once, found it 0 times"):
        nemo_edits.patched_strategy("class MegatronStrategy: ...\n", lambda until: True, [])


def test_a_stage_that_leaves_an_undefined_name_or_a_missing_module_is_refused():
    state = {"nemo/lightning/io/consolidation/a.py": "def f():\n    return held_back()\n"}
    with pytest.raises(SystemExit, match="undefined name 'held_back'"):
        make_upstream_patch.check_pyflakes(state, {}, "knob")
    state = {"nemo/lightning/io/consolidation/a.py": "from nemo.lightning.io.consolidation.training import latest\n"}
    with pytest.raises(SystemExit, match="imports nemo.lightning.io.consolidation.training"):
        make_upstream_patch.check_imports(state, "knob")


def test_the_docs_page_is_listed_in_a_source_checkouts_toctree(tmp_path):
    """The ``nemo_toolkit`` wheel has no ``docs/``; a NeMo source checkout has the checkpoints index, and the first
    patch adds the new page to its toctree."""
    installed = make_upstream_patch.installed_nemo_src()
    assert not (installed / "docs").exists()
    for path in nemo_edits.EDITED:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(installed / path, tmp_path / path)
    index = tmp_path / nemo_edits.DOCS_INDEX
    index.parent.mkdir(parents=True)
    index.write_text(
        "Checkpoints\n===========\n\n.. toctree::\n   :maxdepth: 1\n   :caption: NeMo Checkpoints\n\n"
        "   dist_ckpt\n   user_guide\n   dev_guide\n   convert_mlm\n"
    )
    state = make_upstream_patch.tree_state(tmp_path, make_upstream_patch.STAGE_KEYS[0])
    assert state[nemo_edits.DOCS_INDEX].endswith("   convert_mlm\n   consolidation\n")
    assert make_upstream_patch.DOCS_PAGE in state
