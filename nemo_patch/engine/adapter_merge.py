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

"""Merge a LoRA adapter checkpoint into its base model's weights, one output tensor at a time.

NeMo's LoRA saves, per wrapped linear layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``),
``<layer>.adapter.linear_in.weight`` (``A``, ``[dim, in]``) and ``<layer>.adapter.linear_out.weight`` (``B``,
``[out, dim]``); ``weights/adapter_metadata.json`` names the base checkpoint. As NeMo's ``LoRAMerge``, on the TP=1
tensors::

    merged = base + alpha / dim * B @ A        # (alpha / dim * B) @ A, in the stored dtype

so the output is the model ``llm.peft.merge_lora`` would give, with the base model's names; every other tensor is the
base checkpoint's, unchanged. Imports torch and the rest of the engine only.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata

from nemo_patch.engine.adapter_settings import adapter_base, peft_settings
from nemo_patch.engine.checkpoint_layout import CheckpointLocation, inspect_checkpoint
from nemo_patch.engine.checkpoint_reader import RegionReader, open_weights
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.plan import OutputTensor, TensorSpec, plan_outputs

__all__ = [
    "AdapterMergeError",
    "LoRAMergeSource",
    "LoRAPair",
    "lora_pairs",
    "lora_scale",
    "merged_producer",
    "open_lora_merge",
]


class AdapterMergeError(ConsolidationError):
    """Adapters cannot be merged into their base model: the base checkpoint NeMo recorded is missing or unreadable, the
    PEFT method is not LoRA, its ``alpha``/``dim`` are unknown, or an adapter tensor does not pair with a base weight;
    the message names the path, method or tensor. Nothing is written."""

    exit_code, summary = 13, "adapters that cannot be merged (e.g. base checkpoint missing)"


_LORA_HALF = re.compile(r"^(?P<layer>.+)\.adapter\.linear_(?P<half>in|out)\.weight$")


@dataclass(frozen=True)
class LoRAPair:
    """The two adapter tensors of one LoRA-wrapped linear layer (consolidated names and sources)."""

    linear_in: OutputTensor
    linear_out: OutputTensor


def lora_pairs(adapter_outputs: List[OutputTensor], base_names: AbstractSet[str]) -> Dict[str, LoRAPair]:
    """Base weight name (``<layer>.weight``) -> its adapter pair.

    Args:
        adapter_outputs: the planned outputs of the adapter checkpoint (:func:`.plan.plan_outputs`).
        base_names: the names of the base checkpoint's outputs.

    Raises:
        AdapterMergeError: an adapter tensor that is neither half of a LoRA pair, a pair with one half missing, or a
            pair whose layer has no ``<layer>.weight`` in the base model (the message names the tensor).
    """
    halves: Dict[str, Dict[str, OutputTensor]] = {}
    for output in adapter_outputs:
        match = _LORA_HALF.match(output.spec.name)
        if match is None:
            raise AdapterMergeError(
                f"Cannot merge adapter tensor {output.spec.name}: only LoRA's <layer>.adapter.linear_in.weight and "
                "<layer>.adapter.linear_out.weight pairs can be merged"
            )
        halves.setdefault(match["layer"], {})[match["half"]] = output
    pairs = {}
    for layer, half in sorted(halves.items()):
        if set(half) != {"in", "out"}:
            raise AdapterMergeError(f"Cannot merge the adapter of {layer}: it has only linear_{next(iter(half))}")
        if f"{layer}.weight" not in base_names:
            raise AdapterMergeError(f"Cannot merge the adapter of {layer}: the base model has no {layer}.weight")
        pairs[f"{layer}.weight"] = LoRAPair(half["in"], half["out"])
    return pairs


def lora_scale(peft: Optional[Mapping[str, Any]]) -> Tuple[float, Dict[str, Any]]:
    """``alpha / dim`` of a LoRA adapter and the settings it came from.

    Args:
        peft: the adapter checkpoint's PEFT settings (:func:`.adapter_settings.peft_settings`).

    Raises:
        AdapterMergeError: the settings are unknown, the method is not NeMo's ``LoRA``, or ``alpha``/``dim`` are not
            positive numbers.
    """
    if not peft:
        raise AdapterMergeError(
            "Cannot merge: the adapter checkpoint's context records no PEFT settings (context/model.yaml's "
            "model_transform), so LoRA's alpha and dim are unknown"
        )
    method = str(peft.get("method", ""))
    if method.rsplit(".", 1)[-1] != "LoRA":
        raise AdapterMergeError(f"Cannot merge a {method or 'unknown'} adapter: only NeMo's LoRA can be merged")
    alpha, dim = peft.get("alpha"), peft.get("dim")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (alpha, dim)):
        raise AdapterMergeError(f"Cannot merge: LoRA alpha={alpha!r} and dim={dim!r} must be positive numbers")
    return float(alpha) / float(dim), {"method": method, "alpha": alpha, "dim": dim}  # type: ignore[arg-type]


def merged_producer(
    read_base: Callable[[TensorSpec], torch.Tensor],
    read_adapter: Callable[[OutputTensor], torch.Tensor],
    pairs: Mapping[str, LoRAPair],
    scale: float,
) -> Callable[[TensorSpec], torch.Tensor]:
    """A function that reads a base output tensor and, for a LoRA-wrapped weight, adds ``scale * B @ A``.

    Args:
        read_base: reads a base output tensor in its stored dtype (by spec).
        read_adapter: reads an adapter output tensor.
        pairs: from :func:`lora_pairs`.
        scale: from :func:`lora_scale`.

    The function raises :class:`AdapterMergeError` when ``B @ A`` does not have the base weight's shape.
    """

    def produce(spec: TensorSpec) -> torch.Tensor:
        base = read_base(spec)
        pair = pairs.get(spec.name)
        if pair is None:
            return base
        lora_in, lora_out = read_adapter(pair.linear_in), read_adapter(pair.linear_out)
        lora = scale * lora_out @ lora_in  # NeMo's LoRAMerge: alpha / dim * linear_out.weight @ linear_in.weight
        if lora.shape != base.shape:
            raise AdapterMergeError(
                f"Cannot merge the adapter of {spec.name}: linear_out @ linear_in has shape {list(lora.shape)}, the "
                f"base weight {list(base.shape)}"
            )
        return base + lora.to(base.dtype)

    return produce


@dataclass(frozen=True)
class LoRAMergeSource:
    """Everything a merged consolidation reads: the base checkpoint and the adapter pairs.

    Attributes:
        base_metadata: its distributed checkpoint's metadata.
        base_reader: a reader of its ``weights/``.
        base_outputs: its planned outputs (the merged output's tensors, names and shapes).
        pairs: base weight name -> adapter pair (:func:`lora_pairs`).
        scale: ``alpha / dim``.
        settings: ``{"method", "alpha", "dim"}`` for ``metadata.json``.
    """

    base_metadata: Metadata
    base_reader: RegionReader
    base_outputs: List[OutputTensor]
    pairs: Dict[str, LoRAPair]
    scale: float
    settings: Dict[str, Any]


def open_lora_merge(
    location: CheckpointLocation, adapter_metadata: Metadata, base_checkpoint: Optional[Union[str, Path]] = None
) -> LoRAMergeSource:
    """Open the base checkpoint of an adapter checkpoint and pair its adapters with the base weights.

    Args:
        location: the adapter checkpoint.
        adapter_metadata: its distributed checkpoint's metadata.
        base_checkpoint: the base model's checkpoint; default: the path NeMo recorded (``model_ckpt_path`` in
            ``weights/adapter_metadata.json``), which is resolved as NeMo resolves it: a relative path against the
            current directory.

    Raises:
        AdapterMergeError: the base checkpoint NeMo recorded is missing, not a finished checkpoint or unreadable (the
            message names the path), or the adapters cannot be merged (see :func:`lora_pairs`, :func:`lora_scale`).
    """
    scale, settings = lora_scale(peft_settings(location.checkpoint_dir))
    base = str(base_checkpoint) if base_checkpoint is not None else adapter_base(location.weights_dir)
    if not base:
        raise AdapterMergeError(
            f"Cannot merge the adapters of {location.checkpoint_dir}: its weights/adapter_metadata.json names no base "
            "checkpoint (model_ckpt_path)"
        )
    try:
        base_location = inspect_checkpoint(base)
        if base_location.adapter:
            raise AdapterMergeError(f"{base} is itself an adapter checkpoint")
        base_metadata, base_reader = open_weights(base_location.weights_dir, base_location.backend)
        base_outputs = plan_outputs(base_metadata)
    except ConsolidationError as error:
        given = "given" if base_checkpoint is not None else "NeMo's model_ckpt_path, a relative path is resolved here"
        raise AdapterMergeError(
            f"Cannot merge the adapters of {location.checkpoint_dir}: its base checkpoint {base} ({given}) cannot be "
            f"read: {error}; give the base with --base-checkpoint (base_checkpoint=)"
        ) from error
    pairs = lora_pairs(plan_outputs(adapter_metadata), {output.spec.name for output in base_outputs})
    return LoRAMergeSource(base_metadata, base_reader, base_outputs, pairs, scale, settings)
