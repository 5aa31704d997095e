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

"""A run's consolidation settings, resolved into one frozen value, and ``MegatronStrategy``'s three arguments.

``MegatronStrategy`` takes three consolidation arguments (:data:`STRATEGY_ARGUMENTS`): ``save_consolidated`` and
``ckpt_consolidation_frequency`` say *when* checkpoints are consolidated, ``ckpt_consolidation`` (a
:class:`~nemo_patch.training.config.ConsolidationConfig`, where every other setting is declared) *how*. The
strategy's signature and docstring are made from :data:`STRATEGY_ARGUMENTS`.

:meth:`ConsolidationSettings.from_arguments` resolves them, once, where the user gives them
(``MegatronStrategy.__init__``, or ``MegatronCheckpointIO.__init__`` when a user builds the checkpoint IO), into a
:class:`ConsolidationSettings`: the two switches, the cadence they resolve to and the config. From there the settings
travel as one value: strategy -> checkpoint IO -> consolidation queue -> the consolidation process's command line
(:meth:`ConsolidationSettings.to_json` once per queue, :meth:`ConsolidationSettings.from_json` once per process).

The flat keywords the strategy and the checkpoint IO took before (``ckpt_consolidation_dtype=``,
``consolidation_keep=``, ...) still work, with a ``DeprecationWarning`` (:func:`deprecated_keywords`,
:func:`merge_deprecated_keywords`); they are removed in the next minor release. Standard library only (plus the
cadence in :mod:`nemo_patch.training.policy` and the config in :mod:`nemo_patch.training.config`).
"""

import inspect
import json
import sys
import textwrap
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, cast

from nemo_patch.engine.output_layout import OUTPUT_DIRNAMES
from nemo_patch.training.config import SETTINGS, ConsolidationConfig
from nemo_patch.training.policy import ConsolidationPolicy, resolve_policy

__all__ = [
    "CONFIG_ARGUMENT",
    "DEPRECATED_FIELDS",
    "STRATEGY_ARGUMENTS",
    "WORKER_NICENESS",
    "ConsolidationSettings",
    "StrategyArgument",
    "arguments_docstring",
    "check_config",
    "declare_arguments",
    "deprecated_keywords",
    "init_signature",
    "merge_deprecated_keywords",
    "warn_deprecated",
]

#: How much lower a consolidation process's CPU priority is than the training process's (``os.nice`` increment): on a
#: busy node the training job's threads come first, and a consolidation uses the CPU time they leave.
WORKER_NICENESS = 10

#: The name of ``MegatronStrategy``'s config argument.
CONFIG_ARGUMENT = "ckpt_consolidation"


@dataclass(frozen=True)
class StrategyArgument:
    """One of ``MegatronStrategy``'s consolidation arguments.

    Attributes:
        name: the keyword argument, e.g. ``"ckpt_consolidation_frequency"``.
        field: the :class:`ConsolidationSettings` field it gives, e.g. ``"frequency"``.
        annotation: its type annotation (NeMo-Run converts command-line overrides by it).
        help: what it means (reStructuredText; the strategy's docstring and the documentation).
        default: its default.
    """

    name: str
    field: str
    annotation: Any
    help: str
    default: Any = None

    @property
    def parameter(self) -> inspect.Parameter:
        """The keyword-only parameter of the strategy's signature."""
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default, annotation=self.annotation
        )


_CADENCE_HELP = (
    "``None`` (default), ``\"each\"`` (every finished checkpoint), ``\"latest\"`` (none during training; the newest "
    "finished checkpoint once when ``fit`` ends) or ``\"every_n:<k>\"`` (the k-th, 2k-th, ... finished checkpoint of "
    "the run, counted across resumes; k an integer >= 1), ``\"best\"`` (a finished checkpoint that NeMo's "
    "``ModelCheckpoint`` ranked best by its ``monitor``/``mode`` when it was saved; ``<root>/BEST`` names the best "
    "consolidated one; needs a monitored metric), or phases that change the cadence at given global steps, e.g. "
    "``\"every_n:10; each@50000\"``, ``\"best; each@90000\"``, ``\"every_n:20; latest\"`` (the grammar is on the "
    "documentation's Cadences page). Giving a frequency turns consolidation on; ``ckpt_consolidation`` has no effect "
    "without it (a warning says so)."
)

