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

"""Phases of ``ckpt_consolidation_frequency``: ``"<cadence>; <cadence>@<step>; ...[; latest]"`` (:data:`ACCEPTED`).

Each ``<cadence>@<step>`` replaces the cadence before it for checkpoints saved at global step ``<step>`` or later, and
``every_n`` counts the checkpoints of its own phase. Standard library only.
"""

import re
from typing import Any, Callable, List, Tuple

__all__ = ["ACCEPTED", "parse_phases"]

#: What phases add to the accepted values, for error messages.
ACCEPTED = (
    '; or phases separated by ";": a first cadence, then "<cadence>@<global step>" with steps increasing, optionally '
    'ending in "latest" (e.g. "every_n:10; each@50000", "best; each@90000", "every_n:20; latest")'
)
_SEPARATOR = re.compile(r" *; *")


def parse_phases(value: str, parse_cadence: Callable[[str], Tuple[Any, bool]]) -> Tuple[List[Any], bool]:
    """The phases of ``value`` and whether it ends in ``latest``.

    Args:
        parse_cadence: ``item -> (phase, whether "@<step>" was given)`` for one cadence (the policy's).

    Raises:
        ValueError: saying what is wrong with ``value``.
    """
    items = _SEPARATOR.split(value)
    if "" in items:
        where = "at the end" if items[-1] == "" else "at the start" if items[0] == "" else "between two cadences"
        raise ValueError(f'an empty cadence {where}: a stray ";"')
    latest = items[-1] == "latest"
    phases: List[Any] = []
    for position, item in enumerate(items[:-1] if latest else items):
        if item == "latest":
            raise ValueError('"latest" can only come last, without "@<step>"')
        phase, at_step = parse_cadence(item)
        if position == 0 and at_step:
            raise ValueError(f'the first cadence applies from the start: drop "@{phase.start_step}" from {item!r}')
        if position > 0 and not at_step:
            raise ValueError(f'{item!r} needs "@<global step>" saying from when it applies')
        if phases and phase.start_step <= phases[-1].start_step:
            raise ValueError(f"phase steps must increase: {item!r} starts at or before the previous phase")
        phases.append(phase)
    return phases, latest
