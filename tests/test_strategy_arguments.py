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

"""Constructing the strategy and its checkpoint IO: the three consolidation arguments, ``ConsolidationConfig``'s
validation, NeMo's context and NeMo-Run, the deprecated flat keywords, and the checkpoint IO chain."""

import dataclasses
import inspect
import json
import logging
import warnings
from typing import Optional

import pytest
from conftest import run_python
from nemo.lightning.io.pl import MegatronCheckpointIO as NeMoMegatronCheckpointIO
from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO

import nemo_patch
from nemo_patch import ConsolidationConfig, ConsolidationSettings, MegatronCheckpointIO, MegatronStrategy
from nemo_patch.engine.output_layout import DTYPE_NAMES
from nemo_patch.overlay.deprecated import DEPRECATED_FIELDS, deprecated_keywords
from nemo_patch.training import integration
from nemo_patch.training.callback import consolidation_of, find_base_checkpoint_io
from nemo_patch.training.policy import ACCEPTED_FREQUENCIES, parse_consolidation_frequency


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, None),
        ({"save_consolidated": False}, None),
        ({"save_consolidated": True}, parse_consolidation_frequency("each")),
        ({"ckpt_consolidation_frequency": "latest"}, parse_consolidation_frequency("latest")),
        (
            {"save_consolidated": True, "ckpt_consolidation_frequency": "every_n:5"},
            parse_consolidation_frequency("every_n:5"),
        ),
    ],
)
@pytest.mark.parametrize("async_save", [True, False])
def test_policy_reaches_the_checkpoint_io(kwargs, expected, async_save):
    strategy = MegatronStrategy(ckpt_async_save=async_save, **kwargs)
    assert strategy.consolidation_settings.policy == expected
    io = strategy.checkpoint_io
    # NeMo's create_checkpoint_io built the chain; the async wrapper is still outermost when async save is on.
    assert isinstance(io, AsyncFinalizableCheckpointIO) == async_save
    base = find_base_checkpoint_io(io)
    assert type(base) is NeMoMegatronCheckpointIO is MegatronCheckpointIO  # NeMo's own class, edited
    if expected is None:
        assert base.consolidation is None  # consolidates nothing
    else:
        assert base.consolidation.policy == expected
        assert base.async_save == async_save and base.save_ckpt_format == "torch_dist"


@pytest.mark.parametrize("frequency", ["every_n:0", "every_n:-2", "every_n:x", "every_n", "weekly", 3, ""])
@pytest.mark.parametrize(
    "make",
    [
        lambda frequency: MegatronStrategy(ckpt_consolidation_frequency=frequency),
        lambda frequency: MegatronCheckpointIO(consolidation_settings=ConsolidationSettings(frequency=frequency)),
    ],
    ids=["strategy", "checkpoint-io"],
)
def test_bad_frequency_raises_at_construction(make, frequency):
    with pytest.raises(ValueError) as info:
        make(frequency)
    assert ACCEPTED_FREQUENCIES in str(info.value)


@pytest.mark.parametrize(
    "frequency, why",
    [
        ("latest;", 'an empty cadence at the end: a stray ";"'),
        ("each;;latest", 'an empty cadence between two cadences: a stray ";"'),
        ("off", "consolidation is turned off with ckpt_consolidation_frequency=None (the default)"),
        ("none", "consolidation is turned off with ckpt_consolidation_frequency=None (the default)"),
        ("Latest", "'Latest' is not a cadence: cadences are lower case ('latest')"),
        ("each; EVERY_N:2@10", "'EVERY_N:2@10' is not a cadence: cadences are lower case ('every_n:2@10')"),
    ],
)
def test_frequency_messages_say_what_is_wrong_with_the_value(frequency, why):
    with pytest.raises(ValueError) as info:
        parse_consolidation_frequency(frequency)
    assert f"Invalid ckpt_consolidation_frequency {frequency!r}: {why};" in str(info.value)


