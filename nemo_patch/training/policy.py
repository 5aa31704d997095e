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

"""When a training run consolidates its distributed checkpoints: the cadence.

This module is the single place where the user-facing ``save_consolidated`` and ``ckpt_consolidation_frequency``
arguments are parsed and validated, once, when :class:`nemo_patch.training.settings.ConsolidationSettings` is made
from the user's values; every other part of the package gets the parsed :class:`ConsolidationPolicy`.

Accepted frequencies (:data:`ACCEPTED_FREQUENCIES`): one cadence, or phases separated by ``;``.

* ``"each"``: consolidate every finished checkpoint.
* ``"every_n:<k>"`` with ``k`` an integer >= 1: consolidate the k-th, 2k-th, ... finished checkpoint (of the run,
  or of the phase; the count includes saves made before a resume).
* ``"best"``: consolidate a finished checkpoint when it was the best so far by NeMo's ``ModelCheckpoint``
  ``monitor``/``mode`` when it was saved (``ModelCheckpoint.best_model_path`` named it), and keep ``<root>/BEST`` on
  the best consolidated checkpoint; when ``fit`` ends, the run's best finished checkpoint is consolidated if it is
  not yet and ``BEST`` names it.
* ``"latest"``: consolidate nothing during training; when ``fit`` ends, consolidate the newest finished checkpoint.
* Phases: ``"<cadence>; <cadence>@<step>; ..."``. The first cadence applies from the start; each ``<cadence>@<step>``
  replaces it for checkpoints saved at global step ``<step>`` or later (steps strictly increasing). ``every_n``
  counts the checkpoints of its own phase. A final ``"; latest"`` (no ``@``) also consolidates the newest finished
  checkpoint when ``fit`` ends. Examples: ``"every_n:10; each@50000"``, ``"best; each@90000"``,
  ``"every_n:20; latest"``.

Standard library only: never torch, NeMo or Lightning, so that ``import nemo_patch`` can import it.
"""

import re
from dataclasses import dataclass
from typing import List, Literal, Optional, Tuple

__all__ = [
    "ACCEPTED_FREQUENCIES",
    "CadencePhase",
    "ConsolidationPolicy",
    "parse_consolidation_frequency",
    "resolve_policy",
]

#: Human-readable grammar of ``ckpt_consolidation_frequency``, used in error messages.
ACCEPTED_FREQUENCIES = (
    '"each", "latest", "best" or "every_n:<k>" with k an integer >= 1 (e.g. "every_n:5"); or phases separated by '
    '";": a first cadence, then "<cadence>@<global step>" with steps increasing, optionally ending in "latest" '
    '(e.g. "every_n:10; each@50000", "best; each@90000", "every_n:20; latest")'
)

Cadence = Literal["each", "every_n", "best"]

_PHASE = re.compile(r"(each|best|every_n:([0-9]+))(?:@([0-9]+))?")
_SEPARATOR = re.compile(r" *; *")
#: Values people try for "no consolidation"; the message says how it is really turned off.
_OFF_WORDS = frozenset({"off", "none", "no", "never", "false", "disable", "disabled", "0", ""})


@dataclass(frozen=True)
class CadencePhase:
    """One phase of a cadence: which finished checkpoints saved from ``start_step`` on are consolidated.

    Attributes:
        cadence: ``"each"``, ``"every_n"`` or ``"best"``.
        every_n: the ``k`` of ``"every_n:<k>"`` (>= 1); 1 otherwise.
        start_step: the first global step the phase applies to (0 for the first phase).
    """

    cadence: Cadence
    every_n: int = 1
    start_step: int = 0

    def __str__(self) -> str:
        text = f"every_n:{self.every_n}" if self.cadence == "every_n" else self.cadence
        return f"{text}@{self.start_step}" if self.start_step else text


@dataclass(frozen=True)
class ConsolidationPolicy:
    """A parsed consolidation cadence: phases in order of ``start_step``, and what happens when ``fit`` ends.

    Attributes:
        phases: the phases (empty for ``"latest"``: nothing is consolidated during training); the first starts at
            global step 0, the others at strictly increasing steps.
        latest_at_fit_end: consolidate the newest finished checkpoint when ``fit`` ends (``"latest"``, or a phase
            list ending in ``"; latest"``).
    """

    phases: Tuple[CadencePhase, ...] = ()
    latest_at_fit_end: bool = False

    def __post_init__(self) -> None:
        starts = [phase.start_step for phase in self.phases]
        if starts and (starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:]))):
            raise ValueError(f"Phase start steps must be 0, then strictly increasing; got {starts}")
        if not self.phases and not self.latest_at_fit_end:
            raise ValueError("A consolidation policy needs at least one phase or latest_at_fit_end=True")

    def __str__(self) -> str:
        return "; ".join([str(phase) for phase in self.phases] + (["latest"] if self.latest_at_fit_end else []))

    def phase_at(self, global_step: int) -> Optional[CadencePhase]:
        """The phase that applies to a checkpoint saved at ``global_step`` (``None`` for ``"latest"``)."""
        current = None
        for phase in self.phases:
            if phase.start_step > global_step:
                break
            current = phase
        return current

    def is_due(self, global_step: int, index_in_phase: int, best: bool = False) -> bool:
        """Whether a finished checkpoint is consolidated when it finishes.

        Args:
            global_step: the checkpoint's global step (selects the phase).
            index_in_phase: 1 for the first finished checkpoint of that phase, 2 for the second, ...; saves made
                before a resume count.
            best: whether ``ModelCheckpoint`` named it its best checkpoint when it was saved.

        Returns:
            ``True`` in an ``"each"`` phase; ``index_in_phase % k == 0`` in ``"every_n:<k>"``; ``best`` in
            ``"best"``; ``False`` for ``"latest"`` (which consolidates only when ``fit`` ends).

        Raises:
            ValueError: if ``index_in_phase`` < 1.
        """
        if index_in_phase < 1:
            raise ValueError(f"index_in_phase counts finished checkpoints from 1, got {index_in_phase}")
        phase = self.phase_at(global_step)
        if phase is None:
            return False
        if phase.cadence == "every_n":
            return index_in_phase % phase.every_n == 0
        return best if phase.cadence == "best" else True

    @property
    def uses_best(self) -> bool:
        """Whether a phase is ``"best"``: ``ModelCheckpoint`` must monitor a metric, and ``BEST`` is kept."""
        return any(phase.cadence == "best" for phase in self.phases)

    @property
    def consolidates_periodically(self) -> bool:
        """Whether a phase is ``"each"`` or ``"every_n"`` (consolidations follow the save interval)."""
        return any(phase.cadence != "best" for phase in self.phases)

    @property
    def consolidates_at_fit_end(self) -> bool:
        """Whether the newest finished checkpoint is consolidated when ``fit`` ends."""
        return self.latest_at_fit_end


