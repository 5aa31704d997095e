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

"""A tiny random Llama made locally with ``transformers`` and imported into NeMo on the CPU. Not product code.

Used by the Hugging Face round-trip test: :func:`make_tiny_hf_llama` writes a ``LlamaForCausalLM`` directory (random
weights, a word-level tokenizer built with the ``tokenizers`` library; no hub access), and :func:`import_into_nemo`
runs NeMo's own ``HFLlamaImporter`` on it. The importer's config is NeMo's ``LlamaConfig`` with only what a CPU without
Transformer Engine needs changed (:func:`cpu_llama_config_class`: local layer spec, CPU initialisation, no fusions).

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from nemo_patch.testing.tiny_gpt import CPU_CONFIG_DEFAULTS, SEQ_LENGTH, VOCAB_SIZE

__all__ = ["cpu_llama_config_class", "cpu_mixtral_config_class", "import_into_nemo", "make_tiny_hf_llama"]


def _cpu_config_class(name: str, base: type, **more_defaults: Any) -> type:
    """``base`` (a NeMo config dataclass) with the local layer spec and the CPU defaults
    (:data:`nemo_patch.testing.tiny_gpt.CPU_CONFIG_DEFAULTS`), registered in this module as ``name`` (the name NeMo's
    serialized context refers to)."""
    if name in globals():
        return globals()[name]
    from dataclasses import field, make_dataclass

    from nemo.collections.llm.gpt.model.base import local_layer_spec

    defaults = {**CPU_CONFIG_DEFAULTS, **more_defaults}
    fields = [("transformer_layer_spec", Any, field(default=local_layer_spec))]
    fields += [(key, type(value), field(default=value)) for key, value in defaults.items()]
    config_class = make_dataclass(name, fields, bases=(base,))
    config_class.__module__ = "nemo_patch.testing.tiny_llama"  # also when this file runs as __main__
    config_class.__qualname__ = name
    globals()[name] = config_class
    return config_class


def cpu_llama_config_class() -> type:
    """NeMo's ``LlamaConfig`` with CPU defaults: local layer spec, CPU initialisation, no fused kernels, no dropout.

    megatron-core validates fusion flags when a config is constructed, so the defaults must change, not the fields
    afterwards. Defined on first use (NeMo is imported then) and cached as this module's ``CpuLlamaConfig``, the
    name NeMo's serialized context refers to.
    """
    from nemo.collections.llm import LlamaConfig

    return _cpu_config_class("CpuLlamaConfig", LlamaConfig)


def cpu_mixtral_config_class() -> type:
    """NeMo's ``MixtralConfig8x7B`` (what its importer builds) with CPU defaults, ``SequentialMLP`` experts (no
    grouped GEMM) and the all-gather token dispatcher."""
    from nemo.collections.llm.gpt.model.mixtral import MixtralConfig8x7B

    return _cpu_config_class(
        "CpuMixtralConfig", MixtralConfig8x7B, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False
    )


def __getattr__(name: str) -> Any:
    # NeMo's context loader resolves the config classes by these names
    if name == "CpuLlamaConfig":
        return cpu_llama_config_class()
    if name == "CpuMixtralConfig":
        return cpu_mixtral_config_class()
    raise AttributeError(name)


def make_tiny_hf_llama(
    out_dir: Path,
    tie_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = VOCAB_SIZE,
    padded_vocab_size: Optional[int] = None,
    family: str = "llama",
) -> Path:
    """Write a random 2-layer, hidden-64 ``LlamaForCausalLM`` (GQA: 4 heads, 2 KV heads) and its tokenizer; with
    ``family="mixtral"`` a ``MixtralForCausalLM`` of the same shape with 4 experts, top-2 routing.

    ``dtype`` (a ``torch`` dtype name) is the weights' dtype and the config's, which NeMo's importer makes the
    model's training dtype (``bf16``/``fp16`` flags and ``params_dtype``). The tokenizer has ``vocab_size`` entries;
    the model's embedding has ``padded_vocab_size`` rows (default: the same), as a NeMo model whose
    ``make_vocab_size_divisible_by`` padded its vocabulary (NeMo's importer then keeps the padded rows and its
    exporter prunes them back to the tokenizer's size).

    The vocabulary has :data:`nemo_patch.testing.tiny_gpt.VOCAB_SIZE` (128) entries, ``<unk>``, ``<s>``, ``</s>``
    then ``t0`` ... ``t124``, so the tiny GPT's random token data module serves it.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(vocab_size - 3)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    extra: Dict[str, Any] = dict(num_local_experts=4, num_experts_per_tok=2) if family == "mixtral" else {}
    config = (MixtralConfig if family == "mixtral" else LlamaConfig)(
        vocab_size=padded_vocab_size or vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ_LENGTH,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def import_into_nemo(hf_dir: Path, output_path: Path, family: str = "llama") -> Path:
    """Import ``hf_dir`` into a NeMo 2 checkpoint at ``output_path`` with NeMo's ``HFLlamaImporter`` (or, for
    ``family="mixtral"``, ``HFMixtralImporter``) on the CPU.

    Must run inside :func:`nemo_patch.testing.cpu_harness.megatron_on_cpu`.
    """
    from unittest import mock

    from nemo.collections.llm.gpt.model import llama, mixtral

    # NeMo's importer builds its config class from the HF config; build the CPU variant instead.
    if family == "mixtral":
        patch = mock.patch.object(mixtral, "MixtralConfig8x7B", cpu_mixtral_config_class())
        importer_class: Any = mixtral.HFMixtralImporter
    else:
        patch = mock.patch.object(llama, "LlamaConfig", cpu_llama_config_class())
        importer_class = llama.HFLlamaImporter
    with patch:
        importer = importer_class(str(hf_dir))
        return Path(importer(overwrite=True, output_path=Path(output_path)))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m nemo_patch.testing.tiny_llama --out DIR``: write ``DIR/hf`` and its NeMo import ``DIR/nemo``."""
    import argparse

    from nemo_patch.testing.cpu_harness import megatron_on_cpu

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--padded-vocab-size", type=int, default=None)
    parser.add_argument("--family", choices=["llama", "mixtral"], default="llama")
    args = parser.parse_args(argv)
    # Through the package module, not __main__: NeMo's context must name the config class by its importable path.
    from nemo_patch.testing import tiny_llama

    tiny_llama.make_tiny_hf_llama(
        args.out / "hf",
        tie_embeddings=args.tie_embeddings,
        dtype=args.dtype,
        vocab_size=args.vocab_size,
        padded_vocab_size=args.padded_vocab_size,
        family=args.family,
    )
    with megatron_on_cpu():
        tiny_llama.import_into_nemo(args.out / "hf", args.out / "nemo", family=args.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
