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

"""Each consolidation setting is declared once (a field of ``ConsolidationSettings`` with :func:`setting` metadata),
and everything else is made from that declaration.

The proof: a copy of the package with one new field added to ``nemo_patch/training/settings.py`` -- and no other edit
-- has the new argument on ``MegatronStrategy`` and ``MegatronCheckpointIO`` (signature, docstring, read-only view,
validation with the argument's name in the message, the misspelt-keyword check), in the settings' JSON for the
consolidation process, as a ``nemo-consolidate`` option in its group, and in the documentation's argument table.
"""

import inspect
import json
import shutil
import subprocess
import sys
import textwrap

from conftest import REPO

from nemo_patch.cli.nemo_consolidate import build_parser
from nemo_patch.training.settings import (
    CHECKPOINT_IO_ARGUMENTS,
    SETTINGS,
    STRATEGY_ARGUMENTS,
    ConsolidationSettings,
    arguments_docstring,
    keyword_parameters,
)

#: The one edit: a new setting declared before ``policy`` (the derived field).
NEW_FIELD = '''
    example_count: int = setting(
        7,
        strategy="ckpt_consolidation_example_count",
        io="consolidation_example_count",
        annotation="int",
        validate=validate_max_pending,
        help="an example setting added by one edit (default 7).",
        cli=CliOption("--example-count", "an example option", "parallelism", _whole_number),
    )
'''
ANCHOR = "    policy: Optional[ConsolidationPolicy] = None\n"

PROBE = textwrap.dedent(
    """
    import inspect, json
    import nemo_patch
    from nemo_patch.cli.nemo_consolidate import build_parser
    from nemo_patch.training.settings import ConsolidationSettings
    report = {"package": nemo_patch.__file__}
    strategy = nemo_patch.MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation_example_count=3)
    report["strategy_value"] = strategy.consolidation_settings.example_count
    report["strategy_view"] = strategy.ckpt_consolidation_example_count
    report["strategy_signature"] = str(inspect.signature(nemo_patch.MegatronStrategy))
    entry = "ckpt_consolidation_example_count: an example setting"
    report["strategy_doc"] = entry in nemo_patch.MegatronStrategy.__doc__
    io = nemo_patch.MegatronCheckpointIO(ckpt_consolidation_frequency="each", consolidation_example_count=4)
    report["io_value"] = io.consolidation_example_count
    report["io_signature"] = str(inspect.signature(nemo_patch.MegatronCheckpointIO))
    report["json"] = ConsolidationSettings.from_json(strategy.consolidation_settings.to_json()).example_count
    errors = []
    for call in (
        lambda: nemo_patch.MegatronStrategy(ckpt_consolidation_example_count=-1),
        lambda: nemo_patch.MegatronCheckpointIO(consolidation_example_count="x"),
        lambda: nemo_patch.MegatronStrategy(ckpt_consolidation_example_cuont=1),
    ):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    report["errors"] = errors
    parser = build_parser()
    report["cli"] = parser.parse_args(["ckpt", "--example-count", "5"]).example_count
    groups = parser._action_groups
    report["cli_group"] = [g.title for g in groups for a in g._group_actions if a.dest == "example_count"]
    import sys
    sys.path.insert(0, "docs/_ext")
    import nemo_patch_docs
    report["docs_rows"] = [row[:3] for row in nemo_patch_docs.strategy_argument_rows() if "example" in row[0]]
    print(json.dumps(report))
    """
)


def test_one_new_field_is_a_new_setting_everywhere(tmp_path):
    copy = tmp_path / "nemo_patch"
    shutil.copytree(REPO / "nemo_patch", copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "docs" / "_ext", tmp_path / "docs" / "_ext", ignore=shutil.ignore_patterns("__pycache__"))
    settings = copy / "training" / "settings.py"
    text = settings.read_text()
    assert text.count(ANCHOR) == 1
    settings.write_text(text.replace(ANCHOR, NEW_FIELD + ANCHOR))

    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )  # cwd first on sys.path: the edited copy is the package imported
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["package"] == str(copy / "__init__.py")
    assert report["strategy_value"] == report["strategy_view"] == 3
    assert "ckpt_consolidation_example_count: int = 7" in report["strategy_signature"]
    assert report["strategy_doc"]
    assert report["io_value"] == 4 and "consolidation_example_count: int = 7" in report["io_signature"]
    assert report["json"] == 3
    assert report["errors"] == [
        "ValueError: Invalid ckpt_consolidation_example_count -1: expected an integer >= 0 (e.g. 2).",
        "ValueError: Invalid consolidation_example_count 'x': expected an integer >= 0 (e.g. 2).",
        "TypeError: MegatronStrategy got an unexpected keyword argument 'ckpt_consolidation_example_cuont'; did you "
        "mean 'ckpt_consolidation_example_count'? (consolidation arguments: "
        + ", ".join([*STRATEGY_ARGUMENTS.values(), "ckpt_consolidation_example_count"])
        + ")",
    ]
    assert report["cli"] == 5 and report["cli_group"] == ["parallelism"]
    assert report["docs_rows"] == [["ckpt_consolidation_example_count", "consolidation_example_count", "7"]]


def test_the_declarations_are_what_the_signatures_and_the_cli_offer():
    fields = [spec.field for spec in SETTINGS]
    assert fields == [f.name for f in __import__("dataclasses").fields(ConsolidationSettings) if f.name != "policy"]
    assert [p.name for p in keyword_parameters("strategy")] == list(STRATEGY_ARGUMENTS.values())
    assert [p.name for p in keyword_parameters("io")] == list(CHECKPOINT_IO_ARGUMENTS.values())
    assert all(p.default == spec.default for p, spec in zip(keyword_parameters("strategy"), SETTINGS))
    doc = arguments_docstring("strategy")
    assert [line.split(":")[0].strip() for line in doc.splitlines() if not line.startswith(" " * 12)] == list(
        STRATEGY_ARGUMENTS.values()
    )
    assert max(len(line) for line in doc.splitlines()) <= 119
    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert {spec.cli.flag for spec in SETTINGS if spec.cli is not None} <= options
    defaults = vars(build_parser().parse_args(["ckpt"]))
    for spec in SETTINGS:
        if spec.cli is not None:
            assert defaults[spec.cli.flag[2:].replace("-", "_")] == spec.default, spec.field


def test_every_setting_validates_its_default_to_itself():
    for spec in SETTINGS:
        assert spec.validate(spec.default, spec.strategy_argument) == spec.default, spec.field
        assert inspect.signature(spec.validate).parameters, spec.field