@pytest.mark.parametrize(
    "name, closest",
    [
        ("ckpt_consolidaton_frequency", "ckpt_consolidation_frequency"),
        ("ckpt_consolidation_frequencies", "ckpt_consolidation_frequency"),
        ("ckpt_consolidaton", "ckpt_consolidation"),
        ("ckpt_consolidation_config", "ckpt_consolidation"),
        ("ckpt_consolidation_worker", "ckpt_consolidation=ConsolidationConfig(workers=...)"),
        ("consolidation_frequency", "ckpt_consolidation_frequency"),
        ("save_consolidate", "save_consolidated"),
    ],
)
def test_a_misspelt_consolidation_argument_raises_naming_the_closest(name, closest):
    with pytest.raises(TypeError) as info:
        MegatronStrategy(**{name: "latest"})
    message = str(info.value)
    assert f"unexpected keyword argument {name!r}; did you mean {closest!r}?" in message
    assert message.endswith(
        "(consolidation arguments: save_consolidated, ckpt_consolidation_frequency, ckpt_consolidation)"
    )


def test_nemo_own_arguments_still_pass_through():
    strategy = MegatronStrategy(ckpt_async_save=False, ckpt_load_strictness="log_all", tensor_model_parallel_size=1)
    assert strategy.consolidation_settings.policy is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: MegatronStrategy(save_consolidated=False, ckpt_consolidation_frequency="latest"),
        lambda: ConsolidationSettings.from_arguments(False, "latest"),
    ],
    ids=["strategy", "settings"],
)
def test_false_with_frequency_raises_naming_both(make):
    with pytest.raises(ValueError, match=r"save_consolidated=False contradicts ckpt_consolidation_frequency='latest'"):
        make()


@pytest.mark.parametrize("switch", [{}, {"save_consolidated": False}])
def test_a_config_without_a_frequency_warns_that_it_does_nothing(switch, caplog):
    config = ConsolidationConfig(dtype="bf16", keep=2)
    with caplog.at_level(logging.WARNING, logger="nemo_patch.training.integration"):
        strategy = MegatronStrategy(ckpt_consolidation=config, **switch)
    assert strategy.consolidation_settings.policy is None
    warnings_ = [r.getMessage() for r in caplog.records if "consolidation is off" in r.getMessage()]
    assert warnings_ == [
        "ckpt_consolidation=ConsolidationConfig(dtype='bf16', keep=2) given, but checkpoint consolidation is off: "
        "pass ckpt_consolidation_frequency (or save_consolidated=True) to consolidate checkpoints."
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_patch.training.integration"):
        MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation=config)
        MegatronStrategy(save_consolidated=False, ckpt_consolidation=ConsolidationConfig())
    assert not [r for r in caplog.records if "consolidation is off" in r.getMessage()]


def test_user_supplied_stock_checkpoint_io_consolidates_with_its_settings():
    user_io = NeMoMegatronCheckpointIO(save_ckpt_format="torch_dist", parallel_save=False)
    strategy = MegatronStrategy(checkpoint_io=user_io, ckpt_consolidation_frequency="every_n:3")
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert type(base) is MegatronCheckpointIO and base.parallel_save is False
    assert base.consolidation.policy == parse_consolidation_frequency("every_n:3")
    assert base is user_io  # the object the user gave, configured in place (no copy the user cannot see)


def test_user_supplied_consolidating_io_keeps_its_own_policy_unless_the_strategy_sets_one():
    def own() -> MegatronCheckpointIO:
        return MegatronCheckpointIO(consolidation_settings=ConsolidationSettings(frequency="latest"))

    kept = MegatronStrategy(checkpoint_io=own())
    assert consolidation_of(kept.checkpoint_io).policy == parse_consolidation_frequency("latest")
    overridden = MegatronStrategy(checkpoint_io=own(), ckpt_consolidation_frequency="each")
    assert consolidation_of(overridden.checkpoint_io).policy == parse_consolidation_frequency("each")


