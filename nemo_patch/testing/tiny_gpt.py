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
#: Micro-batches per validation in :func:`make_trainer` (``limit_val_batches``).
VAL_BATCHES = 2


def tiny_gpt_config(num_layers: int = 2, tie_embeddings: bool = True, layer_spec: str = "local") -> Any:
    """A 2-layer, hidden-64 ``llm.GPTConfig`` that runs on the CPU (fp32, local spec, no fusions).

    Args:
        num_layers: number of transformer layers.
        tie_embeddings: share the input embedding with the output layer.
        layer_spec: ``"local"`` (megatron-core's non-TE modules, the only spec that runs without Transformer
            Engine) or ``"te"`` (NeMo's Transformer Engine spec; needs Transformer Engine and a GPU).

    Returns:
        An ``nemo.collections.llm.GPTConfig``.
    """
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec, transformer_engine_layer_spec

    specs = {"local": local_layer_spec, "te": transformer_engine_layer_spec}
    if layer_spec not in specs:
        raise ValueError(f"Unsupported layer_spec {layer_spec!r}: 'local' or 'te' (Transformer Engine, GPU only).")
    return llm.GPTConfig(
        num_layers=num_layers,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=VOCAB_SIZE,
        share_embeddings_and_output_weights=tie_embeddings,
        transformer_layer_spec=specs[layer_spec],
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


def cpu_adam(lr: float = 1e-3, precision: str = "32", distributed_optimizer: bool = False) -> Any:
    """NeMo's ``MegatronOptimizerModule`` with megatron-core Adam set up to run on the CPU (``clip_grad=0``).

    ``precision`` is the trainer's (:data:`PRECISIONS`): with ``"bf16-mixed"``/``"16-mixed"`` the model's parameters
    are bf16/fp16 and megatron-core's mixed-precision optimizer keeps fp32 main parameters (fp16 with a loss scale).
    ``distributed_optimizer`` turns on megatron-core's distributed optimizer, which only runs on CUDA tensors
    (``scripts/gpu_check.py``).
    """
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl

    return nl.MegatronOptimizerModule(
        config=OptimizerConfig(
            optimizer="adam",
            lr=lr,
            clip_grad=0.0,
            use_distributed_optimizer=distributed_optimizer,  # needs CUDA tensors
            bf16=precision == "bf16-mixed",
            fp16=precision == "16-mixed",
            params_dtype=PRECISIONS[precision],
        )
    )


def tiny_gpt_model(
    config: Optional[Any] = None, lr: float = 1e-3, precision: str = "32", distributed_optimizer: bool = False
) -> Any:
    """An ``llm.GPTModel`` of :func:`tiny_gpt_config` with a Megatron Adam optimizer (:func:`cpu_adam`)."""
    from nemo.collections import llm

    return llm.GPTModel(config or tiny_gpt_config(), optim=cpu_adam(lr, precision, distributed_optimizer))


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


class _RehearsedTokens(Dataset):
    """The first ``switch_at`` samples repeat the first ``rehearsed`` samples of ``validation``; then random tokens.

    Training on it, a model memorises the validation samples (its validation loss falls), then forgets them (it
    rises)."""

    def __init__(self, num_samples: int, seed: int, validation: Dataset, rehearsed: int, switch_at: int) -> None:
        self.random = _RandomTokens(num_samples, seed)
        self.validation, self.rehearsed, self.switch_at = validation, rehearsed, switch_at

    def __len__(self) -> int:
        return len(self.random)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return self.validation[index % self.rehearsed] if index < self.switch_at else self.random[index]


class TinyTokenDataModule(pl.LightningDataModule):
    """Deterministic token sequences for the tiny GPT, served through NeMo's ``MegatronDataSampler``.

    Args:
        num_samples: training samples.
        micro_batch_size, global_batch_size: NeMo's (samples).
        val_minimum_at: ``None``: random tokens. A global step ``S``: up to step ``S`` the training samples are the
            validation batches NeMo validates on (the first :data:`VAL_BATCHES` micro-batches), then random ones, so
            the validation loss goes down until step ``S`` and up after it (megatron-core's sampler reads the
            training samples in order, ``global_batch_size`` per step).
    """

    def __init__(
        self,
        num_samples: int = 4096,
        micro_batch_size: int = 2,
        global_batch_size: int = 2,
        val_minimum_at: Optional[int] = None,
    ) -> None:
        super().__init__()
        from nemo.lightning.pytorch.plugins import MegatronDataSampler

        self.val_minimum_at = val_minimum_at
        self.validation = _RandomTokens(64, seed=4321)
        self.num_samples = num_samples
        self.seq_length = SEQ_LENGTH
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.data_sampler = MegatronDataSampler(
            seq_len=SEQ_LENGTH, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size
        )

    def train_dataloader(self) -> DataLoader:
        train: Dataset = _RandomTokens(self.num_samples, seed=1234)
        if self.val_minimum_at is not None:
            switch = self.val_minimum_at * self.data_sampler.global_batch_size
            validated = VAL_BATCHES * self.micro_batch_size
            train = _RehearsedTokens(self.num_samples, 1234, self.validation, validated, switch)
        return DataLoader(train, batch_size=self.micro_batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.validation, batch_size=self.micro_batch_size)


def make_logger(log_dir: Path, save_every: Optional[int], name: str = "tiny_gpt", **checkpoint_kwargs: Any) -> Any:
    """A ``NeMoLogger`` whose NeMo ``ModelCheckpoint`` saves every ``save_every`` global steps (``None``: at the end
    of each validation), keeping all. ``tensorboard=True`` adds a TensorBoard logger (under ``<log_dir>/<name>/tb``).

    The final checkpoint keeps its optimizer state (``save_optim_on_train_end=True``) so that a run can be resumed
    from it and trained further.
    """
    from nemo import lightning as nl

    checkpoint_kwargs.setdefault("save_top_k", -1)
    checkpoint_kwargs.setdefault("save_last", True)
    checkpoint_kwargs.setdefault("save_optim_on_train_end", True)
    checkpoint_kwargs.setdefault("monitor", None)
    tensorboard = checkpoint_kwargs.pop("tensorboard", False)
    checkpoint = nl.ModelCheckpoint(every_n_train_steps=save_every, **checkpoint_kwargs)
    board = None
    if tensorboard:
        from lightning.pytorch.loggers import TensorBoardLogger

        board = TensorBoardLogger(save_dir="tb", name=name)
    return nl.NeMoLogger(
        log_dir=str(log_dir), name=name, ckpt=checkpoint, use_datetime_version=False, tensorboard=board
    )


def make_trainer(
    strategy: Any,
    max_steps: int,
    callbacks: Optional[List[Any]] = None,
    devices: int = 1,
    precision: str = "32",
    num_nodes: int = 1,
    validate_every: Optional[int] = None,
    accelerator: str = "cpu",
) -> Any:
    """An ``nl.Trainer`` on the CPU (``devices`` processes per node on ``num_nodes`` nodes, gloo;
    ``accelerator="gpu"``: GPUs, NCCL): ``precision`` (default fp32; see :data:`PRECISIONS`), no progress bar, and no
    validation, or with ``validate_every`` :data:`VAL_BATCHES` validation batches every that many global steps (NeMo
    logs ``val_loss``)."""
    from nemo import lightning as nl

    validation: Dict[str, Any] = {"limit_val_batches": 0}
    if validate_every is not None:
        validation = {"limit_val_batches": VAL_BATCHES, "val_check_interval": validate_every}
    return nl.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        max_steps=max_steps,
        strategy=strategy,
        plugins=nl.MegatronMixedPrecision(precision=precision),
        callbacks=callbacks or [],
        num_sanity_val_steps=0,
        **validation,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
