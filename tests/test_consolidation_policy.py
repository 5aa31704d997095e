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

"""The accepted and rejected values of ``save_consolidated`` and ``ckpt_consolidation_frequency``: single cadences,
``best``, and phases."""

import pytest

from nemo_patch.training.policy import (
    ACCEPTED_FREQUENCIES,
    CadencePhase,
    ConsolidationPolicy,
    parse_consolidation_frequency,
    resolve_policy,
)

EACH = ConsolidationPolicy((CadencePhase("each"),))
LATEST = ConsolidationPolicy((), latest_at_fit_end=True)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("each", EACH),
        ("latest", LATEST),
        ("best", ConsolidationPolicy((CadencePhase("best"),))),
        ("every_n:1", ConsolidationPolicy((CadencePhase("every_n", 1),))),
        ("every_n:5", ConsolidationPolicy((CadencePhase("every_n", 5),))),
        ("every_n:12", ConsolidationPolicy((CadencePhase("every_n", 12),))),
        (
            "every_n:10; each@50000",
            ConsolidationPolicy((CadencePhase("every_n", 10), CadencePhase("each", 1, 50000))),
        ),
        ("best; each@90000", ConsolidationPolicy((CadencePhase("best"), CadencePhase("each", 1, 90000)))),
        ("every_n:20; latest", ConsolidationPolicy((CadencePhase("every_n", 20),), latest_at_fit_end=True)),
        (
            "each; every_n:4@100; best@1000; latest",
            ConsolidationPolicy(
                (CadencePhase("each"), CadencePhase("every_n", 4, 100), CadencePhase("best", 1, 1000)), True
            ),
        ),
    ],
)
def test_accepted_frequencies_round_trip_in_canonical_spelling(value, expected):
    assert parse_consolidation_frequency(value) == expected
    assert str(expected) == value
    assert parse_consolidation_frequency(str(expected)) == expected


@pytest.mark.parametrize(
    "value, canonical",
    [("every_n:10;each@50000", "every_n:10; each@50000"), ("best ;  each@7 ; latest", "best; each@7; latest")],
)
def test_spaces_around_separators_are_accepted(value, canonical):
    assert str(parse_consolidation_frequency(value)) == canonical


@pytest.mark.parametrize(
    "value, why",
    [
        # single cadences (the forms accepted before phases existed stay rejected)
        ("every_n:0", "k must be >= 1"),
        ("every_n:-2", "not a cadence"),
        ("every_n:x", "not a cadence"),
        ("every_n", "not a cadence"),
        ("every_n:", "not a cadence"),
        ("every_n: 3", "not a cadence"),
        ("every_n:3 ", "not a cadence"),
        ("weekly", "not a cadence"),
        ("EACH", "not a cadence"),
        ("Best", "not a cadence"),
        (" each", "not a cadence"),
        ("", "consolidation is turned off with ckpt_consolidation_frequency=None"),
        (3, "not a string"),
        (2.0, "not a string"),
        (True, "not a string"),
        (b"each", "not a string"),
        (["each"], "not a string"),
        # phases
        ("each@", "not a cadence"),
        ("each; each@", "not a cadence"),
        ("each; every_n:0@10", "k must be >= 1"),
        ("every_n:0@10", "k must be >= 1"),
        ("each@100", "applies from the start"),
        ("each; best", 'needs "@<global step>"'),
        ("each; best@100; each@100", "must increase"),
        ("each; best@200; each@100", "must increase"),
        ("each; every_n:2@0", "must increase"),
        ("latest; each@10", "can only come last"),
        ("each; latest@10", "not a cadence"),
        ("each; latest; latest", "can only come last"),
        ("each;", 'an empty cadence at the end: a stray ";"'),
        ("; each", 'an empty cadence at the start: a stray ";"'),
        ("each; hourly@10", "not a cadence"),
        ("each, best@10", "not a cadence"),
        ("each; best@1e5", "not a cadence"),
    ],
)
def test_rejected_frequencies_say_why_and_give_the_grammar(value, why):
    with pytest.raises(ValueError) as info:
        parse_consolidation_frequency(value)
    assert ACCEPTED_FREQUENCIES in str(info.value)
    assert repr(value) in str(info.value)
    assert why in str(info.value)


@pytest.mark.parametrize(
    "save_consolidated, frequency, expected",
    [
        (None, None, None),
        (False, None, None),
        (True, None, EACH),
        (None, "latest", LATEST),
        (True, "every_n:3", ConsolidationPolicy((CadencePhase("every_n", 3),))),
        (None, "each", EACH),
        (True, "best; each@10", ConsolidationPolicy((CadencePhase("best"), CadencePhase("each", 1, 10)))),
    ],
)
def test_resolution_table(save_consolidated, frequency, expected):
    assert resolve_policy(save_consolidated, frequency) == expected


@pytest.mark.parametrize("frequency", ["each", "latest", "every_n:2", "best", "every_n:2; each@10"])
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
        ("best", []),
        ("every_n:20; latest", []),
    ],
)
def test_which_finished_saves_are_due_in_one_phase(frequency, due):
    policy = parse_consolidation_frequency(frequency)
    assert [i for i in range(1, 7) if policy.is_due(10 * i, i)] == due
    assert policy.consolidates_at_fit_end == frequency.endswith("latest")


def test_best_phases_consolidate_exactly_the_saves_marked_best():
    policy = parse_consolidation_frequency("best; every_n:2@100")
    assert policy.uses_best and policy.consolidates_periodically
    assert policy.is_due(10, 1, best=True) and not policy.is_due(10, 2, best=False)
    # from step 100 on, every 2nd checkpoint of that phase, whether best or not
    assert [policy.is_due(100 + i, i, best=True) for i in (1, 2, 3, 4)] == [False, True, False, True]
    assert not parse_consolidation_frequency("each").uses_best
    assert not parse_consolidation_frequency("best").consolidates_periodically


def test_phase_at_selects_by_global_step_start_inclusive():
    policy = parse_consolidation_frequency("every_n:10; each@50000; best@90000")
    assert [str(policy.phase_at(step)) for step in (0, 49999, 50000, 89999, 90000, 10**9)] == [
        "every_n:10",
        "every_n:10",
        "each@50000",
        "each@50000",
        "best@90000",
        "best@90000",
    ]
    assert parse_consolidation_frequency("latest").phase_at(5) is None


def test_index_in_phase_counts_from_one():
    with pytest.raises(ValueError):
        EACH.is_due(0, 0)


@pytest.mark.parametrize(
    "phases, latest",
    [((), False), ((CadencePhase("each", 1, 5),), False), ((CadencePhase("each"), CadencePhase("best", 1, 0)), False)],
)
def test_an_inconsistent_policy_cannot_be_built(phases, latest):
    with pytest.raises(ValueError):
        ConsolidationPolicy(phases, latest)
