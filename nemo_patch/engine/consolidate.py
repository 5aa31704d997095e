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
(:func:`nemo_patch.engine.part_writer.write_part`), so peak memory is about the largest single output tensor plus
the largest stored chunk, not the model size, per writer.

Writers: the output files are laid out and created before any data is read, then their tensors are cut into parts
that ``workers`` processes on this node fill at once (:mod:`nemo_patch.engine.parts`), or processes on several nodes
(``parts_runner``: :mod:`nemo_patch.cli.distributed`). The bytes written do
not depend on how many: each tensor lands at the same offset, and ``metadata.json`` records per-tensor digests
(:mod:`nemo_patch.engine.digests`), which every writer computes for what it writes.

Imports the standard library, torch and the rest of the engine only; never NeMo, Lightning or megatron-core, and
nothing outside the engine.
"""

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import Metadata

from nemo_patch.engine.adapter_settings import peft_settings
from nemo_patch.engine.checkpoint_layout import CheckpointLocation, inspect_checkpoint
from nemo_patch.engine.digests import digest_algorithm, file_entry, json_file_entry, verify_digests
from nemo_patch.engine.errors import ConsolidationError, VerificationError
from nemo_patch.engine.output_layout import (
    ADAPTER_STEM,
    CONSOLIDATED_DIRNAME,
    DEFAULT_MAX_SHARD_SIZE,
    FORMAT_VERSION,
    METADATA_FILENAME,
    MODEL_STEM,
    index_filename,
)
from nemo_patch.engine.output_target import check_output_target
from nemo_patch.engine.part_writer import placements_of, split_parts
from nemo_patch.engine.parts import PartJob, PartResult, run_parts, validate_workers
from nemo_patch.engine.plan import OutputTensor
from nemo_patch.engine.publish import staged_output
from nemo_patch.engine.safetensors_writer import TensorSpec, create_files, plan_files, write_index
from nemo_patch.engine.stage_times import StageTimes
from nemo_patch.engine.tensor_sources import Sources, merged_reader, open_sources, tensor_producer
from nemo_patch.engine.verify import (
    output_shapes,
    tensors_bitwise_equal,
    verify_consolidated,
    verify_names_and_shapes,
)
from nemo_patch.engine.vocabulary import vocabulary_sizes

__all__ = [
    "ConsolidationResult",
    "PartsRunner",
    "ProgressCallback",
    "consolidate_checkpoint",
    "read_state_dict",
    "tensor_producer",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsolidationResult:
    """What :func:`consolidate_checkpoint` wrote.

    Attributes:
        output_dir: the published ``<ckpt>/consolidated`` directory.
        tensor_count: number of tensors in ``model.safetensors`` (after splitting stacked layers).
        total_bytes: sum of the tensors' data sizes in bytes (``numel * element_size``), excluding headers.
        global_step: the global step recorded in ``metadata.json`` (``None`` if unknown).
        files: output file name -> its digest in ``metadata.json`` (``blake3_tree`` of a safetensors file, ``blake3``
            of a JSON file; :mod:`nemo_patch.engine.digests`).
        kind: ``"model"``, or ``"adapter"`` for a PEFT adapter checkpoint's adapters.
        stage_seconds: busy seconds per stage over every writer (:mod:`nemo_patch.engine.stage_times`).
    """

    output_dir: Path
    tensor_count: int
    total_bytes: int
    global_step: Optional[int]
    files: Dict[str, str] = field(default_factory=dict)
    kind: str = "model"
    stage_seconds: Dict[str, float] = field(default_factory=dict)


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
    sources = open_sources(location, None, merge_adapters, base_checkpoint)
    produce = sources.producer(reuse=False)
    total = sum(output.spec.nbytes for output in sources.outputs)
    state, done = {}, 0
    for output in sources.outputs:
        state[output.spec.name] = produce(output.spec)
        done += output.spec.nbytes
        if progress is not None:
            progress(done, total)
    return state, sources.model_metadata


#: Called during a consolidation with ``(bytes done, bytes in all)`` of tensor data, after each tensor.
ProgressCallback = Callable[[int, int], None]
#: Runs a consolidation's part jobs (given this process's sources of it) and returns their results in order; the
#: default is :func:`nemo_patch.engine.parts.run_parts` on this node. A runner that spreads the parts over nodes must
#: raise when any part fails or does not report in time.
PartsRunner = Callable[[List[PartJob], Sources], List[PartResult]]


def _useful_workers(layout: Sequence[Any], workers: int) -> int:
    """``workers``, but no more than there are tensors to write (at least 1): a writer without a tensor would be a
    process started for nothing, and a huge number of them exhausts the machine."""
    return max(1, min(workers, len(placements_of(layout))))


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
    workers: int = 1,
    parts: Optional[int] = None,
    parts_runner: Optional[PartsRunner] = None,
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
        dtype: cast floating-point tensors to this dtype (``None`` keeps the stored dtypes); a cast that would turn a
            finite value into ``inf`` (e.g. above 65504 in ``torch.float16``) raises
            :class:`~nemo_patch.engine.errors.DtypeOverflowError`.
        overwrite: replace an existing output atomically (the strategy's behaviour); if ``False`` an existing output
            raises :class:`OutputExistsError` before any work. Only a previous output or an empty directory is ever
            replaced, and ``output_dir`` may not be the checkpoint, a directory above it, or in its ``weights/`` or
            ``context/`` (:func:`nemo_patch.engine.output_target.check_output_target`).
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
        workers: writer processes on this node (>= 1; :func:`nemo_patch.engine.parts.default_workers` is the CLI's
            default). The output is the same, byte for byte, whatever the number.
        parts: how many parts the tensors are cut into (default: ``workers``); with ``parts_runner``.
        parts_runner: runs the parts instead of ``workers`` processes on this node (several nodes).

    Returns:
        A :class:`ConsolidationResult`.

    Raises:
        ConsolidationError: or one of its subclasses in :mod:`nemo_patch.engine.errors` naming the cause: not
            a checkpoint, unfinished, unsupported format (``fsdp_dtensor``, a ``zarr`` array it cannot read safely),
            output exists, a shard file that cannot be read or metadata that leaves a layer out
            (:class:`CorruptShardError`, naming the file or the layer), a ``dtype`` too narrow for the values
            (:class:`DtypeOverflowError`), a verification mismatch, or an output that cannot be written. Nothing is
            left under ``output_dir``'s name or in a temporary directory.
        ValueError: if ``max_shard_size`` < 1, ``workers`` < 1 or ``dtype`` is not a floating-point dtype.
    """
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
    workers = validate_workers(workers)
    own = StageTimes()  # this process's planning; the parts report their own stages
    with own.timed("metadata"):
        location = inspect_checkpoint(checkpoint_dir, allow_unfinished=allow_unfinished)
        weights_dir, ckpt_dir = location.weights_dir, location.checkpoint_dir
        output_dir = Path(output_dir) if output_dir is not None else ckpt_dir / CONSOLIDATED_DIRNAME
        check_output_target(ckpt_dir, output_dir, overwrite)
        sources = open_sources(location, dtype, merge_adapters, base_checkpoint)
    outputs = sources.outputs
    if not outputs:
        raise ConsolidationError(f"{weights_dir} holds no model tensors ('module.*' entries) to consolidate.")
    kind = "adapter" if location.adapter and sources.merge is None else "model"
    stem = ADAPTER_STEM if kind == "adapter" else MODEL_STEM
    total_bytes = sum(output.spec.nbytes for output in outputs)

    with staged_output(ckpt_dir, output_dir, overwrite, f"Consolidating {ckpt_dir}") as tmp_dir:
        with own.timed("metadata"):
            layout = plan_files([output.spec for output in outputs], max_shard_size, stem)
            create_files(tmp_dir, layout)
        jobs = [
            PartJob(
                str(ckpt_dir),
                str(tmp_dir),
                tuple(placements),
                None if dtype is None else str(dtype).removeprefix("torch."),
                merge_adapters and sources.merge is not None,
                None if base_checkpoint is None else str(base_checkpoint),
                index,
            )
            for index, placements in enumerate(split_parts(layout, parts or _useful_workers(layout, workers)))
        ]
        if parts_runner is None:
            report = None if progress is None else (lambda done: progress(done, total_bytes))
            results = run_parts(jobs, sources, workers, report)
        else:
            results = parts_runner(jobs, sources)
        digests: Dict[str, str] = {}
        for result in results:
            digests.update(result.digests)
            own.merge(result.stage_seconds)
        entries = {file.name: file_entry(file, digests) for file in layout}
        if len(layout) > 1:
            write_index(tmp_dir / index_filename(stem), ((file.name, file.specs) for file in layout))
            entries[index_filename(stem)] = json_file_entry(tmp_dir / index_filename(stem))
        manifest = {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "global_step": global_step,
            "source_checkpoint": os.path.relpath(weights_dir, output_dir),
            "tensor_count": len(outputs),
            "total_bytes": total_bytes,
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "vocab_size": vocabulary_sizes(ckpt_dir, sources.model_metadata),
            "files": entries,
        }
        if location.adapter:
            manifest.update(base_checkpoint=location.adapter_base, peft=peft_settings(ckpt_dir))
        if sources.merge is not None:
            manifest.update(merged_adapters=sources.merge.settings)
        if best is not None:
            manifest.update(best=dict(best))
        (tmp_dir / METADATA_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (METADATA_FILENAME, *(n for n in entries if n.endswith(".json"))):
            with open(tmp_dir / name, "rb") as handle:
                os.fsync(handle.fileno())
        if verify and sources.merge is not None:
            _verify_merged(tmp_dir, outputs, merged_reader(sources.merge, sources.planned, sources.reader))
        elif verify:
            verify_consolidated(weights_dir, tmp_dir, metadata=sources.metadata)
            if expected_shapes is not None:
                verify_names_and_shapes(tmp_dir, expected_shapes, "the model in the checkpoint's context")
        if verify:
            verify_digests(tmp_dir)
    seconds = own.snapshot()
    logger.info("Consolidated %s -> %s (%d tensors, %d bytes)", ckpt_dir, output_dir, len(outputs), total_bytes)
    algorithm = digest_algorithm()  # BLAKE3 where installed, else sha256
    files = {name: entry.get(f"{algorithm}_tree", entry.get(algorithm, "")) for name, entry in entries.items()}
    return ConsolidationResult(output_dir, len(outputs), total_bytes, global_step, files, kind, seconds)
