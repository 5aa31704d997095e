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

"""The checkpoints of a training run's save directory, which of them are finished, and their global steps.

Two layouts are recognised from what the directory holds (docs/sidecar.md): a NeMo 2 checkpoint root, whose
checkpoints are finished when their weights are written and NeMo's ``<name>-unfinished`` marker is absent; and a
Megatron-LM or Megatron-Bridge ``--save`` directory, whose ``iter_<N>/`` is finished when its ``.metadata`` exists and
``latest_checkpointed_iteration.txt`` (the tracker) names ``N`` or later (its ``common.pt`` is never unpickled).
Hidden entries, ``LATEST``/``BEST`` and outputs kept under ``retained/`` are never checkpoints. Reads only: nothing
here writes. Standard library, and torch for ``common.pt``.
"""

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from nemo_patch.engine.checkpoint_layout import is_marked_unfinished, weights_written
from nemo_patch.engine.safe_files import read_regular_file
from nemo_patch.engine.save_identity import global_step_of
from nemo_patch.runs.checkpoint_root import is_copy_name

__all__ = [
    "MEGATRON_LAYOUT",
    "NEMO_LAYOUT",
    "TRACKER_FILENAME",
    "RunCheckpoint",
    "RunListing",
    "is_copy_name",
    "list_run_checkpoints",
    "read_tracker",
    "run_layout",
]

logger = logging.getLogger(__name__)

#: A NeMo 2 checkpoint root.
NEMO_LAYOUT = "nemo"
#: A Megatron-LM / Megatron-Bridge save directory.
MEGATRON_LAYOUT = "megatron"
#: Megatron-LM's and Megatron-Bridge's record of the newest finished iteration.
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"

_ITERATION = re.compile(r"^iter_([0-9]{7,18})$")
_MAX_TRACKER_BYTES = 4096


@dataclass(frozen=True)
class RunCheckpoint:
    """A finished checkpoint of a run: its directory, its global step and whether it is NeMo's ``-last`` copy."""

    path: Path
    global_step: int
    copy: bool = False


@dataclass
class RunListing:
    """What a save directory holds: its layout (``None`` while it holds no checkpoint), the finished checkpoints in
    step order (a step's own save before its copies, then by name), and the checkpoints that are not finished with
    why (unfinished, removed while listed, no global step, an iteration the tracker passed without ``.metadata``)."""

    layout: Optional[str]
    finished: List[RunCheckpoint] = field(default_factory=list)
    not_finished: Dict[Path, str] = field(default_factory=dict)


def read_tracker(root: Union[str, Path]) -> Optional[int]:
    """The iteration ``<root>/latest_checkpointed_iteration.txt`` names, or ``None`` when it is absent, not a regular
    file, or holds no iteration (``release``, or damaged: logged at debug level)."""
    try:
        text = read_regular_file(Path(root) / TRACKER_FILENAME, _MAX_TRACKER_BYTES).decode("ascii").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError) as error:
        logger.debug("No iteration in %s: %s", Path(root) / TRACKER_FILENAME, error)
        return None


def _iteration(name: str) -> Optional[int]:
    """The iteration of a directory named as Megatron-LM and Megatron-Bridge name them (``iter_{:07d}``), else
    ``None``: ``iter_100`` or ``iter_00000100`` beside ``iter_0000100`` would be a second checkpoint of one
    iteration, and ``\\d`` would take other scripts' digits."""
    match = _ITERATION.match(name)
    if match is None:
        return None
    iteration = int(match.group(1))
    return iteration if name == f"iter_{iteration:07d}" else None


def _entries(root: Path) -> List[os.DirEntry]:
    try:
        with os.scandir(root) as found:
            return [entry for entry in found if not entry.name.startswith(".")]
    except FileNotFoundError:
        return []


def run_layout(root: Union[str, Path]) -> Optional[str]:
    """:data:`MEGATRON_LAYOUT`, :data:`NEMO_LAYOUT`, or ``None`` while ``root`` holds neither kind of checkpoint."""
    entries = _entries(Path(root))
    if any(entry.name == TRACKER_FILENAME for entry in entries) or any(
        _iteration(entry.name) is not None and entry.is_dir(follow_symlinks=False) for entry in entries
    ):
        return MEGATRON_LAYOUT
    for entry in entries:
        if entry.name.endswith("-unfinished") or (
            entry.is_dir(follow_symlinks=False) and (Path(entry.path) / "weights").is_dir()
        ):
            return NEMO_LAYOUT
    return None


def _nemo(root: Path, listing: RunListing) -> None:
    found: List[Tuple[int, bool, str, RunCheckpoint]] = []
    for entry in _entries(root):
        path = Path(entry.path)
        if not entry.is_dir(follow_symlinks=False) or not (path / "weights").is_dir():
            continue
        if is_marked_unfinished(path) or not weights_written(path / "weights"):
            listing.not_finished[path] = "unfinished"
            continue
        step = global_step_of(path)
        if step is None:
            listing.not_finished[path] = "no global step: no 'step=<N>' in its name or 'global_step' in common.pt"
            continue
        copy = is_copy_name(entry.name)
        found.append((step, copy, entry.name, RunCheckpoint(path, step, copy)))
    listing.finished = [item[-1] for item in sorted(found, key=lambda item: item[:3])]


def _megatron(root: Path, listing: RunListing) -> None:
    from nemo_patch.engine.save_identity import in_progress

    tracked = read_tracker(root)
    found = []
    for entry in _entries(root):
        iteration = _iteration(entry.name)
        if iteration is None or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if tracked is None or iteration > tracked:
            listing.not_finished[path] = "unfinished: the tracker has not reached it"
        elif not (path / ".metadata").is_file():
            listing.not_finished[path] = f"no '.metadata' although the tracker names iteration {tracked}"
        elif (saving := in_progress(path)) is not None:  # rewritten in place (a rollback): the tracker says nothing
            listing.not_finished[path] = f"unfinished: {saving}"
        else:
            found.append(RunCheckpoint(path, iteration))
    listing.finished = sorted(found, key=lambda checkpoint: checkpoint.global_step)


def list_run_checkpoints(root: Union[str, Path], layout: Optional[str] = None) -> RunListing:
    """The checkpoints of a save directory (see the module docstring), as the directory is now.

    Args:
        root: a NeMo 2 checkpoint root, or a Megatron-LM / Megatron-Bridge save directory.
        layout: the layout to list it as (a watcher's, found once: a stray tracker file dropped into a NeMo root
            later must not turn it into a Megatron-LM one); default: :func:`run_layout`.

    Returns:
        A :class:`RunListing`; a checkpoint removed while the directory is listed is left out.

    Raises:
        OSError: ``root`` cannot be listed (other than its absence: nothing is listed then).
    """
    root = Path(root)
    listing = RunListing(run_layout(root) if layout is None else layout)
    if listing.layout == MEGATRON_LAYOUT:
        _megatron(root, listing)
    elif listing.layout == NEMO_LAYOUT:
        _nemo(root, listing)
    return listing
