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

"""Find and check a NeMo 2 checkpoint on disk before consolidating it, without importing NeMo.

A NeMo 2 checkpoint written by ``MegatronCheckpointIO`` with the ``torch_dist`` backend looks like::

    <root>/<name>--step=<N>-consumed_samples=<S>/     the checkpoint directory
        context/                                      NeMo's serialized model/trainer context (io.json, model.yaml)
        weights/                                      megatron-core distributed checkpoint
            .metadata                                 torch.distributed.checkpoint metadata, written last
            __<rank>_<i>.distcp                       shard files
            common.pt, metadata.json                  megatron-core: {"sharded_backend": "torch_dist", ...}
    <root>/<name>--step=<N>-...-unfinished            NeMo's marker while the save is not finished
    <root>/LATEST                                     the training side's pointer to the newest consolidated one

Other layouts NeMo can write are recognised and refused by name: ``zarr`` (``metadata.json`` says so) and
``fsdp_dtensor`` (Megatron FSDP; the DCP files lie directly in the checkpoint directory, keyed ``model.*``).

Standard library only (no torch); never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple, Union

from nemo_patch.engine.errors import (
    CheckpointNotFoundError,
    NotACheckpointError,
    UnfinishedCheckpointError,
    UnsupportedFormatError,
)

__all__ = [
    "UNFINISHED_SUFFIX",
    "CheckpointLocation",
    "checkpoints_newest_first",
    "inspect_checkpoint",
    "is_marked_unfinished",
    "looks_like_checkpoint",
]

#: NeMo's ``ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX``.
UNFINISHED_SUFFIX = "-unfinished"
_STEP = re.compile(r"step=(\d+)")


@dataclass(frozen=True)
class CheckpointLocation:
    """A checkpoint found on disk.

    Attributes:
        checkpoint_dir: the checkpoint directory (``<ckpt>``; for a bare DCP directory, the directory itself).
        weights_dir: the directory with the DCP ``.metadata`` and shard files (``<ckpt>/weights``).
        finished: ``False`` when NeMo's unfinished marker is present or ``.metadata`` was never written.
    """

    checkpoint_dir: Path
    weights_dir: Path
    finished: bool


def is_marked_unfinished(checkpoint_dir: Union[str, Path]) -> bool:
    """Whether NeMo's ``<ckpt>-unfinished`` marker exists (as ``ModelCheckpoint.is_checkpoint_unfinished`` checks)."""
    return Path(str(checkpoint_dir).removesuffix(".ckpt").removesuffix("-EMA") + UNFINISHED_SUFFIX).exists()


def _backend(weights_dir: Path) -> str:
    try:
        config = json.loads((weights_dir / "metadata.json").read_text())
    except (OSError, ValueError):
        return "torch_dist"  # a plain DCP directory (no megatron-core config file)
    return str(config.get("sharded_backend", "torch_dist")) if isinstance(config, dict) else "torch_dist"


def looks_like_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint's ``weights/`` or DCP/megatron-core metadata (i.e. is not a root)."""
    return any((path / name).exists() for name in ("weights", ".metadata", "metadata.json"))


def inspect_checkpoint(path: Union[str, Path], allow_unfinished: bool = False) -> CheckpointLocation:
    """Check that ``path`` is one finished ``torch_dist`` checkpoint.

    Args:
        path: a checkpoint directory or its ``weights/`` directory.
        allow_unfinished: return an unfinished checkpoint (``finished=False``) instead of raising.

    Returns:
        Its :class:`CheckpointLocation`.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        NotACheckpointError: ``path`` holds neither ``weights/`` nor DCP/megatron-core metadata.
        UnsupportedFormatError: a ``zarr`` or ``fsdp_dtensor`` checkpoint (the message names which).
        UnfinishedCheckpointError: NeMo's unfinished marker is present or ``.metadata`` is missing.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise NotACheckpointError(f"{path} is not a NeMo 2 checkpoint: it is a file, expected a directory")
    if (path / "weights").is_dir():
        checkpoint_dir, weights_dir = path, path / "weights"
    elif (path / ".metadata").is_file() and (path / "context").is_dir():
        raise UnsupportedFormatError(
            f"{path} is an 'fsdp_dtensor' checkpoint (Megatron FSDP); only 'torch_dist' checkpoints can be "
            "consolidated"
        )
    elif looks_like_checkpoint(path):
        checkpoint_dir, weights_dir = (path.parent if path.name == "weights" else path), path
    else:
        raise NotACheckpointError(
            f"{path} is not a NeMo 2 checkpoint: expected a 'weights/' directory with torch.distributed.checkpoint "
            "'.metadata' (or that directory itself)"
        )
    backend = _backend(weights_dir)
    if backend != "torch_dist":
        raise UnsupportedFormatError(
            f"{checkpoint_dir} is a '{backend}' checkpoint; only 'torch_dist' checkpoints can be consolidated "
            "(re-save with ckpt_save_format='torch_dist')"
        )
    finished = (weights_dir / ".metadata").is_file() and not is_marked_unfinished(checkpoint_dir)
    if not finished and not allow_unfinished:
        why = "NeMo's unfinished marker is present" if is_marked_unfinished(checkpoint_dir) else "no '.metadata'"
        raise UnfinishedCheckpointError(f"{checkpoint_dir} is an unfinished checkpoint ({why}): its save never ended")
    return CheckpointLocation(checkpoint_dir, weights_dir, finished)


def checkpoints_newest_first(root: Union[str, Path]) -> List[Path]:
    """The checkpoint directories (``<name>/weights/``) in a run's checkpoint root, newest first.

    Newest is by the global step in the name (``step=<N>``), a step's own checkpoint before NeMo's ``-last`` copy of
    it, then by modification time. Hidden entries are skipped; a checkpoint that NeMo's top-k removal deletes while
    the root is listed is left out.
    """
    root = Path(root)
    keys: Dict[Path, Tuple[int, bool, float]] = {}
    for path in root.iterdir():
        if path.name.startswith(".") or not (path / "weights").is_dir():
            continue
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        # NeMo's ``-last`` copy of a step holds the same weights as the step's own checkpoint; prefer the latter
        # (the one ``LATEST`` names) whatever the two modification times say.
        match = _STEP.search(path.name)
        keys[path] = (int(match.group(1)) if match else -1, not path.name.endswith("-last"), mtime)
    return sorted(keys, key=keys.__getitem__, reverse=True)