#: ``MegatronStrategy``'s consolidation arguments, in the order of its signature.
STRATEGY_ARGUMENTS: Tuple[StrategyArgument, ...] = (
    StrategyArgument(
        "save_consolidated",
        "save_consolidated",
        Optional[bool],
        "``None`` (default) or ``False``: no consolidation, exactly NeMo's behaviour, unless a frequency is given. "
        "``True``: consolidate, at ``\"each\"`` unless a frequency is given. The name is that of NeMo Automodel's "
        "checkpoint option ``save_consolidated`` (its 25.09 release), which writes Hugging Face-named weights; the "
        "default ``\"safetensors\"`` format here writes megatron-core names (``ConsolidationConfig(format=\"hf\")`` "
        "writes a Hugging Face directory).",
    ),
    StrategyArgument("ckpt_consolidation_frequency", "frequency", Optional[str], _CADENCE_HELP),
    StrategyArgument(
        CONFIG_ARGUMENT,
        "config",
        Optional[ConsolidationConfig],
        "how checkpoints are consolidated: a :class:`~nemo_patch.ConsolidationConfig` (output format and dtype, shard "
        "size, writer processes, outputs kept after top-k removal, queue bound, end-of-fit timeout, adapter merging, "
        "a command run after each output); ``None`` (default) is ``ConsolidationConfig()``.",
    ),
)

#: The settings that were flat keyword arguments before :class:`ConsolidationConfig` (``ckpt_consolidation_<field>``
#: of the strategy, ``consolidation_<field>`` of the checkpoint IO, which had no timeout): deprecated, removed in the
#: next minor release. A new setting is a config field only.
DEPRECATED_FIELDS = (
    "timeout",
    "max_shard_size",
    "max_pending",
    "format",
    "keep",
    "dtype",
    "merge_adapters",
    "workers",
    "post_command",
    "post_command_timeout",
)


def deprecated_keywords(owner: str) -> Dict[str, str]:
    """The deprecated flat keywords of ``owner`` (``"strategy"`` or ``"io"``): keyword -> :class:`ConsolidationConfig`
    field, e.g. ``"ckpt_consolidation_dtype"`` (strategy) or ``"consolidation_dtype"`` (checkpoint IO) -> ``"dtype"``.

    Raises:
        ValueError: ``owner`` is neither.
    """
    if owner == "strategy":
        return {f"ckpt_consolidation_{name}": name for name in DEPRECATED_FIELDS}
    if owner == "io":
        return {f"consolidation_{name}": name for name in DEPRECATED_FIELDS if name != "timeout"}
    raise ValueError(f"owner must be 'strategy' or 'io', not {owner!r}")


def check_config(value: object, name: str = CONFIG_ARGUMENT) -> ConsolidationConfig:
    """``value`` if it is a :class:`ConsolidationConfig`; ``ConsolidationConfig()`` for ``None``.

    Raises:
        ValueError: for anything else, naming ``name`` and the accepted forms.
    """
    if value is None:
        return ConsolidationConfig()
    if isinstance(value, ConsolidationConfig):
        return value
    raise ValueError(
        f"Invalid {name} {value!r}: expected None or a ConsolidationConfig (e.g. ConsolidationConfig(dtype=\"bf16\"))."
    )


