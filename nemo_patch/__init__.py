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

"""nemo_patch: control over when NeMo 2.x training runs consolidate their distributed checkpoints.

Importing this package enables the overlay (unless ``NEMO_PATCH_DISABLE=1``): ``nemo.lightning.MegatronStrategy``
becomes :class:`nemo_patch.MegatronStrategy`, which accepts ``save_consolidated`` and
``ckpt_consolidation_frequency`` -- at once if NeMo is already imported, else as soon as it is. Installing the package
does the same for every interpreter, without importing NeMo at start-up (see :mod:`nemo_patch._autoload`).

The NeMo-dependent names (:class:`MegatronStrategy`, :class:`MegatronCheckpointIO`, :class:`ConsolidationCallback`,
:func:`apply_overlay`, :func:`overlay_applied`) are imported on first use, so that the consolidation engine
(:func:`consolidate_checkpoint`) can run in a process that never imports NeMo; so are the torch-dependent ones, so
that ``import nemo_patch`` itself imports neither.
"""

import importlib
import sys
from typing import Any

from nemo_patch import _autoload
from nemo_patch._nemo_version import check_nemo_version

__nemo_version__ = check_nemo_version()

from nemo_patch.checkpoint_layout import locate_checkpoint  # noqa: E402
from nemo_patch.consolidation_errors import ConsolidationError  # noqa: E402
from nemo_patch.consolidation_policy import (  # noqa: E402
    ACCEPTED_FREQUENCIES,
    ConsolidationPolicy,
    parse_consolidation_frequency,
    resolve_policy,
)
from nemo_patch.latest_pointer import read_latest_pointer  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "ConsolidationResult": "nemo_patch.consolidate",
    "consolidate_checkpoint": "nemo_patch.consolidate",
    "verify_consolidated": "nemo_patch.consolidation_verify",
    "load_consolidated_into": "nemo_patch.load_consolidated",
    "load_consolidated_state_dict": "nemo_patch.load_consolidated",
    "MegatronStrategy": "nemo_patch.strategy",
    "MegatronCheckpointIO": "nemo_patch.checkpoint_io",
    "ConsolidationCallback": "nemo_patch.consolidation_callback",
    "apply_overlay": "nemo_patch.overlay",
    "overlay_applied": "nemo_patch.overlay",
}

__all__ = [
    "ACCEPTED_FREQUENCIES",
    "ConsolidationCallback",
    "ConsolidationError",
    "ConsolidationPolicy",
    "ConsolidationResult",
    "MegatronCheckpointIO",
    "MegatronStrategy",
    "apply_overlay",
    "consolidate_checkpoint",
    "load_consolidated_into",
    "load_consolidated_state_dict",
    "locate_checkpoint",
    "overlay_applied",
    "parse_consolidation_frequency",
    "read_latest_pointer",
    "resolve_policy",
    "verify_consolidated",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nemo_patch' has no attribute {name!r}")


if not _autoload.overlay_disabled():
    if _autoload.TARGET_MODULE in sys.modules:
        importlib.import_module("nemo_patch.overlay").apply_overlay()
    else:
        _autoload.install()
