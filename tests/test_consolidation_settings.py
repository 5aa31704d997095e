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

"""The one frozen settings value: validated where it is made, then handed on (and to the worker) unchanged."""

import dataclasses

import pytest

from nemo_patch.training.policy import parse_consolidation_frequency
from nemo_patch.training.settings import (
    CHECKPOINT_IO_ARGUMENTS,
    DEFAULT_MAX_PENDING,
    DEFAULT_TIMEOUT,
    ConsolidationSettings,
)


@pytest.mark.parametrize(
    "save_consolidated, frequency, policy",
    [
        (None, None, None),
        (False, None, None),
        (True, None, parse_consolidation_frequency("each")),
        (None, "latest", parse_consolidation_frequency("latest")),
        (True, "every_n:7", parse_consolidation_frequency("every_n:7")),
    ],
)
def test_settings_round_trip_through_json_unchanged(save_consolidated, frequency, policy):
    settings = ConsolidationSettings.from_arguments(
        save_consolidated,
        frequency,
        timeout=12,
        max_shard_size="1KiB",
        max_pending=0,
        output_format="hf",
        dtype="bfloat16",
    )
    assert settings.dtype == "bf16"
    assert settings.policy == policy and settings.enabled is (policy is not None)
    assert settings.max_shard_size == 1024 and settings.timeout == 12.0 and settings.output_dirname == "hf"
    assert ConsolidationSettings.from_json(settings.to_json()) == settings


def test_defaults_and_immutability():
    settings = ConsolidationSettings.from_arguments()
    assert settings == ConsolidationSettings() and not settings.requested and not settings.enabled
    assert (settings.max_pending, settings.timeout, settings.output_dirname) == (
        DEFAULT_MAX_PENDING,
        DEFAULT_TIMEOUT,
        "consolidated",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_pending = 5  # type: ignore[misc]
    assert ConsolidationSettings.from_arguments(False).requested  # False is a request (for no consolidation)


@pytest.mark.parametrize(
    "text", ['{"max_pending": 1, "colour": "red"}', "[1, 2]", "not json", '{"policy": {"mode": "each"}}']
)
def test_from_json_refuses_what_to_json_does_not_write(text):
    with pytest.raises((ValueError, KeyError, TypeError)):
        ConsolidationSettings.from_json(text)


def test_error_messages_name_the_argument_of_the_caller():
    with pytest.raises(ValueError, match="Invalid ckpt_consolidation_max_pending -1"):
        ConsolidationSettings.from_arguments(max_pending=-1)
    with pytest.raises(ValueError, match="Invalid consolidation_max_pending -1"):
        ConsolidationSettings.from_arguments(max_pending=-1, names=CHECKPOINT_IO_ARGUMENTS)
    with pytest.raises(ValueError, match="Invalid ckpt_consolidation_frequency 'weekly'"):
        ConsolidationSettings.from_arguments(frequency="weekly")
