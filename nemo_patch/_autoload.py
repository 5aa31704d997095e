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

"""Import hook of the nemo_patch overlay (standard library only: it runs at interpreter start-up).

At interpreter start-up, ``site`` runs the one line of ``nemo_patch.pth``, which loads this file through the
top-level ``_nemo_patch_autoload`` stub and calls :func:`install`. That adds a
meta-path finder and nothing else: it imports only the standard library and never imports NeMo. When (and only when)
a program later imports NeMo's ``nemo.lightning.pytorch.strategies.megatron_strategy`` module, the finder lets NeMo's
own loader execute it and then calls :func:`nemo_patch.overlay.apply_overlay`, which replaces ``MegatronStrategy``
with :class:`nemo_patch.MegatronStrategy` everywhere NeMo exposes it (``nemo.lightning.MegatronStrategy`` included).

Set ``NEMO_PATCH_DISABLE=1`` (or ``true``/``yes``) to turn the overlay off.
"""

import importlib
import os
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional, Sequence

__all__ = ["TARGET_MODULE", "install", "overlay_disabled"]

#: The NeMo module whose import triggers the overlay.
TARGET_MODULE = "nemo.lightning.pytorch.strategies.megatron_strategy"


def overlay_disabled() -> bool:
    """Whether ``NEMO_PATCH_DISABLE`` is set to ``1``, ``true`` or ``yes`` (case-insensitive)."""
    return os.environ.get("NEMO_PATCH_DISABLE", "").strip().lower() in ("1", "true", "yes")


class _OverlayLoader:
    """Runs NeMo's loader, then applies the overlay to the freshly executed module."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        strategy = sys.modules.get("nemo_patch.strategy")
        if strategy is not None and "MegatronStrategy" not in vars(strategy):
            return  # nemo_patch.strategy is importing NeMo right now; it applies the overlay once its class exists
        try:
            importlib.import_module("nemo_patch.overlay").apply_overlay()
        except Exception as error:  # never break `import nemo` because of the overlay
            warnings.warn(f"nemo_patch overlay not applied: {error}", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _OverlayFinder:
    """Meta-path finder that wraps the loader of :data:`TARGET_MODULE` and of nothing else."""

    # Set while this finder asks the others. Imports of one module are serialised by its import lock, and this
    # finder answers for one module only, so a plain flag suffices (importing threading would cost start-up time).
    _searching = False

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        # Re-entered while asking the other finders (another copy of this hook from a second install would ask us
        # back): answer nothing then, so the search cannot recurse.
        if fullname != TARGET_MODULE or _OverlayFinder._searching:
            return None
        _OverlayFinder._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and not isinstance(spec.loader, _OverlayLoader):
                        spec.loader = _OverlayLoader(spec.loader)  # type: ignore[assignment]  # duck-typed loader
                    return spec
            return None
        finally:
            _OverlayFinder._searching = False


def install() -> None:
    """Register the finder once, unless the overlay is disabled."""
    if overlay_disabled() or any(isinstance(finder, _OverlayFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _OverlayFinder())