def merge_deprecated_keywords(
    given: Mapping[str, Any], names: Mapping[str, str], config: object, config_name: str = CONFIG_ARGUMENT
) -> ConsolidationConfig:
    """``config`` with the settings given as deprecated flat keywords.

    Args:
        given: the values, by :class:`ConsolidationConfig` field.
        names: the keyword each was given as, by field (for messages).
        config: the config given with them (``None``: the defaults).
        config_name: the argument ``config`` was given as (for messages).

    Raises:
        ValueError: ``config`` is not a config; a value is invalid (the message names its keyword); or ``config`` sets
            a field to another value than its keyword does.
    """
    base = check_config(config, config_name)
    values = {spec.field: getattr(base, spec.field) for spec in SETTINGS}
    merged = ConsolidationConfig.from_keywords(names, **{**values, **given})
    for spec in SETTINGS:
        if spec.field in given and values[spec.field] not in (spec.default, getattr(merged, spec.field)):
            raise ValueError(
                f"{names[spec.field]}={given[spec.field]!r} contradicts {config_name}=ConsolidationConfig("
                f"{spec.field}={values[spec.field]!r}): give the setting once, in the ConsolidationConfig."
            )
    return merged


#: Modules whose frames a deprecation warning skips, to point at the user's call: this package's training side,
#: NeMo's ``IOMixin`` (which wraps ``__init__``) and fiddle (``fdl.build``).
_INTERNAL_MODULES = ("nemo_patch.training.", "nemo.lightning.io.mixin", "fiddle.")


def warn_deprecated(message: str) -> None:
    """Issue a ``DeprecationWarning`` attributed to the first caller outside :data:`_INTERNAL_MODULES`, so that
    Python's default filters show it for a script's own call (``__main__``)."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(_INTERNAL_MODULES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


@dataclass(frozen=True)
class ConsolidationSettings:
    """Every consolidation setting of a run, resolved (immutable; validated when made).

    Make it with :meth:`from_arguments` (the strategy's three arguments) or, the same, the constructor:
    ``ConsolidationSettings(frequency="each", config=ConsolidationConfig(dtype="bf16"))``.

    Attributes:
        save_consolidated: ``MegatronStrategy``'s ``save_consolidated``, as given.
        frequency: ``MegatronStrategy``'s ``ckpt_consolidation_frequency``, as given.
        policy: the cadence ``save_consolidated`` and ``frequency`` resolve to (derived, not an argument); ``None``
            when consolidation is off.
        config: how checkpoints are consolidated (``MegatronStrategy``'s ``ckpt_consolidation``; ``None`` gives the
            defaults).

    Raises:
        ValueError: for an invalid or contradictory value; the message names the argument and what is accepted.
    """

    save_consolidated: Optional[bool] = None
    frequency: Optional[str] = None
    policy: Optional[ConsolidationPolicy] = field(init=False)
    config: ConsolidationConfig = field(default_factory=ConsolidationConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", resolve_policy(self.save_consolidated, self.frequency))
        object.__setattr__(self, "config", check_config(self.config))

    @classmethod
    def from_arguments(
        cls,
        save_consolidated: Optional[bool] = None,
        frequency: Optional[str] = None,
        config: Optional[ConsolidationConfig] = None,
    ) -> "ConsolidationSettings":
        """Resolve the strategy's three consolidation arguments into settings.

        Args:
            save_consolidated: ``None``, ``True`` or ``False`` (see :func:`nemo_patch.training.policy.resolve_policy`).
            frequency: ``None``, or a value :func:`nemo_patch.training.policy.parse_consolidation_frequency` accepts.
            config: a :class:`ConsolidationConfig` (already validated when it was made), or ``None`` for the defaults.

        Raises:
            ValueError: for an invalid or contradictory value; the message names the argument and what is accepted.
        """
        return cls(save_consolidated, frequency, cast(ConsolidationConfig, config))

    @property
    def requested(self) -> bool:
        """Whether the user gave ``save_consolidated`` or a frequency (``False`` or a frequency included)."""
        return self.save_consolidated is not None or self.frequency is not None

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are consolidated."""
        return self.policy is not None

    @property
    def output_dirname(self) -> str:
        """The output directory's name inside a checkpoint directory, ``consolidated`` or ``hf``."""
        return OUTPUT_DIRNAMES[self.config.format]

    def to_json(self) -> str:
        """The settings as one JSON object (for the consolidation process's command line)."""
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
            raise ValueError(f"not nemo_patch consolidation settings: {text[:200]!r}")
        policy = data.pop("policy", None)
        settings = cls(data.get("save_consolidated"), data.get("frequency"), ConsolidationConfig(**config))
        if policy != (None if settings.policy is None else str(settings.policy)):
            raise ValueError(f"not nemo_patch consolidation settings (cadence {policy!r}): {text[:200]!r}")
        return settings


def init_signature(base: Callable[..., Any], ours: Sequence[inspect.Parameter]) -> inspect.Signature:
    """``(self, <base's arguments>, *, <ours>, <base's **kwargs>)``: the signature of an ``__init__`` that takes
    ``ours`` and passes the rest on to ``base`` (NeMo's ``__init__``), for ``help()``, IDEs and NeMo's configuration
    tools (NeMo-Run converts command-line values by the annotations of NeMo's arguments too). A parameter of ``base``
    named as one of ours is left out."""
    names = {parameter.name for parameter in ours}
    inherited = [parameter for parameter in inspect.signature(base).parameters.values() if parameter.name not in names]
    # A stable sort by kind: base's positional ones, its *args and keyword-only ones, then ours, then its **kwargs.
    return inspect.Signature(sorted([*inherited, *ours], key=lambda parameter: parameter.kind), return_annotation=None)


def arguments_docstring(indent: int = 8, width: int = 119) -> str:
    """The ``Args:`` entries of the strategy's consolidation arguments, Google style: one ``name: help`` entry per
    argument, wrapped at ``width`` columns, continuation lines indented four more."""
    entries = []
    for argument in STRATEGY_ARGUMENTS:
        lines = textwrap.wrap(
            f"{argument.name}: {argument.help}",
            width=width,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent + 4),
            break_on_hyphens=False,
        )
        entries.append("\n".join(lines))
    return "\n".join(entries)


