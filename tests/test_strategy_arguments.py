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

"""Constructing the strategy and its checkpoint IO: arguments, validation and the checkpoint IO chain."""

import inspect
import logging
from typing import Optional

import pytest
from nemo.lightning.io.pl import MegatronCheckpointIO as NeMoMegatronCheckpointIO
from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO

import nemo_patch
from nemo_patch import ConsolidationSettings, MegatronCheckpointIO, MegatronStrategy
from nemo_patch.engine.output_layout import DTYPE_NAMES
from nemo_patch.training.io_chain import find_base_checkpoint_io
from nemo_patch.training.policy import ACCEPTED_FREQUENCIES, parse_consolidation_frequency
from nemo_patch.training.settings import CHECKPOINT_IO_ARGUMENTS
from nemo_patch.training.strategy import NeMoMegatronStrategy


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
    assert strategy.consolidation_policy == expected
    io = strategy.checkpoint_io
    # NeMo's create_checkpoint_io built the chain; the async wrapper is still outermost when async save is on.
    assert isinstance(io, AsyncFinalizableCheckpointIO) == async_save
    base = find_base_checkpoint_io(io)
    if expected is None:
        assert type(base) is NeMoMegatronCheckpointIO  # stock IO, untouched
    else:
        assert type(base) is MegatronCheckpointIO
        assert base.consolidation_policy == expected
        assert base.async_save == async_save and base.save_ckpt_format == "torch_dist"


@pytest.mark.parametrize("frequency", ["every_n:0", "every_n:-2", "every_n:x", "every_n", "weekly", 3, ""])
@pytest.mark.parametrize("cls", [MegatronStrategy, MegatronCheckpointIO])
def test_bad_frequency_raises_at_construction(cls, frequency):
    with pytest.raises(ValueError) as info:
        cls(ckpt_consolidation_frequency=frequency)
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
        ("ckpt_consolidation_worker", "ckpt_consolidation_workers"),
        ("consolidation_frequency", "ckpt_consolidation_frequency"),
        ("save_consolidate", "save_consolidated"),
    ],
)
def test_a_misspelt_consolidation_argument_raises_naming_the_closest(name, closest):
    with pytest.raises(TypeError) as info:
        MegatronStrategy(**{name: "latest"})
    assert f"unexpected keyword argument {name!r}; did you mean {closest!r}?" in str(info.value)


def test_nemo_own_arguments_still_pass_through():
    strategy = MegatronStrategy(ckpt_async_save=False, ckpt_load_strictness="log_all", tensor_model_parallel_size=1)
    assert strategy.consolidation_settings.policy is None


@pytest.mark.parametrize("cls", [MegatronStrategy, MegatronCheckpointIO])
def test_false_with_frequency_raises_naming_both(cls):
    with pytest.raises(ValueError, match=r"save_consolidated=False contradicts ckpt_consolidation_frequency='latest'"):
        cls(save_consolidated=False, ckpt_consolidation_frequency="latest")


@pytest.mark.parametrize("switch", [{}, {"save_consolidated": False}])
def test_settings_without_a_frequency_warn_that_they_do_nothing(switch, caplog):
    with caplog.at_level(logging.WARNING, logger="nemo_patch.training.strategy"):
        strategy = MegatronStrategy(ckpt_consolidation_dtype="bf16", ckpt_consolidation_keep=2, **switch)
    assert strategy.consolidation_policy is None
    warnings = [r.getMessage() for r in caplog.records if "consolidation is off" in r.getMessage()]
    assert warnings == [
        "ckpt_consolidation_keep, ckpt_consolidation_dtype given, but checkpoint consolidation is off: pass "
        "ckpt_consolidation_frequency (or save_consolidated=True) to consolidate checkpoints."
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_patch.training.strategy"):
        MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation_dtype="bf16")
        MegatronStrategy(save_consolidated=False)
    assert not [r for r in caplog.records if "consolidation is off" in r.getMessage()]


def test_user_supplied_stock_checkpoint_io_is_upgraded_with_its_settings():
    user_io = NeMoMegatronCheckpointIO(save_ckpt_format="torch_dist", parallel_save=False)
    strategy = MegatronStrategy(checkpoint_io=user_io, ckpt_consolidation_frequency="every_n:3")
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert type(base) is MegatronCheckpointIO and base.parallel_save is False
    assert base.consolidation_policy == parse_consolidation_frequency("every_n:3")
    assert user_io.__class__ is NeMoMegatronCheckpointIO  # the user's object is not mutated


def test_user_supplied_consolidating_io_keeps_its_own_policy_unless_the_strategy_sets_one():
    own = MegatronCheckpointIO(ckpt_consolidation_frequency="latest")
    assert MegatronStrategy(checkpoint_io=own).consolidation_policy == parse_consolidation_frequency("latest")
    overridden = MegatronStrategy(
        checkpoint_io=MegatronCheckpointIO(ckpt_consolidation_frequency="latest"), ckpt_consolidation_frequency="each"
    )
    assert overridden.consolidation_policy == parse_consolidation_frequency("each")