def test_checkpoint_io_set_after_construction_gets_the_settings():
    strategy = MegatronStrategy(ckpt_consolidation_frequency="each")
    strategy.checkpoint_io = AsyncFinalizableCheckpointIO(NeMoMegatronCheckpointIO(async_save=True))
    assert isinstance(strategy.checkpoint_io, AsyncFinalizableCheckpointIO)
    assert consolidation_of(strategy.checkpoint_io).policy == parse_consolidation_frequency("each")


def test_other_checkpoint_io_keeps_working_without_consolidation(caplog):
    class CustomIO(NeMoMegatronCheckpointIO):
        pass

    custom = CustomIO()
    with caplog.at_level(logging.WARNING, logger="nemo_patch.training.integration"):
        strategy = MegatronStrategy(checkpoint_io=custom, ckpt_consolidation_frequency="each")
    assert strategy.checkpoint_io is custom
    assert consolidation_of(strategy.checkpoint_io) is None
    assert "will not be consolidated" in caplog.text


def test_strategy_records_its_arguments_for_nemo_context():
    import fiddle as fdl

    plain = MegatronStrategy(ckpt_async_save=False)
    assert dict(plain.__io__.__arguments__) == {"ckpt_async_save": False}
    with_args = MegatronStrategy(ckpt_async_save=False, ckpt_consolidation_frequency="every_n:2")
    assert dict(with_args.__io__.__arguments__) == {
        "ckpt_async_save": False,
        "ckpt_consolidation_frequency": "every_n:2",
    }
    config = ConsolidationConfig(dtype="bf16", keep=2)
    with_config = MegatronStrategy(ckpt_async_save=False, save_consolidated=True, ckpt_consolidation=config)
    recorded = dict(with_config.__io__.__arguments__)
    assert recorded.keys() == {"ckpt_async_save", "save_consolidated", "ckpt_consolidation"}
    assert isinstance(recorded["ckpt_consolidation"], fdl.Config)  # as NeMo records any dataclass argument
    assert fdl.build(recorded["ckpt_consolidation"]) == config


def test_a_strategy_with_a_config_round_trips_through_nemo_context(tmp_path):
    """``context/io.json``: NeMo's ``IOMixin`` dump of the strategy (fiddle's JSON of its recorded arguments) and
    NeMo's ``load_context``, which builds it back."""
    from nemo.lightning.io import load_context

    config = ConsolidationConfig(dtype="bf16", keep=2)
    strategy = MegatronStrategy(ckpt_async_save=False, ckpt_consolidation_frequency="each", ckpt_consolidation=config)
    strategy.io_dump(tmp_path, yaml_attrs=[])
    data = json.loads((tmp_path / "io.json").read_text())
    assert {"module": "nemo_patch.training.config", "name": "ConsolidationConfig"} in [
        {"module": v["module"], "name": v["name"]} for v in _json_nodes(data) if "module" in v and "name" in v
    ]
    restored = load_context(tmp_path)
    assert isinstance(restored, MegatronStrategy) and restored.async_save is False
    assert restored.consolidation_settings.config == config
    assert restored.consolidation_settings == strategy.consolidation_settings


def _json_nodes(value):
    stack, found = [value], []
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def test_a_consolidation_config_is_a_nemo_run_config():
    import fiddle as fdl
    import nemo_run as run
    from nemo import lightning as nl

    assert fdl.build(run.Config(ConsolidationConfig, format="hf")) == ConsolidationConfig(format="hf")
    strategy = fdl.build(
        run.Config(
            nl.MegatronStrategy,
            ckpt_consolidation_frequency="each",
            ckpt_consolidation=run.Config(ConsolidationConfig, format="hf", dtype="bfloat16"),
        )
    )
    assert strategy.consolidation_settings.config == ConsolidationConfig(format="hf", dtype="bf16")
    with pytest.raises(ValueError, match="Invalid ConsolidationConfig.keep -1"):
        fdl.build(run.Config(ConsolidationConfig, keep=-1))


