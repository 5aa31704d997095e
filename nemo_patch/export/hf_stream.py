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

"""The streamed Hugging Face export: NeMo's exporter's own mapping and transforms, applied one layer at a time.

While the exporter's ``convert_state`` runs, ``io.apply_transforms`` is :meth:`StreamedConversion.apply_transforms`:
the same mapping and transforms, each of NeMo's ``StateDictTransform`` objects run on a ``TransformCTX`` of one group
of tensors (a layer: every name whose first all-digit dotted component is ``<i>``; then everything else), so NeMo's
wildcards bind ``*`` within the layer as on the whole model. The source is a :class:`LazyCheckpointState` (each tensor
read through the engine when its group runs), the target NeMo's Hugging Face model on the ``meta`` device. Each
converted tensor is checked as ``apply_transforms`` checks it and written at once at its place in files laid out
beforehand as ``save_pretrained`` lays them out (:func:`saved_names`, :func:`plan_hf_files`), by the engine's writer
(:func:`.part_writer.write_part`): the files are byte-identical to the in-memory path's. Transforms that cannot be
split run as NeMo's own ``apply_transforms`` on the whole model, with one log line naming the exporter and why
(docs/outputs.md).

Imports torch and the engine at module level; NeMo inside the functions that need it.
"""

import json
import logging
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from nemo_patch.engine.casting import checked_cast
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.layout_checks import SAFETENSORS_DTYPES
from nemo_patch.engine.part_writer import create_files, placements_of, write_part
from nemo_patch.engine.plan import TensorSpec, plan_shards
from nemo_patch.engine.safetensors_writer import OutputFile, encode_header
from nemo_patch.engine.verify import VerificationError
from nemo_patch.export.errors import ExportError, unassigned_error

__all__ = ["LazyCheckpointState", "StreamedConversion", "floating_dtype", "layer_of", "saved_names"]

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")

#: The ``safetensors`` library's ``Dtype`` order (its files sort tensors by dtype, descending, then by name).
_ORDER = "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64".split()
_DTYPE_RANK = {dtype: _ORDER.index(name) for dtype, name in SAFETENSORS_DTYPES.items()}


def floating_dtype(sizes: Iterable[Tuple[torch.dtype, int]]) -> torch.dtype:
    """The floating-point dtype that holds the most bytes of ``(dtype, bytes)`` pairs (the checkpoint's dtype).

    Raises:
        ConsolidationError: no floating-point dtype.
    """
    totals: Dict[torch.dtype, int] = defaultdict(int)
    for dtype, nbytes in sizes:
        if dtype.is_floating_point:
            totals[dtype] += nbytes
    if not totals:
        raise ConsolidationError("The checkpoint holds no floating-point model tensors to export")
    return max(totals, key=lambda dtype: totals[dtype])


def layer_of(name: str) -> Optional[int]:
    """The layer index of a tensor name: its first all-digit dotted component (``None`` when it has none)."""
    match = _LAYER.search(name)
    return None if match is None else int(match.group(1))


