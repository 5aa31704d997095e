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

"""A tiny NeMo GPT, its data and a trainer factory, sized for CPU tests and the demo. Not product code.

Everything here is real NeMo: ``llm.GPTModel`` with megatron-core's local (non-Transformer-Engine) layer spec,
NeMo's ``MegatronDataSampler``, ``nl.Trainer``, ``nl.MegatronStrategy``, NeMo's ``ModelCheckpoint`` and
``NeMoLogger``. Only the CUDA assumptions are patched away, by :func:`nemo_patch.testing.cpu_harness.megatron_on_cpu`,
which callers must enter around ``fit``.

Test and demo aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["TinyTokenDataModule", "cpu_adam", "tiny_gpt_config", "tiny_gpt_model", "make_trainer", "make_logger"]

SEQ_LENGTH = 16
VOCAB_SIZE = 128


def tiny_gpt_config(num_layers: int = 2, tie_embeddings: bool = True, layer_spec: str = "local") -> Any:
    """A 2-layer, hidden-64 ``llm.GPTConfig`` that runs on the CPU (fp32, local spec, no fusions).

    Args:
        num_layers: number of transformer layers.
        tie_embeddings: share the input embedding with the output layer.
        layer_spec: ``"local"`` (megatron-core's non-TE modules) is the only spec that runs without
            Transformer Engine.

    Returns:
        An ``nemo.collections.llm.GPTConfig``.
    """
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    if layer_spec != "local":
        raise ValueError(f"Unsupported layer_spec {layer_spec!r}: only 'local' runs without Transformer Engine.")
    return llm.GPTConfig(
        num_layers=num_layers,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=VOCAB_SIZE,
        share_embeddings_and_output_weights=tie_embeddings,
        transformer_layer_spec=local_layer_spec,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        init_method_std=0.02,
        **CPU_CONFIG_DEFAULTS,
    )


#: What the CPU needs changed in a NeMo model config's defaults: no fused kernels (they need CUDA), CPU
#: initialisation, no dropout (so that logits can be compared).
CPU_CONFIG_DEFAULTS: Dict[str, Any] = dict(
    use_cpu_initialization=True,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    cross_entropy_loss_fusion=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)

#: ``nl.MegatronMixedPrecision`` precisions the CPU harness trains with -> the parameters' dtype.
PRECISIONS = {"32": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def cpu_adam(lr: float = 1e-3, precision: str = "32") -> Any:
    """NeMo's ``MegatronOptimizerModule`` with megatron-core Adam set up to run on the CPU (``clip_grad=0``).

    ``precision`` is the trainer's (:data:`PRECISIONS`): with ``"bf16-mixed"``/``"16-mixed"`` the model's parameters
    are bf16/fp16 and megatron-core's mixed-precision optimizer keeps fp32 main parameters (fp16 with a loss scale).
    """
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl

    return nl.MegatronOptimizerModule(
        config=OptimizerConfig(
            optimizer="adam",
            lr=lr,
            clip_grad=0.0,
            use_distributed_optimizer=False,  # megatron-core's distributed optimizer needs CUDA tensors
            bf16=precision == "bf16-mixed",
            fp16=precision == "16-mixed",
            params_dtype=PRECISIONS[precision],
        )
    )


def tiny_gpt_model(config: Optional[Any] = None, lr: float = 1e-3, precision: str = "32") -> Any:
    """An ``llm.GPTModel`` of :func:`tiny_gpt_config` with a Megatron Adam optimizer (:func:`cpu_adam`)."""
    from nemo.collections import llm

    return llm.GPTModel(config or tiny_gpt_config(), optim=cpu_adam(lr, precision))


def causal_batch(tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The GPT batch dict for ``tokens`` of shape ``[batch, seq + 1]`` (int64), with a causal attention mask.

    Returns:
        ``tokens``/``labels``/``position_ids`` ``[batch, seq]`` int64, ``loss_mask`` ``[batch, seq]`` float32 and
        ``attention_mask`` ``[batch, 1, seq, seq]`` bool (``True`` = masked), as megatron-core's local attention
        expects.
    """
    batch, length = tokens.shape[0], tokens.shape[1] - 1
    mask = ~torch.tril(torch.ones(length, length, dtype=torch.bool))
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(batch, length, dtype=torch.float32),
        "position_ids": torch.arange(length).unsqueeze(0).expand(batch, -1).contiguous(),
        "attention_mask": mask.unsqueeze(0).unsqueeze(0).expand(batch, 1, -1, -1).contiguous(),
    }


class _RandomTokens(Dataset):
    def __init__(self, num_samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB_SIZE, (num_samples, SEQ_LENGTH + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {key: value[0] for key, value in causal_batch(self.tokens[index : index + 1]).items()}


class TinyTokenDataModule(pl.LightningDataModule):
    """Deterministic random token sequences for the tiny GPT, served through NeMo's ``MegatronDataSampler``."""

    def __init__(self, num_samples: int = 4096, micro_batch_size: int = 2, global_batch_size: int = 2) -> None:
        super().__init__()
        from nemo.lightning.pytorch.plugins import MegatronDataSampler

        self.num_samples = num_samples
        self.seq_length = SEQ_LENGTH
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.data_sampler = MegatronDataSampler(
            seq_len=SEQ_LENGTH, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RandomTokens(self.num_samples, seed=1234), batch_size=self.micro_batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_RandomTokens(64, seed=4321), batch_size=self.micro_batch_size)


def make_logger(log_dir: Path, save_every: int, name: str = "tiny_gpt", **checkpoint_kwargs: Any) -> Any:
    """A ``NeMoLogger`` whose NeMo ``ModelCheckpoint`` saves every ``save_every`` global steps, keeping all.

    The final checkpoint keeps its optimizer state (``save_optim_on_train_end=True``) so that a run can be resumed
    from it and trained further.
    """
    from nemo import lightning as nl

    checkpoint_kwargs.setdefault("save_top_k", -1)
    checkpoint_kwargs.setdefault("save_last", True)
    checkpoint_kwargs.setdefault("save_optim_on_train_end", True)
    checkpoint_kwargs.setdefault("monitor", None)
    checkpoint = nl.ModelCheckpoint(every_n_train_steps=save_every, **checkpoint_kwargs)
    return nl.NeMoLogger(log_dir=str(log_dir), name=name, ckpt=checkpoint, use_datetime_version=False)


def make_trainer(
    strategy: Any, max_steps: int, callbacks: Optional[List[Any]] = None, devices: int = 1, precision: str = "32"
) -> Any:
    """An ``nl.Trainer`` on the CPU (``devices`` processes, gloo): ``precision`` (default fp32; see
    :data:`PRECISIONS`), no validation, no progress bar."""
    from nemo import lightning as nl

    return nl.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        strategy=strategy,
        plugins=nl.MegatronMixedPrecision(precision=precision),
        callbacks=callbacks or [],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
