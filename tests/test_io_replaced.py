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

"""Consolidation is never switched off silently by something that replaces the checkpoint IO (#12, first part), and
PEFT adapter checkpoints are never consolidated as a model (the real LoRA runs are in ``test_peft.py``)."""

import json
import re

import pytest
from conftest import consolidated_names, run_fit

from nemo_patch.cli.nemo_consolidate import main


@pytest.mark.slow
def test_a_callback_that_rebuilds_the_checkpoint_io_gets_consolidation_back(tmp_path):
    """As NeMo's PEFT callback does in ``setup``: a new chain around NeMo's stock MegatronCheckpointIO."""
    report = run_fit(tmp_path, frequency="every_n:2", max_steps=4, save_every=2, async_save=True, swap_io="stock")
    assert (
        report["consolidation_errors"] == []
        and report["completed_steps"] == [4]
        and report["latest"] == "tiny_gpt--step=3-consumed_samples=8.0"
    )
    assert "tiny_gpt--step=3-consumed_samples=8.0" in consolidated_names(report)


@pytest.mark.slow
def test_a_checkpoint_io_that_cannot_consolidate_is_named_in_an_error(tmp_path):
    report = run_fit(tmp_path, frequency="every_n:2", max_steps=4, save_every=2, swap_io="custom")
    log = (tmp_path / "fit.log").read_text()
    assert re.search(
        r"replaced after MegatronStrategy was built by .*CustomCheckpointIO.*will NOT be consolidated", log
    )
    assert report["global_step"] == 4 and consolidated_names(report) == []  # training went on


@pytest.mark.parametrize("kind", ["stock", "custom"])
def test_the_strategy_reinstalls_or_names_the_replacement(kind, caplog):
    """The check itself, at the point Lightning calls it (strategy.setup, after every callback's setup)."""
    from nemo.lightning.io.pl import MegatronCheckpointIO as NeMoMegatronCheckpointIO
    from nemo.lightning.pytorch.strategies.utils import create_checkpoint_io

    from nemo_patch import MegatronCheckpointIO, MegatronStrategy
    from nemo_patch.testing.io_swap import _PassThroughIO
    from nemo_patch.training import integration
    from nemo_patch.training.callback import consolidation_of, find_base_checkpoint_io

    class CustomCheckpointIO(NeMoMegatronCheckpointIO):
        pass

    strategy = MegatronStrategy(ckpt_consolidation_frequency="every_n:3")
    if kind == "stock":
        replacement = create_checkpoint_io(wrapping_ckpt_io=_PassThroughIO, async_save=True)
    else:
        replacement = _PassThroughIO(CustomCheckpointIO())
    strategy._checkpoint_io = replacement  # as NeMo's PEFT callback assigns it
    with caplog.at_level("INFO", logger="nemo_patch.training.integration"):
        integration.ensure_consolidating_io(strategy)  # what strategy.setup calls
    assert strategy._checkpoint_io is replacement  # the wrappers stay the same objects
    base = find_base_checkpoint_io(strategy._checkpoint_io)
    if kind == "stock":
        assert (
            isinstance(base, MegatronCheckpointIO) and base.consolidation_settings is strategy.consolidation_settings
        )
        assert base.consolidation is not None
        assert "re-installed" in caplog.text and "AsyncFinalizableCheckpointIO > " in caplog.text
    else:
        assert type(base) is CustomCheckpointIO and consolidation_of(strategy.checkpoint_io) is None
        assert [r.levelname for r in caplog.records] == ["ERROR"] and "CustomCheckpointIO" in caplog.text


def test_an_adapter_checkpoint_is_never_written_as_a_model(checkpoint_copy, tmp_path, capsys):
    """NeMo's WrappedAdapterIO writes weights/adapter_metadata.json; such a checkpoint holds adapters only: the
    safetensors format writes adapter_model.safetensors; the Hugging Face format needs the model class's "hf-peft"
    exporter, which the plain GPTModel lacks: exit 12 naming the class, nothing written."""
    (checkpoint_copy / "weights" / "adapter_metadata.json").write_text(json.dumps({"model_ckpt_path": "/base/ckpt"}))
    assert main([str(checkpoint_copy), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 12
    err = capsys.readouterr().err
    assert "'hf-peft') exporter for nemo.collections.llm.gpt.model.base.GPTModel" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()
    assert main([str(checkpoint_copy), "--out", str(tmp_path / "out"), "--verify"]) == 0
    assert "adapter tensors" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter_model.safetensors", "metadata.json"]
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["kind"] == "adapter" and meta["base_checkpoint"] == "/base/ckpt" and meta["peft"] is None
