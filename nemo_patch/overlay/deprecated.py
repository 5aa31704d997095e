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

"""The overlay's deprecated spellings, which upstream NeMo never had; removed in the next minor release.

* the flat keywords ``MegatronStrategy(ckpt_consolidation_<field>=...)`` and ``MegatronCheckpointIO(
  consolidation_<field>=..., save_consolidated=..., ckpt_consolidation_frequency=...)``, turned into the new spelling
  outside NeMo's ``IOMixin`` wrapper (NeMo records the new one), with a ``DeprecationWarning`` naming it;
* the attributes named as those keywords, and ``consolidation_policy``: read-only views that warn the same way;
* ``MegatronCheckpointIO.set_consolidation_settings(settings)``.
"""

import functools
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, Mapping, Optional

from nemo_patch.training.config import SETTINGS, ConsolidationConfig, validate_fields
from nemo_patch.training.settings import ConsolidationSettings

__all__ = ["DEPRECATED_FIELDS", "deprecated_keywords", "install", "merge_deprecated_keywords", "warn_deprecated"]

#: The settings that were flat keyword arguments before ``ConsolidationConfig`` (``ckpt_consolidation_<field>`` of the
#: strategy, ``consolidation_<field>`` of the checkpoint IO, which had no timeout). A new setting is a field only.
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
#: The checkpoint IO's deprecated keywords for the cadence -> the ``ConsolidationSettings`` field each gives.
_IO_SWITCHES = {"save_consolidated": "save_consolidated", "ckpt_consolidation_frequency": "frequency"}
#: Frames a deprecation warning skips, to point at the user's call: this package, NeMo's ``IOMixin``, fiddle.
_INTERNAL_MODULES = ("nemo_patch.", "nemo.lightning.io.mixin", "fiddle.")


def deprecated_keywords(owner: str) -> Dict[str, str]:
    """The deprecated flat keywords of ``owner`` (``"strategy"`` or ``"io"``) -> the ``ConsolidationConfig`` field.

    Raises:
        ValueError: ``owner`` is neither.
    """
    if owner == "strategy":
        return {f"ckpt_consolidation_{name}": name for name in DEPRECATED_FIELDS}
    if owner == "io":
        return {f"consolidation_{name}": name for name in DEPRECATED_FIELDS if name != "timeout"}
    raise ValueError(f"owner must be 'strategy' or 'io', not {owner!r}")


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside :data:`_INTERNAL_MODULES`, so that Python's
    default filters show it for a script's own call (``__main__``)."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(_INTERNAL_MODULES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def merge_deprecated_keywords(
    given: Mapping[str, Any], names: Mapping[str, str], config: object, config_name: str = "ckpt_consolidation"
) -> ConsolidationConfig:
    """``config`` (``None``: the defaults) with the ``given`` values (by field; ``names`` gives each one's keyword).

    Raises:
        ValueError: ``config`` is not a config; a value is invalid (naming its keyword); or ``config`` sets a field
            to another value than its keyword does.
    """
    if config is not None and not isinstance(config, ConsolidationConfig):
        raise ValueError(
            f"Invalid {config_name} {config!r}: expected None or a ConsolidationConfig (e.g. "
            "ConsolidationConfig(dtype=\"bf16\"))."
        )
    base = config if config is not None else ConsolidationConfig()
    values = {spec.field: getattr(base, spec.field) for spec in SETTINGS}
    merged = object.__new__(ConsolidationConfig)  # validated once, each message naming the keyword given
    for spec in SETTINGS:
        object.__setattr__(merged, spec.field, given.get(spec.field, values[spec.field]))
    validate_fields(merged, names)
    for spec in SETTINGS:
        if spec.field in given and values[spec.field] not in (spec.default, getattr(merged, spec.field)):
            raise ValueError(
                f"{names[spec.field]}={given[spec.field]!r} contradicts {config_name}=ConsolidationConfig("
                f"{spec.field}={values[spec.field]!r}): give the setting once, in the ConsolidationConfig."
            )
    return merged


def _strategy_keywords(kwargs: Dict[str, Any]) -> None:
    flat = deprecated_keywords("strategy")
    given = {keyword: kwargs.pop(keyword) for keyword in list(kwargs) if keyword in flat}
    if not given:
        return
    fields = {flat[keyword]: value for keyword, value in given.items()}
    warn_deprecated(
        f"MegatronStrategy's {', '.join(given)} {'is' if len(given) == 1 else 'are'} deprecated and will be removed "
        f"in the next minor release: pass ckpt_consolidation=ConsolidationConfig("
        f"{', '.join(f'{field}=...' for field in fields)}) instead."
    )
    names = {field: keyword for keyword, field in flat.items()}
    kwargs["ckpt_consolidation"] = merge_deprecated_keywords(fields, names, kwargs.get("ckpt_consolidation"))


