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
  the weights exceed ``max_shard_size``, as Hugging Face splits them; names in
  :mod:`nemo_patch.engine.output_layout`): the model weights only, named as :mod:`nemo_patch.engine.plan` says.
* ``metadata.json``: see :class:`ConsolidationResult` (layout version ``FORMAT_VERSION``), with ``"kind": "model"``.

A PEFT adapter checkpoint (NeMo's ``weights/adapter_metadata.json``; LoRA fine-tuning saves only the adapters) gives
``adapter_model.safetensors`` instead (the adapter tensors, TP shards reassembled, layer stacks split, names as for a
model), never ``model.safetensors``, and ``metadata.json`` says ``"kind": "adapter"`` with the ``base_checkpoint``
NeMo recorded and the PEFT method and settings from the context (:mod:`nemo_patch.engine.adapter_settings`).

The output is published atomically: everything is written to a hidden temporary directory next to the final one and
renamed into place (:func:`nemo_patch.engine.publish.staged_output`), so a reader sees either no ``consolidated/`` or
a complete one.

Memory: tensors are read one output tensor at a time (one layer of a stacked tensor; see
:class:`nemo_patch.engine.dcp_reader.DCPRegionReader`) and streamed into the file
(:func:`nemo_patch.engine.safetensors_writer.write_safetensors`), so peak memory is about the largest single output
tensor plus the largest stored chunk, not the model size.

Imports the standard library, torch and the rest of the engine only; never NeMo, Lightning or megatron-core, and
nothing outside the engine.
"""

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from nemo_patch.engine.adapter_merge import LoRAMergeSource, merged_producer, open_lora_merge
from nemo_patch.engine.adapter_settings import peft_settings
from nemo_patch.engine.checkpoint_layout import CheckpointLocation, inspect_checkpoint
from nemo_patch.engine.checkpoint_reader import RegionReader, open_weights
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError, OutputExistsError, VerificationError
from nemo_patch.engine.output_layout import (
    ADAPTER_STEM,
    CONSOLIDATED_DIRNAME,
    DEFAULT_MAX_SHARD_SIZE,
    FORMAT_VERSION,
    METADATA_FILENAME,
    MODEL_STEM,
    index_filename,
    shard_filename,
    single_filename,
)
from nemo_patch.engine.plan import OutputTensor, cast_outputs, plan_outputs, stored_spec
from nemo_patch.engine.publish import staged_output
from nemo_patch.engine.safetensors_writer import TensorSpec, plan_shards, write_index, write_safetensors
from nemo_patch.engine.verify import (
    output_shapes,
    tensors_bitwise_equal,
    verify_consolidated,
    verify_names_and_shapes,
)
from nemo_patch.engine.vocabulary import vocabulary_sizes

__all__ = ["ConsolidationResult", "ProgressCallback", "consolidate_checkpoint", "read_state_dict", "tensor_producer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsolidationResult:
    """What :func:`consolidate_checkpoint` wrote.

    Attributes:
        output_dir: the published ``<ckpt>/consolidated`` directory.
        tensor_count: number of tensors in ``model.safetensors`` (after splitting stacked layers).
        total_bytes: sum of the tensors' data sizes in bytes (``numel * element_size``), excluding headers.
        global_step: the global step recorded in ``metadata.json`` (``None`` if unknown).
        files: output file name -> sha256 hex digest.
        kind: ``"model"``, or ``"adapter"`` for a PEFT adapter checkpoint's adapters.
    """

    output_dir: Path
    tensor_count: int
    total_bytes: int
    global_step: Optional[int]
    files: Dict[str, str] = field(default_factory=dict)
    kind: str = "model"


def _root_cause(error: BaseException) -> str:
    """A one-line description of what failed inside a ``torch.distributed.checkpoint`` read."""
    if isinstance(error, CheckpointException) and error.failures:
        cause = next(iter(error.failures.values()))  # (exception, stack summary) per rank
        if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
            error = cause[0]
    return f"{type(error).__name__}: {error}".rstrip(": ")


def tensor_producer(
    reader: RegionReader,
    sources: Dict[str, OutputTensor],
    metadata: Metadata,
    largest: int,
    reuse: bool = True,
) -> Callable[[TensorSpec], torch.Tensor]:
    """A function that reads one output tensor (by its spec's name in ``sources``) from the checkpoint.

    Each tensor is read into one of two reusable byte buffers of ``largest`` bytes (the writer keeps at most one
    tensor in flight while the next is read), so memory is not re-allocated and re-faulted for every tensor. A tensor
    cast to another dtype is read into a third buffer in its stored dtype first. With ``reuse=False`` every tensor is
    new memory (for callers that keep the tensors).

    The function raises :class:`CorruptShardError` naming the shard file(s) when a tensor cannot be read.
    """
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
                return reader.read(source.key, source.index, out=out)
            if not staging or staging[0].numel() < stored.nbytes:
                staging[:] = [torch.empty(stored.nbytes, dtype=torch.uint8)]
            raw = reader.read(
                source.key, source.index, out=staging[0][: stored.nbytes].view(stored.dtype).view(stored.shape)
            )
            return out.copy_(raw)
        except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
            files = ", ".join(reader.files_of(source.key))
            raise CorruptShardError(
                f"Cannot read shard file(s) {files} of {reader.path} (tensor {source.key}): {_root_cause(error)}"
            ) from error

    return produce


def _merged_reader(
    merge: LoRAMergeSource, planned: List[OutputTensor], adapter_reader: RegionReader
) -> Callable[[TensorSpec], torch.Tensor]:
    """Reads a merged output tensor (base + LoRA delta, in the stored dtype), cast to the spec's dtype."""
    stored = {output.spec.name: output for output in planned}
    read_base = tensor_producer(merge.base_reader, stored, merge.base_metadata, 0, reuse=False)
    merged = merged_producer(
        read_base, lambda output: adapter_reader.read(output.key, output.index), merge.pairs, merge.scale
    )

    def read(spec: TensorSpec) -> torch.Tensor:
        tensor = merged(stored[spec.name].spec)
        return tensor if tensor.dtype == spec.dtype else tensor.to(spec.dtype)

    return read


def _verify_merged(output_dir: Path, outputs: List[OutputTensor], read: Callable[[TensorSpec], torch.Tensor]) -> None:
    """Every tensor of a merged output equals a fresh merge of its sources, bitwise, and nothing else is there."""
    shapes = output_shapes(output_dir)
    expected = {output.spec.name for output in outputs}
    if set(shapes) != expected:
        raise VerificationError(
            f"{output_dir} does not hold the merged model's tensors: missing {sorted(expected - set(shapes))[:5]}, "
            f"unexpected {sorted(set(shapes) - expected)[:5]}"
        )
    for path in sorted(output_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names = set(handle.keys())
            for output in outputs:
                if output.spec.name in names and not tensors_bitwise_equal(
                    read(output.spec), handle.get_tensor(output.spec.name)
                ):
                    raise VerificationError(f"Tensor {output.spec.name} in {path} differs from the merged model's")


def read_state_dict(
    location: CheckpointLocation,
    merge_adapters: bool = False,
    progress: Optional["ProgressCallback"] = None,
    base_checkpoint: Optional[Union[str, Path]] = None,
) -> Tuple[Dict[str, torch.Tensor], Metadata]:
    """Every output tensor of a checkpoint in memory (what the Hugging Face export converts at once).

    Args:
        location: from :func:`nemo_patch.engine.checkpoint_layout.inspect_checkpoint`.
        merge_adapters: for a LoRA adapter checkpoint, the base model with the adapters merged.
        progress: called with ``(bytes read, bytes in all)``.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.

    Returns:
        ``(name -> tensor in its stored dtype, the metadata of the checkpoint the model tensors come from)``.

    Raises:
        ConsolidationError: or a subclass, as :func:`consolidate_checkpoint` raises them.
    """
    metadata, reader = open_weights(location.weights_dir, location.backend)
    merge = open_lora_merge(location, metadata, base_checkpoint) if merge_adapters and location.adapter else None
    outputs = merge.base_outputs if merge is not None else plan_outputs(metadata)
    if merge is not None:
        produce = _merged_reader(merge, outputs, reader)
    else:
        produce = tensor_producer(reader, {output.spec.name: output for output in outputs}, metadata, 0, reuse=False)
    total = sum(output.spec.nbytes for output in outputs)
    state, done = {}, 0
    for output in outputs:
        state[output.spec.name] = produce(output.spec)
        done += output.spec.nbytes
        if progress is not None:
            progress(done, total)
    return state, (merge.base_metadata if merge is not None else metadata)


#: Called during a consolidation with ``(bytes done, bytes in all)`` of tensor data, after each tensor.
ProgressCallback = Callable[[int, int], None]


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
    expected_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None,
    merge_adapters: bool = False,
    base_checkpoint: Optional[Union[str, Path]] = None,
    best: Optional[Mapping[str, Any]] = None,
) -> ConsolidationResult:
    """Consolidate a finished NeMo 2 ``torch_dist`` or ``zarr`` checkpoint into ``consolidated/`` safetensors.

    Reads only files: no process group is needed or used. Unpickles nothing but the DCP ``.metadata`` file, with an
    allowlist of metadata types (:func:`nemo_patch.engine.dcp_metadata.read_dcp_metadata`; megatron-core is not
    imported); stored tensors are read with ``torch.load(weights_only=True)``; ``_extra_state`` payloads and
    ``common.pt`` are never loaded. Temporary output left in the checkpoint directory by a consolidation process that
    was killed is removed first (:func:`nemo_patch.engine.publish.remove_stale_tmp_dirs`).

    Args:
        checkpoint_dir: the checkpoint directory (``<ckpt>``) or its ``weights/`` directory; ``torch_dist`` or
            megatron-core's ``zarr`` (:mod:`nemo_patch.engine.zarr_reader`: same output, bit for bit).
        output_dir: where to publish; defaults to ``<ckpt>/consolidated``.
        global_step: recorded in ``metadata.json``; ``None`` if unknown.
        max_shard_size: most tensor-data bytes per safetensors file (default 5 * 10**9, Hugging Face's "5GB"); a
            single ``model.safetensors`` is written when everything fits, else shards plus an index.
        dtype: cast floating-point tensors to this dtype (``None`` keeps the stored dtypes).
        overwrite: replace an existing output atomically (the strategy's behaviour); if ``False`` an existing output
            raises :class:`OutputExistsError` before any work.
        verify: re-read the written files and compare every tensor with the checkpoint before publishing
            (:func:`nemo_patch.engine.verify.verify_consolidated`).
        allow_unfinished: consolidate even if NeMo's unfinished marker is present (the CLI's explicit override).
        progress: called with ``(bytes done, bytes in all)`` after each tensor is read.
        expected_shapes: with ``verify``, the names and shapes the output must have besides (e.g. the model in the
            checkpoint's context: :func:`nemo_patch.export.context_model.context_model_shapes`), checked before
            publishing (:func:`nemo_patch.engine.verify.verify_names_and_shapes`).
        merge_adapters: for a LoRA adapter checkpoint, write the base model with the adapters merged
            (``model.safetensors``, :mod:`nemo_patch.engine.adapter_merge`) instead of ``adapter_model.safetensors``;
            no effect on a model checkpoint.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.
        best: recorded as ``"best"`` in ``metadata.json`` when the checkpoint was consolidated as the best by a
            monitored metric: ``{"monitor": name, "value": float, "mode": "min" | "max"}`` (NeMo's
            ``ModelCheckpoint``'s).

    Returns:
        A :class:`ConsolidationResult`.

    Raises:
        ConsolidationError: or one of its subclasses in :mod:`nemo_patch.engine.errors` naming the cause: not
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

    metadata, reader = open_weights(weights_dir, location.backend)
    merge = open_lora_merge(location, metadata, base_checkpoint) if merge_adapters and location.adapter else None
    planned = merge.base_outputs if merge is not None else plan_outputs(metadata)
    outputs = cast_outputs(planned, dtype)
    if not outputs:
        raise ConsolidationError(f"{weights_dir} holds no model tensors ('module.*' entries) to consolidate.")

    with staged_output(ckpt_dir, output_dir, overwrite, f"Consolidating {ckpt_dir}") as tmp_dir:
        largest = max(output.spec.nbytes for output in outputs)
        total_bytes = sum(output.spec.nbytes for output in outputs)
        if merge is None:
            read = tensor_producer(reader, {output.spec.name: output for output in outputs}, metadata, largest)
        else:
            read = _merged_reader(merge, planned, reader)
        done = [0]

        def produce(spec: TensorSpec) -> torch.Tensor:
            tensor = read(spec)
            done[0] += spec.nbytes
            if progress is not None:
                progress(done[0], total_bytes)
            return tensor

        shards = plan_shards([output.spec for output in outputs], max_shard_size)
        kind = "adapter" if location.adapter and merge is None else "model"
        stem = ADAPTER_STEM if kind == "adapter" else MODEL_STEM
        count = len(shards)
        names = [single_filename(stem)] if count == 1 else [shard_filename(i, count, stem) for i in range(count)]
        files = {}
        for name, specs in zip(names, shards):
            files[name] = write_safetensors(tmp_dir / name, specs, produce, metadata={"format": "pt"})
        if len(shards) > 1:
            files[index_filename(stem)] = write_index(tmp_dir / index_filename(stem), zip(names, shards))
        manifest = {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "global_step": global_step,
            "source_checkpoint": os.path.relpath(weights_dir, output_dir),
            "tensor_count": len(outputs),
            "total_bytes": total_bytes,
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "vocab_size": vocabulary_sizes(ckpt_dir, metadata if merge is None else merge.base_metadata),
            "files": {name: {"sha256": digest} for name, digest in sorted(files.items())},
        }
        if location.adapter:
            manifest.update(base_checkpoint=location.adapter_base, peft=peft_settings(ckpt_dir))
        if merge is not None:
            manifest.update(merged_adapters=merge.settings)
        if best is not None:
            manifest.update(best=dict(best))
        (tmp_dir / METADATA_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (METADATA_FILENAME, *(n for n in files if n.endswith(".json"))):
            with open(tmp_dir / name, "rb") as handle:
                os.fsync(handle.fileno())
        if verify and merge is not None:
            _verify_merged(tmp_dir, outputs, _merged_reader(merge, planned, reader))
        elif verify:
            verify_consolidated(weights_dir, tmp_dir, metadata=metadata)
            if expected_shapes is not None:
                verify_names_and_shapes(tmp_dir, expected_shapes, "the model in the checkpoint's context")
    logger.info("Consolidated %s -> %s (%d tensors, %d bytes)", ckpt_dir, output_dir, len(outputs), total_bytes)
    return ConsolidationResult(output_dir, len(outputs), total_bytes, global_step, files, kind)