def test_checkpoint_io_set_after_construction_gets_the_settings():
    strategy = MegatronStrategy(ckpt_consolidation_frequency="each")
    strategy.checkpoint_io = AsyncFinalizableCheckpointIO(NeMoMegatronCheckpointIO(async_save=True))
    assert isinstance(strategy.checkpoint_io, AsyncFinalizableCheckpointIO)
    assert type(find_base_checkpoint_io(strategy.checkpoint_io)) is MegatronCheckpointIO


def test_other_checkpoint_io_keeps_working_without_consolidation(caplog):
    class CustomIO(NeMoMegatronCheckpointIO):
        pass

    custom = CustomIO()
    with caplog.at_level(logging.WARNING, logger="nemo_patch.training.strategy"):
        strategy = MegatronStrategy(checkpoint_io=custom, ckpt_consolidation_frequency="each")
    assert strategy.checkpoint_io is custom
    assert strategy.consolidation_policy is None
    assert "will not be consolidated" in caplog.text


def test_strategy_records_its_arguments_for_nemo_context():
    plain = MegatronStrategy(ckpt_async_save=False)
    assert dict(plain.__io__.__arguments__) == {"ckpt_async_save": False}
    with_args = MegatronStrategy(ckpt_async_save=False, ckpt_consolidation_frequency="every_n:2")
    assert dict(with_args.__io__.__arguments__) == {
        "ckpt_async_save": False,
        "ckpt_consolidation_frequency": "every_n:2",
    }


def test_upgrade_from_stock_io_keeps_every_setting():
    stock = NeMoMegatronCheckpointIO(async_save=True, torch_dist_multiproc=2, parallel_load=True)
    upgraded = MegatronCheckpointIO.from_checkpoint_io(stock, ConsolidationSettings.from_arguments(True))
    for name, value in vars(stock).items():
        assert getattr(upgraded, name) == value, name
    assert upgraded.consolidation_policy == parse_consolidation_frequency("each")
    assert nemo_patch.MegatronCheckpointIO is MegatronCheckpointIO


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("ckpt_consolidation_timeout", 0, "a number of seconds > 0"),
        ("ckpt_consolidation_timeout", -5, "a number of seconds > 0"),
        ("ckpt_consolidation_timeout", float("inf"), "a number of seconds > 0"),
        ("ckpt_consolidation_timeout", "10", "a number of seconds > 0"),
        ("ckpt_consolidation_timeout", True, "a number of seconds > 0"),
        ("ckpt_consolidation_max_shard_size", 0, "an integer number of bytes >= 1"),
        ("ckpt_consolidation_max_shard_size", 1.5, "an integer number of bytes >= 1"),
        ("ckpt_consolidation_max_shard_size", "5XB", 'an integer number of bytes >= 1 or a size such as "5GB"'),
        ("ckpt_consolidation_max_shard_size", "0GB", 'an integer number of bytes >= 1 or a size such as "5GB"'),
        ("ckpt_consolidation_max_shard_size", "-1", 'an integer number of bytes >= 1 or a size such as "5GB"'),
        ("ckpt_consolidation_max_pending", -1, "an integer >= 0"),
        ("ckpt_consolidation_max_pending", 2.0, "an integer >= 0"),
        ("ckpt_consolidation_max_pending", None, "an integer >= 0"),
        ("ckpt_consolidation_timeout", None, "a number of seconds > 0"),
        ("ckpt_consolidation_max_shard_size", None, "an integer number of bytes >= 1"),
        ("ckpt_consolidation_format", "onnx", '"safetensors" or "hf"'),
        ("ckpt_consolidation_format", "HF", '"safetensors" or "hf"'),
        ("ckpt_consolidation_format", None, '"safetensors" or "hf"'),
        ("ckpt_consolidation_keep", -1, "None (keep every consolidated output) or an integer >= 0"),
        ("ckpt_consolidation_keep", True, "None (keep every consolidated output) or an integer >= 0"),
        ("ckpt_consolidation_keep", 2.0, "None (keep every consolidated output) or an integer >= 0"),
        ("ckpt_consolidation_keep", "all", "None (keep every consolidated output) or an integer >= 0"),
        ("ckpt_consolidation_dtype", "int8", "None (the checkpoint's dtype) or one of 'bf16', 'fp16', 'fp32'"),
        ("ckpt_consolidation_dtype", True, "None (the checkpoint's dtype) or one of 'bf16', 'fp16', 'fp32'"),
        ("ckpt_consolidation_dtype", "fp8", "None (the checkpoint's dtype) or one of 'bf16', 'fp16', 'fp32'"),
        ("ckpt_consolidation_merge_adapters", 1, "True or False"),
        ("ckpt_consolidation_merge_adapters", "yes", "True or False"),
        ("ckpt_consolidation_merge_adapters", None, "True or False"),
        ("ckpt_consolidation_workers", 0, "a whole number of writer processes >= 1"),
        ("ckpt_consolidation_workers", 2.0, "a whole number of writer processes >= 1"),
        ("ckpt_consolidation_workers", True, "a whole number of writer processes >= 1"),
        ("ckpt_consolidation_workers", "4", "a whole number of writer processes >= 1"),
        ("ckpt_consolidation_post_command", "", "None or a shell command such as 'python eval.py {output}'"),
        ("ckpt_consolidation_post_command", "  ", "None or a shell command such as 'python eval.py {output}'"),
        ("ckpt_consolidation_post_command", ["ls"], "None or a shell command such as 'python eval.py {output}'"),
        ("ckpt_consolidation_post_command_timeout", 0, "a number of seconds > 0"),
        ("ckpt_consolidation_post_command_timeout", None, "a number of seconds > 0"),
    ],
)
def test_bad_consolidation_settings_raise_at_construction(name, value, accepted):
    with pytest.raises(ValueError) as info:
        MegatronStrategy(**{name: value})
    assert f"Invalid {name} {value!r}: expected {accepted}" in str(info.value)


