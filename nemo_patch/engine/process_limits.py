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

"""What a consolidating process sets on itself so that it never outlives, or costs, the process it serves.

A training run's consolidation process and its writer processes call :func:`die_with_parent` (a killed training rank
leaves no consolidation behind) and inherit :func:`raise_oom_score` (the OOM killer picks them before a training rank).
"""

import os
import signal
import sys
from typing import Optional

__all__ = ["OOM_SCORE_ADJ_INCREMENT", "die_with_parent", "raise_oom_score"]

#: How much a consolidating process raises its ``oom_score_adj`` over the training process's (the range is -1000 to
#: 1000; 500 makes it the OOM killer's choice over any training rank of the same size).
OOM_SCORE_ADJ_INCREMENT = 500
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: Optional[int] = None) -> bool:
    """Ask Linux to SIGKILL this process when the thread that started it ends (``PR_SET_PDEATHSIG``).

    Args:
        parent_pid: the pid of the process that started this one, when known: if it has already died (before this
            call, so the signal cannot come), this process kills itself at once.

    Returns:
        Whether the parent-death signal is set (``False`` off Linux or where ``prctl`` is unavailable).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes  # Linux only, never at module import

        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            return False
    except (ImportError, OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:  # reparented: the parent died before the prctl
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def raise_oom_score(increment: int = OOM_SCORE_ADJ_INCREMENT) -> Optional[int]:
    """Raise this process's ``/proc/self/oom_score_adj`` by ``increment`` (at most to 1000); children inherit it.

    Returns:
        The new value, or ``None`` where it cannot be read or written (not Linux, a restricted ``/proc``).
    """
    if not sys.platform.startswith("linux"):
        return None
    path = "/proc/self/oom_score_adj"
    try:
        with open(path) as handle:
            value = min(1000, int(handle.read().strip()) + increment)
        with open(path, "w") as handle:
            handle.write(str(value))
    except (OSError, ValueError):
        return None
    return value
