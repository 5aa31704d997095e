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

"""The ``LATEST`` pointer: a relative symlink in the checkpoint root naming the newest consolidated checkpoint."""

import os
import uuid
from pathlib import Path
from typing import Optional, Union

__all__ = ["LATEST_NAME", "read_latest_pointer", "update_latest_pointer"]

#: File name of the pointer in the checkpoint root.
LATEST_NAME = "LATEST"


def update_latest_pointer(checkpoint_dir: Union[str, Path]) -> Path:
    """Point ``<root>/LATEST`` at ``checkpoint_dir`` (whose parent is ``<root>``).

    The symlink is relative (``LATEST -> <checkpoint name>``) so the run directory can be moved. It is replaced
    atomically: a new link is created under a temporary name and renamed over the old one, so a reader never finds
    ``LATEST`` missing or half-written.

    Args:
        checkpoint_dir: the checkpoint directory to point at.

    Returns:
        The path of the ``LATEST`` link.

    Raises:
        OSError: if the link cannot be created (e.g. a read-only directory).
    """
    checkpoint_dir = Path(checkpoint_dir)
    link = checkpoint_dir.parent / LATEST_NAME
    tmp = checkpoint_dir.parent / f".{LATEST_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.symlink(checkpoint_dir.name, tmp)
    try:
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return link


def read_latest_pointer(checkpoint_root: Union[str, Path]) -> Optional[Path]:
    """The checkpoint directory ``<checkpoint_root>/LATEST`` points at, or ``None`` if there is no pointer."""
    link = Path(checkpoint_root) / LATEST_NAME
    if not link.is_symlink():
        return None
    return (link.parent / os.readlink(link)).resolve()
