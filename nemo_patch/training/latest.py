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

"""A run's ``LATEST`` and ``BEST`` pointers (relative symlinks, replaced atomically, moving forward only), and which
checkpoint a run's checkpoint root designates. Standard library and the engine's torch-free layout only.
"""

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from nemo_patch.engine.checkpoint_layout import CheckpointLocation, inspect_checkpoint, looks_like_checkpoint
from nemo_patch.engine.errors import CheckpointNotFoundError, NotACheckpointError, UnfinishedCheckpointError
from nemo_patch.engine.output_layout import OUTPUT_DIRNAMES, RETAINED_DIRNAME
from nemo_patch.engine.output_target import refuse_an_output_as_checkpoint
from nemo_patch.runs.checkpoint_root import checkpoint_root, checkpoints_newest_first

__all__ = ["BEST_NAME", "LATEST_NAME", "OutputOrder", "locate_checkpoint", "moves_forward", "output_order"]
__all__ += ["pointed_output", "read_latest_pointer", "read_output_metadata", "remove_latest_pointer"]
__all__ += ["set_aside_non_link", "update_latest_pointer"]

#: File name of the pointer to the newest consolidated checkpoint, in the checkpoint root.
LATEST_NAME = "LATEST"
#: File name of the pointer to the best consolidated checkpoint by the monitored metric (``"best"`` cadences).
BEST_NAME = "BEST"


@dataclass(frozen=True)
class OutputOrder:
    """Where an output's save stands in the order ``LATEST``/``BEST`` move in.

    Attributes:
        key: ``save_identity.order_key`` of the save its ``metadata.json`` records under ``"save"``; ``None`` when
            it records none (an output written before identities were recorded).
        run: the run it records (``"run"``, else the save's), ``None`` when none.
        global_step: its ``global_step`` (``-1`` when it records none).
    """

    key: Optional[Tuple[Any, ...]]
    run: Optional[str]
    global_step: int


