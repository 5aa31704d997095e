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

* ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json`` when
  the weights exceed ``max_shard_size``, as Hugging Face splits them): the model weights only. Optimizer state
  (``optimizer.*``), ``_extra_state`` entries and anything that is not a tensor are left out; dtypes are kept. Names
  are the checkpoint's canonical keys without the ``module.`` prefix, with megatron-core's layer-stacked tensors
  split back per layer:
  ``module.decoder.layers.mlp.linear_fc1.weight`` of shape ``[L, ...]`` becomes
  ``decoder.layers.<i>.mlp.linear_fc1.weight`` of shape ``[...]`` for ``i`` in ``0..L-1``.
* ``metadata.json``: see :data:`FORMAT_VERSION` and :class:`ConsolidationResult`.

The output is published atomically: everything is written to a hidden temporary directory next to the final one and
renamed into place, so a reader sees either no ``consolidated/`` or a complete one.

Memory: tensors are read one output tensor at a time (one layer of a stacked tensor; see
:class:`nemo_patch.dcp_reader.DCPRegionReader`) and streamed into the file
(:func:`nemo_patch.safetensors_writer.write_safetensors`), so peak memory is about the largest single output tensor
plus the largest stored chunk, not the model size.
"""

import contextlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Union, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_patch.atomic_output import TMP_PREFIX, make_tmp_dir, publish_dir, remove_stale_tmp_dirs
from nemo_patch.checkpoint_layout import inspect_checkpoint
from nemo_patch.consolidation_errors import (
    CheckpointNotFoundError,
    ConsolidationError,
    CorruptShardError,
    NotACheckpointError,
    OutputExistsError,
    UnfinishedCheckpointError,
)
from nemo_patch.dcp_metadata import read_dcp_metadata
from nemo_patch.dcp_reader import DCPRegionReader
from nemo_patch.safetensors_writer import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILENAME,
    SINGLE_FILENAME,
    TensorSpec,
    plan_shards,
    shard_filename,
    write_index,
    write_safetensors,
)

__all__ = [
    "CONSOLIDATED_DIRNAME",
    "TMP_PREFIX",
    "CheckpointNotFoundError",
    "FORMAT_VERSION",
    "ConsolidationError",
    "ConsolidationResult",
    "NotACheckpointError",
    "UnfinishedCheckpointError",
    "DEFAULT_MAX_SHARD_SIZE",
    "consolidate_checkpoint",
    "consolidated_key",
    "link_consolidated_output",
    "model_tensor_keys",
    "staged_output",
]

logger = logging.getLogger(__name__)

#: Name of the output directory inside a checkpoint directory.
CONSOLIDATED_DIRNAME = "consolidated"
#: Name of the safetensors file inside :data:`CONSOLIDATED_DIRNAME` when the weights fit in one shard.
SAFETENSORS_FILENAME = SINGLE_FILENAME
#: Name of the metadata file inside :data:`CONSOLIDATED_DIRNAME`.
METADATA_FILENAME = "metadata.json"
#: Version of the ``metadata.json`` layout written by this module.
FORMAT_VERSION = 1

_MODEL_PREFIX = "module."
_STACKED_LAYERS = re.compile(r"^(?P<head>(?:.*\.)?layers)\.(?P<tail>[^0-9].*)$")


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


def _natural(name: str) -> List[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class _Output:
    spec: TensorSpec
    key: str
    layer: Optional[int]


def plan_outputs(metadata: Metadata) -> List["_Output"]:
    """Every output tensor with its source: ``(spec, DCP key, layer or None)``, in natural name order."""
    outputs = []
    for key in model_tensor_keys(metadata):
        item = cast(TensorStorageMetadata, metadata.state_dict_metadata[key])
        dtype, size = item.properties.dtype, tuple(item.size)
        if _is_stacked(key):
            outputs += [_Output(TensorSpec(consolidated_key(key, i), dtype, size[1:]), key, i) for i in range(size[0])]
        else:
            outputs.append(_Output(TensorSpec(consolidated_key(key), dtype, size), key, None))
    return sorted(outputs, key=lambda output: _natural(output.spec.name))


def link_consolidated_output(
    source_output: Union[str, Path], checkpoint_dir: Union[str, Path], output_name: str = CONSOLIDATED_DIRNAME
) -> Path:
    """Give ``checkpoint_dir`` a ``consolidated/`` with the same files as ``source_output``, without recomputing.

    For NeMo's ``-last`` copy of a checkpoint: the weights are the same, so are the outputs (``metadata.json``'s
    ``source_checkpoint`` is relative, ``../weights``, and stays right). Files are hard-linked where the filesystem
    allows and copied otherwise; the directory is published atomically.

    Args:
        source_output: an existing ``consolidated/`` directory.
        checkpoint_dir: the checkpoint directory that receives ``consolidated/``.
        output_name: the name of the new directory (``hf`` for a Hugging Face export).

    Returns:
        The new ``<checkpoint_dir>/consolidated``.

    Raises:
        OSError: if the files cannot be linked or copied (nothing is left behind).
    """
    source_output, checkpoint_dir = Path(source_output), Path(checkpoint_dir)
    tmp_dir = make_tmp_dir(checkpoint_dir)
    try:
        for source in sorted(source_output.iterdir()):
            try:
                os.link(source, tmp_dir / source.name)
            except OSError:
                shutil.copy2(source, tmp_dir / source.name)
        publish_dir(tmp_dir, checkpoint_dir / output_name)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return checkpoint_dir / output_name


def _root_cause(error: BaseException) -> str:
    """A one-line description of what failed inside a ``torch.distributed.checkpoint`` read."""
    if isinstance(error, CheckpointException) and error.failures:
        cause = next(iter(error.failures.values()))  # (exception, stack summary) per rank
        if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
            error = cause[0]
    return f"{type(error).__name__}: {error}".rstrip(": ")


def _producer(
    reader: DCPRegionReader, sources: Dict[str, _Output], metadata: Metadata, largest: int, reuse: bool = True
) -> Callable[[TensorSpec], torch.Tensor]:
    """Reads each output tensor into one of two reusable byte buffers (the writer keeps at most one tensor in flight
    while the next is read), so memory is not re-allocated and re-faulted for every tensor. A tensor cast to another
    dtype is read into a third buffer in its stored dtype first. With ``reuse=False`` every tensor is new memory."""
    buffers = [torch.empty(largest if reuse else 0, dtype=torch.uint8) for _ in range(2)]
    staging: List[torch.Tensor] = []
    turn = [0]

    def produce(spec: TensorSpec) -> torch.Tensor:
        source = sources[spec.name]
        buffer = buffers[turn[0] % 2]
        turn[0] += 1
        out = (
            buffer[: spec.nbytes].view(spec.dtype).view(spec.shape)
            if reuse
            else torch.empty(spec.shape, dtype=spec.dtype)
        )
        stored = stored_spec(metadata, source)
        try:
            if stored.dtype == spec.dtype:
                return reader.read(source.key, source.layer, out=out)
            if not staging or staging[0].numel() < stored.nbytes:
                staging[:] = [torch.empty(stored.nbytes, dtype=torch.uint8)]
            raw = reader.read(
                source.key, source.layer, out=staging[0][: stored.nbytes].view(stored.dtype).view(stored.shape)
            )
            return out.copy_(raw)
        except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
            files = ", ".join(reader.files_of(source.key))
            raise CorruptShardError(
                f"Cannot read shard file(s) {files} of {reader.path} (tensor {source.key}): {_root_cause(error)}"
            ) from error

    return produce


def stored_spec(metadata: Metadata, output: "_Output") -> TensorSpec:
    """The spec of an output tensor as stored in the checkpoint (before any dtype cast)."""
    item = cast(TensorStorageMetadata, metadata.state_dict_metadata[output.key])
    size = tuple(item.size)
    return TensorSpec(output.spec.name, item.properties.dtype, size if output.layer is None else size[1:])


def _cast(outputs: List[_Output], dtype: Optional[torch.dtype]) -> List[_Output]:
    """Outputs with floating-point tensors cast to ``dtype`` (integer and bool tensors keep theirs)."""
    if dtype is None:
        return outputs
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype (bf16, fp16, fp32), got {dtype}")
    return [
        _Output(TensorSpec(o.spec.name, dtype, o.spec.shape), o.key, o.layer) if o.spec.dtype.is_floating_point else o
        for o in outputs
    ]


#: Called during a consolidation with ``(bytes done, bytes in all)`` of tensor data, after each tensor.
ProgressCallback = Callable[[int, int], None]


@contextlib.contextmanager
def staged_output(
    checkpoint_dir: Path, output_dir: Path, overwrite: bool, failure: str, kind: str = ""
) -> Iterator[Path]:
    """A hidden temporary directory next to ``output_dir``, published as ``output_dir`` when the block ends normally
    and removed when it does not (whatever the exception, Ctrl-C included). Temporary output that killed processes
    left in ``output_dir``'s parent or in ``checkpoint_dir`` is removed first.

    Args:
        checkpoint_dir: the checkpoint being consolidated.
        output_dir: the final output directory.
        overwrite: replace an existing ``output_dir`` (atomically) instead of raising :class:`OutputExistsError`.
        failure: how a failure message starts, e.g. ``"Consolidating <ckpt>"``.
        kind: a tag in the temporary name (``"hf-"``).

    Raises:
        ConsolidationError: the output cannot be written (``OSError`` naming the directory), or any other error of the
            block, wrapped as ``"<failure> failed: <type>: <message>"``; a :class:`ConsolidationError` of the block
            passes unchanged.
        OutputExistsError: ``output_dir`` appeared meanwhile and ``overwrite`` is ``False``.
    """
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        for parent in {output_dir.parent, checkpoint_dir}:
            remove_stale_tmp_dirs(parent)
        tmp_dir = make_tmp_dir(output_dir.parent, kind)
    except OSError as error:
        raise ConsolidationError(
            f"Cannot write the output of {checkpoint_dir} in {output_dir.parent}: {error}"
        ) from error
    try:
        yield tmp_dir
        publish_dir(tmp_dir, output_dir, overwrite=overwrite)
    except ConsolidationError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    except FileExistsError as error:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise OutputExistsError(f"{output_dir} exists (overwrite it with --force)") from error
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ConsolidationError(f"{failure} failed: {type(error).__name__}: {error}") from error
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def consolidate_checkpoint(
    checkpoint_dir: Union[str, Path],
    output_dir: Optional[Union[str, Path]] = None,
    global_step: Optional[int] = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = True,
    verify: bool = False,
    allow_unfinished: bool = False,
    progress: Optional[ProgressCallback] = None,
) -> ConsolidationResult:
    """Consolidate a finished NeMo 2 ``torch_dist`` checkpoint into ``consolidated/`` safetensors.

    Reads only files: no process group is needed or used. Unpickles nothing but the DCP ``.metadata`` file, with an
    allowlist of metadata types (:func:`nemo_patch.dcp_metadata.read_dcp_metadata`; megatron-core is not imported);
    stored tensors are read with ``torch.load(weights_only=True)``; ``_extra_state`` payloads and ``common.pt`` are
    never loaded. Temporary output left in the checkpoint directory by a consolidation process that was killed is
    removed first (:func:`nemo_patch.atomic_output.remove_stale_tmp_dirs`).

    Args:
        checkpoint_dir: the checkpoint directory (``<ckpt>``) or its ``weights/`` directory.
        output_dir: where to publish; defaults to ``<ckpt>/consolidated``.
        global_step: recorded in ``metadata.json``; ``None`` if unknown.
        max_shard_size: most tensor-data bytes per safetensors file (default 5 * 10**9, Hugging Face's "5GB"); a
            single ``model.safetensors`` is written when everything fits, else shards plus an index.
        dtype: cast floating-point tensors to this dtype (``None`` keeps the stored dtypes).
        overwrite: replace an existing output atomically (the strategy's behaviour); if ``False`` an existing output
            raises :class:`OutputExistsError` before any work.
        verify: re-read the written files and compare every tensor with the checkpoint before publishing
            (:func:`nemo_patch.consolidation_verify.verify_consolidated`).
        allow_unfinished: consolidate even if NeMo's unfinished marker is present (the CLI's explicit override).
        progress: called with ``(bytes done, bytes in all)`` after each tensor is read.

    Returns:
        A :class:`ConsolidationResult`.

    Raises:
        ConsolidationError: or one of its subclasses in :mod:`nemo_patch.consolidation_errors` naming the cause: not
            a checkpoint, unfinished, unsupported format (``zarr``, ``fsdp_dtensor``), output exists, a shard file
            that cannot be read (:class:`CorruptShardError`, naming the file), a verification mismatch, or an output
            that cannot be written. Nothing is left under ``output_dir``'s name or in a temporary directory.
        ValueError: if ``max_shard_size`` < 1 or ``dtype`` is not a floating-point dtype.
    """
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
    location = inspect_checkpoint(checkpoint_dir, allow_unfinished=allow_unfinished)
    weights_dir, ckpt_dir = location.weights_dir, location.checkpoint_dir
    output_dir = Path(output_dir) if output_dir is not None else ckpt_dir / CONSOLIDATED_DIRNAME
    if output_dir.exists() and not overwrite:
        raise OutputExistsError(f"{output_dir} exists (overwrite it with --force)")

    try:
        metadata = read_dcp_metadata(weights_dir)
    except Exception as error:  # OSError, pickle.UnpicklingError, EOFError
        raise CorruptShardError(
            f"Cannot read the checkpoint metadata file {weights_dir / '.metadata'}: {type(error).__name__}: {error}"
        ) from error
    outputs = _cast(plan_outputs(metadata), dtype)
    if not outputs:
        raise ConsolidationError(f"{weights_dir} holds no model tensors ('module.*' entries) to consolidate.")

    with staged_output(ckpt_dir, output_dir, overwrite, f"Consolidating {ckpt_dir}") as tmp_dir:
        reader = DCPRegionReader(weights_dir, metadata)
        largest = max(output.spec.nbytes for output in outputs)
        total_bytes = sum(output.spec.nbytes for output in outputs)
        read = _producer(reader, {output.spec.name: output for output in outputs}, metadata, largest)
        done = [0]

        def produce(spec: TensorSpec) -> torch.Tensor:
            tensor = read(spec)
            done[0] += spec.nbytes
            if progress is not None:
                progress(done[0], total_bytes)
            return tensor

        shards = plan_shards([output.spec for output in outputs], max_shard_size)
        names = [SINGLE_FILENAME] if len(shards) == 1 else [shard_filename(i, len(shards)) for i in range(len(shards))]
        files = {}
        for name, specs in zip(names, shards):
            files[name] = write_safetensors(tmp_dir / name, specs, produce, metadata={"format": "pt"})
        if len(shards) > 1:
            files[INDEX_FILENAME] = write_index(tmp_dir / INDEX_FILENAME, zip(names, shards))
        manifest = {
            "format_version": FORMAT_VERSION,
            "global_step": global_step,
            "source_checkpoint": os.path.relpath(weights_dir, output_dir),
            "tensor_count": len(outputs),
            "total_bytes": total_bytes,
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "files": {name: {"sha256": digest} for name, digest in sorted(files.items())},
        }
        (tmp_dir / METADATA_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (METADATA_FILENAME, *(n for n in files if n.endswith(".json"))):
            with open(tmp_dir / name, "rb") as handle:
                os.fsync(handle.fileno())
        if verify:
            from nemo_patch.consolidation_verify import verify_consolidated

            verify_consolidated(weights_dir, tmp_dir, metadata=metadata)
    logger.info("Consolidated %s -> %s (%d tensors, %d bytes)", ckpt_dir, output_dir, len(outputs), total_bytes)
    return ConsolidationResult(output_dir, len(outputs), total_bytes, global_step, files)
