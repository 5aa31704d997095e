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

"""A run's consolidation settings, resolved once into one frozen value that travels unchanged: strategy -> checkpoint
IO -> queue -> the consolidation process's command line (:meth:`ConsolidationSettings.to_json`)."""

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional

from nemo_patch.engine.output_layout import OUTPUT_DIRNAMES
from nemo_patch.training.config import SETTINGS, ConsolidationConfig
from nemo_patch.training.policy import ConsolidationPolicy, resolve_policy

__all__ = ["OUTPUT_DIRNAME_OF", "WORKER_NICENESS", "ConsolidationSettings"]

#: How much lower a consolidation process's CPU priority is than training's (``os.nice`` increment).
WORKER_NICENESS = 10
#: Extensions' ``output_dirname(config)``: the output directory's name for a config of theirs (another output format),
#: or ``None`` (the first answer counts; none here: ``consolidated``).
OUTPUT_DIRNAME_OF: List[Callable[[ConsolidationConfig], Optional[str]]] = []


@dataclass(frozen=True)
class ConsolidationSettings:
    """``MegatronStrategy``'s consolidation arguments, resolved (immutable; validated when made):
    ``ConsolidationSettings(frequency="each", config=ConsolidationConfig(dtype="bf16"))``.

    Attributes:
        save_consolidated: ``save_consolidated``, as given.
        frequency: ``ckpt_consolidation_frequency``, as given.
        policy: the cadence the two resolve to (derived); ``None`` when consolidation is off.
        config: ``ckpt_consolidation`` (``None`` gives the defaults).

    Raises:
        ValueError: an invalid or contradictory value, naming the argument and what is accepted.
    """

    save_consolidated: Optional[bool] = None
    frequency: Optional[str] = None
    policy: Optional[ConsolidationPolicy] = field(init=False)
    config: ConsolidationConfig = field(default_factory=ConsolidationConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", resolve_policy(self.save_consolidated, self.frequency))
        if self.config is None:
            object.__setattr__(self, "config", ConsolidationConfig())
        elif not isinstance(self.config, ConsolidationConfig):
            raise ValueError(
                f"Invalid ckpt_consolidation {self.config!r}: expected None or a ConsolidationConfig (e.g. "
                "ConsolidationConfig(dtype=\"bf16\"))."
            )

    @classmethod
    def from_arguments(
        cls,
        save_consolidated: Optional[bool] = None,
        frequency: Optional[str] = None,
        config: Optional[ConsolidationConfig] = None,
    ) -> "ConsolidationSettings":
        """The same as the constructor, ``config`` ``None`` included."""
        return cls(save_consolidated, frequency, config)  # type: ignore[arg-type]

    @property
    def requested(self) -> bool:
        """Whether ``save_consolidated`` or a frequency was given (``False`` included)."""
        return self.save_consolidated is not None or self.frequency is not None

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are consolidated."""
        return self.policy is not None

    @property
    def output_dirname(self) -> str:
        """The output directory's name inside a checkpoint directory: ``consolidated``, or an extension's
        (:data:`OUTPUT_DIRNAME_OF`)."""
        found = (name for name in (of(self.config) for of in OUTPUT_DIRNAME_OF) if name is not None)
        return next(found, OUTPUT_DIRNAMES["safetensors"])

    def to_json(self) -> str:
        """The settings as one JSON object."""
        data = asdict(self)
        data["policy"] = None if self.policy is None else str(self.policy)  # for the reader's eyes: it is derived
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ConsolidationSettings":
        """The settings :meth:`to_json` wrote.

        Raises:
            ValueError: ``text`` is not such a JSON object (malformed, with fields this version does not know, or
                with a cadence its arguments do not resolve to).
        """
        data: Dict[str, Any] = json.loads(text)
        known = {field_.name for field_ in fields(cls)}
        config = data.get("config", {}) if isinstance(data, dict) else None
        if (
            not isinstance(data, dict)
            or set(data) - known
            or not isinstance(config, dict)
            or set(config) - {spec.field for spec in SETTINGS}
        ):
            raise ValueError(f"not consolidation settings: {text[:200]!r}")
        policy = data.pop("policy", None)
        settings = cls(data.get("save_consolidated"), data.get("frequency"), ConsolidationConfig(**config))
        if policy != (None if settings.policy is None else str(settings.policy)):
            raise ValueError(f"not consolidation settings (cadence {policy!r}): {text[:200]!r}")
        return settings
