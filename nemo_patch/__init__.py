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

Importing this package enables the overlay (unless ``NEMO_PATCH_DISABLE=1``): NeMo's ``MegatronStrategy``,
``MegatronCheckpointIO``, ``ModelCheckpoint`` and ``PEFT`` run with the edits of ``nemo_patch/overlay/nemo_edits/``
applied to their source (subpackages: "Architecture" in docs/how-it-works.md). The public names (``__all__``) are
those the API reference documents; NeMo's (edited) classes and the torch-dependent names are imported on first use,
so that ``import nemo_patch`` imports neither NeMo nor torch. The rest may change between releases.
"""

import importlib
from typing import Any

from nemo_patch.overlay.version import check_nemo_version

__nemo_version__ = check_nemo_version()

from nemo_patch.engine.errors import ConsolidationError  # noqa: E402
from nemo_patch.overlay.apply import apply_overlay as _apply_overlay  # noqa: E402
from nemo_patch.overlay.apply import overlay_applied  # noqa: E402
from nemo_patch.overlay.extensions import register_extensions  # noqa: E402
from nemo_patch.training.config import ConsolidationConfig  # noqa: E402
from nemo_patch.training.latest import locate_checkpoint, read_latest_pointer  # noqa: E402
from nemo_patch.training.settings import ConsolidationSettings  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "ConsolidationResult": "nemo_patch.engine.consolidate",
    "consolidate_checkpoint": "nemo_patch.engine.consolidate",
    "verify_consolidated": "nemo_patch.engine.verify",
    "load_consolidated_into": "nemo_patch.engine.load",
    "load_consolidated_state_dict": "nemo_patch.engine.load",
    "export_hf_checkpoint": "nemo_patch.export.hf",
    "MegatronStrategy": "nemo.lightning.pytorch.strategies.megatron_strategy",
    "MegatronCheckpointIO": "nemo.lightning.io.pl",
    "ConsolidationOutcome": "nemo_patch.training.hooks",
    "find_best_checkpoint": "nemo_patch.runs.best_checkpoint",
    "consolidation_config": "nemo_patch.training.config",
}

__all__ = ["ConsolidationConfig", "ConsolidationError", "ConsolidationOutcome", "ConsolidationResult"]
__all__ += ["ConsolidationSettings", "MegatronCheckpointIO", "MegatronStrategy", "consolidate_checkpoint"]
__all__ += ["consolidation_config", "export_hf_checkpoint", "find_best_checkpoint", "load_consolidated_into"]
__all__ += ["load_consolidated_state_dict", "locate_checkpoint", "overlay_applied", "read_latest_pointer"]
__all__ += ["verify_consolidated"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        globals()[name] = value = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'nemo_patch' has no attribute {name!r}")


register_extensions()  # the training side's later additions, which NeMo's tree does not have yet
_apply_overlay()
