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

"""The accepted and rejected values of ``save_consolidated`` and ``ckpt_consolidation_frequency``."""

import pytest

from nemo_patch.training.policy import (
    ACCEPTED_FREQUENCIES,
    ConsolidationPolicy,
    parse_consolidation_frequency,
    resolve_policy,
)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("each", ConsolidationPolicy("each")),
        ("latest", ConsolidationPolicy("latest")),
        ("every_n:1", ConsolidationPolicy("every_n", 1)),
        ("every_n:5", ConsolidationPolicy("every_n", 5)),
        ("every_n:12", ConsolidationPolicy("every_n", 12)),
    ],
)
def test_accepted_frequencies(value, expected):
    assert parse_consolidation_frequency(value) == expected
    assert str(expected) == value


@pytest.mark.parametrize(
    "value",
    [
        "every_n:0",
        "every_n:-2",
        "every_n:x",
        "every_n",
        "every_n:",
        "every_n: 3",
        "every_n:3 ",
        "weekly",
        "EACH",
        " each",
        "",
        3,
        2.0,
        True,
        b"each",
        ["each"],
    ],
)
def test_rejected_frequencies_name_the_accepted_forms(value):
    with pytest.raises(ValueError) as info:
        parse_consolidation_frequency(value)
    assert ACCEPTED_FREQUENCIES in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    "save_consolidated, frequency, expected",
    [
        (None, None, None),
        (False, None, None),
        (True, None, ConsolidationPolicy("each")),
        (None, "latest", ConsolidationPolicy("latest")),
        (True, "every_n:3", ConsolidationPolicy("every_n", 3)),
        (None, "each", ConsolidationPolicy("each")),
    ],
)
def test_resolution_table(save_consolidated, frequency, expected):
    assert resolve_policy(save_consolidated, frequency) == expected


@pytest.mark.parametrize("frequency", ["each", "latest", "every_n:2"])
def test_false_with_a_frequency_is_a_contradiction_naming_both(frequency):
    with pytest.raises(ValueError, match="save_consolidated=False") as info:
        resolve_policy(False, frequency)
    assert "ckpt_consolidation_frequency" in str(info.value)


@pytest.mark.parametrize("value", [1, 0, "yes", "True"])
def test_save_consolidated_must_be_none_or_bool(value):
    with pytest.raises(ValueError, match="expected None, True or False"):
        resolve_policy(value, None)


def test_invalid_frequency_is_reported_even_with_save_consolidated_false():
    with pytest.raises(ValueError, match="Invalid ckpt_consolidation_frequency"):
        resolve_policy(False, "weekly")


@pytest.mark.parametrize(
    "frequency, due",
    [
        ("each", [1, 2, 3, 4, 5, 6]),
        ("every_n:1", [1, 2, 3, 4, 5, 6]),
        ("every_n:2", [2, 4, 6]),
        ("every_n:3", [3, 6]),
        ("latest", []),
    ],
)
def test_which_finished_saves_are_due(frequency, due):
    policy = parse_consolidation_frequency(frequency)
    assert [i for i in range(1, 7) if policy.consolidates_during_training(i)] == due
    assert policy.consolidates_at_fit_end == (frequency == "latest")


def test_save_index_counts_from_one():
    with pytest.raises(ValueError):
        ConsolidationPolicy("each").consolidates_during_training(0)