def test_the_strategy_keeps_the_checkpoint_io_it_is_given_and_makes_it_consolidate():
    stock = NeMoMegatronCheckpointIO(async_save=True, torch_dist_multiproc=2, parallel_load=True)
    before = {
        name: value for name, value in vars(stock).items() if name not in ("consolidation_settings", "consolidation")
    }
    assert integration.with_consolidation(stock, ConsolidationSettings.from_arguments(True)) is stock
    assert stock.consolidation.policy == parse_consolidation_frequency("each")
    assert {name: getattr(stock, name) for name in before} == before  # every other setting as it was
    strategy = MegatronStrategy(ckpt_consolidation_frequency="every_n:2")
    given = NeMoMegatronCheckpointIO(async_save=True)
    strategy.checkpoint_io = given  # NeMo's setter: the object itself is kept (it stored a copy)
    assert strategy.checkpoint_io is given and str(given.consolidation.policy) == "every_n:2"
    assert nemo_patch.MegatronCheckpointIO is MegatronCheckpointIO is NeMoMegatronCheckpointIO


#: (field, invalid value, what the message says is accepted)
BAD_VALUES = [
    ("timeout", 0, "a number of seconds > 0"),
    ("timeout", -5, "a number of seconds > 0"),
    ("timeout", float("inf"), "a number of seconds > 0"),
    ("timeout", "10", "a number of seconds > 0"),
    ("timeout", True, "a number of seconds > 0"),
    ("timeout", None, "a number of seconds > 0"),
    ("max_shard_size", 0, "an integer number of bytes >= 1"),
    ("max_shard_size", 1.5, "an integer number of bytes >= 1"),
    ("max_shard_size", "5XB", 'an integer number of bytes >= 1 or a size such as "5GB"'),
    ("max_shard_size", "0GB", 'an integer number of bytes >= 1 or a size such as "5GB"'),
    ("max_shard_size", "-1", 'an integer number of bytes >= 1 or a size such as "5GB"'),
    ("max_shard_size", None, "an integer number of bytes >= 1"),
    ("max_pending", -1, "an integer >= 0"),
    ("max_pending", 2.0, "an integer >= 0"),
    ("max_pending", None, "an integer >= 0"),
    ("format", "onnx", '"safetensors" or "hf"'),
    ("format", "HF", '"safetensors" or "hf"'),
    ("format", None, '"safetensors" or "hf"'),
    ("keep", -1, "None (keep every consolidated output) or an integer >= 0"),
    ("keep", True, "None (keep every consolidated output) or an integer >= 0"),
    ("keep", 2.0, "None (keep every consolidated output) or an integer >= 0"),
    ("keep", "all", "None (keep every consolidated output) or an integer >= 0"),
    ("dtype", "int8", "None (the checkpoint's dtype) or one of 'bf16', 'fp16', 'fp32'"),
    ("dtype", True, "None (the checkpoint's dtype) or one of 'bf16', 'fp16', 'fp32'"),
    ("dtype", "fp8", "None (the checkpoint's dtype) or one of 'bf16', 'fp16', 'fp32'"),
    ("merge_adapters", 1, "True or False"),
    ("merge_adapters", "yes", "True or False"),
    ("merge_adapters", None, "True or False"),
    ("workers", 0, "a whole number of writer processes >= 1"),
    ("workers", 2.0, "a whole number of writer processes >= 1"),
    ("workers", True, "a whole number of writer processes >= 1"),
    ("workers", "4", "a whole number of writer processes >= 1"),
    ("post_command", "", "None or a shell command such as 'python eval.py {output}'"),
    ("post_command", "  ", "None or a shell command such as 'python eval.py {output}'"),
    ("post_command", ["ls"], "None or a shell command such as 'python eval.py {output}'"),
    ("post_command_timeout", 0, "a number of seconds > 0"),
    ("post_command_timeout", None, "a number of seconds > 0"),
]


@pytest.mark.parametrize("field, value, accepted", BAD_VALUES)
def test_a_bad_config_value_raises_when_the_config_is_made(field, value, accepted):
    with pytest.raises(ValueError) as info:
        ConsolidationConfig(**{field: value})
    assert f"Invalid ConsolidationConfig.{field} {value!r}: expected {accepted}" in str(info.value)


