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

"""A tiny random Llama and its NeMo 2 checkpoint, made on the CPU with NeMo's own importer (a test aid).

Usage: ``python tiny_llama.py <dir>``: ``<dir>/hf`` is a 2-layer, hidden-64 ``LlamaForCausalLM`` (GQA) with random
weights, random norms included, and a word-level tokenizer; ``<dir>/nemo`` is its import by ``HFLlamaImporter``.
The model config is NeMo's ``LlamaConfig`` with what a CPU without Transformer Engine needs (:class:`CpuLlamaConfig`:
local layer spec, CPU initialisation, no fusions), and the importer's fused layer-norm targets are renamed to the
local spec's. The checkpoint's context names this module's ``CpuLlamaConfig``: whoever loads it imports this file.
"""

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable, Dict

import torch
from nemo.collections.llm import LlamaConfig
from nemo.collections.llm.gpt.model.base import local_layer_spec


@dataclasses.dataclass
class CpuLlamaConfig(LlamaConfig):
    """NeMo's ``LlamaConfig`` that builds and runs on the CPU without Transformer Engine."""

    transformer_layer_spec: Any = local_layer_spec
    use_cpu_initialization: bool = True
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    apply_rope_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    cross_entropy_loss_fusion: bool = False


_LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
}


def make_tiny_hf_llama(out_dir: Path) -> Path:
    """A random ``LlamaForCausalLM`` (norms random too, so a norm lost on the way shows) and its tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(125)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = HFLlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape))
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def import_into_nemo(hf_dir: Path, output_path: Path) -> Path:
    """``hf_dir`` imported by NeMo's ``HFLlamaImporter`` as a :class:`CpuLlamaConfig` model, norms included."""
    from unittest import mock

    from nemo.collections.llm.gpt.model import llama
    from nemo.lightning import io

    apply_transforms: Callable[..., Any] = io.apply_transforms

    def with_local_norms(source: Any, target: Any, mapping: Dict[str, str], *args: Any, **kwargs: Any) -> Any:
        if any(key.endswith("input_layernorm.weight") for key in target.state_dict()):
            renamed = {}
            for key, value in mapping.items():
                for fused, local in _LOCAL_NORMS.items():
                    value = value.replace(fused, local)
                renamed[key] = value
            mapping = renamed
        return apply_transforms(source, target, mapping, *args, **kwargs)

    with (
        mock.patch.object(llama, "LlamaConfig", CpuLlamaConfig),
        mock.patch.object(io, "apply_transforms", with_local_norms),
    ):
        return Path(llama.HFLlamaImporter(str(hf_dir))(overwrite=True, output_path=Path(output_path)))


def main(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_llama  # the context must name the config class by an importable module, not __main__
    from cpu_harness import megatron_on_cpu

    tiny_llama.make_tiny_hf_llama(out / "hf")
    with megatron_on_cpu():
        tiny_llama.import_into_nemo(out / "hf", out / "nemo")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
