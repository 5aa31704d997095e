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

"""MegatronStrategy's checkpoint consolidation arguments: validated at construction, carried to the checkpoint IO."""

import nemo.lightning as nl
import pytest
from nemo.lightning.io.consolidation.training.checkpoint_io import MegatronCheckpointIO as ConsolidatingIO
from nemo.lightning.io.consolidation.training.io_chain import find_base_checkpoint_io
from nemo.lightning.io.consolidation.training.policy import parse_consolidation_frequency
from nemo.lightning.io.pl import ConsolidatingMegatronCheckpointIO, MegatronCheckpointIO


def test_the_consolidating_io_is_exported_next_to_nemos():
    assert nl.MegatronStrategy.__module__ == "nemo.lightning.pytorch.strategies.megatron_strategy"
    assert ConsolidatingMegatronCheckpointIO is ConsolidatingIO


def test_default_is_nemos_checkpoint_io():
    strategy = nl.MegatronStrategy()
    assert strategy.consolidation_policy is None
    assert type(find_base_checkpoint_io(strategy.checkpoint_io)) is MegatronCheckpointIO


@pytest.mark.parametrize(
    "kwargs, frequency",
    [
        ({"ckpt_consolidation_frequency": "latest"}, "latest"),
        ({"ckpt_consolidation_frequency": "every_n:5"}, "every_n:5"),
        ({"ckpt_consolidation_frequency": "best"}, "best"),
        ({"save_consolidated": True}, "each"),
    ],
)
def test_frequency_reaches_the_checkpoint_io(kwargs, frequency):
    strategy = nl.MegatronStrategy(ckpt_consolidation_max_shard_size="1GB", ckpt_async_save=False, **kwargs)
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert isinstance(base, ConsolidatingIO) and base.consolidation_policy == parse_consolidation_frequency(frequency)
    assert base.consolidation_settings.max_shard_size == 10**9


@pytest.mark.parametrize(
    "kwargs, accepted",
    [
        ({"ckpt_consolidation_frequency": "weekly"}, '"each", "latest", "best" or "every_n:<k>"'),
        ({"ckpt_consolidation_frequency": "every_n:0"}, "k must be >= 1"),
        ({"ckpt_consolidation_frequency": "every_n:10; each@500"}, "one cadence is expected"),
        ({"save_consolidated": False, "ckpt_consolidation_frequency": "each"}, "contradicts"),
        ({"ckpt_consolidation_timeout": 0}, "a number of seconds > 0"),
        ({"ckpt_consolidation_max_pending": -1}, "an integer >= 0"),
        ({"ckpt_consolidation_format": "onnx"}, '"safetensors" or "hf"'),
        ({"ckpt_consolidation_keep": -1}, "None (keep every consolidated output) or an integer >= 0"),
        ({"ckpt_consolidation_dtype": "int8"}, "None (the checkpoint's dtype)"),
        ({"ckpt_consolidation_merge_adapters": 1}, "True or False"),
        ({"ckpt_consolidation_workers": 0}, "writer processes >= 1"),
    ],
)
def test_bad_values_raise_at_construction(kwargs, accepted):
    with pytest.raises(ValueError, match=accepted.replace("(", r"\(").replace(")", r"\)")):
        nl.MegatronStrategy(**kwargs)


def test_the_arguments_are_documented_before_kwargs():
    doc = nl.MegatronStrategy.__doc__ or ""
    kwargs = doc.index("**kwargs")
    for name in ("save_consolidated (", "ckpt_consolidation_frequency (", "ckpt_consolidation_workers ("):
        assert 0 <= doc.index(name) < kwargs, name