def read_output_metadata(output_dir: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """``<output_dir>/metadata.json`` (a bounded regular file holding a JSON object), ``None`` when it cannot be read
    (no output there, a link or a FIFO, malformed JSON, not an object)."""
    from nemo_patch.engine.safe_files import read_json_file

    try:
        manifest = read_json_file(Path(output_dir) / "metadata.json")
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def output_order(output_dir: Union[str, Path]) -> Optional[OutputOrder]:
    """The :class:`OutputOrder` of an output (a checkpoint's ``consolidated/``/``hf/`` or a retained one's), read from
    its own ``metadata.json``; ``None`` when that cannot be read (:func:`read_output_metadata`)."""
    from nemo_patch.engine.save_identity import SaveIdentity, order_key

    manifest = read_output_metadata(output_dir)
    if manifest is None:
        return None
    try:
        identity: Optional[SaveIdentity] = SaveIdentity.from_json(manifest.get("save"))
    except ValueError:
        identity = None
    run = manifest.get("run")
    run = run if isinstance(run, str) else (identity.run if identity is not None else None)
    step = manifest.get("global_step")
    step = step if type(step) is int else -1
    return OutputOrder(None if identity is None else order_key(identity), run, step)


def moves_forward(candidate: Optional[OutputOrder], current: Optional[OutputOrder]) -> bool:
    """Whether a pointer that names an output of order ``current`` may move to one of order ``candidate``: never
    backwards. ``current`` ``None`` (no pointer, or it names nothing readable): yes. Both with a recorded save: by
    ``save_identity.order_key`` (a newer run's output is newer whatever its step); else by run (a run that records
    none first), then global step. ``candidate`` ``None``: no."""
    if current is None:
        return True
    if candidate is None:
        return False
    if candidate.key is not None and current.key is not None:
        return candidate.key >= current.key
    return (candidate.run or "", candidate.global_step) >= (current.run or "", current.global_step)


def pointed_output(
    checkpoint_root: Union[str, Path], output_names: Tuple[str, ...] = ("consolidated", "hf"), name: str = LATEST_NAME
) -> Optional[Path]:
    """The output ``<checkpoint_root>/LATEST`` (or ``<name>``) names: ``<target>/<output name>`` for the first of
    ``output_names`` that is a directory there (a checkpoint or a ``retained/`` entry); ``None`` when there is no
    pointer or it names no output (gone: a dangling pointer)."""
    link = Path(checkpoint_root) / name
    try:
        target = Path(os.path.normpath(link.parent / os.readlink(link)))
    except OSError:  # absent, or not a link
        return None
    for output_name in output_names:
        if (target / output_name).is_dir() and not (target / output_name).is_symlink():
            return target / output_name
    return None


def update_latest_pointer(
    checkpoint_dir: Union[str, Path], root: Optional[Union[str, Path]] = None, name: str = LATEST_NAME
) -> Path:
    """Point ``<root>/LATEST`` (or ``<root>/<name>``, e.g. :data:`BEST_NAME`) at ``checkpoint_dir``.

    The symlink is relative (``LATEST -> <checkpoint name>`` or ``retained/<name>``), so the run directory can be
    moved, and replaced atomically (a new link renamed over the old one).

    Args:
        checkpoint_dir: the directory to point at (a checkpoint directory, or a retained entry).
        root: the checkpoint root that holds ``LATEST``; default: ``checkpoint_dir``'s parent.
        name: the pointer's file name (:data:`LATEST_NAME` or :data:`BEST_NAME`).

    Returns:
        The path of the link.

    Raises:
        OSError: if the link cannot be created (e.g. a read-only directory).
    """
    checkpoint_dir = Path(checkpoint_dir)
    root = checkpoint_dir.parent if root is None else Path(root)
    link = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.symlink(os.path.relpath(checkpoint_dir, root), tmp)
    try:
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return link


def set_aside_non_link(checkpoint_root: Union[str, Path], name: str = LATEST_NAME) -> Optional[Path]:
    """Make room for the ``<checkpoint_root>/LATEST`` (or ``<name>``) symlink when a directory (e.g. a copy made by a
    sync tool that follows symlinks) or a file took its place: it is renamed, not deleted, to a hidden
    ``.<name>.replaced-<UTC time>`` beside it, which nothing takes for a checkpoint.

    Returns:
        Where it was moved, or ``None`` when ``<name>`` is a symlink or absent (nothing to do).

    Raises:
        OSError: it cannot be renamed.
    """
    link = Path(checkpoint_root) / name
    if link.is_symlink() or not os.path.lexists(link):
        return None
    aside = link.parent / f".{name}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    os.rename(link, aside)
    return aside


def remove_latest_pointer(checkpoint_root: Union[str, Path], name: str = LATEST_NAME) -> None:
    """Remove ``<checkpoint_root>/LATEST`` (or ``<name>``) if it exists: no pointer rather than a dangling one."""
    (Path(checkpoint_root) / name).unlink(missing_ok=True)


def read_latest_pointer(checkpoint_root: Union[str, Path], name: str = LATEST_NAME) -> Optional[Path]:
    """The directory ``<checkpoint_root>/LATEST`` (or ``<name>``) points at, or ``None`` if there is no pointer."""
    link = Path(checkpoint_root) / name
    if not link.is_symlink():
        return None
    return (link.parent / os.readlink(link)).resolve()


def locate_checkpoint(path: Union[str, Path], allow_unfinished: bool = False) -> CheckpointLocation:
    """Resolve a user-given path to one checkpoint.

    Args:
        path: a checkpoint directory, its ``weights/`` directory, or a run's checkpoint root (the directory that
            holds the checkpoints, or the run directory holding ``checkpoints/``). For a root, ``LATEST`` is taken
            when it points at a checkpoint (not at an output retained after its checkpoint was removed, which has no
            distributed checkpoint left to read), else the newest finished checkpoint by the global step in its name
            (``step=<N>``), a step's own checkpoint before its ``-last`` copy, then by modification time.
        allow_unfinished: accept an unfinished checkpoint (given directly, or the newest one of a root).

    Returns:
        The checkpoint's :class:`nemo_patch.engine.checkpoint_layout.CheckpointLocation`.

    Raises:
        ConsolidationError: those of :func:`nemo_patch.engine.checkpoint_layout.inspect_checkpoint`;
            :class:`NotACheckpointError` for a root with no checkpoint and :class:`UnfinishedCheckpointError` for a
            root whose checkpoints are all unfinished.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if path.resolve().parent.name == RETAINED_DIRNAME and any(
        (path / name).is_dir() for name in OUTPUT_DIRNAMES.values()
    ):
        raise NotACheckpointError(
            f"{path} is a consolidated output kept after NeMo's top-k retention removed its checkpoint: there is no "
            f"distributed checkpoint left to consolidate; its files are in {path}/consolidated (or hf)"
        )
    refuse_an_output_as_checkpoint(path)
    if not path.is_dir() or looks_like_checkpoint(path):
        return inspect_checkpoint(path, allow_unfinished)
    root = checkpoint_root(path)
    link = root / LATEST_NAME
    latest = link.parent / os.readlink(link) if link.is_symlink() else None  # as given: relative stays relative
    if latest is not None and latest.is_dir() and looks_like_checkpoint(latest):
        return inspect_checkpoint(latest, allow_unfinished)
    candidates = checkpoints_newest_first(root)
    for candidate in candidates:
        try:
            location = inspect_checkpoint(candidate, allow_unfinished=True)
        except CheckpointNotFoundError:  # removed by NeMo's top-k removal since it was listed
            continue
        if location.finished or allow_unfinished:
            return location
    if candidates:
        raise UnfinishedCheckpointError(f"every checkpoint under {root} is unfinished; newest: {candidates[0].name}")
    roots = sorted(str(found) for found in path.glob("*/checkpoints") if found.is_dir())
    hint = f" (a NeMoLogger log_dir? its checkpoint roots: {', '.join(roots)})" if roots else ""
    raise NotACheckpointError(
        f"{path} is neither a NeMo 2 checkpoint nor a checkpoint root: no '<name>/weights/' directory in it{hint}"
    )
