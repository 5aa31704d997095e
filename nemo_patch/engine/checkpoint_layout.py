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

NeMo's ``save_ckpt_format='zarr'`` writes megatron-core's ``zarr`` layout instead: ``weights/`` holds one Zarr array
directory per tensor (``<key>/.zarray`` plus chunk files) and ``metadata.json`` says ``"sharded_backend": "zarr"``;
it is read by :mod:`nemo_patch.engine.zarr_reader`. megatron-core writes ``metadata.json`` last, so for ``zarr`` it
is what marks a finished save (``.metadata`` does for ``torch_dist``). Other layouts are recognised and refused by
name: ``fsdp_dtensor`` (Megatron FSDP; the DCP files lie directly in the checkpoint directory, keyed ``model.*``) and
any other ``sharded_backend``.

Standard library only (no torch); never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from nemo_patch.engine.errors import (
    CheckpointNotFoundError,
    CorruptShardError,
    NotACheckpointError,
    UnfinishedCheckpointError,
    UnsupportedFormatError,
)
from nemo_patch.engine.safe_files import read_json_file

__all__ = [
    "ADAPTER_METADATA",
    "UNFINISHED_SUFFIX",
    "CheckpointLocation",
    "checkpoint_root",
    "checkpoints_newest_first",
    "global_step_in_name",
    "inspect_checkpoint",
    "is_marked_unfinished",
    "looks_like_checkpoint",
    "sharded_backend",
    "weights_written",
]

#: The distributed-checkpoint formats that can be consolidated (megatron-core's ``sharded_backend`` names).
READABLE_BACKENDS = ("torch_dist", "zarr")

#: NeMo's ``ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX``.
UNFINISHED_SUFFIX = "-unfinished"
#: NeMo's marker of a PEFT adapter checkpoint, in its ``weights/`` (NeMo's ``ADAPTER_META_FILENAME``).
ADAPTER_METADATA = "adapter_metadata.json"
_STEP = re.compile(r"step=(\d+)")


@dataclass(frozen=True)
class CheckpointLocation:
    """A checkpoint found on disk.

    Attributes:
        checkpoint_dir: the checkpoint directory (``<ckpt>``; for a bare DCP directory, the directory itself).
        weights_dir: the directory with the distributed checkpoint's files (``<ckpt>/weights``).
        finished: ``False`` when NeMo's unfinished marker is present or the file the format writes last (``.metadata``
            for ``torch_dist``, megatron-core's ``metadata.json`` for ``zarr``) was never written.
        backend: ``"torch_dist"`` or ``"zarr"``.
        adapter: whether it is a PEFT adapter checkpoint (NeMo's ``weights/adapter_metadata.json``): adapter weights
            only, for the base model NeMo recorded.
        adapter_base: the base model's checkpoint path NeMo recorded (``model_ckpt_path``), ``None`` if unreadable.
    """

    checkpoint_dir: Path
    weights_dir: Path
    finished: bool
    backend: str = "torch_dist"
    adapter: bool = False
    adapter_base: Optional[str] = None


def is_marked_unfinished(checkpoint_dir: Union[str, Path]) -> bool:
    """Whether NeMo's ``<ckpt>-unfinished`` marker exists (as ``ModelCheckpoint.is_checkpoint_unfinished`` checks)."""
    return Path(str(checkpoint_dir).removesuffix(".ckpt").removesuffix("-EMA") + UNFINISHED_SUFFIX).exists()


def sharded_backend(weights_dir: Path) -> str:
    """The format of a checkpoint's ``weights/``: megatron-core's ``metadata.json`` ``sharded_backend``; without that
    file, ``"zarr"`` when Zarr array directories are there (a zarr save that never finished), else ``"torch_dist"``
    (a plain DCP directory)."""
    try:
        config = read_json_file(weights_dir / "metadata.json")
    except (OSError, ValueError):
        try:
            is_zarr = any((entry / ".zarray").is_file() for entry in weights_dir.iterdir() if entry.is_dir())
        except OSError:
            is_zarr = False
        return "zarr" if is_zarr else "torch_dist"
    return str(config.get("sharded_backend", "torch_dist")) if isinstance(config, dict) else "torch_dist"


def _is_consolidated_output(path: Path) -> bool:
    """Whether ``path`` is an output this package wrote (``metadata.json`` with its ``format_version``)."""
    try:
        return "format_version" in read_json_file(path / "metadata.json") and not (path / "weights").exists()
    except (OSError, ValueError, TypeError):
        return False


def weights_written(weights_dir: Path) -> bool:
    """Whether the file a distributed checkpoint's format writes last is there: ``.metadata`` for ``torch_dist``,
    megatron-core's ``metadata.json`` for ``zarr`` (NeMo's unfinished marker is checked separately)."""
    backend = sharded_backend(weights_dir)
    return (weights_dir / ("metadata.json" if backend == "zarr" else ".metadata")).is_file()


