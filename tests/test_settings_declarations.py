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

"""Each consolidation setting is declared once (a field of ``ConsolidationConfig`` with :func:`setting` metadata),
and everything else is made from that declaration.

The proof: a copy of the package with one new field added to ``ConsolidationConfig`` in
``nemo_patch/training/config.py`` -- and no other edit -- has the new setting in the config (its default, its
validation with ``ConsolidationConfig.<field>`` in the message, its documented ``Attributes:``), reaching the
strategy's checkpoint IO and the consolidation process's JSON, as a ``nemo-consolidate`` option in its group, and in
the documentation's reference; the strategy's signature does not change (a setting is not an argument of its own),
and a ``ckpt_consolidation_<field>=`` keyword for it is refused naming the config's spelling.
"""

import dataclasses
import inspect
import json
import shutil
import subprocess
import sys
import textwrap
import typing

import pytest
from conftest import REPO

from nemo_patch.cli.nemo_consolidate import build_parser
from nemo_patch.training.config import SETTINGS, ConsolidationConfig, documented_attributes
from nemo_patch.training.integration import ARGUMENTS

#: The one edit: a new setting declared after the last field, and its entry in the class's ``Attributes:``.
NEW_FIELD = '''
    example_count: int = setting(
        7,
        validate=validate_max_pending,
        cli=CliOption("--example-count", "an example option", "parallelism", _whole_number),
    )
'''
ANCHOR = "\n    def __post_init__(self) -> None:\n"
NEW_ENTRY = "        example_count: an example setting added by one edit (default 7).\n"
DOC_ANCHOR = "\n\n    Raises:\n        ValueError: for an invalid value, naming ``ConsolidationConfig.<field>``"

PROBE = textwrap.dedent(
    """
    import contextlib, inspect, io, json
    import nemo_patch
    from nemo_patch import ConsolidationConfig, ConsolidationSettings
    from nemo_patch.cli.nemo_consolidate import build_parser
    from nemo_patch.overlay.deprecated import deprecated_keywords
    from nemo_patch.training.callback import find_base_checkpoint_io
    report = {"package": nemo_patch.__file__}
    report["default"] = ConsolidationConfig().example_count
    report["config_signature"] = str(inspect.signature(ConsolidationConfig))
    report["config_doc"] = "example_count: an example setting added by one edit" in ConsolidationConfig.__doc__
    config = ConsolidationConfig(example_count=3)
    strategy = nemo_patch.MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation=config)
    report["strategy_value"] = strategy.consolidation_settings.config.example_count
    report["io_value"] = find_base_checkpoint_io(strategy.checkpoint_io).consolidation_settings.config.example_count
    report["strategy_signature"] = [
        name for name in inspect.signature(nemo_patch.MegatronStrategy).parameters if "consolidat" in name
    ]
    report["json"] = ConsolidationSettings.from_json(strategy.consolidation_settings.to_json()).config.example_count
    report["deprecated"] = sorted(deprecated_keywords("strategy").values())
    errors = []
    for call in (
        lambda: ConsolidationConfig(example_count=-1),
        lambda: nemo_patch.MegatronStrategy(ckpt_consolidation_example_count=1),
    ):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    report["errors"] = errors
    parser = build_parser()
    report["cli"] = parser.parse_args(["ckpt", "--example-count", "5"]).example_count
    report["cli_default"] = parser.parse_args(["ckpt"]).example_count
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.suppress(SystemExit):
        parser.parse_args(["ckpt", "--example-count", "x"])
    report["cli_error"] = stderr.getvalue().strip().splitlines()[-1]
    groups = parser._action_groups
    report["cli_group"] = [g.title for g in groups for a in g._group_actions if a.dest == "example_count"]
    import sys
    sys.path.insert(0, "docs/_ext")
    import nemo_patch_docs
    report["docs"] = [list(entry[:5]) for entry in nemo_patch_docs.config_field_entries() if "example" in entry[0]]
    print(json.dumps(report))
    """
)


