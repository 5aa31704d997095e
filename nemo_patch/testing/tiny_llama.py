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

Used by the Hugging Face round-trip tests: :func:`make_tiny_hf_llama` writes a ``LlamaForCausalLM`` directory (or a
Mixtral, Qwen2, Qwen3, Mistral or Phi-3 one; random weights, a word-level tokenizer built with the ``tokenizers``
library; no hub access), and :func:`import_into_nemo` runs NeMo's own importer on it (``HFLlamaImporter``, ...). The
importer's config is NeMo's (``LlamaConfig``, ...) with only what a CPU without Transformer Engine needs changed
(:func:`cpu_llama_config_class`: local layer spec, CPU initialisation, no fusions).

Layer norms: NeMo's importers map the Hugging Face layer norms to the Transformer Engine spec's fused names
(``decoder.layers.<i>.self_attention.linear_qkv.layer_norm_weight``, ``...mlp.linear_fc1.layer_norm_weight``), which a
model built with the local spec does not have (it has ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``), so
on the CPU they would import nothing and keep their initial ones (:func:`local_norm_names` renames the targets during
the import; the local spec saves them under the TE names in the checkpoint). With ``perturb`` the source model's norms
and biases are not their initial values, so a norm or bias lost or misplaced anywhere in a round trip shows.

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from nemo_patch.testing.tiny_gpt import CPU_CONFIG_DEFAULTS, SEQ_LENGTH, VOCAB_SIZE

__all__ = [
    "FAMILIES",
    "cpu_llama_config_class",
    "cpu_mistral_config_class",
    "cpu_mixtral_config_class",
    "cpu_phi3_config_class",
    "cpu_qwen2_config_class",
    "cpu_qwen3_config_class",
    "import_into_nemo",
    "local_norm_names",
    "make_tiny_hf_llama",
]

#: The model families this module builds and imports.
FAMILIES = ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3")

#: TE spec's fused layer-norm names (NeMo's importers' targets) -> the local spec's module names.
_LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
}


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


def cpu_qwen2_config_class() -> type:
    """NeMo's ``Qwen2Config`` (QKV bias) with CPU defaults."""
    from nemo.collections.llm.gpt.model.qwen2 import Qwen2Config

    return _cpu_config_class("CpuQwen2Config", Qwen2Config)


def cpu_qwen3_config_class() -> type:
    """NeMo's ``Qwen3Config`` (QK layer norm, ``kv_channels=128``) with CPU defaults."""
    from nemo.collections.llm.gpt.model.qwen3 import Qwen3Config

    return _cpu_config_class("CpuQwen3Config", Qwen3Config)


def cpu_mistral_config_class() -> type:
    """NeMo's ``MistralConfig7B`` (what its importer builds) with CPU defaults. (For a model without sliding window,
    NeMo's importer sets ``seq_length`` to ``None``, its ``sliding_window``; its exporter then writes
    ``max_position_embeddings: null``, which ``transformers`` loads and runs.)"""
    from nemo.collections.llm.gpt.model.mistral import MistralConfig7B

    return _cpu_config_class("CpuMistralConfig", MistralConfig7B)


def cpu_phi3_config_class() -> type:
    """NeMo's ``Phi3Config`` (fused QKV and gate/up projections in Hugging Face; no GQA: NeMo's importer does not
    read ``num_key_value_heads``) with CPU defaults."""
    from nemo.collections.llm.gpt.model.phi3mini import Phi3Config

    return _cpu_config_class("CpuPhi3Config", Phi3Config)


_CONFIG_CLASSES = {
    "CpuLlamaConfig": cpu_llama_config_class,
    "CpuMistralConfig": cpu_mistral_config_class,
    "CpuMixtralConfig": cpu_mixtral_config_class,
    "CpuPhi3Config": cpu_phi3_config_class,
    "CpuQwen2Config": cpu_qwen2_config_class,
    "CpuQwen3Config": cpu_qwen3_config_class,
}


