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

"""Names of mixture-of-experts tensors: expert-stacked checkpoint entries split into one output tensor per expert.

megatron-core's ``SequentialMLP``, ``GroupedMLP`` and ``TEGroupedMLP`` all save ``<...>.mlp.experts.experts.<linear>.
<param>`` with the expert axis first (after any layer axis). Each expert becomes ``<...>.mlp.experts.local_experts.
<e>.<linear>.<param>``, as ``SequentialMLP``'s ``state_dict`` names it, ``e`` the global expert index, so any
expert-parallel layout gives the same names and bytes. The pre-MLP norm of an MoE layer, which the local layer spec
saves as ``mlp.linear_fc1.layer_norm_*`` although the layer has no ``linear_fc1``, is named ``pre_mlp_layernorm.*`` as
the model names it (dense layers keep the fused names); also in a multi-token-prediction layer's
``mtp.layers.<i>.transformer_layer.``. :mod:`.checkpoint_reader` registers it in :mod:`.plan`.
"""

import re
from typing import Dict, List, Sequence, Set, Tuple

from nemo_patch.engine.errors import UnknownLayoutError

__all__ = ["LAYER_PREFIX", "check_experts", "expert_key", "has_experts", "renamed"]

_STACKED_EXPERTS = re.compile(r"^(?P<head>(?:.*\.)?experts)\.experts\.(?P<tail>[^0-9].*)$")
#: A transformer layer's prefix: ``decoder.layers.<i>.``, or ``mtp.layers.<i>.transformer_layer.``.
LAYER_PREFIX = r"(?:.*\.)?layers\.\d+\.(?:transformer_layer\.)?"
_FUSED_MLP_NORM = re.compile(rf"^(?P<layer>{LAYER_PREFIX})mlp\.linear_fc1\.layer_norm_(?P<param>\w+)$")


def has_experts(name: str) -> bool:
    """Whether an output name (layer index already inserted) is an expert-stacked entry's."""
    return _STACKED_EXPERTS.match(name) is not None


def expert_key(name: str, expert: int) -> str:
    """``<...>.experts.local_experts.<expert>.<tail>`` for an expert-stacked ``<...>.experts.experts.<tail>``.

    Raises:
        ValueError: ``name`` is not expert-stacked.
    """
    match = _STACKED_EXPERTS.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not an expert-stacked key")
    return f"{match.group('head')}.local_experts.{expert}.{match.group('tail')}"


def check_experts(key: str, size: Sequence[int], indices: List[Tuple[int, ...]], stacked: bool) -> None:
    """Refuse an entry in which a layer holds only some of its experts (``indices``: the stored leading indices).

    Raises:
        UnknownLayoutError: naming the entry, the layer and a missing expert.
    """
    experts = size[1] if stacked else size[0]
    by_layer: Dict[int, Set[int]] = {}
    for index in indices:
        by_layer.setdefault(index[0] if stacked else 0, set()).add(index[-1])
    if not by_layer:
        raise UnknownLayoutError(f"{key}: no stored chunk holds it; refusing a missing tensor")
    for layer, found in sorted(by_layer.items()):
        if len(found) != experts:
            absent = min(set(range(experts)) - found)
            where = [layer, absent] if stacked else [absent]
            raise UnknownLayoutError(
                f"{key}{where}: {len(found)} of its {experts} experts are stored; refusing an output without some of "
                "them"
            )


def renamed(names: Sequence[str]) -> Dict[str, str]:
    """The output names of MoE layers' fused pre-MLP norms (see the module docstring): old name -> new name.

    Raises:
        UnknownLayoutError: an ``experts.experts`` name is left after planning (an expert entry it cannot name).
    """
    present, renames = set(names), {}
    for name in names:
        if ".experts.experts." in f".{name}.":
            raise UnknownLayoutError(f"{name}: an expert entry this plan cannot name")
        match = _FUSED_MLP_NORM.match(name)
        if match and f"{match.group('layer')}mlp.linear_fc1.weight" not in present:
            renames[name] = f"{match.group('layer')}pre_mlp_layernorm.{match.group('param')}"
    return renames
