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

"""Layer-norm names: the Transformer Engine spec's fused names, which NeMo's Hugging Face exporters and importers use.

A model of megatron-core's local (non-TE) spec saves its layer norms under the TE names too;
:func:`te_layer_norm_names` renames local names that reach it anyway. Imports torch and the engine's MoE names only.
"""

import re
from typing import Dict

import torch

from nemo_patch.engine.moe_names import LAYER_PREFIX

__all__ = ["te_layer_norm_names"]

_LOCAL_NORM = re.compile(rf"^(?P<layer>{LAYER_PREFIX})(?P<norm>input_layernorm|pre_mlp_layernorm)\.(?P<p>\w+)$")
_FUSED_INTO = {"input_layernorm": "self_attention.linear_qkv", "pre_mlp_layernorm": "mlp.linear_fc1"}


def te_layer_norm_names(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Rename local-spec layer norms to the Transformer Engine spec's fused names NeMo's exporters expect.

    ``decoder.layers.<i>.input_layernorm.<p>`` becomes ``decoder.layers.<i>.self_attention.linear_qkv.layer_norm_<p>``
    and ``decoder.layers.<i>.pre_mlp_layernorm.<p>`` becomes ``decoder.layers.<i>.mlp.linear_fc1.layer_norm_<p>``
    (``<p>`` is ``weight`` or ``bias``), but only where the layer has that fused linear layer (a dense MLP; an MoE
    layer keeps its ``pre_mlp_layernorm``, as the TE spec does). Names already in TE form are unchanged.

    Args:
        state_dict: consolidated name -> tensor.

    Returns:
        A new dict with the same tensors.
    """
    renamed = {}
    for name, tensor in state_dict.items():
        match = _LOCAL_NORM.match(name)
        if match:
            fused = f"{match.group('layer')}{_FUSED_INTO[match.group('norm')]}"
            if f"{fused}.weight" in state_dict:
                name = f"{fused}.layer_norm_{match.group('p')}"
        renamed[name] = tensor
    return renamed
