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

The output holds the model weights of the checkpoint: its ``module.*`` tensor entries. Optimizer state
(``optimizer.*``), ``_extra_state`` entries (pickled bytes) and anything that is not a tensor are left out; dtypes are
kept unless a cast is asked for. Names are the checkpoint's canonical keys without the ``module.`` prefix, with
megatron-core's layer-stacked tensors split back per layer: ``module.decoder.layers.mlp.linear_fc1.weight`` of shape
``[L, ...]`` becomes ``decoder.layers.<i>.mlp.linear_fc1.weight`` of shape ``[...]`` for ``i`` in ``0..L-1``. Output
tensors are in natural name order (``layers.2`` before ``layers.10``).

Imports torch and the engine's safetensors writer only; never NeMo, Lightning or megatron-core, and nothing outside the
engine.
"""

import re
from dataclasses import dataclass
from typing import List, Optional, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_patch.engine.safetensors_writer import TensorSpec

__all__ = ["OutputTensor", "cast_outputs", "consolidated_key", "model_tensor_keys", "plan_outputs", "stored_spec"]

_MODEL_PREFIX = "module."
_STACKED_LAYERS = re.compile(r"^(?P<head>(?:.*\.)?layers)\.(?P<tail>[^0-9].*)$")


def consolidated_key(checkpoint_key: str, layer: Optional[int] = None) -> str:
    """Map a DCP model key to its consolidated name.

    Args:
        checkpoint_key: a key of the distributed checkpoint, e.g. ``module.decoder.layers.mlp.linear_fc1.weight``.
        layer: for a layer-stacked tensor, the layer index to insert after ``layers``.

    Returns:
        The key without ``module.``, e.g. ``decoder.layers.3.mlp.linear_fc1.weight`` for ``layer=3``.

    Raises:
        ValueError: ``layer`` is given for a key that is not layer-stacked.
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
class OutputTensor:
    """One output tensor and its source.

    Attributes:
        spec: name, dtype and shape in the output.
        key: the DCP key it is read from.
        layer: for a layer-stacked source ``[L, ...]``, the index along its first axis; ``None`` for the whole entry.
    """

    spec: TensorSpec
    key: str
    layer: Optional[int]


def plan_outputs(metadata: Metadata) -> List[OutputTensor]:
    """Every output tensor of a checkpoint with its source, in natural name order, dtypes as stored."""
    outputs = []
    for key in model_tensor_keys(metadata):
        item = cast(TensorStorageMetadata, metadata.state_dict_metadata[key])
        dtype, size = item.properties.dtype, tuple(item.size)
        if _is_stacked(key):
            outputs += [
                OutputTensor(TensorSpec(consolidated_key(key, i), dtype, size[1:]), key, i) for i in range(size[0])
            ]
        else:
            outputs.append(OutputTensor(TensorSpec(consolidated_key(key), dtype, size), key, None))
    return sorted(outputs, key=lambda output: _natural(output.spec.name))


def stored_spec(metadata: Metadata, output: OutputTensor) -> TensorSpec:
    """The spec of an output tensor as stored in the checkpoint (before any dtype cast)."""
    item = cast(TensorStorageMetadata, metadata.state_dict_metadata[output.key])
    size = tuple(item.size)
    return TensorSpec(output.spec.name, item.properties.dtype, size if output.layer is None else size[1:])


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
            OutputTensor(TensorSpec(o.spec.name, dtype, o.spec.shape), o.key, o.layer)
            if o.spec.dtype.is_floating_point
            else o
        )
        for o in outputs
    ]
