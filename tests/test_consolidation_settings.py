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

"""The one frozen settings value: resolved where it is made, then handed on (and to the worker) unchanged."""

import dataclasses
import json

import pytest

from nemo_patch.overlay.deprecated import merge_deprecated_keywords
from nemo_patch.training.config import DEFAULT_MAX_PENDING, DEFAULT_TIMEOUT, ConsolidationConfig
from nemo_patch.training.policy import parse_consolidation_frequency
from nemo_patch.training.settings import ConsolidationSettings


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
    config = ConsolidationConfig(timeout=12, max_shard_size="1KiB", max_pending=0, format="hf", dtype="bfloat16")
    settings = ConsolidationSettings.from_arguments(save_consolidated, frequency, config)
    assert settings.config.dtype == "bf16" and settings.config is config
    assert settings.policy == policy and settings.enabled is (policy is not None)
    assert settings.config.max_shard_size == 1024 and settings.config.timeout == 12.0
    assert settings.output_dirname == "hf"
    assert ConsolidationSettings.from_json(settings.to_json()) == settings
    assert json.loads(settings.to_json())["config"] == dataclasses.asdict(config)  # the worker's JSON carries it


def test_defaults_and_immutability():
    settings = ConsolidationSettings.from_arguments()
    assert settings == ConsolidationSettings() and not settings.requested and not settings.enabled
    assert settings.config == ConsolidationConfig()
    assert (settings.config.max_pending, settings.config.timeout, settings.output_dirname) == (
        DEFAULT_MAX_PENDING,
        DEFAULT_TIMEOUT,
        "consolidated",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.frequency = "each"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.config.max_pending = 5  # type: ignore[misc]
    assert ConsolidationSettings.from_arguments(False).requested  # False is a request (for no consolidation)


def test_the_constructor_resolves_the_cadence_as_from_arguments_does():
    config = ConsolidationConfig(keep=1)
    assert ConsolidationSettings(True, "every_n:2", config) == ConsolidationSettings.from_arguments(
        True, "every_n:2", config
    )
    assert ConsolidationSettings(frequency="best").policy == parse_consolidation_frequency("best")
    assert "policy" not in {field.name for field in dataclasses.fields(ConsolidationSettings) if field.init}


@pytest.mark.parametrize(
    "text",
    [
        '{"max_pending": 1, "colour": "red"}',
        "[1, 2]",
        "not json",
        '{"policy": {"mode": "each"}}',
        '{"config": {"colour": "red"}}',
        '{"config": [1]}',
        '{"frequency": "each", "policy": "latest"}',  # a cadence its arguments do not resolve to
    ],
)
def test_from_json_refuses_what_to_json_does_not_write(text):
    with pytest.raises((ValueError, KeyError, TypeError)):
        ConsolidationSettings.from_json(text)


def test_error_messages_name_the_argument_or_the_field():
    with pytest.raises(ValueError, match="Invalid ConsolidationConfig.max_pending -1"):
        ConsolidationConfig(max_pending=-1)
    with pytest.raises(ValueError, match="Invalid consolidation_max_pending -1"):
        merge_deprecated_keywords({"max_pending": -1}, {"max_pending": "consolidation_max_pending"}, None)
    with pytest.raises(ValueError, match="Invalid ckpt_consolidation_frequency 'weekly'"):
        ConsolidationSettings.from_arguments(frequency="weekly")
    with pytest.raises(ValueError, match="Invalid ckpt_consolidation 3: expected None or a ConsolidationConfig"):
        ConsolidationSettings.from_arguments(config=3)  # type: ignore[arg-type]
