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

"""The later additions of the training side, which NeMo's tree does not have yet, registered where the core takes
extensions: each one's ``Observer`` with :func:`~nemo_patch.training.schedule.register_observer` (retention and
``LATEST``, ``BEST``, the journal, metrics, the post command's result and the callbacks' ``on_consolidation_end``
hooks); the ``"best"`` cadence and cadence phases (:func:`~nemo_patch.training.policy.extend_cadences`); the
consolidation process's isolation and post command, through its launcher (:func:`launch`, in
:data:`~nemo_patch.training.worker.PROCESS_LAUNCHERS`) and entry point (:func:`extend_worker`). The package root calls
:func:`register_extensions` when it is imported; a module that needs torch or Lightning is imported when it is first
needed, so that ``import nemo_patch`` stays free of both.
"""

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from nemo_patch.training import phases
from nemo_patch.training.policy import _MORE_CADENCES, extend_cadences
from nemo_patch.training.schedule import ConsolidationObserver, register_observer
from nemo_patch.training.worker import PROCESS_LAUNCHERS

__all__ = ["OBSERVER_MODULES", "after_publish", "consolidator", "extend_worker", "launch", "output_dirname"]
__all__ += ["register_extensions"]

#: The modules whose ``Observer`` every coordinator gets, in the order it calls them (``BEST`` moves before retention
#: prunes).
OBSERVER_MODULES = tuple(
    f"nemo_patch.training.{name}" for name in ("best", "retention", "journal", "metrics", "hooks")
)


@dataclass(frozen=True)
class _ObserverOf:
    """``<module>.Observer(coordinator)``, the module imported on the first call."""

    module: str

    def __call__(self, coordinator: Any) -> ConsolidationObserver:
        observer: ConsolidationObserver = importlib.import_module(self.module).Observer(coordinator)
        return observer


def launch(args: List[str], environ: Mapping[str, str]) -> Tuple[List[str], Mapping[str, str]]:
    """The consolidation process's command line and environment: kept apart from the training job
    (:mod:`nemo_patch.training.isolation`), with this module as its extension (:func:`extend_worker`)."""
    from nemo_patch.training import isolation

    return [*args, *isolation.parent_arguments(), "--extension", __name__], isolation.environment(environ)


def extend_worker(parent: Optional[int]) -> None:
    """In the consolidation process, before torch is imported: its isolation set up (``parent``: the training
    process it dies with), the ``hf`` format and merged adapters (:func:`consolidator`) and the post command
    (:func:`after_publish`) registered."""
    from nemo_patch.training import isolation, worker

    isolation.set_up(parent)
    _register_output_dirname()
    if consolidator not in worker.CONSOLIDATORS:
        worker.CONSOLIDATORS.append(consolidator)
    if after_publish not in worker.AFTER_PUBLISH:
        worker.AFTER_PUBLISH.append(after_publish)


def consolidator(settings: Any, preload: bool) -> Optional[Tuple[Callable[..., Any], Dict[str, Any]]]:
    """What consolidates with ``settings`` in the consolidation process where the core's engine alone does not:
    ``format="hf"``, NeMo's exporter streamed (:func:`nemo_patch.export.hf.export_hf_checkpoint`; with ``preload``,
    what finding the model's exporter imports, the slow part, is imported now); ``merge_adapters``, the engine with
    the adapters merged; else ``None``."""
    config = settings.config
    more: Dict[str, Any] = {"merge_adapters": True} if config.merge_adapters else {}
    if config.format == "hf":
        from nemo_patch.export.hf import export_hf_checkpoint

        if preload:
            try:
                importlib.import_module("nemo.collections.llm")
            except Exception:  # noqa: BLE001 - reported by the consolidation that needs it
                pass
        return export_hf_checkpoint, more
    if more:
        from nemo_patch.engine.consolidate import consolidate_checkpoint
        from nemo_patch.engine.parts import default_workers

        return consolidate_checkpoint, {"workers": config.workers or default_workers(share=4), **more}
    return None


def after_publish(settings: Any) -> Optional[Callable[[Any, Path, Optional[int]], Tuple[Any, bool]]]:
    """The post command's runner (:func:`nemo_patch.training.hooks.run_post_command`) where ``settings`` have one."""
    if settings.config.post_command is None:
        return None
    from nemo_patch.training import hooks

    return hooks.run_post_command


def output_dirname(config: Any) -> str:
    """The output directory's name for ``config.format`` (``consolidated`` or ``hf``)."""
    from nemo_patch.engine.output_layout import OUTPUT_DIRNAMES

    return OUTPUT_DIRNAMES[config.format]


def _register_output_dirname() -> None:
    from nemo_patch.training.settings import OUTPUT_DIRNAME_OF

    if output_dirname not in OUTPUT_DIRNAME_OF:
        OUTPUT_DIRNAME_OF.append(output_dirname)


def register_extensions() -> None:
    """Register the later additions (once; calling again changes nothing)."""
    _register_output_dirname()
    for module in OBSERVER_MODULES:
        register_observer(_ObserverOf(module))
    if "best" not in _MORE_CADENCES:
        extend_cadences(("best",), phases.parse_phases, phases.ACCEPTED)
    if launch not in PROCESS_LAUNCHERS:
        PROCESS_LAUNCHERS.append(launch)
