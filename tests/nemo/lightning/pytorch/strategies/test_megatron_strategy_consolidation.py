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

"""``MegatronStrategy(ckpt_consolidation_frequency=...)``: its arguments, validated when the strategy is made, and a
save through NeMo's ``MegatronCheckpointIO`` with NeMo's default async save, consolidated once it is finalized."""

import shutil
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from nemo.lightning.pytorch.strategies import MegatronStrategy
from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO
from safetensors.torch import load_file

from nemo_patch.training import integration
from nemo_patch.training.callback import ConsolidationCallback, consolidation_of
from nemo_patch.training.config import ConsolidationConfig

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]


class TestMegatronStrategyConsolidation:
    def test_off_by_default_and_validated_when_made(self):
        assert consolidation_of(MegatronStrategy().checkpoint_io) is None
        strategy = MegatronStrategy(save_consolidated=True, ckpt_consolidation=ConsolidationConfig(dtype="bf16"))
        assert str(strategy.consolidation_settings.policy) == "each"
        assert consolidation_of(strategy.checkpoint_io).settings.config.dtype == "bf16"
        with pytest.raises(ValueError, match="ckpt_consolidation_frequency"):
            MegatronStrategy(ckpt_consolidation_frequency="every_n:0")
        with pytest.raises(ValueError, match="ckpt_consolidation"):
            MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation={"dtype": "bf16"})
        with pytest.raises(TypeError, match="did you mean 'ckpt_consolidation_frequency'"):
            MegatronStrategy(ckpt_consolidaton_frequency="each")

    def test_a_flat_keyword_names_the_config_field_that_replaces_it(self):
        with pytest.raises(TypeError, match=r"did you mean 'ckpt_consolidation=ConsolidationConfig\(dtype=...\)'"):
            integration.strategy_settings(None, "each", None, {"ckpt_consolidation_dtype": "bf16"})

    def test_an_async_save_is_consolidated_once_finalized(self, moe_checkpoint, tmp_path):
        source, expected = moe_checkpoint
        strategy = MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_async_save=True)
        assert isinstance(strategy.checkpoint_io, AsyncFinalizableCheckpointIO)
        checkpoint_io = strategy.checkpoint_io.checkpoint_io  # NeMo's MegatronCheckpointIO, saving asynchronously
        consolidation = consolidation_of(checkpoint_io)
        assert checkpoint_io.async_save and consolidation is not None
        checkpoint_dir = tmp_path / "model--step=9"

        def save(sharded_state_dict, checkpoint_dir, async_sharded_save, **kwargs):
            shutil.copytree(source / "weights", checkpoint_dir, dirs_exist_ok=True)
            return AsyncRequest(None, (), []) if async_sharded_save else None

        rank_zero = patch("torch.distributed.get_rank", return_value=0)
        with patch("megatron.core.dist_checkpointing.save", side_effect=save), rank_zero:
            progress = {"epoch_loop.batch_progress": {"total": {"completed": 9}}}
            request = checkpoint_io.save_checkpoint(
                {"global_step": 9, "loops": {"fit_loop": progress}}, checkpoint_dir
            )
        trainer = SimpleNamespace(strategy=strategy, is_global_zero=True, global_step=9, loggers=[])
        callback = ConsolidationCallback(trainer)
        callback.on_train_batch_end(trainer)
        consolidation.sync()
        assert not consolidation.queue.busy  # not finalized yet: not a finished checkpoint
        for finalize in request.finalize_fns:  # what the async queue does once the save has ended
            finalize()
        callback.on_train_batch_end(trainer)  # the coordinator's stepper thread hands it over
        consolidation.sync()
        assert consolidation.queue.busy and consolidation.wait(timeout=120)
        consolidation.close()
        tensors = load_file(checkpoint_dir / "consolidated" / "model.safetensors")
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name]) for name in expected)
        assert callback.state_dict()["finished_count"] == 1  # every_n counts across resumes