@pytest.mark.parametrize("value", [{"dtype": "bf16"}, "hf", ConsolidationSettings()])
def test_a_strategy_config_that_is_not_a_consolidation_config_raises(value):
    with pytest.raises(ValueError, match=r"Invalid ckpt_consolidation .*: expected None or a ConsolidationConfig"):
        MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation=value)


def test_a_config_is_frozen_and_replace_validates():
    config = ConsolidationConfig(keep=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.keep = 3  # type: ignore[misc]
    assert dataclasses.replace(config, keep=3).keep == 3
    with pytest.raises(ValueError, match="Invalid ConsolidationConfig.keep -3"):
        dataclasses.replace(config, keep=-3)


@pytest.mark.parametrize(
    "value, size",
    [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("2.5 kB", 2500), ("2.5 kb", 312), ("123", 123), (7, 7)],
)
def test_shard_sizes_take_hugging_face_style_strings(value, size):
    assert ConsolidationConfig(max_shard_size=value).max_shard_size == size


@pytest.mark.parametrize(
    "text, size",
    [
        ("9" * 400, int("9" * 400)),
        ("9" * 400 + "TB", int("9" * 400) * 10**12),
        ("123456789012345678901", 123456789012345678901),
    ],
)
def test_shard_sizes_beyond_a_float_are_whole_numbers_not_an_overflow(text, size):
    """A size string is counted exactly: no float, whose overflow was an OverflowError (a traceback and exit code 1 in
    nemo-consolidate) and whose rounding changed sizes above 2**53."""
    from nemo_patch.cli.nemo_consolidate import build_parser

    assert ConsolidationConfig(max_shard_size=text).max_shard_size == size
    assert build_parser().parse_args(["ckpt", "--max-shard-size", text]).max_shard_size == size


@pytest.mark.parametrize(
    "value, name", [("bf16", "bf16"), ("bfloat16", "bf16"), ("FP16", "fp16"), ("half", "fp16"), ("float32", "fp32")]
)
def test_dtypes_take_short_torch_and_dtype_forms(value, name):
    import torch

    assert ConsolidationConfig(dtype=value).dtype == name
    assert ConsolidationConfig(dtype=getattr(torch, DTYPE_NAMES[name])) == ConsolidationConfig(dtype=name)


def test_consolidation_settings_reach_the_io():
    config = ConsolidationConfig(
        timeout=12.5, max_shard_size=1000, max_pending=0, dtype="bf16", merge_adapters=True, workers=3
    )
    strategy = MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation=config)
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert strategy.consolidation_settings.config is config is base.consolidation_settings.config
    assert base.consolidation_settings.config.dtype == "bf16" and base.consolidation_settings.config.workers == 3
    assert strategy.consolidation_settings.config.timeout == 12.5
    assert base.consolidation.queue.settings is strategy.consolidation_settings  # one value, validated once
    assert base.consolidation.queue._max_pending == 0


def test_a_post_command_with_an_unknown_placeholder_raises_naming_the_four():
    with pytest.raises(ValueError) as info:
        ConsolidationConfig(post_command="eval {ouptut}")
    message = str(info.value)
    assert message.startswith("Invalid ConsolidationConfig.post_command: post command 'eval {ouptut}'")
    assert "{output}, {format}, {global_step} or {checkpoint}" in message


def test_the_post_command_reaches_the_io_and_the_consolidation_process():
    command = "python eval.py {output} --step {global_step}"
    config = ConsolidationConfig(post_command=command, post_command_timeout=60)
    strategy = MegatronStrategy(ckpt_consolidation_frequency="best", ckpt_consolidation=config)
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert base.consolidation_settings.config.post_command == command
    assert base.consolidation_settings.config.post_command_timeout == 60.0
    sent = ConsolidationSettings.from_json(base.consolidation.queue._settings_json)
    assert (
        sent.config.post_command == command
        and sent.config.post_command_timeout == 60.0
        and sent == base.consolidation.queue.settings
    )