def test_one_new_field_is_a_new_setting_everywhere(tmp_path):
    copy = tmp_path / "nemo_patch"
    shutil.copytree(REPO / "nemo_patch", copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "docs" / "_ext", tmp_path / "docs" / "_ext", ignore=shutil.ignore_patterns("__pycache__"))
    config = copy / "training" / "config.py"
    text = config.read_text()
    assert text.count(ANCHOR) == 1 and text.count(DOC_ANCHOR) == 1
    text = text.replace(DOC_ANCHOR, "\n" + NEW_ENTRY + DOC_ANCHOR[1:])
    config.write_text(text.replace(ANCHOR, NEW_FIELD + ANCHOR))

    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )  # cwd first on sys.path: the edited copy is the package imported
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["package"] == str(copy / "__init__.py")
    assert report["default"] == 7 and "example_count: int = 7" in report["config_signature"]
    assert report["config_doc"]
    assert report["strategy_value"] == report["io_value"] == report["json"] == 3
    assert report["strategy_signature"] == list(ARGUMENTS)  # no new argument
    assert "example_count" not in report["deprecated"]  # a new setting gets no flat keyword
    assert report["errors"] == [
        "ValueError: Invalid ConsolidationConfig.example_count -1: expected an integer >= 0 (e.g. 2).",
        "TypeError: MegatronStrategy got an unexpected keyword argument 'ckpt_consolidation_example_count'; did you "
        "mean 'ckpt_consolidation=ConsolidationConfig(example_count=...)'? (consolidation arguments: "
        "save_consolidated, ckpt_consolidation_frequency, ckpt_consolidation)",
    ]
    assert report["cli"] == 5 and report["cli_default"] == 7 and report["cli_group"] == ["parallelism"]
    assert "argument --example-count: Invalid --example-count 'x': expected an integer >= 0" in report["cli_error"]
    assert report["docs"] == [["example_count", "int", "7", "--example-count", ""]]


def test_the_declarations_are_the_config_s_fields_and_what_the_cli_offers():
    assert [spec.field for spec in SETTINGS] == [field.name for field in dataclasses.fields(ConsolidationConfig)]
    for spec, field in zip(SETTINGS, dataclasses.fields(ConsolidationConfig)):
        assert spec.default == field.default and spec.help.strip(), spec.field
        parameter = inspect.signature(ConsolidationConfig).parameters[spec.field]
        assert parameter.default == spec.default and parameter.annotation == spec.annotation, spec.field
    # the class's literal Attributes: one entry per field, in field order, each a setting's help text
    documented = documented_attributes(ConsolidationConfig.__doc__ or "")
    assert list(documented) == [spec.field for spec in SETTINGS]
    assert all(spec.help == documented[spec.field] and len(spec.help) > 40 for spec in SETTINGS)
    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert {spec.cli.flag for spec in SETTINGS if spec.cli is not None} <= options
    defaults = vars(build_parser().parse_args(["ckpt"]))
    for spec in SETTINGS:
        if spec.cli is not None:
            assert defaults[spec.cli.flag[2:].replace("-", "_")] == spec.default, spec.field


def test_every_setting_validates_its_default_to_itself():
    for spec in SETTINGS:
        assert spec.validate(spec.default, spec.name) == spec.default, spec.field
        assert inspect.signature(spec.validate).parameters, spec.field
    assert ConsolidationConfig() == ConsolidationConfig(**{spec.field: spec.default for spec in SETTINGS})


def test_each_field_is_annotated_with_the_type_it_stores():
    """As megatron-core's ``TransformerConfig``: the annotation is what the field holds once the config is made (the
    constructor takes more: a ``torch.dtype``), so a reader and a type checker see the stored type; ``max_shard_size``
    alone also names the size string it accepts, which NeMo-Run's command line parses by the annotation."""
    import torch

    config = ConsolidationConfig(
        dtype=torch.bfloat16, max_shard_size="500MiB", workers=2, keep=3, timeout=5, post_command="true"
    )
    hints = typing.get_type_hints(ConsolidationConfig)
    for field in dataclasses.fields(config):
        value, hint = getattr(config, field.name), hints[field.name]
        allowed = set(typing.get_args(hint)) if typing.get_origin(hint) is typing.Union else {hint}
        if field.name == "max_shard_size":  # also a size string: NeMo-Run's command line parses by the annotation
            assert type(value) is int and allowed == {int, str}, (hint, value)
            continue
        assert allowed - {type(None)} == {type(value)}, (field.name, hint, value)


def test_each_later_field_is_a_field_and_names_the_product_module_that_uses_it():
    """The upstream packager leaves out of the series' ``config.py`` the fields of :data:`LATER_FIELDS` whose module
    the series lacks: each is a ``ConsolidationConfig`` field, its module is a product file that reads it, and the
    config without them still builds (what only they used goes with them)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_upstream_patch as packager

    declared = {field.name for field in dataclasses.fields(ConsolidationConfig)}
    for field, module in packager.LATER_FIELDS.items():
        assert field in declared, field
        source = REPO / (module.replace(".", "/") + ".py")
        assert source.is_file(), module
    text = packager.without_later_fields((REPO / packager.CONFIG).read_text(), list(packager.LATER_FIELDS))
    namespace: dict = {}
    exec(compile(text, "config_without_later_fields.py", "exec"), namespace)
    kept = [field.name for field in dataclasses.fields(namespace["ConsolidationConfig"])]
    assert kept == [
        name for name in (f.name for f in dataclasses.fields(ConsolidationConfig)) if name not in packager.LATER_FIELDS
    ]
    assert namespace["ConsolidationConfig"](dtype="bf16", max_shard_size="1GB").max_shard_size == 10**9
    with pytest.raises(TypeError):
        namespace["ConsolidationConfig"](format="hf")
