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

"""Which tensors a consolidation writes, under which names, read from which checkpoint entries.

The rule: the output holds exactly the tensors of the TP=1, PP=1, EP=1 megatron-core model's ``state_dict()`` minus
``_extra_state``, under the distributed checkpoint's canonical names (for the dense layer norms, the Transformer Engine
names that megatron-core saves for either layer spec), whatever parallelism wrote the checkpoint. From the checkpoint's
``module.*`` tensor entries (optimizer state, ``_extra_state`` payloads and non-tensors are left out; dtypes are kept
unless a cast is asked for), with ``module.`` dropped:

* layer-stacked entries are split per layer: ``decoder.layers.mlp.linear_fc1.weight`` ``[L, ...]`` becomes
  ``decoder.layers.<i>.mlp.linear_fc1.weight`` ``[...]``; a layer index that no chunk of an entry covers (a layer of
  another kind, e.g. a dense layer among MoE layers) has no output from that entry (the indices come from the chunks,
  never from the declared size alone: at most :data:`MAX_OUTPUTS_PER_ENTRY` per entry; a chunk removed from the
  metadata while its stored record stays is found by :func:`nemo_patch.engine.layout_checks.check_dcp_layout`); but a
  layer index below the layer count every entry of its stack declares (``decoder.layers``, ``mtp.layers``: the
  smallest leading size among them) that no chunk of any of them covers is a hole, not a layer of another kind, and
  fails (:class:`~nemo_patch.engine.errors.CorruptShardError`, naming the layer and an entry), instead of giving a
  smaller model; a layer with only some of its experts stored fails;
* expert-stacked entries of MoE layers (``SequentialMLP``, ``GroupedMLP`` and ``TEGroupedMLP`` all save
  ``<...>.mlp.experts.experts.<linear>.<param>`` with the expert axis first, after any layer axis) are split per
  expert, named as ``SequentialMLP``'s ``state_dict`` names them:
  ``<...>.mlp.experts.local_experts.<e>.<linear>.<param>``; expert ``e`` is the global expert index, so any
  expert-parallel layout gives the same names and bytes;
* the pre-MLP norm of an MoE layer, which the local layer spec saves as ``mlp.linear_fc1.layer_norm_*`` although the
  layer has no ``linear_fc1``, is named ``pre_mlp_layernorm.*`` as the model names it (dense layers keep the fused
  names); the same holds in a multi-token-prediction layer's ``mtp.layers.<i>.transformer_layer.``;
* everything else keeps its name and shape.

Anything the plan does not understand fails, naming the key, instead of giving a misnamed or partly filled output: an
expert entry without its expert axis, an ``experts.experts`` name left after planning, or an output tensor that the
stored chunks cover only in part (the chunks are first proven to lie inside their tensor without overlapping, by
:func:`nemo_patch.engine.layout_checks.check_chunk_tiling`, so the count of covered elements is exact). Output
tensors are in natural name order (``layers.2`` before ``layers.10``).

Imports torch and the engine's safetensors writer, layout checks and errors only; never NeMo, Lightning or
megatron-core, and nothing outside the engine.
"""

import itertools
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_patch.engine.errors import CorruptShardError, DtypeOverflowError, UnknownLayoutError
from nemo_patch.engine.layout_checks import check_chunk_tiling
from nemo_patch.engine.safetensors_writer import TensorSpec

__all__ = [
    "LAYER_PREFIX",
    "OutputTensor",
    "cast_outputs",
    "cast_overflow",
    "checked_cast",
    "consolidated_key",
    "model_tensor_keys",
    "plan_outputs",
    "stored_spec",
]

_MODEL_PREFIX = "module."
_STACKED_LAYERS = re.compile(r"^(?P<head>(?:.*\.)?layers)\.(?P<tail>[^0-9].*)$")
_STACKED_EXPERTS = re.compile(r"^(?P<head>(?:.*\.)?experts)\.experts\.(?P<tail>[^0-9].*)$")