def looks_like_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint's ``weights/`` or DCP/megatron-core metadata (i.e. is not a root)."""
    return any((path / name).exists() for name in ("weights", ".metadata", "metadata.json"))


def inspect_checkpoint(path: Union[str, Path], allow_unfinished: bool = False) -> CheckpointLocation:
    """Check that ``path`` is one finished ``torch_dist`` or ``zarr`` checkpoint.

    Args:
        path: a checkpoint directory or its ``weights/`` directory.
        allow_unfinished: return an unfinished checkpoint (``finished=False``) instead of raising.

    Returns:
        Its :class:`CheckpointLocation`.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        NotACheckpointError: ``path`` holds neither ``weights/`` nor DCP/megatron-core metadata.
        UnsupportedFormatError: an ``fsdp_dtensor`` checkpoint or another ``sharded_backend`` (the message names it).
        UnfinishedCheckpointError: NeMo's unfinished marker is present, or the file the format writes last is
            missing (``.metadata``; ``metadata.json`` for ``zarr``).
        CorruptShardError: its ``weights/`` or ``context/`` is a symbolic link out of the checkpoint directory (a
            symlinked checkpoint directory itself is fine).

    A PEFT adapter checkpoint (NeMo's ``weights/adapter_metadata.json``) is returned with ``adapter=True``: its
    consolidation writes adapters, never a model.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise NotACheckpointError(f"{path} is not a NeMo 2 checkpoint: it is a file, expected a directory")
    if _is_consolidated_output(path):
        raise NotACheckpointError(
            f"{path} is a consolidated output (nemo_patch's metadata.json and safetensors files), not a distributed "
            "checkpoint: give the checkpoint directory that holds it (for one written elsewhere with --out, "
            "check it with: nemo-consolidate <checkpoint> --verify --out <this directory>)"
        )
    if (path / "weights").is_dir():
        checkpoint_dir, weights_dir = path, path / "weights"
    elif (path / ".metadata").is_file() and (path / "context").is_dir():
        raise UnsupportedFormatError(
            f"{path} is an 'fsdp_dtensor' checkpoint (Megatron FSDP); only 'torch_dist' and 'zarr' checkpoints can "
            "be consolidated (re-save with MegatronStrategy(save_ckpt_format='torch_dist'))"
        )
    elif looks_like_checkpoint(path):
        checkpoint_dir, weights_dir = (path.parent if path.name == "weights" else path), path
    else:
        raise NotACheckpointError(
            f"{path} is not a NeMo 2 checkpoint: expected a 'weights/' directory with torch.distributed.checkpoint "
            "'.metadata' (or that directory itself)"
        )
    if weights_dir != checkpoint_dir:
        for part in (weights_dir, checkpoint_dir / "context"):
            resolved, home = part.resolve(), checkpoint_dir.resolve()
            if part.exists() and home not in resolved.parents:
                raise CorruptShardError(
                    f"{part} is a symbolic link to {resolved}, outside the checkpoint {home}; refusing to read "
                    "another directory as this checkpoint's"
                )
    backend = sharded_backend(weights_dir)
    if backend not in READABLE_BACKENDS:
        raise UnsupportedFormatError(
            f"{checkpoint_dir} is a '{backend}' checkpoint; only 'torch_dist' and 'zarr' checkpoints can be "
            "consolidated (re-save with MegatronStrategy(save_ckpt_format='torch_dist'))"
        )
    adapter, base = (weights_dir / ADAPTER_METADATA).is_file(), None
    if adapter:
        try:
            base = read_json_file(weights_dir / ADAPTER_METADATA).get("model_ckpt_path")
        except (OSError, ValueError, AttributeError):
            base = None
    last_file = "metadata.json" if backend == "zarr" else ".metadata"
    finished = weights_written(weights_dir) and not is_marked_unfinished(checkpoint_dir)
    if not finished and not allow_unfinished:
        why = "NeMo's unfinished marker is present" if is_marked_unfinished(checkpoint_dir) else f"no '{last_file}'"
        raise UnfinishedCheckpointError(
            f"{checkpoint_dir} is an unfinished checkpoint ({why}): its save never ended (--allow-unfinished, or "
            "allow_unfinished=True, consolidates what it holds anyway)"
        )
    return CheckpointLocation(checkpoint_dir, weights_dir, finished, backend, adapter, base)


def checkpoint_root(path: Union[str, Path]) -> Path:
    """A run's checkpoint root: ``path`` itself, or ``path/checkpoints`` when ``path`` is the run directory (it holds
    no checkpoint but a ``checkpoints/`` directory)."""
    path = Path(path)
    if not checkpoints_newest_first(path) and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def global_step_in_name(name: str) -> Optional[int]:
    """The global step of a checkpoint from NeMo's ``step=<N>`` in its name (``N`` is the global step - 1), or
    ``None`` when the name has none."""
    match = _STEP.search(name)
    return int(match.group(1)) + 1 if match else None


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
