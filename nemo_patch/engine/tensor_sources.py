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

"""Where each output tensor of a consolidation comes from, and the functions that read it.

:func:`open_sources` turns a checkpoint (and the consolidation's options: a dtype cast, merging LoRA adapters) into a
:class:`Sources`: the checkpoint's metadata, a reader of its ``weights/`` and the planned output tensors, in output
order (:func:`.plan.plan_outputs`). The same call, in any process, on any node, gives the same plan: it is a function
of the checkpoint's files and the options alone, which is what lets several writers share one consolidation
(:mod:`.parts`). :meth:`Sources.producer` reads one output tensor at a time. Imports the standard library, torch and
the rest of the engine only.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Union, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_patch.engine.checkpoint_layout import CheckpointLocation
from nemo_patch.engine.checkpoint_reader import RegionReader, open_weights
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError
from nemo_patch.engine.plan import OutputTensor, TensorSpec, plan_outputs
from nemo_patch.engine.stage_times import stage_times

#: The module casting outputs to another dtype (``checked_cast``, ``cast_outputs``), which registers itself here.
casting: Any = None

#: What merges LoRA adapter checkpoints into their base model (``open_lora_merge``, ``merged_producer``), where an
#: extension registers it; ``None``: merging adapters is refused.
adapter_merge: Any = None

__all__ = ["Sources", "merged_reader", "open_sources", "root_cause", "tensor_producer"]

#: Reads the output tensor a spec names (its dtype and shape are the spec's).
Producer = Callable[[TensorSpec], torch.Tensor]


def root_cause(error: BaseException) -> str:
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
) -> Producer:
    """A function that reads one output tensor (by its spec's name in ``sources``) from the checkpoint.

    Each tensor is read into one of two reusable byte buffers of ``largest`` bytes (the writer keeps at most one
    tensor in flight while the next is read), so memory is not re-allocated and re-faulted for every tensor. A tensor
    cast to another dtype is read into a third buffer in its stored dtype first. With ``reuse=False`` every tensor is
    new memory (for callers that keep the tensors). Time goes to the ``read_crc`` and ``placement`` stages
    (:mod:`.stage_times`).

    The function raises :class:`CorruptShardError` naming the shard file(s) when a tensor cannot be read, and
    :class:`~.errors.DtypeOverflowError` when a cast would make a finite value ``inf`` (:func:`.casting.checked_cast`).
    """
    buffers = [torch.empty(largest if reuse else 0, dtype=torch.uint8) for _ in range(2)]
    staging: List[torch.Tensor] = []
    turn = [0]

    def read(source: OutputTensor, out: torch.Tensor) -> torch.Tensor:
        placed, start = stage_times.snapshot()["placement"], time.perf_counter()
        tensor = reader.read(source.key, source.index, out=out)
        stage_times.add("read_crc", time.perf_counter() - start - (stage_times.snapshot()["placement"] - placed))
        return tensor

    def produce(spec: TensorSpec) -> torch.Tensor:
        source = sources[spec.name]
        buffer = buffers[turn[0] % 2] if reuse else torch.empty(spec.nbytes, dtype=torch.uint8)
        turn[0] += 1
        out = buffer[: spec.nbytes].view(spec.dtype).view(spec.shape)
        item = cast(TensorStorageMetadata, metadata.state_dict_metadata[source.key])
        stored = TensorSpec(spec.name, item.properties.dtype, spec.shape)
        try:
            if stored.dtype == spec.dtype:
                return read(source, out)
            if not staging or staging[0].numel() < stored.nbytes:
                staging[:] = [torch.empty(stored.nbytes, dtype=torch.uint8)]
            raw = read(source, staging[0][: stored.nbytes].view(stored.dtype).view(stored.shape))
        except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
            files = ", ".join(reader.files_of(source.key))
            raise CorruptShardError(
                f"Cannot read shard file(s) {files} of {reader.path} (tensor {source.key}): {root_cause(error)}"
            ) from error
        with stage_times.timed("placement"):
            return casting.checked_cast(spec.name, raw, out)

    return produce


def merged_reader(merge: Any, planned: List[OutputTensor], adapter_reader: RegionReader) -> Producer:
    """Reads a merged output tensor (base + LoRA delta, in the stored dtype), cast to the spec's dtype (refusing a cast
    that overflows: :func:`.casting.checked_cast`)."""
    stored = {output.spec.name: output for output in planned}
    read_base = tensor_producer(merge.base_reader, stored, merge.base_metadata, 0, reuse=False)
    merged = adapter_merge.merged_producer(
        read_base, lambda output: adapter_reader.read(output.key, output.index), merge.pairs, merge.scale
    )

    def read(spec: TensorSpec) -> torch.Tensor:
        tensor = merged(stored[spec.name].spec)
        if tensor.dtype == spec.dtype:
            return tensor
        return casting.checked_cast(spec.name, tensor, torch.empty(tensor.shape, dtype=spec.dtype))

    return read


@dataclass
class Sources:
    """The output tensors of one consolidation and what they are read from.

    Attributes:
        metadata: the checkpoint's metadata (of ``weights/``).
        reader: a reader of ``weights/``.
        merge: the base model and adapter pairs when LoRA adapters are merged, else ``None``.
        planned: the output tensors in output order, in their stored dtypes.
        outputs: the same, cast to the requested dtype.
    """

    metadata: Metadata
    reader: RegionReader
    merge: Optional[Any]
    planned: List[OutputTensor]
    outputs: List[OutputTensor]

    @property
    def model_metadata(self) -> Metadata:
        """The metadata of the checkpoint the model tensors come from (the base model's when merging)."""
        return self.metadata if self.merge is None else self.merge.base_metadata

    def producer(self, reuse: bool = True, names: Optional[Iterable[str]] = None) -> Producer:
        """A function that reads one output tensor by its spec (:func:`tensor_producer`, :func:`merged_reader`).

        With ``reuse``, tensors are read into two reused buffers of the largest output tensor's size (of those in
        ``names`` when given), so a tensor is valid until the next-but-one call.
        """
        if self.merge is not None:
            return merged_reader(self.merge, self.planned, self.reader)
        wanted = None if names is None else set(names)
        largest = max((o.spec.nbytes for o in self.outputs if wanted is None or o.spec.name in wanted), default=0)
        by_name = {output.spec.name: output for output in self.outputs}
        return tensor_producer(self.reader, by_name, self.metadata, largest if reuse else 0, reuse=reuse)


def open_sources(
    location: CheckpointLocation,
    dtype: Optional[torch.dtype] = None,
    merge_adapters: bool = False,
    base_checkpoint: Optional[Union[str, Path]] = None,
) -> Sources:
    """The :class:`Sources` of a consolidation of ``location``.

    Args:
        location: from :func:`.checkpoint_layout.inspect_checkpoint`.
        dtype: cast floating-point tensors to this dtype (``None``: as stored).
        merge_adapters: for a LoRA adapter checkpoint, the base model with the adapters merged.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.

    Raises:
        ConsolidationError: or a subclass from :mod:`.errors`: unreadable metadata, a layout the
            plan does not understand (naming the key), a missing base checkpoint.
        ValueError: ``dtype`` is not a floating-point dtype.
    """
    metadata, reader = open_weights(location.weights_dir, location.backend)
    merge = None
    if merge_adapters and location.adapter:
        if adapter_merge is None:
            raise ConsolidationError(f"{location.checkpoint_dir}: merging adapters needs a module that merges them")
        merge = adapter_merge.open_lora_merge(location, metadata, base_checkpoint)
    planned = merge.base_outputs if merge is not None else plan_outputs(metadata)
    if dtype is not None and casting is None:
        raise ConsolidationError(f"casting the outputs to {dtype} needs a dtype cast module; none is registered")
    return Sources(
        metadata, reader, merge, planned, planned if dtype is None else casting.cast_outputs(planned, dtype)
    )