def consolidated_key(checkpoint_key: str, layer: Optional[int] = None, expert: Optional[int] = None) -> str:
    """Map a DCP model key to its consolidated name.

    Args:
        checkpoint_key: a key of the distributed checkpoint, e.g. ``module.decoder.layers.mlp.linear_fc1.weight``.
        layer: for a layer-stacked tensor, the layer index to insert after ``layers``.
        expert: for an expert-stacked tensor (``...experts.experts...``), the global expert index.

    Returns:
        The key without ``module.``, e.g. ``decoder.layers.3.mlp.linear_fc1.weight`` for ``layer=3``, or
        ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`` for
        ``module.decoder.layers.mlp.experts.experts.linear_fc1.weight`` with ``layer=3, expert=5``.

    Raises:
        ValueError: ``layer`` (``expert``) is given for a key that is not layer-stacked (expert-stacked).
    """
    key = checkpoint_key[len(_MODEL_PREFIX) :] if checkpoint_key.startswith(_MODEL_PREFIX) else checkpoint_key
    if layer is not None:
        match = _STACKED_LAYERS.match(key)
        if match is None:
            raise ValueError(f"{checkpoint_key!r} is not a layer-stacked key")
        key = f"{match.group('head')}.{layer}.{match.group('tail')}"
    if expert is not None:
        match = _STACKED_EXPERTS.match(key)
        if match is None:
            raise ValueError(f"{checkpoint_key!r} is not an expert-stacked key")
        key = f"{match.group('head')}.local_experts.{expert}.{match.group('tail')}"
    return key


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


def _has_experts(key: str) -> bool:
    return _STACKED_EXPERTS.match(consolidated_key(key, 0) if _is_stacked(key) else consolidated_key(key)) is not None


def _covered(item: TensorStorageMetadata, index: Tuple[int, ...]) -> int:
    """How many elements of ``item[index]`` (a region of the leading dims) the stored chunks hold."""
    total = 0
    for chunk in item.chunks:
        volume = 1
        for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
            if dim < len(index):
                if not offset <= index[dim] < offset + size:
                    volume = 0
                    break
            else:
                volume *= size
        total += volume
    return total


