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
extensions (docs/UPSTREAM.md): observers, the post command's result, the ``"best"`` cadence and phases, the
consolidation process's launcher (:func:`launch`) and entry point (:func:`extend_worker`). The package root calls
:func:`register_extensions`; ``import nemo_patch`` stays free of torch and Lightning.
"""

import contextlib
import importlib
import sys
from importlib.machinery import ModuleSpec, PathFinder, SourceFileLoader
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from nemo_patch.engine.output_layout import OUTPUT_DIRNAMES
from nemo_patch.training import hooks, phases, post_results
from nemo_patch.training.policy import _MORE_CADENCES, extend_cadences
from nemo_patch.training.schedule import ObserverOf, register_observer
from nemo_patch.training.settings import OUTPUT_DIRNAME_OF
from nemo_patch.training.worker import PROCESS_LAUNCHERS

__all__ = ["ENGINE_EXTENSIONS", "OBSERVER_MODULES", "after_publish", "consolidator", "extend_worker", "launch"]
__all__ += ["output_dirname", "register_extensions"]

#: The modules whose ``Observer`` every coordinator gets, in call order (``BEST`` moves before retention prunes).
OBSERVER_MODULES = tuple(
    f"nemo_patch.training.{name}" for name in ("best", "retention", "journal", "metrics", "hooks")
)

#: The engine's later additions (``None`` in NeMo's tree): engine module -> modules set as its attributes when run.
ENGINE_EXTENSIONS = {
    "nemo_patch.engine.checkpoint_reader": ("zarr_reader",),
    "nemo_patch.engine.consolidate": ("adapter_settings",),
    "nemo_patch.engine.tensor_sources": ("adapter_merge",),
}


class _ExtendingLoader(SourceFileLoader):
    """Executes an engine module from its source file, then gives it its extensions."""

    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        for name in ENGINE_EXTENSIONS.get(module.__name__, ()):
            setattr(module, name, importlib.import_module(f"nemo_patch.engine.{name}"))


class _EngineFinder:
    """Meta-path finder that gives the engine modules of :data:`ENGINE_EXTENSIONS` an :class:`_ExtendingLoader`."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        spec = PathFinder.find_spec(fullname, path, target) if fullname in ENGINE_EXTENSIONS else None
        if spec is None or not isinstance(spec.loader, SourceFileLoader):
            return None  # not ours, or not from a source file: the other finders answer
        spec.loader = _ExtendingLoader(fullname, spec.loader.path)
        return spec


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
            with contextlib.suppress(Exception):  # reported by the consolidation that needs it
                importlib.import_module("nemo.collections.llm")
        return export_hf_checkpoint, more
    if more:
        from nemo_patch.engine.consolidate import consolidate_checkpoint
        from nemo_patch.engine.parts import default_workers

        return consolidate_checkpoint, {"workers": config.workers or default_workers(share=4), **more}
    return None


def after_publish(settings: Any) -> Optional[Callable[[Any, Path, Optional[int]], Tuple[Any, bool]]]:
    """The post command's runner (:func:`.post_results.run_post_command`) where ``settings`` have one."""
    return None if settings.config.post_command is None else post_results.run_post_command


def output_dirname(config: Any) -> str:
    """The output directory's name for ``config.format`` (``consolidated`` or ``hf``)."""
    return OUTPUT_DIRNAMES[config.format]


def _register_output_dirname() -> None:
    if output_dirname not in OUTPUT_DIRNAME_OF:
        OUTPUT_DIRNAME_OF.append(output_dirname)


def register_extensions() -> None:
    """Register the later additions (once; calling again changes nothing)."""
    _register_output_dirname()
    for module in OBSERVER_MODULES:
        register_observer(ObserverOf(module))
    if post_results.read_post_command not in hooks.POST_COMMAND_READERS:
        hooks.POST_COMMAND_READERS.append(post_results.read_post_command)
    if "best" not in _MORE_CADENCES:
        extend_cadences(("best",), phases.parse_phases, phases.ACCEPTED)
    if launch not in PROCESS_LAUNCHERS:
        PROCESS_LAUNCHERS.append(launch)
    if not any(isinstance(finder, _EngineFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EngineFinder())