def _view(name: str, field_: str, deprecated: bool) -> property:
    """A read-only property ``name`` returning the setting ``field_`` (a :class:`ConsolidationSettings` field, else a
    :class:`ConsolidationConfig` one); a ``deprecated`` one warns."""
    in_config = field_ not in {item.name for item in fields(ConsolidationSettings)}
    path = f"consolidation_settings.{'config.' if in_config else ''}{field_}"

    def view(self: Any) -> Any:
        if deprecated:
            warn_deprecated(
                f"{type(self).__name__}.{name} is deprecated and will be removed in the next minor release: read "
                f".{path} instead."
            )
        settings = self.consolidation_settings
        return getattr(settings.config if in_config else settings, field_)

    return property(view, doc=f"{'Deprecated: ' if deprecated else 'The setting '}``{path}`` (read-only).")


def declare_arguments(cls: Type[Any], owner: str, base: Callable[..., Any], ours: Sequence[inspect.Parameter]) -> None:
    """Make ``cls`` (the strategy or the checkpoint IO, per ``owner``) show the consolidation arguments it takes: its
    ``__init__``'s ``__signature__`` (:func:`init_signature` with ``base`` and ``ours``), the strategy's docstring's
    ``{consolidation arguments}`` line replaced by their ``Args:`` entries (:func:`arguments_docstring`), and one
    read-only property per argument, named as it, returning its setting: the strategy's three, the deprecated flat
    keywords (which warn), and for the checkpoint IO its deprecated ``save_consolidated`` and
    ``ckpt_consolidation_frequency``.

    Raises:
        ValueError: ``owner`` is neither ``"strategy"`` nor ``"io"``.
    """
    views: List[Tuple[str, str, bool]] = [(name, field_, True) for name, field_ in deprecated_keywords(owner).items()]
    own = [(argument.name, argument.field) for argument in STRATEGY_ARGUMENTS if argument.name != CONFIG_ARGUMENT]
    views += [(name, field_, owner == "io") for name, field_ in own]
    if owner == "strategy":
        views.append((CONFIG_ARGUMENT, "config", False))
    setattr(cls.__init__, "__signature__", init_signature(base, ours))
    cls.__doc__ = (cls.__doc__ or "").replace("        {consolidation arguments}", arguments_docstring())
    for name, field_, deprecated in views:
        setattr(cls, name, _view(name, field_, deprecated))
