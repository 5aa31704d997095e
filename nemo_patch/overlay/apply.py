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

"""Apply the overlay: NeMo's modules edited by the start-up hook (:mod:`.hook`), and the overlay's own additions to
the edited classes (:mod:`.deprecated`). Imports the standard library and :mod:`.hook` at module level; the training
side (and with it NeMo) only inside the functions the hook calls once NeMo is being imported.
"""

from types import ModuleType

from nemo_patch.overlay import hook
from nemo_patch.overlay.hook import overlay_applied

__all__ = ["after_exec", "apply_overlay", "overlay_applied", "prepare"]


def prepare() -> None:
    """Before the first edit of a NeMo module: importing the package refuses a NeMo it does not support."""
    import nemo_patch  # noqa: F401


def after_exec(module: ModuleType) -> None:
    """Once NeMo's ``module`` was executed edited: the deprecated keywords and attributes of its class."""
    from nemo_patch.overlay import deprecated

    deprecated.install(module)


def apply_overlay() -> bool:
    """Register the hook (unless the start-up did) and edit the NeMo modules imported before it; applying twice is
    harmless. When nothing is edited, NeMo's ``MegatronStrategy`` refuses the consolidation arguments
    (:func:`.hook.guard_unedited`).

    Returns:
        Whether NeMo's ``MegatronStrategy`` module is in effect edited (``False`` with ``NEMO_PATCH_DISABLE``, or
        before a program imports it: the hook edits it then).
    """
    hook.install(prepare, after_exec)
    hook.edit_loaded_modules()
    return overlay_applied()
