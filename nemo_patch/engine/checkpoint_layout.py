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

"""Find and check a NeMo 2 checkpoint: ``<ckpt>/context/``, ``<ckpt>/weights/`` (DCP's ``.metadata``, written last,
``*.distcp`` shards, megatron-core's ``metadata.json``) and ``<ckpt>-unfinished`` while NeMo saves it."""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Union

from nemo_patch.engine.errors import (
    CheckpointNotFoundError,
    CorruptShardError,
    NotACheckpointError,
    UnfinishedCheckpointError,
    UnsupportedFormatError,
)

#: The output directory inside a checkpoint directory.
CONSOLIDATED_DIRNAME = "consolidated"
#: NeMo's ``ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX``.
UNFINISHED_SUFFIX = "-unfinished"
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)  # the last two: POSIX only


@dataclass(frozen=True)
class CheckpointLocation:
    """A checkpoint: its directory and ``weights/``, whether its save finished, megatron-core's ``sharded_backend``,
    and whether it holds PEFT adapter weights only."""

    checkpoint_dir: Path
    weights_dir: Path
    finished: bool
    backend: str = "torch_dist"
    adapter: bool = False


def is_marked_unfinished(checkpoint_dir: Union[str, Path]) -> bool:
    """Whether NeMo's ``<ckpt>-unfinished`` marker exists (as ``ModelCheckpoint.is_checkpoint_unfinished`` checks)."""
    return Path(str(checkpoint_dir).removesuffix(".ckpt").removesuffix("-EMA") + UNFINISHED_SUFFIX).exists()


def _json(path: Path) -> Dict[str, Any]:
    """The object in a JSON side file (``{}`` unless it is a regular file of at most 1 MB holding a JSON object)."""
    try:  # opened without blocking (a FIFO would block a plain open for ever); a device or FIFO has size 0: none read
        with open(os.open(path, _READ_FLAGS), "rb") as file:
            value = json.loads(file.read(min(os.fstat(file.fileno()).st_size, (1 << 20) + 1)))
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def weights_written(weights_dir: Path) -> bool:
    """Whether the file the format writes last is there (``.metadata``; ``metadata.json`` for ``zarr``)."""
    zarr = _json(weights_dir / "metadata.json").get("sharded_backend") == "zarr"
    return (weights_dir / ("metadata.json" if zarr else ".metadata")).is_file()


def looks_like_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint's ``weights/`` or DCP/megatron-core metadata (i.e. is not a root)."""
    return any((path / name).exists() for name in ("weights", ".metadata", "metadata.json"))


def inspect_checkpoint(path: Union[str, Path], allow_unfinished: bool = False) -> CheckpointLocation:
    """Check that ``path`` (a checkpoint directory or its ``weights/``) is one checkpoint of a known format.

    Args:
        path: the checkpoint.
        allow_unfinished: return an unfinished checkpoint (``finished=False``) instead of raising.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        NotACheckpointError: ``path`` holds neither ``weights/`` nor DCP/megatron-core metadata.
        UnsupportedFormatError: an ``fsdp_dtensor`` checkpoint or an unknown ``sharded_backend``.
        UnfinishedCheckpointError: NeMo's unfinished marker is there, or the file the format writes last is missing.
        CorruptShardError: ``weights/`` or ``context/`` is a symbolic link out of the checkpoint directory.
    """
    path, only = Path(path), "save with MegatronStrategy(save_ckpt_format='torch_dist') to consolidate it"
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if (path / "weights").is_dir():
        checkpoint_dir, weights_dir = path, path / "weights"
    elif (path / ".metadata").is_file() and (path / "context").is_dir():
        raise UnsupportedFormatError(f"{path} is an 'fsdp_dtensor' checkpoint; {only}")
    elif path.is_dir() and looks_like_checkpoint(path):
        checkpoint_dir, weights_dir = (path.parent if path.name == "weights" else path), path
    else:
        raise NotACheckpointError(f"{path} is not a NeMo 2 checkpoint: expected a 'weights/' directory")
    for part in (weights_dir, checkpoint_dir / "context") if weights_dir != checkpoint_dir else ():
        if part.exists() and checkpoint_dir.resolve() not in part.resolve().parents:
            raise CorruptShardError(f"{part} is a symbolic link to {part.resolve()}, outside the checkpoint")
    backend = str(_json(weights_dir / "metadata.json").get("sharded_backend", "torch_dist"))
    if backend not in ("torch_dist", "zarr"):
        what = f"a '{backend}' checkpoint, not 'torch_dist' or 'zarr'"
        raise UnsupportedFormatError(f"{checkpoint_dir} is {what}; {only}")
    adapter = (weights_dir / "adapter_metadata.json").is_file()
    finished = weights_written(weights_dir) and not is_marked_unfinished(checkpoint_dir)
    if not finished and not allow_unfinished:
        why = "NeMo's unfinished marker is present" if is_marked_unfinished(checkpoint_dir) else "no '.metadata'"
        raise UnfinishedCheckpointError(f"{checkpoint_dir} is an unfinished checkpoint ({why}): its save never ended")
    return CheckpointLocation(checkpoint_dir, weights_dir, finished, backend, adapter)
