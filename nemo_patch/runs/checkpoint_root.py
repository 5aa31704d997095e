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

"""A run's checkpoint root and its checkpoints: which is newest, and the global step in a checkpoint's name.

NeMo names a checkpoint ``<name>--step=<N>-consumed_samples=<S>`` (``N`` is the global step - 1) and a second save of
a run's final step ``...-last``. Standard library only.
"""

import re
from pathlib import Path
from typing import Dict, List, Tuple, Union

from nemo_patch.engine.save_identity import _STEP_IN_NAME, global_step_in_name

__all__ = ["checkpoint_root", "checkpoints_newest_first", "global_step_in_name", "is_copy_name", "without_copy_suffix"]

_COPY = re.compile(r"-last(?:-v[0-9]+)?$")


def checkpoint_root(path: Union[str, Path]) -> Path:
    """A run's checkpoint root: ``path`` itself, or ``path/checkpoints`` when ``path`` is the run directory (it holds
    no checkpoint but a ``checkpoints/`` directory)."""
    path = Path(path)
    if not checkpoints_newest_first(path) and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def is_copy_name(name: str) -> bool:
    """Whether a NeMo checkpoint name is ``ModelCheckpoint``'s ``-last`` copy (``-last``, ``-last-v1``, ...)."""
    return _COPY.search(name) is not None


def without_copy_suffix(name: str) -> str:
    """``name`` without ``ModelCheckpoint``'s ``-last`` copy suffix (``-last``, ``-last-v1``, ...), if it has one."""
    return _COPY.sub("", name)


def checkpoints_newest_first(root: Union[str, Path]) -> List[Path]:
    """The checkpoint directories (``<name>/weights/``) in a run's checkpoint root, newest first.

    Newest is by the global step in the name (``step=<N>``), a step's own checkpoint before NeMo's ``-last`` copy of
    it, then by modification time. Hidden entries are skipped; a checkpoint that NeMo's top-k removal deletes while
    the root is listed is left out.
    """
    keys: Dict[Path, Tuple[int, bool, float]] = {}
    for path in Path(root).iterdir():
        if path.name.startswith(".") or not (path / "weights").is_dir():
            continue
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        match = _STEP_IN_NAME.search(path.name)
        keys[path] = (int(match.group(1)) if match else -1, not is_copy_name(path.name), mtime)
    return sorted(keys, key=keys.__getitem__, reverse=True)