def test_settings_are_validated_once_and_handed_on_as_one_value(monkeypatch, tmp_path):
    """The strategy resolves the user's values once; its checkpoint IO, queue and the worker's command line get that
    one value (serialised once), never the separate arguments again."""
    from nemo_patch.training import settings as settings_module

    calls = []
    resolve = settings_module.resolve_policy
    monkeypatch.setattr(settings_module, "resolve_policy", lambda *args: calls.append(args) or resolve(*args))
    strategy = MegatronStrategy(
        ckpt_consolidation_frequency="every_n:3", ckpt_consolidation=ConsolidationConfig(format="hf")
    )
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert base.consolidation_settings is strategy.consolidation_settings is base.consolidation.queue.settings
    assert calls == [(None, "every_n:3")]
    assert base.consolidation.queue._settings_json == strategy.consolidation_settings.to_json()


@pytest.mark.parametrize("frequency", ["best; every_n:3@10; latest", "every_n:10; each@50000"])
def test_a_phased_frequency_round_trips_through_a_nemo_run_config(frequency):
    import fiddle as fdl
    import nemo_run as run
    from nemo import lightning as nl

    strategy = fdl.build(run.Config(nl.MegatronStrategy, ckpt_consolidation_frequency=frequency))
    assert strategy.consolidation_settings.policy == parse_consolidation_frequency(frequency)
    assert strategy.consolidation_settings.frequency == frequency


def test_nemo_run_command_line_overrides_parse_every_argument_by_its_type():
    """``nemo llm ... trainer.strategy.<name>=<text>`` goes through NeMo-Run's parser, which converts the text by the
    signature's annotations: ours, the config's fields (once the recipe holds a ``run.Config`` of it), and NeMo's own,
    which the strategy passes on (stock NeMo parses them the same)."""
    import fiddle as fdl
    import nemo_run as run
    from nemo import lightning as nl
    from nemo_run.cli.cli_parser import parse_cli_args

    overrides = {
        "ckpt_consolidation_frequency=each": "each",
        "save_consolidated=true": True,
        "ckpt_consolidation.keep=3": 3,
        "ckpt_consolidation.merge_adapters=true": True,
        "ckpt_consolidation.timeout=60": 60.0,
        "ckpt_consolidation.workers=4": 4,
        "ckpt_consolidation.max_shard_size=5GB": "5GB",  # validated into bytes when built
        "ckpt_consolidation.dtype=bf16": "bf16",
        "ckpt_async_save=false": False,  # NeMo's: a string "false" would turn async save on
        "tensor_model_parallel_size=1": 1,
    }
    recipe = run.Config(nl.MegatronStrategy, ckpt_consolidation=run.Config(ConsolidationConfig))
    config = parse_cli_args(recipe, list(overrides))
    for override, value in overrides.items():
        owner, name = config, override.split("=")[0]
        if "." in name:
            owner, name = config.ckpt_consolidation, name.split(".")[1]
        assert getattr(owner, name) == value and type(getattr(owner, name)) is type(value), override
    strategy = fdl.build(config)
    assert strategy.consolidation_settings.config == ConsolidationConfig(
        keep=3, merge_adapters=True, timeout=60, workers=4, max_shard_size=5 * 10**9, dtype="bf16"
    )


def test_the_signatures_are_nemo_s_plus_the_consolidation_arguments():
    stock = run_python(  # NeMo's own signatures, unedited
        "import inspect, json, nemo.lightning as nl; from nemo.lightning.io.pl import MegatronCheckpointIO as io; "
        "print(json.dumps([list(inspect.signature(c.__init__).parameters) for c in (nl.MegatronStrategy, io)]))",
        env={"NEMO_PATCH_DISABLE": "1"},
    )
    assert stock.returncode == 0, stock.stderr[-3000:]
    nemo, nemo_io = json.loads(stock.stdout.strip().splitlines()[-1])
    ours = inspect.signature(MegatronStrategy.__init__).parameters
    assert [name for name in ours if name in nemo] == list(nemo)  # NeMo's, in NeMo's order, positional ones first
    assert [name for name in ours if name not in nemo] == [
        "save_consolidated",
        "ckpt_consolidation_frequency",
        "ckpt_consolidation",
    ]
    assert MegatronStrategy(2).tensor_model_parallel_size == 2
    assert ours["ckpt_consolidation"].annotation == Optional[ConsolidationConfig]
    assert (
        ours["ckpt_consolidation"].kind is inspect.Parameter.KEYWORD_ONLY
        and ours["ckpt_consolidation"].default is None
    )
    io = inspect.signature(MegatronCheckpointIO.__init__).parameters
    assert list(io) == [*nemo_io, "consolidation_settings"]
    assert io["consolidation_settings"].annotation == Optional[ConsolidationSettings]
    assert MegatronCheckpointIO("zarr").save_ckpt_format == "zarr"


