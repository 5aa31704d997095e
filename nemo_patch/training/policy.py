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
from the user's values; every other part of the package gets the parsed :class:`ConsolidationPolicy`. Standard library
only.

Accepted frequencies:

* ``"each"``: consolidate every finished checkpoint.
* ``"latest"``: consolidate nothing during training; when ``fit`` ends, consolidate the newest finished
  checkpoint once.
* ``"every_n:<k>"`` with ``k`` an integer >= 1: consolidate the k-th, 2k-th, ... finished checkpoint of the
  run (the count includes saves made before a resume).

Standard library only: never torch, NeMo or Lightning, so that ``import nemo_patch`` can import it.
"""

import re
from dataclasses import dataclass
from typing import Literal, Optional

__all__ = ["ACCEPTED_FREQUENCIES", "ConsolidationPolicy", "parse_consolidation_frequency", "resolve_policy"]

#: Human-readable list of accepted ``ckpt_consolidation_frequency`` values, used in error messages.
ACCEPTED_FREQUENCIES = '"each", "latest" or "every_n:<k>" with k an integer >= 1 (e.g. "every_n:5")'

_EVERY_N = re.compile(r"every_n:([0-9]+)")

Mode = Literal["each", "latest", "every_n"]


@dataclass(frozen=True)
class ConsolidationPolicy:
    """A parsed consolidation cadence.

    Attributes:
        mode: ``"each"``, ``"latest"`` or ``"every_n"``.
        every_n: the ``k`` of ``"every_n:<k>"`` (>= 1); 1 for ``"each"`` and ``"latest"``.
    """

    mode: Mode
    every_n: int = 1

    def __str__(self) -> str:
        return f"every_n:{self.every_n}" if self.mode == "every_n" else self.mode

    def consolidates_during_training(self, save_index: int) -> bool:
        """Whether the ``save_index``-th finished checkpoint of the run (1-based) is consolidated when saved.

        Args:
            save_index: 1 for the first finished checkpoint of the run, 2 for the second, ...; saves made
                before a resume count.

        Returns:
            ``True`` for ``"each"``; ``save_index % k == 0`` for ``"every_n:<k>"``; ``False`` for ``"latest"``,
            which consolidates only when ``fit`` ends.

        Raises:
            ValueError: if ``save_index`` < 1.
        """
        if save_index < 1:
            raise ValueError(f"save_index counts finished checkpoints from 1, got {save_index}")
        if self.mode == "each":
            return True
        if self.mode == "every_n":
            return save_index % self.every_n == 0
        return False

    @property
    def consolidates_at_fit_end(self) -> bool:
        """Whether the newest finished checkpoint is consolidated when ``fit`` ends (``"latest"`` only)."""
        return self.mode == "latest"


def parse_consolidation_frequency(value: object) -> ConsolidationPolicy:
    """Parse a ``ckpt_consolidation_frequency`` value.

    Args:
        value: ``"each"``, ``"latest"`` or ``"every_n:<k>"`` (``k`` an integer >= 1, decimal digits, no sign
            or spaces). Anything else, including non-strings, is rejected.

    Returns:
        The parsed :class:`ConsolidationPolicy`.

    Raises:
        ValueError: if ``value`` is not one of the accepted forms; the message lists them.
    """
    if isinstance(value, str):
        if value == "each":
            return ConsolidationPolicy(mode="each")
        if value == "latest":
            return ConsolidationPolicy(mode="latest")
        match = _EVERY_N.fullmatch(value)
        if match and int(match.group(1)) >= 1:
            return ConsolidationPolicy(mode="every_n", every_n=int(match.group(1)))
    raise ValueError(f"Invalid ckpt_consolidation_frequency {value!r}: expected {ACCEPTED_FREQUENCIES}.")


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
        return ConsolidationPolicy(mode="each") if save_consolidated else None
    policy = parse_consolidation_frequency(frequency)
    if save_consolidated is False:
        raise ValueError(
            f"save_consolidated=False contradicts ckpt_consolidation_frequency={frequency!r}: drop the frequency "
            "to turn consolidation off, or drop save_consolidated=False to consolidate at that frequency."
        )
    return policy