def _natural(name: str) -> List[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class OutputTensor:
    """One output tensor and its source.

    Attributes:
        spec: name, dtype and shape in the output.
        key: the DCP key it is read from.
        index: the indices into the source's leading axes (layer, then expert), ``()`` for the whole entry; the
            output is ``source[index]``.
    """

    spec: TensorSpec
    key: str
    index: Tuple[int, ...] = ()

    @property
    def where(self) -> str:
        """``key[i, j]`` (for messages)."""
        return self.key + (f"[{', '.join(map(str, self.index))}]" if self.index else "")


#: The most output tensors one checkpoint entry may split into (layers x experts); a larger count is a crafted size.
MAX_OUTPUTS_PER_ENTRY = 1 << 20


def _leading_indices(key: str, item: TensorStorageMetadata, axes: int) -> List[Tuple[int, ...]]:
    """The indices into the first ``axes`` dimensions that at least one stored chunk covers, in order.

    Taken from the chunks, never from the declared size alone, so a size that declares 10^9 layers costs nothing
    unless the checkpoint holds their bytes (:mod:`nemo_patch.engine.layout_checks`)."""
    if axes == 0:
        return [()]
    found: set = set()
    for chunk in item.chunks:
        ranges = [range(offset, offset + size) for offset, size in zip(chunk.offsets[:axes], chunk.sizes[:axes])]
        if math.prod(len(r) for r in ranges) + len(found) > MAX_OUTPUTS_PER_ENTRY:
            raise UnknownLayoutError(
                f"{key}: shape {list(item.size)} splits into more than {MAX_OUTPUTS_PER_ENTRY} output tensors"
            )
        found.update(itertools.product(*ranges))
    return sorted(found)


def _outputs_of(key: str, item: TensorStorageMetadata) -> List[OutputTensor]:
    dtype, size = item.properties.dtype, tuple(item.size)
    stacked, experts = _is_stacked(key), _has_experts(key)
    axes = int(stacked) + int(experts)
    if len(size) <= axes:
        raise UnknownLayoutError(
            f"{key}: shape {list(size)} lacks the {'layer and expert' if axes == 2 else 'stacked'} axis its name says "
            "it has; cannot name its tensors"
        )
    check_chunk_tiling(key, size, item.chunks)
    indices = _leading_indices(key, item, axes)
    if stacked and experts:
        by_layer: Dict[int, set] = {}
        for layer, expert in indices:
            by_layer.setdefault(layer, set()).add(expert)
        for stack_index, found in sorted(by_layer.items()):
            if len(found) != size[1]:
                absent = min(set(range(size[1])) - found)
                raise UnknownLayoutError(
                    f"{key}[{stack_index}, {absent}]: layer {stack_index} has {len(found)} of its {size[1]} experts "
                    "stored; refusing an output without some of them"
                )
    if not stacked and len(indices) != math.prod(size[:axes]):
        present = set(indices)
        missing = next(i for i in itertools.product(*(range(n) for n in size[:axes])) if i not in present)
        raise UnknownLayoutError(f"{key}{list(missing)}: no stored chunk holds any of it; refusing a missing tensor")
    outputs = []
    region = math.prod(size[axes:])
    for index in indices:
        # chunks are proven inside bounds and not overlapping (layout_checks), so this count is exact
        covered = _covered(item, index)
        if covered != region:
            raise UnknownLayoutError(
                f"{key}{list(index) if index else ''}: the stored chunks cover {covered} of its {region} elements; "
                "refusing to write a partly filled tensor"
            )
        name = consolidated_key(key, index[0] if stacked else None, index[-1] if experts else None)
        outputs.append(OutputTensor(TensorSpec(name, dtype, size[axes:]), key, tuple(index)))
    return outputs


#: A transformer layer's prefix: ``decoder.layers.<i>.``, or a multi-token-prediction layer's inner transformer layer,
#: ``mtp.layers.<i>.transformer_layer.``.
LAYER_PREFIX = r"(?:.*\.)?layers\.\d+\.(?:transformer_layer\.)?"
_FUSED_MLP_NORM = re.compile(rf"^(?P<layer>{LAYER_PREFIX})mlp\.linear_fc1\.layer_norm_(?P<param>\w+)$")


def _moe_pre_mlp_norms(outputs: List[OutputTensor]) -> List[OutputTensor]:
    """The local spec saves every layer's pre-MLP norm as ``mlp.linear_fc1.layer_norm_*``; in a layer whose MLP has no
    ``linear_fc1`` (an MoE layer) that is a name no model has, so it gets the model's own, ``pre_mlp_layernorm.*``
    (what both layer specs call it in an MoE layer)."""
    names = {output.spec.name for output in outputs}
    renamed = []
    for output in outputs:
        match = _FUSED_MLP_NORM.match(output.spec.name)
        if match and f"{match.group('layer')}mlp.linear_fc1.weight" not in names:
            name = f"{match.group('layer')}pre_mlp_layernorm.{match.group('param')}"
            output = OutputTensor(TensorSpec(name, output.spec.dtype, output.spec.shape), output.key, output.index)
        renamed.append(output)
    return renamed


def _check_no_missing_layer(stacks: Dict[str, List[Tuple[str, int, set]]]) -> None:
    """Refuse a layer index that no entry of its stack covers (see the module docstring).

    Args:
        stacks: the head of each stack (``decoder.layers``) -> ``(key, declared layer count, covered layer indices)``
            for each of its layer-stacked entries.

    Raises:
        CorruptShardError: naming the stack's first missing layer and an entry that declares it.
    """
    for head, entries in stacks.items():
        key, layers, _ = min(entries, key=lambda entry: (entry[1], entry[0]))
        covered = set().union(*(entry[2] for entry in entries))
        missing = 0
        while missing < layers and missing in covered:  # at most len(covered) + 1 steps, whatever the declared size
            missing += 1
        if missing < layers:
            raise CorruptShardError(
                f"{key}[{missing}]: no stored chunk of any of the {len(entries)} {head}.* entries holds layer "
                f"{missing} of the {layers} they declare; the metadata leaves a hole (a layer of another kind would "
                f"be held by another entry), refusing an output without layer {missing}"
            )


def plan_outputs(metadata: Metadata) -> List[OutputTensor]:
    """Every output tensor of a checkpoint with its source, in natural name order, dtypes as stored.

    Raises:
        UnknownLayoutError: an entry whose layout is not understood (see the module docstring); names the key.
        CorruptShardError: an entry whose chunks stick out of it or overlap, naming the key and the chunk; or a layer
            index no entry of its stack covers (a hole), naming the layer and an entry.
    """
    outputs = []
    stacks: Dict[str, List[Tuple[str, int, set]]] = {}
    for key in model_tensor_keys(metadata):
        item = cast(TensorStorageMetadata, metadata.state_dict_metadata[key])
        found = _outputs_of(key, item)
        outputs += found
        stacked = _STACKED_LAYERS.match(key[len(_MODEL_PREFIX) :])
        if stacked is not None:
            entry = (key, int(item.size[0]), {output.index[0] for output in found})
            stacks.setdefault(stacked.group("head"), []).append(entry)
    _check_no_missing_layer(stacks)
    outputs = _moe_pre_mlp_norms(outputs)
    for output in outputs:
        if ".experts.experts." in f".{output.spec.name}.":
            raise UnknownLayoutError(
                f"{output.key}: an expert entry this plan cannot name (output {output.spec.name})"
            )
    names = [output.spec.name for output in outputs]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise UnknownLayoutError(f"two checkpoint entries map to the output name {duplicate}")
    return sorted(outputs, key=lambda output: _natural(output.spec.name))


def stored_spec(metadata: Metadata, output: OutputTensor) -> TensorSpec:
    """The spec of an output tensor as stored in the checkpoint (before any dtype cast)."""
    item = cast(TensorStorageMetadata, metadata.state_dict_metadata[output.key])
    return TensorSpec(output.spec.name, item.properties.dtype, tuple(item.size)[len(output.index) :])


def cast_outputs(outputs: List[OutputTensor], dtype: Optional[torch.dtype]) -> List[OutputTensor]:
    """Outputs with floating-point tensors cast to ``dtype`` (integer and bool tensors keep theirs).

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype.
    """
    if dtype is None:
        return outputs
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype (bf16, fp16, fp32), got {dtype}")
    return [
        (
            OutputTensor(TensorSpec(o.spec.name, dtype, o.spec.shape), o.key, o.index)
            if o.spec.dtype.is_floating_point
            else o
        )
        for o in outputs
    ]


def _narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` to ``target`` can overflow: both floating point, ``target``'s range smaller."""
    return source.is_floating_point and target.is_floating_point and torch.finfo(target).max < torch.finfo(source).max


def cast_overflow(source: torch.Tensor, cast: torch.Tensor) -> Optional[str]:
    """Whether a cast of ``source`` (``cast``, same shape) turned a finite value into ``inf``, and what overflowed.

    Checked only when ``cast``'s dtype has a smaller range than ``source``'s; then one pass over ``cast`` (its minimum
    and maximum) clears the usual tensor, and only one holding a non-finite value is looked at element by element. A
    value too small for ``cast``'s dtype that became 0 is precision loss, not overflow.

    Returns:
        ``None``, or for messages: how many finite values became non-finite, the largest finite magnitude of
        ``source`` and the dtypes.
    """
    if not _narrows(source.dtype, cast.dtype) or cast.numel() == 0:
        return None
    low, high = torch.aminmax(cast)
    if math.isfinite(float(low)) and math.isfinite(float(high)):
        return None
    finite = torch.isfinite(source)
    lost = finite & ~torch.isfinite(cast)
    count = int(lost.sum())
    if count == 0:  # the non-finite values were non-finite in the source already
        return None
    largest = float(source[finite].abs().max())
    return (
        f"{count} finite value(s) of {source.dtype} become inf or -inf in {cast.dtype} (largest magnitude "
        f"{largest:.6g}; {cast.dtype} holds at most {torch.finfo(cast.dtype).max:.6g})"
    )


def checked_cast(name: str, source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ``source`` into ``out`` (of the output dtype), refusing a cast that overflows (:func:`cast_overflow`).

    Args:
        name: the output tensor's name (for the message).
        source: the tensor as stored.
        out: a tensor of its shape in the output dtype.

    Returns:
        ``out``.

    Raises:
        DtypeOverflowError: naming the tensor and its largest magnitude.
    """
    out.copy_(source)
    overflow = cast_overflow(source, out)
    if overflow is not None:
        raise DtypeOverflowError(
            f"{name}: {overflow}; refusing to write inf for finite weights. Consolidate with --dtype bf16 "
            "(ckpt_consolidation_dtype='bf16') or without a dtype (the stored one)"
        )
    return out