def __getattr__(name: str) -> Any:
    # NeMo's context loader resolves the config classes by these names
    if name in _CONFIG_CLASSES:
        return _CONFIG_CLASSES[name]()
    raise AttributeError(name)


def local_norm_names(mapping: Dict[str, str], target_keys: Any) -> Dict[str, str]:
    """``mapping`` (an importer's source pattern -> target pattern) with the TE spec's fused layer-norm targets renamed
    to the local spec's (``...self_attention.linear_qkv.layer_norm_weight`` -> ``...input_layernorm.weight``,
    ``...mlp.linear_fc1.layer_norm_weight`` -> ``...pre_mlp_layernorm.weight``) when ``target_keys`` (the NeMo
    model's state-dict names) has local-spec norms; otherwise ``mapping`` unchanged."""
    if not any(key.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight")) for key in target_keys):
        return mapping
    renamed = {}
    for source, target in mapping.items():
        for fused, local in _LOCAL_NORMS.items():
            target = target.replace(fused, local)
        renamed[source] = target
    return renamed


def _perturb(model: Any, seed: int) -> None:
    """Norm weights ``1 + N(0, 0.1)`` and biases ``N(0, 0.1)`` instead of ``transformers``' ones and zeros."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.1 * torch.randn(param.shape, generator=generator).to(param.dtype)
            if name.endswith("norm.weight"):
                param.copy_(1 + noise)
            elif name.endswith(".bias"):
                param.copy_(noise)


def make_tiny_hf_llama(
    out_dir: Path,
    tie_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = VOCAB_SIZE,
    padded_vocab_size: Optional[int] = None,
    family: str = "llama",
    perturb: bool = False,
    layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
) -> Path:
    """Write a random 2-layer, hidden-64 ``LlamaForCausalLM`` (GQA: 4 heads, 2 KV heads) and its tokenizer; with
    ``family="mixtral"`` a ``MixtralForCausalLM`` of the same shape with 4 experts, top-2 routing; ``"qwen2"`` a
    ``Qwen2ForCausalLM`` (QKV bias); ``"qwen3"`` a ``Qwen3ForCausalLM`` (QK norms; ``head_dim=128``, as NeMo's
    importer does not read ``head_dim`` and its ``kv_channels`` is 128); ``"mistral"`` a ``MistralForCausalLM``
    without sliding window; ``"phi3"`` a ``Phi3ForCausalLM`` (fused ``qkv_proj`` and ``gate_up_proj``; 4 KV heads,
    as NeMo's importer reads no ``num_key_value_heads``; no sliding window, no pad token). With ``perturb`` the norms
    and biases are random too (:func:`_perturb`). ``layers``, ``hidden_size`` and ``intermediate_size`` make a larger
    model of the same kind (``scripts/bench_hf_export.py``, the export's memory-bound test).

    ``dtype`` (a ``torch`` dtype name) is the weights' dtype and the config's, which NeMo's importer makes the
    model's training dtype (``bf16``/``fp16`` flags and ``params_dtype``). The tokenizer has ``vocab_size`` entries;
    the model's embedding has ``padded_vocab_size`` rows (default: the same), as a NeMo model whose
    ``make_vocab_size_divisible_by`` padded its vocabulary (NeMo's importer then keeps the padded rows and its
    exporter prunes them back to the tokenizer's size).

    The vocabulary has :data:`nemo_patch.testing.tiny_gpt.VOCAB_SIZE` (128) entries, ``<unk>``, ``<s>``, ``</s>``
    then ``t0`` ... ``t124``, so the tiny GPT's random token data module serves it.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen3Config,
    )

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(vocab_size - 3)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    extras: Dict[str, Dict[str, Any]] = {
        "llama": {},
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen2": dict(use_sliding_window=False),
        "qwen3": dict(head_dim=128, use_sliding_window=False),
        "mistral": dict(sliding_window=None),
        "phi3": dict(num_key_value_heads=4, sliding_window=None, pad_token_id=None),
    }
    config_classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "mixtral": MixtralConfig,
        "phi3": Phi3Config,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }
    settings: Dict[str, Any] = dict(
        vocab_size=padded_vocab_size or vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ_LENGTH,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
    )
    config = config_classes[family](**{**settings, **extras[family]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    if perturb:
        _perturb(model, seed)
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def import_into_nemo(hf_dir: Path, output_path: Path, family: str = "llama") -> Path:
    """Import ``hf_dir`` into a NeMo 2 checkpoint at ``output_path`` with NeMo's importer for ``family``
    (``HFLlamaImporter``, ``HFMistralImporter``, ``HFMixtralImporter``, ``HFPhi3Importer``, ``HFQwen2Importer``,
    ``HFQwen3Importer``) on the CPU, its layer norms included (:func:`local_norm_names`).

    Must run inside :func:`nemo_patch.testing.cpu_harness.megatron_on_cpu`.
    """
    from unittest import mock

    from nemo.collections.llm.gpt.model import llama, mistral, mixtral, phi3mini, qwen2, qwen3
    from nemo.lightning import io

    # NeMo's importer builds its config class from the HF config; build the CPU variant instead.
    module, name, config_class, importer_class = {
        "llama": (llama, "LlamaConfig", cpu_llama_config_class, llama.HFLlamaImporter),
        "mistral": (mistral, "MistralConfig7B", cpu_mistral_config_class, mistral.HFMistralImporter),
        "mixtral": (mixtral, "MixtralConfig8x7B", cpu_mixtral_config_class, mixtral.HFMixtralImporter),
        "phi3": (phi3mini, "Phi3Config", cpu_phi3_config_class, phi3mini.HFPhi3Importer),
        "qwen2": (qwen2, "Qwen2Config", cpu_qwen2_config_class, qwen2.HFQwen2Importer),
        "qwen3": (qwen3, "Qwen3Config", cpu_qwen3_config_class, qwen3.HFQwen3Importer),
    }[family]
    apply_transforms = io.apply_transforms

    def with_local_norms(source: Any, target: Any, mapping: Dict[str, str], *args: Any, **kwargs: Any) -> Any:
        mapping = local_norm_names(mapping, target.state_dict().keys())
        return apply_transforms(source, target, mapping, *args, **kwargs)

    with mock.patch.object(module, name, config_class()), mock.patch.object(io, "apply_transforms", with_local_norms):
        importer = importer_class(str(hf_dir))
        return Path(importer(overwrite=True, output_path=Path(output_path)))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m nemo_patch.testing.tiny_llama --out DIR``: write ``DIR/hf`` and its NeMo import ``DIR/nemo``; with
    ``--families qwen2,qwen3-tied,...``, ``DIR/<name>/hf`` and ``DIR/<name>/nemo`` for each (``<family>`` or
    ``<family>-tied``), imported in this one process (NeMo's import start-up is paid once)."""
    import argparse

    from nemo_patch.testing.cpu_harness import megatron_on_cpu

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--padded-vocab-size", type=int, default=None)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--families", default=None, help="comma-separated <family>[-tied] names, one model each")
    parser.add_argument("--perturb", action="store_true", help="random norms and biases (not ones and zeros)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=128)
    args = parser.parse_args(argv)
    # Through the package module, not __main__: NeMo's context must name the config class by its importable path.
    from nemo_patch.testing import tiny_llama

    models = [(args.out, args.family, args.tie_embeddings)]
    if args.families:
        names = args.families.split(",")
        models = [(args.out / name, name.removesuffix("-tied"), name.endswith("-tied")) for name in names]
        unknown = [family for _, family, _ in models if family not in FAMILIES]
        if unknown:
            parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    for out, family, tied in models:
        tiny_llama.make_tiny_hf_llama(
            out / "hf",
            tie_embeddings=tied,
            dtype=args.dtype,
            vocab_size=args.vocab_size,
            padded_vocab_size=args.padded_vocab_size,
            family=family,
            perturb=args.perturb,
            layers=args.layers,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
        )
    with megatron_on_cpu():
        for out, family, _ in models:
            tiny_llama.import_into_nemo(out / "hf", out / "nemo", family=family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
