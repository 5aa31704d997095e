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

"""A consolidation with what the engine adds to the converter: integrity, parallel writers, adapters, zarr.

:func:`consolidate_checkpoint` runs the converter's :class:`~.converter.Consolidation` with the steps of a
:class:`ConsolidationSteps`: ``metadata.json`` with per-tensor digests (:mod:`.digests`) and an optional
verification before publishing; several writer processes (:mod:`.parts`) or nodes (``parts_runner``), with the same
bytes whatever their number; PEFT adapters, alone or merged (:mod:`.adapter_merge`); ``zarr`` checkpoints
(:mod:`.zarr_reader`); publishing with a lock and an atomic exchange (:mod:`.publish`), after refusing an output
that would overwrite the checkpoint (:mod:`.output_target`).
"""

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union, cast

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import Metadata

from nemo_patch.engine.checkpoint_layout import CheckpointLocation, inspect_checkpoint
from nemo_patch.engine.converter import Consolidation, Producer
from nemo_patch.engine.digests import (
    digest_algorithm,
    file_entry,
    json_file_entry,
    new_digest,
    source_fingerprint,
    verify_digests,
)
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.output_layout import (
    ADAPTER_STEM,
    CONSOLIDATED_DIRNAME,
    DEFAULT_MAX_SHARD_SIZE,
    FORMAT_VERSION,
    METADATA_FILENAME,
    index_filename,
)
from nemo_patch.engine.output_target import check_output_target, refuse_an_output_as_checkpoint, refuse_remote
from nemo_patch.engine.plan import OutputTensor, TensorSpec
from nemo_patch.engine.safetensors_writer import OutputFile, encode_header, write_file
from nemo_patch.engine.save_identity import SaveIdentity, check_unchanged, save_identity, saved_again_instead
from nemo_patch.engine.stage_times import StageTimes, stage_times
from nemo_patch.engine.tensor_sources import Sources, merged_reader, open_sources
from nemo_patch.engine.verify import (
    VerificationError,
    output_shapes,
    tensors_bitwise_equal,
    verify_consolidated,
    verify_names_and_shapes,
)
from nemo_patch.engine.vocabulary import vocabulary_sizes

try:  # later additions: writer processes, and publishing with locks and an atomic exchange
    import nemo_patch.engine.part_writer as part_writer
    import nemo_patch.engine.parts as parts
    import nemo_patch.engine.publish as publish
except ModuleNotFoundError as missing:  # pragma: no cover
    if not str(missing.name).startswith(__package__):
        raise
    part_writer = parts = publish = None  # type: ignore[assignment]
#: What tells a PEFT adapter checkpoint's settings (``peft_settings(checkpoint_dir)``), where an extension registers
#: it; ``None``: a checkpoint is consolidated as it is.
adapter_settings: Any = None

