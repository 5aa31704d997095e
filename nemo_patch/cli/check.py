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


"""``nemo-consolidate --check``: whether the overlay would be active in a new interpreter of this environment (one
that imports NeMo's ``MegatronStrategy`` without importing ``nemo_patch`` first). Standard library only."""

import json
import os
import subprocess
import sys
from typing import Optional, Tuple

__all__ = ["OVERLAY_OFF_EXIT_CODE", "check_overlay"]

#: The exit code of ``nemo-consolidate --check`` (and of the demo) when the overlay would not be active.
OVERLAY_OFF_EXIT_CODE = 21

#: Run in the fresh interpreter: import the module a training script imports, then read the hook's state.
_PROBE = """
import json, sys
from importlib import metadata
import nemo.lightning.pytorch.strategies.megatron_strategy as module
hook = sys.modules.get("nemo_patch.overlay.hook")
print(json.dumps({
    "hook": hook is not None,
    "applied": bool(hook is not None and hook.overlay_applied()),
    "reason": hook.not_applied_reason() if hook is not None else None,
    "file": module.__file__,
    "nemo": metadata.version("nemo_toolkit"),
}))
"""


def check_overlay(python: Optional[str] = None, timeout: float = 600.0) -> Tuple[bool, str]:
    """Whether the overlay would be active in a new interpreter, and one line saying so (or why not).

    Args:
        python: the interpreter to ask (default: this one, ``sys.executable``); it inherits this environment
            (``NEMO_PATCH_DISABLE``, ``PYTHONPATH``).
        timeout: seconds the child may take (importing NeMo takes 10 to 60 s).

    Returns:
        ``(True, "nemo_patch overlay active: ...")`` or ``(False, reason)``; the reason names the cause: the start-up
        hook did not run, ``NEMO_PATCH_DISABLE``, an unsupported NeMo or edits that do not apply to its files.
    """
    command = [python or sys.executable, "-c", _PROBE]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"the check's interpreter could not run ({error})"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"importing NeMo's MegatronStrategy failed in a new interpreter ({last})"
    try:
        found = json.loads(lines[-1])
    except ValueError:
        return False, f"the check's interpreter printed {lines[-1][:200]!r}"
    where = f"{found['file']} of nemo_toolkit {found['nemo']}"
    if not found["hook"]:
        return False, (
            f"the start-up hook (nemo_patch.pth) did not run in a new interpreter, so {where} is unedited unless the "
            "job imports nemo_patch first (nemo-patch on PYTHONPATH, or python -S?): install nemo-patch with pip "
            "into this environment"
        )
    if not found["applied"]:
        return False, f"{where} is not edited: {found['reason']}"
    return True, f"nemo_patch overlay active: {where} is edited (start-up hook installed)"