def _io_keywords(kwargs: Dict[str, Any]) -> None:
    flat = deprecated_keywords("io")
    given = {name: kwargs.pop(name) for name in list(kwargs) if name in flat or name in _IO_SWITCHES}
    if not given:
        return
    if kwargs.get("consolidation_settings") is not None:
        raise ValueError(
            "Pass either consolidation_settings or the deprecated individual consolidation arguments "
            f"({', '.join(given)}), not both."
        )
    switches = {_IO_SWITCHES[name]: value for name, value in given.items() if name in _IO_SWITCHES}
    fields = {flat[name]: value for name, value in given.items() if name in flat}
    arguments = [f"{name}=..." for name in switches]
    if fields:
        arguments.append(f"config=ConsolidationConfig({', '.join(f'{field}=...' for field in fields)})")
    warn_deprecated(
        f"MegatronCheckpointIO's {', '.join(given)} {'is' if len(given) == 1 else 'are'} deprecated and will be "
        "removed in the next minor release: pass consolidation_settings=ConsolidationSettings.from_arguments("
        f"{', '.join(arguments)}) instead."
    )
    names = {field: keyword for keyword, field in flat.items()}
    config = merge_deprecated_keywords(fields, names, None) if fields else None
    kwargs["consolidation_settings"] = ConsolidationSettings.from_arguments(
        switches.get("save_consolidated"), switches.get("frequency"), config
    )


def _accepting(cls: type, convert: Callable[[Dict[str, Any]], None]) -> None:
    """Wrap ``cls.__init__`` so that ``convert`` rewrites the keywords first, outside NeMo's ``IOMixin`` wrapper."""
    from nemo.lightning.io.mixin import _io_wrap_init

    _io_wrap_init(cls)  # NeMo's own wrapper first (it records the arguments it is given), ours around it
    init: Callable[..., None] = vars(cls)["__init__"]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        convert(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]


def _view(owner: str, name: str, path: str) -> property:
    """A read-only property ``name`` that warns and returns ``consolidation_settings.<path>``."""

    def view(self: Any) -> Any:
        warn_deprecated(
            f"{owner}.{name} is deprecated and will be removed in the next minor release: read "
            f".consolidation_settings.{path} instead."
        )
        value: Optional[Any] = self.consolidation_settings
        for part in path.split("."):
            value = getattr(value, part, None)
        return value

    return property(view, doc=f"Deprecated: ``consolidation_settings.{path}`` (read-only).")


def _set_consolidation_settings(self: Any, settings: ConsolidationSettings) -> None:
    """Deprecated: build the checkpoint IO with ``consolidation_settings=``."""
    warn_deprecated(
        "MegatronCheckpointIO.set_consolidation_settings is deprecated and will be removed in the next minor release: "
        "pass consolidation_settings= when the checkpoint IO is built."
    )
    from nemo_patch.training.integration import coordinator

    self.consolidation_settings, self.consolidation = settings, coordinator(settings)


def install(module: ModuleType) -> None:
    """Give the edited ``MegatronStrategy`` or ``MegatronCheckpointIO`` of NeMo's ``module`` the deprecated
    keywords and attributes (called once the overlay executed it)."""
    common = {**_IO_SWITCHES, "consolidation_policy": "policy"}
    strategy = vars(module).get("MegatronStrategy")
    if module.__name__.endswith(".megatron_strategy") and isinstance(strategy, type):
        _accepting(strategy, _strategy_keywords)
        views = {**common, **{kw: f"config.{field}" for kw, field in deprecated_keywords("strategy").items()}}
        for name, path in views.items():
            setattr(strategy, name, _view("MegatronStrategy", name, path))
    io = vars(module).get("MegatronCheckpointIO")
    if module.__name__.endswith(".io.pl") and isinstance(io, type):
        _accepting(io, _io_keywords)
        views = {**common, **{keyword: f"config.{field}" for keyword, field in deprecated_keywords("io").items()}}
        for name, path in views.items():
            setattr(io, name, _view("MegatronCheckpointIO", name, path))
        setattr(io, "set_consolidation_settings", _set_consolidation_settings)