class LazyCheckpointState(Mapping[str, torch.Tensor]):
    """The checkpoint's consolidated state dict without its tensors: each is read through the engine when asked for
    (new memory each time, cast to :attr:`dtype` if floating-point, raising ``DtypeOverflowError`` on overflow).

    Args:
        specs: name -> its spec as stored (the exporter's names).
        read: reads a tensor by its name in ``specs``, in its stored dtype.
        dtype: floating-point dtype of the tensors returned (``None``: as stored).
        progress: called with ``(bytes read, bytes in all)`` after each read.
    """

    def __init__(
        self,
        specs: Mapping[str, TensorSpec],
        read: Callable[[str], torch.Tensor],
        dtype: Optional[torch.dtype] = None,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> None:
        self.specs, self._read, self.dtype, self._progress = dict(specs), read, dtype, progress
        self._total = sum(spec.nbytes for spec in self.specs.values())
        self._done = [0]

    def cast_to(self, dtype: torch.dtype) -> "LazyCheckpointState":
        """The same state whose floating-point tensors come in ``dtype``."""
        other = LazyCheckpointState(self.specs, self._read, dtype, self._progress)
        other._done = self._done
        return other

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        tensor = self._read(name)
        self._done[0] += spec.nbytes
        if self._progress is not None:
            self._progress(min(self._done[0], self._total), self._total)
        if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
            tensor = checked_cast(name, tensor, torch.empty(tensor.shape, dtype=self.dtype))
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def saved_names(target: Any, state: Mapping[str, torch.Tensor]) -> List[str]:
    """The names of ``state`` that ``transformers``' ``save_pretrained(state_dict=state, safe_serialization=True)``
    writes for ``target`` (a model on the ``meta`` device): ``_keys_to_ignore_on_save`` removed, and of names sharing
    one parameter, those matching the model's tied-weight patterns removed while one is left (its rule)."""
    from transformers.modeling_utils import _get_tied_weight_keys

    names = [name for name in state if name not in (getattr(target, "_keys_to_ignore_on_save", None) or ())]
    owners: Dict[int, List[str]] = defaultdict(list)
    for name in names:
        try:
            owner: Any = target.get_parameter(name)
        except AttributeError:
            try:
                owner = target.get_buffer(name)
            except AttributeError:
                owner = state[name]
        owners[id(owner)].append(name)
    tied = _get_tied_weight_keys(target)
    dropped: Set[str] = set()
    for group in owners.values():
        if len(group) > 1 and tied is not None:
            found = 0
            for name in sorted(group):
                if any(re.search(pattern, name) for pattern in tied):
                    found += 1
                    if found < len(group):
                        dropped.add(name)
    return [name for name in names if name not in dropped]


def _checked(name: str, tensor: torch.Tensor, meta: torch.Tensor, cast_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A converted tensor checked as NeMo's ``apply_transforms`` checks it, cast to ``cast_dtype`` and contiguous.

    Raises:
        ValueError: its shape differs from the target parameter's.
        AssertionError: its dtype differs from the target's (no ``cast_dtype``).
    """
    if tuple(tensor.shape) != tuple(meta.shape):
        raise ValueError(
            f"Shape mismatch for parameter {name}: target shape {tuple(meta.shape)} vs converted source shape "
            f"{tuple(tensor.shape)}"
        )
    if cast_dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(cast_dtype)
    elif tensor.dtype != meta.dtype:
        raise AssertionError(
            f"dtype mismatch between source and target state dicts: {name} is {tensor.dtype}, "
            f"the target's {meta.dtype}"
        )
    return tensor.detach().contiguous()


def plan_hf_files(specs: Sequence[TensorSpec], max_shard_size: int) -> List[OutputFile]:
    """The safetensors files ``save_pretrained`` writes for ``specs`` (in state dict order): ``huggingface_hub``'s
    shards, each file's tensors in the ``safetensors`` library's order, ``{"format": "pt"}`` metadata."""
    files = []
    for name, group in plan_shards(specs, max_shard_size).items():
        ordered = tuple(sorted(group, key=lambda spec: (-_DTYPE_RANK.get(spec.dtype, 99), spec.name)))
        files.append(OutputFile(name, encode_header(ordered, {"format": "pt"}), ordered))
    return files


def _matches(keys: List[str], pattern: str) -> bool:
    from nemo.lightning.io.state import _match_keys

    return any(key is not None for key in _match_keys(keys, pattern).flat)


def _patterns(key: Any) -> List[str]:
    if isinstance(key, str):
        return [key]
    if isinstance(key, dict):
        return list(key.values())
    return list(key)


class StreamedConversion:
    """``io.apply_transforms`` for one export, applied per group and written at once (see the module docstring).

    Args:
        exporter: the exporter's class name, for log lines and errors.
        output_dir: where ``save_pretrained`` will save (the files are created there).
        max_shard_size: bytes of tensor data per safetensors file.
        compare_with: a directory this conversion wrote before, whose files each converted tensor is compared with
            instead of being written (``verify`` where NeMo's importer cannot run).
    """

    def __init__(
        self, exporter: str, output_dir: Path, max_shard_size: int, compare_with: Optional[Path] = None
    ) -> None:
        self.exporter, self.output_dir, self.max_shard_size = exporter, Path(output_dir), max_shard_size
        self.compare_with = None if compare_with is None else Path(compare_with)
        self.streamed = False
        self.planned: List[TensorSpec] = []
        self.files: List[OutputFile] = []
        self.total_parameters = 0

    def _split_problem(self, transforms: List[Any], source: Dict[Any, List[str]], target: Dict[Any, List[str]]) -> str:
        from nemo.lightning.io.state import StateDictTransform

        for transform in transforms:
            if not isinstance(transform, StateDictTransform):
                return f"its transform {transform!r} is not a StateDictTransform"
            sources, targets = _patterns(transform.source_key), _patterns(transform.target_key)
            for group, keys in source.items():
                found = [_matches(keys, pattern) for pattern in sources]
                if any(found) and not all(found):
                    return f"the source keys of its transform {transform.source_key} span layers"
                if all(found) and not all(_matches(target.get(group, []), pattern) for pattern in targets):
                    return f"the target keys of its transform {transform.target_key} are not in the source's layer"
        return ""

    def apply_transforms(
        self,
        nemo_apply: Callable[..., Any],
        source: Any,
        target: Any,
        mapping: Dict[str, str],
        transforms: Optional[List[Any]] = None,
        state_dict_ignored_entries: Optional[List[str]] = None,
        cast_dtype: Optional[torch.dtype] = None,
    ) -> Any:
        """NeMo's ``apply_transforms``, streamed: the converted tensors are written to :attr:`output_dir` and
        ``target`` (on ``meta``) is returned unassigned; or, where the transforms cannot be split, ``nemo_apply`` on
        the whole model.

        Raises:
            ValueError, AssertionError: NeMo's checks (a converted tensor's shape or dtype, a source key unmatched).
            ExportError: a tensor of the Hugging Face model to be saved is assigned by no transform (names them).
            VerificationError: with :attr:`compare_with`, a file or a tensor differs (names it).
            OSError: the files cannot be written.
        """
        from nemo.lightning.io.state import StateDictTransform, TransformCTX

        transforms = list(transforms or [])
        state = source.state_dict() if hasattr(source, "state_dict") else None
        everything = [StateDictTransform(key, value) for key, value in mapping.items()] + transforms
        target_state = target.state_dict()
        by_layer: Dict[Any, List[str]] = defaultdict(list)
        target_by_layer: Dict[Any, List[str]] = defaultdict(list)
        problem = "its source is not the checkpoint read by the engine"
        if isinstance(state, LazyCheckpointState):
            for key in state:
                by_layer[layer_of(key)].append(key)
            for key in target_state:
                target_by_layer[layer_of(key)].append(key)
            problem = self._split_problem(everything, by_layer, target_by_layer)
        if problem:
            logger.info("Not streaming NeMo's %s: %s; converting the whole model in memory", self.exporter, problem)
            if isinstance(state, LazyCheckpointState):
                source._state_dict = dict(state.items())
            converted = nemo_apply(source, target, mapping=mapping, transforms=transforms,
                                   state_dict_ignored_entries=state_dict_ignored_entries or [],
                                   cast_dtype=cast_dtype)  # fmt: skip
            for module in converted.modules():  # buffers never saved (rotary inv_freq): memory, not meta, for .cpu()
                for name in getattr(module, "_non_persistent_buffers_set", ()):
                    buffer = module._buffers.get(name)
                    if buffer is not None and buffer.is_meta:
                        module._buffers[name] = torch.empty_like(buffer, device="cpu")
            return converted
        assert isinstance(state, LazyCheckpointState)
        if getattr(target.config, "tie_word_embeddings", False) and hasattr(target, "tie_weights"):
            target.tie_weights()
        names = saved_names(target, target_state)
        self.planned = [
            TensorSpec(name, cast_dtype if cast_dtype and target_state[name].is_floating_point()
                       else target_state[name].dtype, tuple(target_state[name].shape))
            for name in names
        ]  # fmt: skip
        self.total_parameters = target.num_parameters()
        self.files = plan_hf_files(self.planned, self.max_shard_size)
        groups = sorted((g for g in by_layer if g is not None)) + ([None] if None in by_layer else [])

        def converted_tensors() -> Iterator[Tuple[str, torch.Tensor]]:
            """Each saved tensor, group by group, checked and cast as NeMo's ``apply_transforms`` does; at the end,
            every transform must have matched and every planned tensor been assigned."""
            saved = {spec.name for spec in self.planned}
            applied = set()
            written: Set[str] = set()
            for group in groups:
                keys = by_layer[group]
                todo = [t for t in everything if all(_matches(keys, p) for p in _patterns(t.source_key))]
                if not todo:
                    continue
                ctx = TransformCTX(
                    source=source,
                    source_state={key: state[key] for key in keys},
                    target=target,
                    target_state={key: target_state[key] for key in target_by_layer.get(group, [])},
                )
                for transform in todo:
                    ctx = transform(ctx)
                    applied.add(id(transform))
                tensors = {name: tensor for name, tensor in ctx.target_state.items() if not tensor.is_meta}
                del ctx
                for name in list(tensors):
                    tensor = _checked(name, tensors.pop(name), target_state[name], cast_dtype)
                    written.add(name)
                    if name in saved:  # else a tensor save_pretrained leaves out (a tied duplicate)
                        yield name, tensor
                    del tensor
            for transform in everything:
                if id(transform) not in applied and isinstance(transform.source_key, str):
                    raise ValueError(f"No matches found for source key: {transform.source_key}")
            missing = [spec.name for spec in self.planned if spec.name not in written]
            if missing:
                raise unassigned_error(self.exporter, missing)

        if self.compare_with is None:
            self._write(converted_tensors(), [name for group in groups for name in target_by_layer.get(group, [])])
        else:
            self._compare(converted_tensors())
        self.streamed = True
        target.cpu = lambda *args, **kwargs: target  # its parameters stay on meta: what apply calls next keeps it
        return target

    def _write(self, converted: Iterator[Tuple[str, torch.Tensor]], order: List[str]) -> None:
        """Write the converted tensors with the engine's writer (:func:`.part_writer.write_part`), asking for them in
        the order the groups produce them."""
        placements = {placement.name: placement for placement in placements_of(self.files)}
        ready: Dict[str, torch.Tensor] = {}

        def produce(spec: TensorSpec) -> torch.Tensor:
            while spec.name not in ready:
                found = next(converted, None)  # at its end, the converter raises naming what was never assigned
                if found is None:
                    raise ValueError(f"NeMo's {self.exporter} gave {spec.name} no tensor to write")
                ready[found[0]] = found[1]
            return ready.pop(spec.name)

        ordered = [placements[name] for name in order if name in placements]
        create_files(self.output_dir, self.files)
        write_part(self.output_dir, ordered, {spec.name: spec for spec in self.planned}, produce)
        for name, tensor in converted:  # the groups after the last saved tensor, and the converter's checks at the end
            ready[name] = tensor
        unwritten = sorted(set(ready) | (set(placements) - {placement.name for placement in ordered}))
        if unwritten:  # converted outside the group that holds its target: never left as zeros in a file
            raise ExportError(f"NeMo's {self.exporter} converted tensors that were not written: {unwritten[:5]}")

    def _compare(self, converted: Iterator[Tuple[str, torch.Tensor]]) -> None:
        """Compare the converted tensors and the planned headers with the files of :attr:`compare_with`.

        Raises:
            VerificationError: a file is missing or extra, or its header or a tensor differs (names it).
        """
        directory = self.compare_with
        assert directory is not None
        found = sorted(path.name for path in directory.glob("*.safetensors"))
        planned = sorted(file.name for file in self.files)
        if found != planned:
            raise VerificationError(
                f"{directory} holds the safetensors files {found[:5]}, the exported model {planned[:5]}"
            )
        for file in self.files:
            with open(directory / file.name, "rb") as handle:
                if handle.read(len(file.header)) != file.header:
                    raise VerificationError(f"The header of {directory / file.name} differs from the exported model's")
        where = {spec.name: (file.name, offset) for file in self.files for spec, offset in file.offsets()}
        descriptors = {file.name: os.open(directory / file.name, os.O_RDONLY) for file in self.files}
        try:
            for name, tensor in converted:
                filename, offset = where[name]
                data = tensor.reshape(-1).view(torch.uint8).numpy().data
                for start in range(0, len(data), 1 << 26):  # read back 64 MiB at a time
                    want = data[start : start + (1 << 26)]
                    if os.pread(descriptors[filename], len(want), offset + start) != want:
                        raise VerificationError(
                            f"Tensor {name} in {directory / filename} differs from the exported model's"
                        )
        finally:
            for fd in descriptors.values():
                os.close(fd)

    def write_index(self) -> None:
        """``model.safetensors.index.json`` as ``save_pretrained`` writes it, when there are several files."""
        if len(self.files) < 2:
            return
        index = {
            "metadata": {"total_parameters": self.total_parameters,
                         "total_size": sum(spec.nbytes for spec in self.planned)},
            "weight_map": {spec.name: file.name for file in self.files for spec in file.specs},
        }  # fmt: skip
        with open(self.output_dir / "model.safetensors.index.json", "w", encoding="utf-8") as handle:
            handle.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