def test_the_docstring_documents_the_three_arguments():
    doc = MegatronStrategy.__doc__
    for name in ("save_consolidated", "ckpt_consolidation_frequency", "ckpt_consolidation"):
        assert f"\n        {name} (" in doc, name  # NeMo's docstring style: name (type): meaning
    assert "NeMo Automodel's checkpoint option ``save_consolidated`` (its 25.09 release)" in " ".join(doc.split())
    assert "{consolidation arguments}" not in doc
    attributes = ConsolidationConfig.__doc__
    for field in dataclasses.fields(ConsolidationConfig):
        assert f"\n        {field.name}: " in attributes, field.name


def test_a_checkpoint_io_built_with_positional_arguments_is_restored_from_its_context(tmp_path):
    """NeMo's IOMixin records the constructor's arguments by the signature's names; under ``(*args, ...)`` a
    positional ``save_ckpt_format`` was recorded as ``args`` and restored as the default ("torch_dist")."""
    from nemo.lightning.io import load_context

    NeMoMegatronCheckpointIO()  # NeMo's IOMixin then records from NeMo's __init__, for every subclass built after
    settings = ConsolidationSettings(frequency="each", config=ConsolidationConfig(keep=3))
    io = MegatronCheckpointIO("zarr", consolidation_settings=settings)
    io.io_dump(tmp_path, yaml_attrs=[])
    restored = load_context(tmp_path)
    assert restored.save_ckpt_format == "zarr" and restored.consolidation_settings == settings


# --- the deprecated flat keywords --------------------------------------------------------------------------------


def test_the_flat_keywords_still_work_and_warn_naming_the_new_spelling():
    with pytest.warns(DeprecationWarning) as caught:
        strategy = MegatronStrategy(
            ckpt_consolidation_frequency="each", ckpt_consolidation_dtype="bfloat16", ckpt_consolidation_keep=2
        )
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert str(warning.message) == (
        "MegatronStrategy's ckpt_consolidation_dtype, ckpt_consolidation_keep are deprecated and will be removed in "
        "the next minor release: pass ckpt_consolidation=ConsolidationConfig(dtype=..., keep=...) instead."
    )
    assert warning.filename == __file__  # attributed to the caller, not to NeMo's IOMixin or this package
    assert strategy.consolidation_settings.config == ConsolidationConfig(dtype="bf16", keep=2)
    with pytest.warns(DeprecationWarning, match=r"read \.consolidation_settings\.config\.keep instead"):
        assert strategy.ckpt_consolidation_keep == 2


def test_every_old_flat_keyword_maps_onto_its_config_field():
    assert set(DEPRECATED_FIELDS) <= {field.name for field in dataclasses.fields(ConsolidationConfig)}
    assert list(deprecated_keywords("strategy")) == [f"ckpt_consolidation_{name}" for name in DEPRECATED_FIELDS]
    assert "consolidation_timeout" not in deprecated_keywords("io")  # the checkpoint IO never took a timeout
    values = dict(timeout=5, max_shard_size="1KB", max_pending=0, format="hf", keep=1, dtype="fp16")
    values.update(merge_adapters=True, workers=2, post_command="true {output}", post_command_timeout=9)
    flat = {f"ckpt_consolidation_{name}": value for name, value in values.items()}
    with pytest.warns(DeprecationWarning):
        strategy = MegatronStrategy(ckpt_consolidation_frequency="each", **flat)
    assert strategy.consolidation_settings.config == ConsolidationConfig(**values)