@pytest.mark.parametrize(
    "value, size",
    [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("2.5 kB", 2500), ("2.5 kb", 312), ("123", 123), (7, 7)],
)
def test_shard_sizes_take_hugging_face_style_strings(value, size):
    assert MegatronStrategy(ckpt_consolidation_max_shard_size=value).ckpt_consolidation_max_shard_size == size


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

    assert MegatronStrategy(ckpt_consolidation_max_shard_size=text).ckpt_consolidation_max_shard_size == size
    assert build_parser().parse_args(["ckpt", "--max-shard-size", text]).max_shard_size == size


@pytest.mark.parametrize(
    "value, name", [("bf16", "bf16"), ("bfloat16", "bf16"), ("FP16", "fp16"), ("half", "fp16"), ("float32", "fp32")]
)
def test_dtypes_take_short_torch_and_dtype_forms(value, name):
    import torch

    assert MegatronStrategy(ckpt_consolidation_dtype=value).ckpt_consolidation_dtype == name
    assert (
        MegatronStrategy(ckpt_consolidation_dtype=getattr(torch, DTYPE_NAMES[name])).ckpt_consolidation_dtype == name
    )


def test_consolidation_settings_reach_the_io():
    strategy = MegatronStrategy(
        ckpt_consolidation_frequency="each",
        ckpt_consolidation_timeout=12.5,
        ckpt_consolidation_max_shard_size=1000,
        ckpt_consolidation_max_pending=0,
        ckpt_consolidation_dtype="bf16",
        ckpt_consolidation_merge_adapters=True,
        ckpt_consolidation_workers=3,
    )
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert base.consolidation_dtype == "bf16" and base.consolidation_merge_adapters is True
    assert base.consolidation_workers == 3 and strategy.ckpt_consolidation_workers == 3
    assert strategy.ckpt_consolidation_timeout == 12.5
    assert base.consolidation_max_shard_size == 1000 and base.consolidation_max_pending == 0
    assert base.queue.settings is strategy.consolidation_settings  # one value, validated once, handed on


def test_a_post_command_with_an_unknown_placeholder_raises_naming_the_four():
    with pytest.raises(ValueError) as info:
        MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation_post_command="eval {ouptut}")
    message = str(info.value)
    assert message.startswith("Invalid ckpt_consolidation_post_command: post command 'eval {ouptut}'")
    assert "{output}, {format}, {global_step} or {checkpoint}" in message


def test_the_post_command_reaches_the_io_and_the_consolidation_process():
    command = "python eval.py {output} --step {global_step}"
    strategy = MegatronStrategy(
        ckpt_consolidation_frequency="best",
        ckpt_consolidation_post_command=command,
        ckpt_consolidation_post_command_timeout=60,
    )
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert strategy.ckpt_consolidation_post_command == base.consolidation_post_command == command
    assert strategy.ckpt_consolidation_post_command_timeout == base.consolidation_post_command_timeout == 60.0
    sent = ConsolidationSettings.from_json(base.queue._settings_json)
    assert sent.post_command == command and sent.post_command_timeout == 60.0
    io = MegatronCheckpointIO(
        ckpt_consolidation_frequency="each", consolidation_post_command="true", consolidation_post_command_timeout=5
    )
    assert io.consolidation_settings.post_command == "true" and io.consolidation_post_command_timeout == 5.0
    with pytest.raises(ValueError, match="Invalid consolidation_post_command_timeout -1"):
        MegatronCheckpointIO(ckpt_consolidation_frequency="each", consolidation_post_command_timeout=-1)


