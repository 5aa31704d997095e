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

"""Turn a NeMo 2 ``torch_dist`` distributed checkpoint into one unsharded safetensors file.

Input: a finished checkpoint directory ``<ckpt>/`` whose ``weights/`` subdirectory was written by megatron-core's
``dist_checkpointing.save`` with the ``torch_dist`` backend, i.e. a ``torch.distributed.checkpoint`` (DCP) directory:
``.metadata`` plus ``__<rank>_<i>.distcp`` shard files. Each tensor is described in the DCP metadata by its global
shape and dtype and stored as one or more chunks (TP/PP shards); ``torch.distributed.checkpoint.load`` reassembles
them, so any TP/PP layout reads back to the same global tensors.

Output: ``<ckpt>/consolidated/``

* ``model.safetensors``: the model weights only. Optimizer state (``optimizer.*``), ``_extra_state`` entries and
  anything that is not a tensor are left out; dtypes are kept. Names are the checkpoint's canonical keys without the
  ``module.`` prefix, with megatron-core's layer-stacked tensors split back per layer:
  ``module.decoder.layers.mlp.linear_fc1.weight`` of shape ``[L, ...]`` becomes
  ``decoder.layers.<i>.mlp.linear_fc1.weight`` of shape ``[...]`` for ``i`` in ``0..L-1``.
* ``metadata.json``: see :data:`FORMAT_VERSION` and :class:`ConsolidationResult`.

The output is published atomically: everything is written to a hidden temporary directory next to the final one and
renamed into place, so a reader sees either no ``consolidated/`` or a complete one.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = [
    "CONSOLIDATED_DIRNAME",
    "FORMAT_VERSION",
    "ConsolidationError",
    "ConsolidationResult",
    "consolidate_checkpoint",
    "consolidated_key",
    "model_tensor_keys",
    "resolve_weights_dir",
]

logger = logging.getLogger(__name__)

#: Name of the output directory inside a checkpoint directory.
CONSOLIDATED_DIRNAME = "consolidated"
#: Name of the safetensors file inside :data:`CONSOLIDATED_DIRNAME`.
SAFETENSORS_FILENAME = "model.safetensors"
#: Name of the metadata file inside :data:`CONSOLIDATED_DIRNAME`.
METADATA_FILENAME = "metadata.json"
#: Version of the ``metadata.json`` layout written by this module.
FORMAT_VERSION = 1
#: Prefix of temporary output directories; they are never visible under the final name.
TMP_PREFIX = ".consolidated.tmp-"

_MODEL_PREFIX = "module."
_STACKED_LAYERS = re.compile(r"^(?P<head>(?:.*\.)?layers)\.(?P<tail>[^0-9].*)$")
# Upper bound on the bytes of model tensors requested from torch.distributed.checkpoint in one load call.
_LOAD_BATCH_BYTES = 256 * 1024 * 1024


class ConsolidationError(RuntimeError):
    """A checkpoint could not be consolidated; the message names the checkpoint and the cause."""


@dataclass(frozen=True)
class ConsolidationResult:
    """What :func:`consolidate_checkpoint` wrote.

    Attributes:
        output_dir: the published ``<ckpt>/consolidated`` directory.
        tensor_count: number of tensors in ``model.safetensors`` (after splitting stacked layers).
        total_bytes: sum of the tensors' data sizes in bytes (``numel * element_size``), excluding headers.
        global_step: the global step recorded in ``metadata.json`` (``None`` if unknown).
        files: output file name -> sha256 hex digest.
    """

    output_dir: Path
    tensor_count: int
    total_bytes: int
    global_step: Optional[int]
    files: Dict[str, str] = field(default_factory=dict)


def resolve_weights_dir(checkpoint_dir: Union[str, Path]) -> Path:
    """Return the DCP directory of a NeMo 2 checkpoint.

    Args:
        checkpoint_dir: a checkpoint directory (holding ``weights/``) or its ``weights/`` directory itself.

    Returns:
        The directory that holds the DCP ``.metadata`` file.

    Raises:
        ConsolidationError: if neither ``checkpoint_dir/weights/.metadata`` nor ``checkpoint_dir/.metadata`` exists.
    """
    path = Path(checkpoint_dir)
    for candidate in (path / "weights", path):
        if (candidate / ".metadata").is_file():
            return candidate
    raise ConsolidationError(
        f"{path} is not a NeMo 2 torch_dist checkpoint: expected a 'weights/.metadata' file "
        "(torch.distributed.checkpoint metadata) in it or a '.metadata' file directly in it."
    )


def consolidated_key(checkpoint_key: str, layer: Optional[int] = None) -> str:
    """Map a DCP model key to its consolidated name.

    Args:
        checkpoint_key: a key of the distributed checkpoint, e.g. ``module.decoder.layers.mlp.linear_fc1.weight``.
        layer: for a layer-stacked tensor, the layer index to insert after ``layers``.

    Returns:
        The key without ``module.``, e.g. ``decoder.layers.3.mlp.linear_fc1.weight`` for ``layer=3``.
    """
    key = checkpoint_key[len(_MODEL_PREFIX) :] if checkpoint_key.startswith(_MODEL_PREFIX) else checkpoint_key
    if layer is None:
        return key
    match = _STACKED_LAYERS.match(key)
    if match is None:
        raise ValueError(f"{checkpoint_key!r} is not a layer-stacked key")
    return f"{match.group('head')}.{layer}.{match.group('tail')}"


def model_tensor_keys(metadata: Metadata) -> List[str]:
    """The model-weight keys of a DCP checkpoint, in metadata order.

    Model weights are the ``module.*`` tensor entries; ``optimizer.*`` state, ``_extra_state`` payloads (pickled
    bytes) and other non-tensor entries are excluded.
    """
    return [
        key
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL_PREFIX) and isinstance(item, TensorStorageMetadata) and "_extra_state" not in key
    ]


def _is_stacked(key: str) -> bool:
    return _STACKED_LAYERS.match(key[len(_MODEL_PREFIX) :]) is not None


def _batches(keys: List[str], metadata: Metadata) -> Iterator[List[str]]:
    batch: List[str] = []
    batch_bytes = 0
    for key in keys:
        item = metadata.state_dict_metadata[key]
        nbytes = item.size.numel() * torch.empty((), dtype=item.properties.dtype).element_size()
        if batch and batch_bytes + nbytes > _LOAD_BATCH_BYTES:
            yield batch
            batch, batch_bytes = [], 0
        batch.append(key)
        batch_bytes += nbytes
    if batch:
        yield batch


def _read_model_tensors(weights_dir: Path, metadata: Metadata, keys: List[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(dcp_key, global_tensor)`` for ``keys``, reading a bounded batch of tensors at a time."""
    reader = FileSystemReader(str(weights_dir))
    for batch in _batches(keys, metadata):
        state = {}
        for key in batch:
            item = metadata.state_dict_metadata[key]
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
        try:
            dcp_load(state, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
            raise _read_error(weights_dir, metadata, reader, state, error) from error
        yield from state.items()


def _read_error(
    weights_dir: Path,
    metadata: Metadata,
    reader: FileSystemReader,
    state: Dict[str, torch.Tensor],
    error: BaseException,
) -> "ConsolidationError":
    """Name the shard file(s) behind a failed batch read: re-read its tensors one at a time to find the culprit."""
    for key, tensor in state.items():
        try:
            dcp_load({key: torch.empty_like(tensor)}, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as single:
            error = single
            state = {key: tensor}
            break
    files = sorted({info.relative_path for index, info in metadata.storage_data.items() if index.fqn in state})
    return ConsolidationError(f"Cannot read shard file(s) {', '.join(files)} of {weights_dir}: {_root_cause(error)}")


def _root_cause(error: BaseException) -> str:
    """A one-line description of what failed inside a ``torch.distributed.checkpoint`` load."""
    if isinstance(error, CheckpointException) and error.failures:
        cause = next(iter(error.failures.values()))  # (exception, stack summary) per rank
        if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
            return f"{type(cause[0]).__name__}: {cause[0]}".rstrip(": ")
    return f"{type(error).__name__}: {error}".rstrip(": ")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_tmp_dir(parent: Path, kind: str = "") -> Path:
    """Create a hidden, uniquely named directory in ``parent`` (permissions follow the umask)."""
    path = parent / f"{TMP_PREFIX}{kind}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def _publish(tmp_dir: Path, output_dir: Path) -> None:
    """Rename ``tmp_dir`` to ``output_dir``; an existing ``output_dir`` is moved aside first, then removed."""
    old = None
    if output_dir.exists():
        old = _make_tmp_dir(output_dir.parent, "old-")
        os.replace(output_dir, old / output_dir.name)
    os.replace(tmp_dir, output_dir)
    _fsync_dir(output_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def consolidate_checkpoint(
    checkpoint_dir: Union[str, Path],
    output_dir: Optional[Union[str, Path]] = None,
    global_step: Optional[int] = None,
) -> ConsolidationResult:
    """Consolidate a finished NeMo 2 ``torch_dist`` checkpoint into ``consolidated/model.safetensors``.

    Reads only files: no process group is needed or used (``torch.distributed.checkpoint.load`` with
    ``no_dist=True``). Unpickles nothing but the DCP ``.metadata`` file, which ``torch.distributed.checkpoint``
    itself must read; ``_extra_state`` payloads and ``common.pt`` are never loaded.

    Args:
        checkpoint_dir: the checkpoint directory (``<ckpt>``) or its ``weights/`` directory.
        output_dir: where to publish; defaults to ``<ckpt>/consolidated``. Replaced atomically if it exists.
        global_step: recorded in ``metadata.json``; ``None`` if unknown.

    Returns:
        A :class:`ConsolidationResult`.

    Raises:
        ConsolidationError: if the directory is not a ``torch_dist`` checkpoint, holds no model tensors, or a shard
            cannot be read or the output cannot be written. Nothing is left under ``output_dir``'s name or in a
            temporary directory on failure.
    """
    weights_dir = resolve_weights_dir(checkpoint_dir)
    ckpt_dir = weights_dir.parent if weights_dir.name == "weights" else weights_dir
    output_dir = Path(output_dir) if output_dir is not None else ckpt_dir / CONSOLIDATED_DIRNAME
    output_dir.parent.mkdir(parents=True, exist_ok=True)

    try:
        metadata = FileSystemReader(str(weights_dir)).read_metadata()
    except Exception as error:  # torch raises several types for a missing or unreadable .metadata
        raise ConsolidationError(f"Cannot read the checkpoint metadata of {weights_dir}: {error}") from error
    keys = model_tensor_keys(metadata)
    if not keys:
        raise ConsolidationError(f"{weights_dir} holds no model tensors ('module.*' entries) to consolidate.")

    tmp_dir = _make_tmp_dir(output_dir.parent)
    try:
        tensors: Dict[str, torch.Tensor] = {}
        for key, tensor in _read_model_tensors(weights_dir, metadata, keys):
            if _is_stacked(key):
                for layer in range(tensor.shape[0]):
                    tensors[consolidated_key(key, layer)] = tensor[layer].clone()
            else:
                tensors[consolidated_key(key)] = tensor
        total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        safetensors_path = tmp_dir / SAFETENSORS_FILENAME
        save_file(tensors, str(safetensors_path), metadata={"format": "pt"})
        tensor_count = len(tensors)
        del tensors
        files = {SAFETENSORS_FILENAME: _sha256(safetensors_path)}
        manifest = {
            "format_version": FORMAT_VERSION,
            "global_step": global_step,
            "source_checkpoint": os.path.relpath(weights_dir, output_dir),
            "tensor_count": tensor_count,
            "total_bytes": total_bytes,
            "files": {name: {"sha256": digest} for name, digest in files.items()},
        }
        (tmp_dir / METADATA_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (SAFETENSORS_FILENAME, METADATA_FILENAME):
            with open(tmp_dir / name, "rb") as handle:
                os.fsync(handle.fileno())
        _publish(tmp_dir, output_dir)
    except ConsolidationError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    except (Exception, CheckpointException) as error:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ConsolidationError(f"Consolidating {ckpt_dir} failed: {type(error).__name__}: {error}") from error
    logger.info("Consolidated %s -> %s (%d tensors, %d bytes)", ckpt_dir, output_dir, tensor_count, total_bytes)
    return ConsolidationResult(output_dir, tensor_count, total_bytes, global_step, files)