def _invalid(value: object, why: str) -> ValueError:
    return ValueError(f"Invalid ckpt_consolidation_frequency {value!r}: {why}; expected {ACCEPTED_FREQUENCIES}.")


def parse_consolidation_frequency(value: object) -> ConsolidationPolicy:
    """Parse a ``ckpt_consolidation_frequency`` value (grammar in the module docstring).

    Args:
        value: ``"each"``, ``"latest"``, ``"best"``, ``"every_n:<k>"`` (``k`` decimal digits, >= 1), or phases
            ``"<cadence>; <cadence>@<step>; ...[; latest]"`` (spaces only around ``;``). Anything else, including
            non-strings, is rejected.

    Returns:
        The parsed :class:`ConsolidationPolicy`; ``str()`` of it gives the value back in canonical spelling (one
        space after each ``;``).

    Raises:
        ValueError: if ``value`` is not one of the accepted forms; the message says what is wrong and gives the
            grammar.
    """
    if not isinstance(value, str):
        raise _invalid(value, "not a string")
    if value.strip().lower() in _OFF_WORDS:
        raise _invalid(value, "consolidation is turned off with ckpt_consolidation_frequency=None (the default)")
    items = _SEPARATOR.split(value)
    if "" in items:
        where = "at the end" if items[-1] == "" else "at the start" if items[0] == "" else "between two cadences"
        raise _invalid(value, f'an empty cadence {where}: a stray ";"')
    latest = items[-1] == "latest"
    if latest:
        items = items[:-1]
    phases: List[CadencePhase] = []
    for position, item in enumerate(items):
        match = _PHASE.fullmatch(item)
        if item == "latest":
            raise _invalid(value, '"latest" can only come last, without "@<step>"')
        if match is None and (item.lower() == "latest" or _PHASE.fullmatch(item.lower()) is not None):
            raise _invalid(value, f"{item!r} is not a cadence: cadences are lower case ({item.lower()!r})")
        if match is None:
            raise _invalid(value, f"{item!r} is not a cadence")
        if match.group(2) is not None and int(match.group(2)) < 1:
            raise _invalid(value, f"{item!r}: k must be >= 1")
        step = match.group(3)
        if position == 0 and step is not None:
            raise _invalid(value, f'the first cadence applies from the start: drop "@{step}" from {item!r}')
        if position > 0 and step is None:
            raise _invalid(value, f'{item!r} needs "@<global step>" saying from when it applies')
        start = 0 if step is None else int(step)
        if phases and start <= phases[-1].start_step:
            raise _invalid(value, f"phase steps must increase: {item!r} starts at or before the previous phase")
        cadence = match.group(1).partition(":")[0]
        every_n = int(match.group(2)) if match.group(2) is not None else 1
        phases.append(CadencePhase(cadence, every_n, start))  # type: ignore[arg-type]
    return ConsolidationPolicy(tuple(phases), latest)


def resolve_policy(save_consolidated: Optional[bool], frequency: Optional[str]) -> Optional[ConsolidationPolicy]:
    """Combine ``save_consolidated`` and ``ckpt_consolidation_frequency`` into one policy.

    ============================  ======================  ==================================
    ``save_consolidated``         frequency               result
    ============================  ======================  ==================================
    ``None`` or ``False``         ``None``                ``None``: no consolidation (stock NeMo)
    ``True``                      ``None``                ``each`` (backward-compatible default)
    ``None`` or ``True``          a valid frequency       that frequency
    ``False``                     any frequency           ``ValueError`` (contradiction)
    ============================  ======================  ==================================

    Args:
        save_consolidated: ``None``, ``True`` or ``False``.
        frequency: ``None`` or a value accepted by :func:`parse_consolidation_frequency`.

    Returns:
        The policy, or ``None`` when consolidation is off.

    Raises:
        ValueError: if ``save_consolidated`` is not ``None``/``True``/``False``, if the frequency is invalid,
            or if ``save_consolidated=False`` is combined with a frequency.
    """
    if not isinstance(save_consolidated, (bool, type(None))):
        raise ValueError(f"Invalid save_consolidated {save_consolidated!r}: expected None, True or False.")
    if frequency is None:
        return ConsolidationPolicy((CadencePhase("each"),)) if save_consolidated else None
    policy = parse_consolidation_frequency(frequency)
    if save_consolidated is False:
        raise ValueError(
            f"save_consolidated=False contradicts ckpt_consolidation_frequency={frequency!r}: drop the frequency "
            "to turn consolidation off, or drop save_consolidated=False to consolidate at that frequency."
        )
    return policy
