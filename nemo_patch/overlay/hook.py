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

"""The overlay's import hook (standard library only: it runs at interpreter start-up).

At interpreter start-up, ``site`` runs the one line of ``nemo_patch.pth``, which loads this file through the
top-level ``_nemo_patch_autoload`` stub (without importing the ``nemo_patch`` package, which would cost start-up
time) and calls :func:`install` with the function that applies the overlay. That adds a meta-path finder and nothing
else: it never imports NeMo. When a program later imports NeMo's ``megatron_strategy`` module
(:data:`TARGET_MODULE`), the finder lets NeMo's own loader execute it and then calls that function
(:func:`nemo_patch.overlay.apply.apply_overlay`), which replaces ``MegatronStrategy`` with
:class:`nemo_patch.MegatronStrategy` everywhere NeMo exposes it (``nemo.lightning.MegatronStrategy`` included). The
same happens after :data:`STRATEGY_MODULE` is executed, for programs that import ``nemo_patch``'s strategy before NeMo
(NeMo's module is then executed from inside it, before the class exists).

Must import the standard library only, and no other ``nemo_patch`` module: the function to call is handed in, so
this module knows nothing of what it triggers. Set ``NEMO_PATCH_DISABLE=1`` (or ``true``/``yes``) to turn the
overlay off.
"""

import os
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

__all__ = ["STRATEGY_MODULE", "TARGET_MODULE", "install", "overlay_disabled"]

#: The NeMo module whose import triggers the overlay.
TARGET_MODULE = "nemo.lightning.pytorch.strategies.megatron_strategy"
#: The module that defines :class:`nemo_patch.MegatronStrategy` (it imports :data:`TARGET_MODULE`).
STRATEGY_MODULE = "nemo_patch.training.strategy"
_WATCHED = (TARGET_MODULE, STRATEGY_MODULE)

#: Called after a watched module has been executed; returns whether the overlay is in effect.
ApplyOverlay = Callable[[], bool]


def overlay_disabled() -> bool:
    """Whether ``NEMO_PATCH_DISABLE`` is set to ``1``, ``true`` or ``yes`` (case-insensitive)."""
    return os.environ.get("NEMO_PATCH_DISABLE", "").strip().lower() in ("1", "true", "yes")


def strategy_module_importing() -> bool:
    """Whether :data:`STRATEGY_MODULE` is being executed right now (in ``sys.modules``, its class not yet defined)."""
    strategy = sys.modules.get(STRATEGY_MODULE)
    return strategy is not None and "MegatronStrategy" not in vars(strategy)


class _OverlayLoader:
    """Runs the module's own loader, then applies the overlay."""

    def __init__(self, loader: Any, apply: ApplyOverlay) -> None:
        self._loader = loader
        self._apply = apply

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if strategy_module_importing():
            return  # NeMo's module, executed from inside nemo_patch's strategy module: the overlay follows that one
        if module.__name__ == STRATEGY_MODULE and TARGET_MODULE not in sys.modules:
            return  # cannot happen (the strategy module imports NeMo's), but nothing to overlay then
        try:
            self._apply()
        except Exception as error:  # never break `import nemo` because of the overlay
            warnings.warn(f"nemo_patch overlay not applied: {error}", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _OverlayFinder:
    """Meta-path finder that wraps the loaders of :data:`TARGET_MODULE` and :data:`STRATEGY_MODULE` only."""

    # Set while this finder asks the others. Imports of one module are serialised by its import lock, and this
    # finder answers for two modules only, so a plain flag suffices (importing threading would cost start-up time).
    _searching = False

    def __init__(self, apply: ApplyOverlay) -> None:
        self._apply = apply

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        # Re-entered while asking the other finders (another copy of this hook from a second install would ask us
        # back): answer nothing then, so the search cannot recurse.
        if fullname not in _WATCHED or _OverlayFinder._searching:
            return None
        _OverlayFinder._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and not isinstance(spec.loader, _OverlayLoader):
                        spec.loader = _OverlayLoader(spec.loader, self._apply)  # type: ignore[assignment]
                    return spec
            return None
        finally:
            _OverlayFinder._searching = False


def install(apply: ApplyOverlay) -> None:
    """Register the finder once, unless the overlay is disabled.

    Args:
        apply: what to call after a watched module has been executed (the overlay's
            :func:`nemo_patch.overlay.apply.apply_overlay`, or a function importing it).
    """
    if overlay_disabled() or any(isinstance(finder, _OverlayFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _OverlayFinder(apply))