__all__ = [
    "ConsolidationResult",
    "ConsolidationSteps",
    "PartsRunner",
    "ProgressCallback",
    "consolidate_checkpoint",
    "read_state_dict",
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
            of a JSON file; :mod:`.digests`).
        kind: ``"model"``, or ``"adapter"`` for a PEFT adapter checkpoint's adapters.
        stage_seconds: busy seconds per stage over every writer (:mod:`.stage_times`).
    """

    output_dir: Path
    tensor_count: int
    total_bytes: int
    global_step: Optional[int] = None
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
        location: from :func:`.checkpoint_layout.inspect_checkpoint`.
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
#: Runs a consolidation's :class:`.parts.PartJob` list (given this process's sources of it) and returns their
#: :class:`.parts.PartResult` in order; it raises when a part fails or does not report in time.
PartsRunner = Callable[[List[Any], Sources], List[Any]]


@dataclass
class ConsolidationSteps:
    """The steps :func:`consolidate_checkpoint` gives the converter's :class:`~.converter.Consolidation` (see the
    module docstring, and :func:`consolidate_checkpoint` for the fields), and what they record for the result."""

    job: Consolidation = field(init=False)
    global_step: Optional[int] = None
    dtype: Optional[torch.dtype] = None
    verify: bool = False
    progress: Optional[ProgressCallback] = None
    expected_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None
    merge_adapters: bool = False
    base_checkpoint: Optional[Union[str, Path]] = None
    best: Optional[Mapping[str, Any]] = None
    run_id: Optional[str] = None
    workers: int = 1
    parts: Optional[int] = None
    parts_runner: Optional[PartsRunner] = None
    allow_unfinished: bool = False
    staging_dir: Optional[Union[str, Path]] = None
    before_publish: Optional[Callable[[], None]] = None
    times: StageTimes = field(default_factory=StageTimes)  # this process's planning; the parts report their own
    location: Optional[CheckpointLocation] = None
    readers: Optional[Sources] = None  # what the outputs are read from (``job.sources``: by name)
    digests: Dict[str, str] = field(default_factory=dict)
    entries: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    kind: str = "model"
    source: Dict[str, Any] = field(default_factory=dict)  # digests.source_fingerprint, taken when it is opened
    identity: Optional[SaveIdentity] = None  # which save it holds, taken before it is read
    layout: List[OutputFile] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"Invalid workers {self.workers!r}: expected a whole number of writer processes >= 1.")

    def consolidation(self, checkpoint_dir: Union[str, Path], output_dir: Any, **options: Any) -> Consolidation:
        """The converter's consolidation with these steps."""
        self.job = Consolidation(
            checkpoint_dir,
            output_dir,
            locator=self.locate,
            reader=self.open,
            stager=self.staged,
            writer=self.write,
            **options,
        )
        return self.job

    @property
    def output_path(self) -> Path:
        """The output directory (known once the checkpoint is located)."""
        return Path(cast(Path, self.job.output_dir))

    def locate(self, job: Consolidation) -> CheckpointLocation:
        with self.times.timed("metadata"):
            refuse_remote(job.checkpoint_dir, "the checkpoint")
            refuse_an_output_as_checkpoint(job.checkpoint_dir)
            location = inspect_checkpoint(job.checkpoint_dir, allow_unfinished=self.allow_unfinished)
            job.output_dir = job.output_dir or location.checkpoint_dir / CONSOLIDATED_DIRNAME
            check_output_target(location.checkpoint_dir, job.output_dir, job.overwrite)
        return location

    def open(self, location: CheckpointLocation) -> Tuple[List[OutputTensor], Producer]:
        self.location = location
        with self.times.timed("metadata"):
            # Which save: taken before anything is read, compared once all is read (finish); a save visibly in
            # progress is refused then, after the reader has named any damaged shard.
            self.identity = save_identity(location.checkpoint_dir, allow_unfinished=True)
            self.source = source_fingerprint(location.weights_dir)
            self.readers = open_sources(location, self.dtype, self.merge_adapters, self.base_checkpoint)
        if location.adapter and self.readers.merge is None:
            self.kind, self.job.stem = "adapter", ADAPTER_STEM
        return self.readers.outputs, self.readers.producer()

    @contextlib.contextmanager
    def staged(self, location: CheckpointLocation) -> Iterator[Path]:
        """Publishing with the output's lock and an atomic exchange (:func:`.publish.staged_output`), else the
        converter's; ``metadata.json`` is written, and with ``verify`` every tensor checked, before publishing."""
        staging = (
            self.job.staged(location)
            if publish is None
            else publish.staged_output(
                location.checkpoint_dir,
                self.output_path,
                self.job.overwrite,
                f"Consolidating {location.checkpoint_dir}",
                staging_dir=self.staging_dir,
                before_publish=self.before_publish,
            )
        )
        with staging as directory:
            yield directory
            self.finish(directory, location, list(self.job.sources.values()))

    def write(self, directory: Path, files: Dict[str, List[TensorSpec]], produce: Producer) -> None:
        location, sources = cast(CheckpointLocation, self.location), cast(Sources, self.readers)
        self.layout = [
            OutputFile(name, encode_header(specs, {"format": "pt"}), tuple(specs)) for name, specs in files.items()
        ]
        total = sum(spec.nbytes for specs in files.values() for spec in specs)
        count = self.parts or max(1, min(self.workers, sum(len(file.specs) for file in self.layout)))
        if count == 1 and self.parts_runner is None:  # front to back, in this process
            done = [0]

            def written(spec: TensorSpec, data: memoryview) -> None:
                done[0] += spec.nbytes
                if self.progress is not None:
                    self.progress(done[0], total)

            before, threads = stage_times.snapshot(), torch.get_num_threads()
            torch.set_num_threads(1)  # a writer's work is memory copies, which torch's threads only slow down
            try:
                for file in self.layout:  # each tensor hashed as it is written (BLAKE3 where installed)
                    self.digests.update(write_file(directory, file, produce, written, digest=new_digest))
            finally:
                torch.set_num_threads(threads)
            after = stage_times.snapshot()
            self.times.merge({stage: seconds - before.get(stage, 0.0) for stage, seconds in after.items()})
            return
        if parts is None:
            raise ValueError(f"{count} writers need {__package__}.parts; write with one")
        progress = self.progress
        report = None if progress is None else (lambda done: progress(done, total))
        with self.times.timed("metadata"):
            part_writer.create_files(directory, self.layout)
        for result in parts.write_parts(self, location, sources, directory, self.layout, count, report):
            self.digests.update(result.digests)
            self.times.merge(result.stage_seconds)

    def finish(self, directory: Path, location: CheckpointLocation, outputs: List[OutputTensor]) -> None:
        sources, output_dir, stem = cast(Sources, self.readers), self.output_path, self.job.stem
        self.entries = {file.name: file_entry(file, self.digests) for file in self.layout}
        if len(self.layout) > 1:
            self.entries[index_filename(stem)] = json_file_entry(directory / index_filename(stem))
        manifest = {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "global_step": self.global_step,
            "source_checkpoint": os.path.relpath(location.weights_dir, output_dir),
            "source_metadata": self.source,
            "save": None if self.identity is None else self.identity.as_json(),
            "tensor_count": len(outputs),
            "total_bytes": sum(output.spec.nbytes for output in outputs),
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
            "vocab_size": vocabulary_sizes(location.checkpoint_dir, sources.model_metadata),
            "files": self.entries,
        }
        if location.adapter and adapter_settings is not None:
            peft = adapter_settings.peft_settings(location.checkpoint_dir)
            manifest.update(base_checkpoint=adapter_settings.adapter_base(location.weights_dir), peft=peft)
        if sources.merge is not None:
            manifest.update(merged_adapters=sources.merge.settings)
        if self.best is not None:
            manifest.update(best=dict(self.best))
        if self.run_id is not None:
            manifest.update(run=self.run_id)
        (directory / METADATA_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (METADATA_FILENAME, *(n for n in self.entries if n.endswith(".json"))):
            with open(directory / name, "rb") as handle:
                os.fsync(handle.fileno())
        if self.verify and sources.merge is not None:
            _verify_merged(directory, outputs, merged_reader(sources.merge, sources.planned, sources.reader))
        elif self.verify:
            verify_consolidated(location.weights_dir, directory, metadata=sources.metadata)
            if self.expected_shapes is not None:
                verify_names_and_shapes(directory, self.expected_shapes, "the model in the checkpoint's context")
        if self.verify:
            verify_digests(directory)
        if self.identity is not None:  # the checkpoint still holds the save that was read: else nothing is published
            check_unchanged(location.checkpoint_dir, self.identity, self.allow_unfinished)


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
    run: Optional[str] = None,
    workers: int = 1,
    parts: Optional[int] = None,
    parts_runner: Optional[PartsRunner] = None,
    staging_dir: Optional[Union[str, Path]] = None,
    before_publish: Optional[Callable[[], None]] = None,
) -> ConsolidationResult:
    """Consolidate a finished NeMo 2 ``torch_dist`` or ``zarr`` checkpoint into ``consolidated/`` safetensors.

    Reads only files (no process group). Unpickles nothing but the DCP ``.metadata`` file, with an allowlist
    (:func:`.metadata_checks.read_dcp_metadata`); stored tensors are read with ``torch.load(weights_only=True)``;
    ``_extra_state`` payloads and ``common.pt`` are never loaded.

    Args:
        checkpoint_dir: the checkpoint directory (``<ckpt>``) or its ``weights/`` directory; ``torch_dist`` or
            megatron-core's ``zarr`` (:mod:`.zarr_reader`: same output, bit for bit).
        output_dir: where to publish; defaults to ``<ckpt>/consolidated``.
        global_step: recorded in ``metadata.json``; ``None`` if unknown.
        max_shard_size: most tensor-data bytes per safetensors file (default 5 * 10**9, Hugging Face's "5GB"); a
            single ``model.safetensors`` is written when everything fits, else shards plus an index.
        dtype: cast floating-point tensors to this dtype (``None`` keeps the stored dtypes); a cast that would turn a
            finite value into ``inf`` (e.g. above 65504 in ``torch.float16``) raises
            :class:`~.errors.DtypeOverflowError`.
        overwrite: replace an existing output atomically; if ``False`` an existing output raises
            :class:`OutputExistsError` before any work (:func:`.output_target.check_output_target` says what may be
            replaced, and where an output may not go).
        verify: re-read the written files and compare every tensor with the checkpoint before publishing
            (:func:`.verify.verify_consolidated`).
        allow_unfinished: consolidate even if NeMo's unfinished marker is present (the CLI's explicit override).
        progress: called with ``(bytes done, bytes in all)`` after each tensor is read.
        expected_shapes: with ``verify``, the names and shapes the output must have besides (e.g. the model in the
            checkpoint's context; :func:`.verify.verify_names_and_shapes`).
        merge_adapters: for a LoRA adapter checkpoint, write the base model with the adapters merged
            (``model.safetensors``) instead of ``adapter_model.safetensors``; no effect on a model checkpoint.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.
        best: recorded as ``"best"`` in ``metadata.json`` when the checkpoint was consolidated as the best by a
            monitored metric: ``{"monitor": name, "value": float, "mode": "min" | "max"}`` (NeMo's
            ``ModelCheckpoint``'s).
        run: recorded as ``"run"`` in ``metadata.json``: the training run the checkpoint belongs to.
        workers: writer processes on this node (>= 1); the output is the same, byte for byte, whatever the number.
        parts: how many parts the tensors are cut into (default: ``workers``); with ``parts_runner``.
        parts_runner: runs the parts instead of ``workers`` processes on this node (several nodes).
        staging_dir: where the output is written before it is renamed into place (on the output's filesystem;
            default: the output's parent); see :func:`.publish.staged_output`.
        before_publish: called right before the output is renamed into place; what it raises is raised, and
            nothing is published (the sidecar checks there that the checkpoint is still finished).

    Returns:
        A :class:`ConsolidationResult`.

    Raises:
        ConsolidationError: or one of its subclasses in :mod:`.errors` naming the cause (not a checkpoint,
            unfinished, unsupported format, a URL, output exists, a shard file that cannot be read or metadata that
            leaves a layer out, a ``dtype`` too narrow for the values, a verification mismatch, an output that cannot
            be written). Nothing is left under ``output_dir``'s name or in a temporary directory.
        ValueError: if ``max_shard_size`` < 1, ``workers`` < 1 or ``dtype`` is not a floating-point dtype.
    """
    steps = ConsolidationSteps(
        global_step,
        dtype,
        verify,
        progress,
        expected_shapes,
        merge_adapters,
        base_checkpoint,
        best,
        run,
        workers,
        parts,
        parts_runner,
        allow_unfinished,
        staging_dir,
        before_publish,
    )
    job = steps.consolidation(checkpoint_dir, output_dir, max_shard_size=max_shard_size, overwrite=overwrite)
    try:
        outputs = job.run()
    except (ConsolidationError, OSError) as error:  # a read that failed because the checkpoint was saved again
        if steps.location is not None and steps.identity is not None:
            changed = saved_again_instead(steps.location.checkpoint_dir, steps.identity, error)
            if changed is not None:
                raise changed from error
        raise
    total = sum(output.spec.nbytes for output in outputs)
    logger.info(
        "Consolidated %s -> %s (%d tensors, %d bytes)", job.checkpoint_dir, job.output_dir, len(outputs), total
    )
    algorithm = digest_algorithm()  # BLAKE3 where installed, else sha256
    files = {name: entry.get(f"{algorithm}_tree", entry.get(algorithm, "")) for name, entry in steps.entries.items()}
    output = steps.output_path
    return ConsolidationResult(output, len(outputs), total, global_step, files, steps.kind, steps.times.snapshot())
