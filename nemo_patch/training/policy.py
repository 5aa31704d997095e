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

"""When a training run consolidates its checkpoints: ``ckpt_consolidation_frequency`` (``"each"``,
``"every_n:<k>"`` or ``"latest"``), parsed once into a :class:`ConsolidationPolicy`; extensions add cadences and phases
(:func:`extend_cadences`). Standard library only.
"""

import re
from dataclasses import dataclass
from typing import Any, Callable, List, Literal, Optional, Tuple

__all__ = ["ACCEPTED_FREQUENCIES", "CadencePhase", "ConsolidationPolicy", "extend_cadences"]
__all__ += ["parse_consolidation_frequency"]

#: The accepted values, for error messages; the cadences and parser of phases extensions add (:func:`extend_cadences`).
ACCEPTED_FREQUENCIES = '"each", "latest" or "every_n:<k>" with k an integer >= 1 (e.g. "every_n:5")'
_MORE_CADENCES: List[str] = []
_PHASES: List[Callable[[str, Callable[[str], Tuple[Any, bool]]], Tuple[List[Any], bool]]] = []


def extend_cadences(
    cadences: Tuple[str, ...] = (), parse_phases: Optional[Callable] = None, accepted: str = ""
) -> None:
    """Accept an extension's ``cadences`` (e.g. ``("best",)``) and, with ``parse_phases(value, parse_cadence) ->
    (phases, latest)``, several cadences by global step; ``accepted`` ends :data:`ACCEPTED_FREQUENCIES`."""
    global ACCEPTED_FREQUENCIES
    _MORE_CADENCES.extend(name for name in cadences if name not in _MORE_CADENCES)
    _PHASES[:] = [parse_phases] if parse_phases is not None else _PHASES
    more = "".join(f', "{name}"' for name in cadences) + ' or "every_n:'
    ACCEPTED_FREQUENCIES = ACCEPTED_FREQUENCIES.replace(' or "every_n:', more, 1) + accepted


Cadence = Literal["each", "every_n", "best"]

_CADENCE = re.compile(r"(each|best|every_n:([0-9]+))(?:@([0-9]+))?")
#: Values people try for "no consolidation"; the message says how it is really turned off.
_OFF_WORDS = frozenset({"off", "none", "no", "never", "false", "disable", "disabled", "0", ""})


@dataclass(frozen=True)
class CadencePhase:
    """Which finished checkpoints saved from global step ``start_step`` on are consolidated: ``cadence`` ``"each"``,
    ``"every_n"`` (every ``every_n``-th) or ``"best"``."""

    cadence: Cadence
    every_n: int = 1
    start_step: int = 0

    def __str__(self) -> str:
        text = f"every_n:{self.every_n}" if self.cadence == "every_n" else self.cadence
        return f"{text}@{self.start_step}" if self.start_step else text


@dataclass(frozen=True)
class ConsolidationPolicy:
    """A parsed cadence: phases by ``start_step`` (the first at 0; none for ``"latest"``), and whether the newest
    finished checkpoint is consolidated when ``fit`` ends."""

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
        """The phase of a checkpoint saved at ``global_step`` (``None`` for ``"latest"``)."""
        return next((phase for phase in reversed(self.phases) if phase.start_step <= global_step), None)

    def is_due(self, global_step: int, index_in_phase: int, best: bool = False) -> bool:
        """Whether a finished checkpoint is consolidated when it finishes: always in ``"each"``, the k-th of its phase
        (``index_in_phase`` counts from 1) in ``"every_n:<k>"``, ``best`` in ``"best"``, never in ``"latest"``.

        Raises:
            ValueError: ``index_in_phase`` < 1.
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
        """Whether a phase is ``"best"``."""
        return any(phase.cadence == "best" for phase in self.phases)

    @property
    def consolidates_periodically(self) -> bool:
        """Whether a phase is ``"each"`` or ``"every_n"``."""
        return any(phase.cadence != "best" for phase in self.phases)

    @property
    def consolidates_at_fit_end(self) -> bool:
        """Whether the newest finished checkpoint is consolidated when ``fit`` ends."""
        return self.latest_at_fit_end


def _invalid(value: object, why: str) -> ValueError:
    return ValueError(f"Invalid ckpt_consolidation_frequency {value!r}: {why}; expected {ACCEPTED_FREQUENCIES}.")


def _cadence(item: str) -> Tuple[CadencePhase, bool]:
    """One cadence (``"each"``, ``"every_n:<k>"``, ``"best"`` where installed) with the ``@<global step>`` it applies
    from, and whether that step was given; ``ValueError`` says why ``item`` is not one."""
    match = _CADENCE.fullmatch(item)
    if match is None or (match.group(1) == "best" and "best" not in _MORE_CADENCES):
        lower = item.lower()
        if match is None and lower != item and (lower == "latest" or _CADENCE.fullmatch(lower)):
            raise ValueError(f"{item!r} is not a cadence: cadences are lower case ({lower!r})")
        raise ValueError(f"{item!r} is not a cadence")
    if match.group(2) is not None and int(match.group(2)) < 1:
        raise ValueError(f"{item!r}: k must be >= 1")
    cadence, every_n, step = match.group(1).partition(":")[0], int(match.group(2) or 1), match.group(3)
    return CadencePhase(cadence, every_n, int(step or 0)), step is not None  # type: ignore[arg-type]


def parse_consolidation_frequency(value: object) -> ConsolidationPolicy:
    """Parse a ``ckpt_consolidation_frequency`` value; ``str()`` of the result gives it back in canonical spelling.

    Raises:
        ValueError: ``value`` is not one of the accepted forms; the message says what is wrong and what is accepted.
    """
    if not isinstance(value, str):
        raise _invalid(value, "not a string")
    if value.strip().lower() in _OFF_WORDS:
        raise _invalid(value, "consolidation is turned off with ckpt_consolidation_frequency=None (the default)")
    try:
        if _PHASES:
            found, latest = _PHASES[0](value, _cadence)
        elif value == "latest":
            found, latest = [], True
        else:
            phase, at_step = _cadence(value)
            if at_step:
                raise ValueError(f"{value!r} is not a cadence")
            found, latest = [phase], False
    except ValueError as why:
        raise _invalid(value, str(why)) from None
    return ConsolidationPolicy(tuple(found), latest)


def resolve_policy(save_consolidated: Optional[bool], frequency: Optional[str]) -> Optional[ConsolidationPolicy]:
    """Combine ``save_consolidated`` and ``ckpt_consolidation_frequency``: ``None`` (consolidation off) when neither
    asks for it; ``"each"`` for ``save_consolidated=True`` alone; else the frequency.

    Raises:
        ValueError: ``save_consolidated`` not ``None``/``True``/``False``, an invalid frequency, or
            ``save_consolidated=False`` with a frequency.
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
