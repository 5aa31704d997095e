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

"""Load a consolidated output back into a megatron-core model with TP=1 and PP=1.

Consolidated names are the distributed checkpoint's canonical keys: megatron-core maps ``state_dict`` names with each
``TransformerLayer``'s ``submodules_config.sharded_state_dict_keys_map`` (the local spec's ``input_layernorm.`` is
``self_attention.linear_qkv.layer_norm_``), and experts are named as ``SequentialMLP`` names them.
:func:`canonical_key_map` applies the map read from the model itself and maps grouped-GEMM experts (``TEGroupedMLP``'s
``linear_fc1.weight<e>``) to those names, so a model of any spec loads one file. Imports torch, safetensors and the
engine only (a NeMo model is taken as any ``torch.nn.Module``).
"""

import re
from pathlib import Path
from typing import Dict, Union

import torch
from safetensors.torch import load_file

from nemo_patch.engine.output_files import output_weight_map, read_index_weight_map, read_output_tensors
from nemo_patch.engine.output_layout import INDEX_FILENAME

__all__ = ["canonical_key_map", "load_consolidated_into", "load_consolidated_state_dict"]

_GROUPED_EXPERT = re.compile(
    r"^(?P<head>.*\.experts)\.(?P<linear>linear_fc[12])\.(?P<param>weight|bias)(?P<expert>\d+)$"
)


def load_consolidated_state_dict(path: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """Read a consolidated checkpoint, single-file or sharded.

    Args:
        path: a consolidated output directory (``consolidated/``, holding ``model.safetensors`` or shards plus
            ``model.safetensors.index.json``), its ``model.safetensors.index.json`` (every shard it names is read), or
            one ``.safetensors`` file (read alone).

    Returns:
        Consolidated name -> CPU tensor, with the shapes and dtypes stored in the output (the training dtypes, or the
        ``dtype`` the output was written in, e.g. ``torch.bfloat16``).

    Raises:
        FileNotFoundError: ``path`` holds neither ``model.safetensors`` nor ``model.safetensors.index.json``, or a
            shard the index names is missing.
        nemo_patch.engine.output_files.InvalidOutputError: (a ``ValueError``) the directory holds both a single file
            and an index, or the index is malformed or contradicts its shards (a path for a file name, a tensor named
            twice, a shard holding a tensor the index does not map to it or lacking one it does), naming them.
    """
    path = Path(path)
    if path.is_dir():
        return read_output_tensors(path, output_weight_map(path))
    if path.is_file() and path.name.endswith(".index.json"):
        return read_output_tensors(path.parent, read_index_weight_map(path))
    if path.is_file():
        return load_file(str(path))
    raise FileNotFoundError(f"No consolidated model.safetensors or {INDEX_FILENAME} at {path}")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def canonical_key_map(model: torch.nn.Module) -> Dict[str, str]:
    """Map each ``state_dict`` key of a TP=1 megatron-core model to its consolidated (canonical) name.

    ``_extra_state`` entries are not weights and are left out. Grouped-GEMM experts (``linear_fc1.weight<e>``) map to
    the per-expert names of the output (``local_experts.<e>.linear_fc1.weight``).

    Args:
        model: a megatron-core model (e.g. ``GPTModel``) or a NeMo ``LightningModule`` wrapping one in ``.module``.

    Returns:
        ``state_dict`` key -> canonical key.
    """
    model = _unwrap(model)
    prefix_maps = {}
    for name, module in model.named_modules():
        keys_map = getattr(getattr(module, "submodules_config", None), "sharded_state_dict_keys_map", None)
        if keys_map:
            prefix_maps[f"{name}." if name else ""] = keys_map
    mapping = {}
    state_keys = set(model.state_dict())
    for key in state_keys:
        if key.endswith("_extra_state"):
            continue
        canonical = key
        for layer_prefix, keys_map in prefix_maps.items():
            if not key.startswith(layer_prefix):
                continue
            rest = key[len(layer_prefix) :]
            for old, new in keys_map.items():
                # Only into a fused module the layer has: an MoE layer keeps its pre_mlp_layernorm (as the plan does).
                fused = f"{layer_prefix}{new.rsplit('.', 1)[0]}.weight"
                if rest.startswith(old) and fused in state_keys:
                    canonical = layer_prefix + new + rest[len(old) :]
                    break
        match = _GROUPED_EXPERT.match(canonical)  # TEGroupedMLP's ``linear_fc1.weight3``: ``local_experts.3.``
        if match:
            canonical = f"{match['head']}.local_experts.{match['expert']}.{match['linear']}.{match['param']}"
        mapping[key] = canonical
    return dict(sorted(mapping.items()))


def load_consolidated_into(model: torch.nn.Module, path: Union[str, Path]) -> None:
    """Load a consolidated checkpoint into a TP=1, PP=1 model, strictly.

    Args:
        model: a megatron-core model of either layer spec (local or Transformer Engine), or a NeMo
            ``LightningModule`` wrapping one in ``.module``, with the architecture the checkpoint was trained with.
        path: a consolidated output directory (``model.safetensors`` or shards plus ``model.safetensors.index.json``),
            or one of the paths :func:`load_consolidated_state_dict` takes.

    Raises:
        FileNotFoundError, nemo_patch.engine.output_files.InvalidOutputError: as :func:`load_consolidated_state_dict`.
        KeyError: if a model weight has no tensor in the file or the file holds a tensor the model does not have;
            the message lists them. ``_extra_state`` entries are not weights and are not required.
        RuntimeError: if a shape does not match (from ``torch.nn.Module.load_state_dict``).
    """
    tensors = load_consolidated_state_dict(path)
    key_map = canonical_key_map(model)
    missing = sorted(key for key, canonical in key_map.items() if canonical not in tensors)
    unexpected = sorted(set(tensors) - set(key_map.values()))
    if missing or unexpected:
        raise KeyError(
            f"Consolidated checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    state = {key: tensors[canonical] for key, canonical in key_map.items()}
    _unwrap(model).load_state_dict(state, strict=False)
