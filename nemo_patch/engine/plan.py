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

"""Which tensors a consolidation writes, under which names, read from which checkpoint entries, in which files.

The output is the TP=1, PP=1 megatron-core model's ``state_dict()`` but ``_extra_state``, under the checkpoint's names
whatever parallelism saved it: ``module.*`` tensor entries less ``module.`` (Megatron-LM's: all but ``optimizer.*``),
layer-stacked entries split per layer (``decoder.layers.mlp.linear_fc1.weight`` ``[L, ...]`` becomes
``decoder.layers.<i>.mlp.linear_fc1.weight``). A tensor the chunks cover in part is refused, naming the key; so are
mixture-of-experts entries unless a module naming their experts is registered (:data:`moe_names`).
"""

import itertools
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_patch.engine.errors import UnknownLayoutError

#: The module naming mixture-of-experts outputs, which registers itself here; without one they are refused.
moe_names: Any = None

_MODEL_PREFIX = "module."
_OPTIMIZER = re.compile(r"^(?:chained_\d+\.)?optimizer\.")  # Megatron-LM's; ``chained_<i>.`` for several optimizers
_STACKED = re.compile(r"^(?P<head>(?:.*\.)?layers)\.(?P<tail>[^0-9].*)$")
#: The most (output tensor, chunk) pairs of one checkpoint entry (layers x experts x chunks); more is a crafted size.
MAX_OUTPUTS_PER_ENTRY = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one output tensor."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Data size in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OutputTensor:
    """An output tensor ``spec``: ``key[index]`` of the checkpoint (``index`` into its layer, then expert, axes)."""

    spec: TensorSpec
    key: str
    index: Tuple[int, ...] = ()


def consolidated_key(checkpoint_key: str, layer: Optional[int] = None) -> str:
    """The output name of a checkpoint key: ``module.`` dropped, ``layer`` inserted after ``layers`` if given.

    Raises:
        ValueError: ``layer`` is given for a key that is not layer-stacked.
    """
    key = checkpoint_key.removeprefix(_MODEL_PREFIX)
    match = _STACKED.match(key) if layer is not None else None
    if layer is not None and match is None:
        raise ValueError(f"{checkpoint_key!r} is not a layer-stacked key")
    return key if match is None else f"{match.group('head')}.{layer}.{match.group('tail')}"


def model_tensor_keys(metadata: Metadata) -> List[str]:
    """The model weights of a DCP checkpoint, in metadata order, never ``_extra_state``: NeMo's ``module.*`` tensor
    entries or, where there are none (Megatron-LM, Megatron-Bridge), every tensor entry but the optimizer's."""
    entries = metadata.state_dict_metadata.items()
    tensors = [k for k, v in entries if "_extra_state" not in k and isinstance(v, TensorStorageMetadata)]
    return [k for k in tensors if k.startswith(_MODEL_PREFIX)] or [k for k in tensors if not _OPTIMIZER.match(k)]


def _leading_indices(key: str, item: TensorStorageMetadata, axes: int) -> Dict[Tuple[int, ...], int]:
    """The indices into the first ``axes`` dimensions stored chunks cover (never the size alone) -> elements held."""
    found, pairs = cast(Dict[Tuple[int, ...], int], {}), 0
    for chunk in item.chunks:
        ranges = [range(offset, offset + size) for offset, size in zip(chunk.offsets[:axes], chunk.sizes[:axes])]
        if (pairs := pairs + math.prod(map(len, ranges))) > MAX_OUTPUTS_PER_ENTRY:
            raise UnknownLayoutError(f"{key}: shape {list(item.size)} splits into too many output tensors")
        for index in itertools.product(*ranges):
            found[index] = found.get(index, 0) + math.prod(chunk.sizes[axes:])
    return dict(sorted(found.items()))


def _outputs_of(key: str, item: TensorStorageMetadata) -> List[OutputTensor]:
    name, size = consolidated_key(key), tuple(item.size)
    stacked = _STACKED.match(name) is not None
    experts = moe_names is not None and moe_names.has_experts(consolidated_key(key, 0) if stacked else name)
    if ".experts.experts." in f".{name}." and not experts:
        raise UnknownLayoutError(f"{key}: a mixture-of-experts entry this plan cannot name")
    axes = int(stacked) + int(experts)
    if len(size) <= axes:
        raise UnknownLayoutError(f"{key}: shape {list(size)} lacks the layer or expert axis its name says it has")
    indices = _leading_indices(key, item, axes)
    if experts:
        moe_names.check_experts(key, size, list(indices), stacked)
    elif not stacked and not indices:
        raise UnknownLayoutError(f"{key}: no stored chunk holds it; refusing a missing tensor")
    outputs = []
    for index, covered in indices.items():
        if covered != math.prod(size[axes:]):
            raise UnknownLayoutError(
                f"{key}{list(index)}: the stored chunks cover {covered} of its {math.prod(size[axes:])} elements; "
                "refusing to write a partly filled tensor"
            )
        out = consolidated_key(key, index[0] if stacked else None)
        out = moe_names.expert_key(out, index[-1]) if experts else out
        outputs.append(OutputTensor(TensorSpec(out, item.properties.dtype, size[axes:]), key, index))
    return outputs


def _natural(name: str) -> List[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_outputs(metadata: Metadata) -> List[OutputTensor]:
    """Every output tensor of a checkpoint with its source, dtypes as stored, in natural name order.

    Raises:
        UnknownLayoutError: an entry whose layout is not understood, or two entries mapping to one name.
    """
    outputs: List[OutputTensor] = []
    for key in model_tensor_keys(metadata):
        outputs += _outputs_of(key, cast(TensorStorageMetadata, metadata.state_dict_metadata[key]))
    renames = {} if moe_names is None else moe_names.renamed([output.spec.name for output in outputs])
    outputs = [
        replace(o, spec=replace(o.spec, name=renames[o.spec.name])) if o.spec.name in renames else o for o in outputs
    ]
    names = [output.spec.name for output in outputs]
    if len(set(names)) != len(names):
        raise UnknownLayoutError(f"two checkpoint entries map to the output name {max(names, key=names.count)}")
    return sorted(outputs, key=lambda output: _natural(output.spec.name))


def plan_shards(
    specs: Sequence[TensorSpec], max_shard_size: Union[int, str], stem: str = "model"
) -> Dict[str, List[TensorSpec]]:
    """The output files of ``specs`` (file name -> its tensors), as ``huggingface_hub`` shards them: one
    ``model.safetensors`` when all fits in ``max_shard_size`` bytes (or a size string such as ``"5GB"``), else
    ``model-0000i-of-0000N.safetensors`` files, a tensor larger than that in a file of its own."""
    by_name = {spec.name: spec for spec in specs}
    naming: Dict[str, Any] = dict(filename_pattern=stem + "{suffix}.safetensors", max_shard_size=max_shard_size)
    split = split_state_dict_into_shards_factory(by_name, get_storage_size=lambda spec: spec.nbytes, **naming)
    return {name: [by_name[tensor] for tensor in tensors] for name, tensors in split.filename_to_tensors.items()}