@pytest.mark.parametrize("field, value, accepted", BAD_VALUES[::4])
def test_a_bad_flat_keyword_raises_naming_the_keyword(field, value, accepted):
    name = f"ckpt_consolidation_{field}"
    with pytest.raises(ValueError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        MegatronStrategy(**{name: value})
    assert f"Invalid {name} {value!r}: expected {accepted}" in str(info.value)


def test_a_flat_keyword_and_a_config_that_disagree_raise():
    with pytest.warns(DeprecationWarning):
        same = MegatronStrategy(
            ckpt_consolidation_dtype="bfloat16",
            ckpt_consolidation_workers=2,
            ckpt_consolidation=ConsolidationConfig(dtype="bf16", keep=4),
        )
    assert same.consolidation_settings.config == ConsolidationConfig(dtype="bf16", keep=4, workers=2)
    with pytest.raises(ValueError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        MegatronStrategy(ckpt_consolidation_keep=2, ckpt_consolidation=ConsolidationConfig(keep=4))
    assert str(info.value) == (
        "ckpt_consolidation_keep=2 contradicts ckpt_consolidation=ConsolidationConfig(keep=4): give the setting once, "
        "in the ConsolidationConfig."
    )


def test_a_strategy_built_with_flat_keywords_records_the_config_in_its_context(tmp_path):
    from nemo.lightning.io import load_context

    with pytest.warns(DeprecationWarning):
        strategy = MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation_max_pending=5)
    assert set(strategy.__io__.__arguments__) == {"ckpt_consolidation_frequency", "ckpt_consolidation"}
    strategy.io_dump(tmp_path, yaml_attrs=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # restoring it uses the new spelling only
        restored = load_context(tmp_path)
    assert restored.consolidation_settings == strategy.consolidation_settings


def test_the_checkpoint_io_flat_keywords_still_work_and_warn():
    with pytest.warns(DeprecationWarning) as caught:
        io = MegatronCheckpointIO(
            ckpt_consolidation_frequency="each", consolidation_keep=3, consolidation_post_command="true"
        )
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert str(warning.message) == (
        "MegatronCheckpointIO's ckpt_consolidation_frequency, consolidation_keep, consolidation_post_command are "
        "deprecated and will be removed in the next minor release: pass consolidation_settings=ConsolidationSettings"
        ".from_arguments(frequency=..., config=ConsolidationConfig(keep=..., post_command=...)) instead."
    )
    assert io.consolidation_settings == ConsolidationSettings(
        frequency="each", config=ConsolidationConfig(keep=3, post_command="true")
    )
    with pytest.raises(ValueError, match="Invalid consolidation_post_command_timeout -1"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        MegatronCheckpointIO(ckpt_consolidation_frequency="each", consolidation_post_command_timeout=-1)
    with pytest.raises(ValueError, match="not both"):
        MegatronCheckpointIO(consolidation_settings=ConsolidationSettings(), consolidation_keep=3)
    with pytest.raises(TypeError):  # NeMo's own class takes no unknown keyword, and neither does this one
        MegatronCheckpointIO(consolidation_timeout=5)


def test_the_former_attributes_still_work_and_warn():
    strategy = MegatronStrategy(ckpt_consolidation_frequency="every_n:2")
    with pytest.warns(DeprecationWarning, match=r"read \.consolidation_settings\.policy instead"):
        assert strategy.consolidation_policy == parse_consolidation_frequency("every_n:2")
    with pytest.warns(DeprecationWarning, match=r"read \.consolidation_settings\.frequency instead"):
        assert strategy.ckpt_consolidation_frequency == "every_n:2"
    io = MegatronCheckpointIO()
    with pytest.warns(DeprecationWarning, match="pass consolidation_settings= when the checkpoint IO is built"):
        io.set_consolidation_settings(ConsolidationSettings(frequency="latest"))
    assert io.consolidation.policy == parse_consolidation_frequency("latest")