def test_settings_are_validated_once_and_handed_on_as_one_value(monkeypatch, tmp_path):
    """The strategy parses the user's values once; its checkpoint IO, queue and the worker's command line get that
    one value (serialised once), never the separate arguments again."""
    from nemo_patch.training import settings as settings_module

    calls = []
    resolve = settings_module.resolve_policy
    monkeypatch.setattr(settings_module, "resolve_policy", lambda *args: calls.append(args) or resolve(*args))
    strategy = MegatronStrategy(ckpt_consolidation_frequency="every_n:3", ckpt_consolidation_format="hf")
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert base.consolidation_settings is strategy.consolidation_settings is base.queue.settings
    assert calls == [(None, "every_n:3")]
    assert base.queue._settings_json == strategy.consolidation_settings.to_json()


@pytest.mark.parametrize("frequency", ["best; every_n:3@10; latest", "every_n:10; each@50000"])
def test_a_phased_frequency_round_trips_through_a_nemo_run_config(frequency):
    import fiddle as fdl
    import nemo_run as run
    from nemo import lightning as nl

    strategy = fdl.build(run.Config(nl.MegatronStrategy, ckpt_consolidation_frequency=frequency))
    assert strategy.consolidation_policy == parse_consolidation_frequency(frequency)
    assert strategy.ckpt_consolidation_frequency == frequency


def test_nemo_run_command_line_overrides_parse_every_argument_by_its_type():
    """``nemo llm ... trainer.strategy.<name>=<text>`` goes through NeMo-Run's parser, which converts the text by the
    signature's annotations: ours, and NeMo's own, which the strategy passes on (stock NeMo parses them the same)."""
    import fiddle as fdl
    import nemo_run as run
    from nemo import lightning as nl
    from nemo_run.cli.cli_parser import parse_cli_args

    overrides = {
        "ckpt_consolidation_frequency=each": "each",
        "ckpt_consolidation_keep=3": 3,
        "ckpt_consolidation_merge_adapters=true": True,
        "ckpt_consolidation_timeout=60": 60.0,
        "ckpt_consolidation_workers=4": 4,
        "ckpt_consolidation_max_shard_size=5GB": "5GB",  # validated into bytes when built
        "ckpt_async_save=false": False,  # NeMo's: a string "false" would turn async save on
        "tensor_model_parallel_size=1": 1,
    }
    config = parse_cli_args(run.Config(nl.MegatronStrategy), list(overrides))
    for override, value in overrides.items():
        name = override.split("=")[0]
        assert getattr(config, name) == value and type(getattr(config, name)) is type(value), override
    strategy = fdl.build(config)
    assert strategy.ckpt_consolidation_keep == 3 and strategy.ckpt_consolidation_max_shard_size == 5 * 10**9


def test_the_signatures_are_nemo_s_plus_the_consolidation_arguments():
    nemo = inspect.signature(NeMoMegatronStrategy.__init__).parameters
    ours = inspect.signature(MegatronStrategy.__init__).parameters
    assert [name for name in ours if name in nemo] == list(nemo)  # NeMo's, in NeMo's order, positional ones first
    assert MegatronStrategy(2).tensor_model_parallel_size == 2
    assert ours["ckpt_consolidation_keep"].annotation == Optional[int]
    assert ours["ckpt_consolidation_keep"].kind is inspect.Parameter.KEYWORD_ONLY
    io = inspect.signature(MegatronCheckpointIO.__init__).parameters
    own = [*CHECKPOINT_IO_ARGUMENTS.values(), "consolidation_settings"]
    assert list(io) == [*inspect.signature(NeMoMegatronCheckpointIO.__init__).parameters, *own]  # no **kwargs
    assert io["consolidation_settings"].annotation == Optional[ConsolidationSettings]
    assert MegatronCheckpointIO("zarr").save_ckpt_format == "zarr"


def test_a_checkpoint_io_built_with_positional_arguments_is_restored_from_its_context(tmp_path):
    """NeMo's IOMixin records the constructor's arguments by the signature's names; under ``(*args, ...)`` a
    positional ``save_ckpt_format`` was recorded as ``args`` and restored as the default ("torch_dist")."""
    from nemo.lightning.io import load_context

    NeMoMegatronCheckpointIO()  # NeMo's IOMixin then records from NeMo's __init__, for every subclass built after
    io = MegatronCheckpointIO("zarr", ckpt_consolidation_frequency="each", consolidation_keep=3)
    io.io_dump(tmp_path, yaml_attrs=[])
    restored = load_context(tmp_path)
    assert restored.save_ckpt_format == "zarr" and restored.consolidation_settings == io.consolidation_settings
