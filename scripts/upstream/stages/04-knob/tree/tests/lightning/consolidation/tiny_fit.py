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

"""Fit a tiny GPT with ``llm.train`` on the CPU, saving a checkpoint every step (a test aid).

Usage: ``python tiny_fit.py <log dir> <steps> [<strategy keyword>=<JSON value> ...] [lora_from=<JSON path>]``: NeMo's
``MegatronStrategy`` with those keywords, ``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)``, ``NeMoLogger``
under ``<log dir>``; everything real but CUDA (``cpu_harness.megatron_on_cpu``). With ``lora_from``, ``llm.finetune``
with NeMo's ``LoRA`` on the model of that checkpoint, restored from it. Writes ``<log dir>/report.json``: whether the
consolidation process had started when training started (the callback's setup hook ran), and the callback's count of
seconds the training loop spent in it.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

SEQ, VOCAB = 16, 128


class Tokens(Dataset):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        tokens = self.tokens[index]
        return {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": torch.ones(SEQ),
            "position_ids": torch.arange(SEQ),
            "attention_mask": ~torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).unsqueeze(0),
        }


class TokenData(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        from nemo.lightning.pytorch.plugins import MegatronDataSampler

        self.seq_length, self.micro_batch_size, self.global_batch_size = SEQ, 2, 2
        self.data_sampler = MegatronDataSampler(seq_len=SEQ, micro_batch_size=2, global_batch_size=2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(), batch_size=2)


class ProcessStarted(pl.Callback):
    """Records whether the consolidation process was already started when training started."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        consolidating_io = trainer.strategy._consolidating_io()
        self.started = consolidating_io is not None and consolidating_io.queue.process is not None


def main(log_dir: Path, steps: int, strategy_args: dict, lora_from: str = None) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_harness import megatron_on_cpu
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    config = llm.GPTConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        seq_length=SEQ,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=VOCAB,
        transformer_layer_spec=local_layer_spec,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    optim = nl.MegatronOptimizerModule(config=OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0))
    model = llm.GPTModel(config, optim=optim)
    resume = None
    if lora_from is not None:
        restore = nl.RestoreConfig(path=lora_from, load_optim_state=False)
        resume = nl.AutoResume(restore_config=restore, resume_if_exists=True, resume_ignore_no_checkpoint=True)
    strategy = nl.MegatronStrategy(ckpt_async_save=False, **strategy_args)
    started = ProcessStarted()
    trainer = nl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        strategy=strategy,
        plugins=nl.MegatronMixedPrecision(precision="32"),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.callbacks.append(started)  # not a constructor argument: NeMo's context (io.json) would record its class
    checkpoint = nl.ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=False, monitor=None)
    log = nl.NeMoLogger(log_dir=str(log_dir), name="tiny_gpt", ckpt=checkpoint, use_datetime_version=False)
    with megatron_on_cpu():
        if lora_from is None:
            llm.train(model, TokenData(), trainer, log=log, tokenizer=None)
        else:
            lora = llm.peft.LoRA(target_modules=["linear_qkv", "linear_proj"], dim=4, alpha=8)
            llm.finetune(model, TokenData(), trainer, peft=lora, log=log, resume=resume, tokenizer=None)
    blocked = [
        getattr(c, "blocked_seconds", None) for c in trainer.callbacks if type(c).__name__ == "ConsolidationCallback"
    ]
    report = {"process_started_before_training": getattr(started, "started", False), "blocked_seconds": blocked}
    (log_dir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    arguments = dict((item.split("=", 1)[0], json.loads(item.split("=", 1)[1])) for item in sys.argv[3:])
    main(Path(sys.argv[1]), int(sys.argv[2]), arguments, arguments.pop("lora_from", None))
