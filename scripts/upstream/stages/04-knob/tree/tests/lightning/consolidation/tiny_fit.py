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

"""Fit a tiny GPT with ``llm.train`` on the CPU, saving a checkpoint every step (a test aid), and what the tests of
such fits share (:func:`fit`, :func:`checkpoint_tensors`).

Usage: ``python tiny_fit.py <log dir> <steps> [<keyword>=<JSON value> ...]``: NeMo's ``MegatronStrategy`` with the
``ckpt_*`` keywords, ``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)``, ``NeMoLogger`` under ``<log dir>``;
everything real but CUDA (``cpu_harness.megatron_on_cpu``). Other keywords: ``monitor=<metric>`` and
``save_top_k=<k>`` (``ModelCheckpoint``'s, mode ``"min"``, the metric in the checkpoint names), ``snapshots=true``
(each checkpoint's ``weights/`` hard-linked into ``<log dir>/snapshots/<name>/`` when its save returns, so that an
output kept after NeMo removed its checkpoint can be compared with it), ``lora_from=<checkpoint>`` (``llm.finetune``
with NeMo's ``LoRA`` on the model of that checkpoint, restored from it). Writes ``<log dir>/report.json``: whether
the consolidation process had started when training started (the callback's setup hook ran), the callback's count of
seconds the training loop spent in it, and the monitored metric at each global step.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

SEQ, VOCAB = 16, 128
#: LoRA rank and alpha (alpha != rank: the merge scale alpha / rank is 2, not 1).
LORA_DIM, LORA_ALPHA = 4, 8


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


class Recorder(pl.Callback):
    """Records whether the consolidation process was already started when training started, the monitored metric
    at each global step, and (``snapshots``) hard links of each checkpoint's weights as soon as its save returns."""

    def __init__(self, monitor: Optional[str], snapshots: Optional[Path]) -> None:
        self.monitor, self.snapshots, self.metric, self.started = monitor, snapshots, {}, False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        consolidating_io = trainer.strategy._consolidating_io()
        self.started = consolidating_io is not None and consolidating_io.queue.process is not None
        if self.snapshots is not None:  # a sync save: the checkpoint is complete when save_checkpoint returns
            checkpoint_io = trainer.strategy.checkpoint_io
            save = checkpoint_io.save_checkpoint

            def save_and_link(checkpoint: Any, path: Any, storage_options: Any = None) -> Any:
                result = save(checkpoint, path, storage_options=storage_options)
                weights = Path(str(path).removesuffix(".ckpt")) / "weights"
                target = self.snapshots / weights.parent.name / "weights"
                for file in (f for f in weights.rglob("*") if f.is_file()):
                    (target / file.relative_to(weights)).parent.mkdir(parents=True, exist_ok=True)
                    os.link(file, target / file.relative_to(weights))
                return result

            checkpoint_io.save_checkpoint = save_and_link

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self.monitor in trainer.callback_metrics:
            self.metric[trainer.global_step] = float(trainer.callback_metrics[self.monitor])


def main(log_dir: Path, steps: int, options: Dict[str, Any]) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_harness import megatron_on_cpu
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    lora_from, monitor = options.pop("lora_from", None), options.pop("monitor", None)
    save_top_k = options.pop("save_top_k", -1)
    recorder = Recorder(monitor, log_dir / "snapshots" if options.pop("snapshots", False) else None)
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
    strategy = nl.MegatronStrategy(ckpt_async_save=False, **options)
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
    trainer.callbacks.append(recorder)  # not a constructor argument: NeMo's context (io.json) would record its class
    names = {"filename": f"tiny_gpt--{{{monitor}:.4f}}-{{step}}-{{consumed_samples}}"} if monitor else {}
    checkpoint = nl.ModelCheckpoint(
        every_n_train_steps=1, save_top_k=save_top_k, save_last=False, monitor=monitor, mode="min", **names
    )
    log = nl.NeMoLogger(log_dir=str(log_dir), name="tiny_gpt", ckpt=checkpoint, use_datetime_version=False)
    with megatron_on_cpu():
        if lora_from is None:
            llm.train(model, TokenData(), trainer, log=log, tokenizer=None)
        else:
            lora = llm.peft.LoRA(target_modules=["linear_qkv", "linear_proj"], dim=LORA_DIM, alpha=LORA_ALPHA)
            llm.finetune(model, TokenData(), trainer, peft=lora, log=log, resume=resume, tokenizer=None)
    blocked = [
        getattr(c, "blocked_seconds", None) for c in trainer.callbacks if type(c).__name__ == "ConsolidationCallback"
    ]
    report = {
        "process_started_before_training": recorder.started,
        "blocked_seconds": blocked,
        "metric": recorder.metric,
    }
    (log_dir / "report.json").write_text(json.dumps(report))


def fit(name: str, steps: int, tmp_path_factory: Any, **options: Any) -> Path:
    """Run this script in a fresh interpreter (``options`` as its keywords) and return its log directory, in which
    ``tiny_gpt/checkpoints`` is the checkpoint root. A fit of that ``name`` in ``$NEMO_CONSOLIDATION_TEST_CACHE``
    (when set) is reused, so that the tests of later patches can start from an earlier patch's checkpoints."""
    from conftest import run_python

    cache = os.environ.get("NEMO_CONSOLIDATION_TEST_CACHE")
    log_dir = Path(cache) / f"fit-{name}" if cache else tmp_path_factory.mktemp(name)
    if (log_dir / "report.json").is_file():  # written last
        return log_dir
    arguments = [f"{key}={json.dumps(value)}" for key, value in options.items()]
    proc = run_python(str(Path(__file__).resolve()), str(log_dir), str(steps), *arguments)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return log_dir


def every_second(tmp_path_factory: Any) -> Path:
    """The knob's fit (4 steps, a checkpoint each, every second one consolidated by two writers), which the tests of
    later patches start from (reused from the cache when an earlier patch's tests ran it)."""
    options = dict(ckpt_consolidation_frequency="every_n:2", ckpt_consolidation_workers=2)
    return fit("every-second", 4, tmp_path_factory, **options)


def checkpoints(root: Path) -> list:
    """The checkpoint directories of a root, in the order they were saved (by their consumed samples)."""
    found = (p for p in root.iterdir() if (p / "weights").is_dir() and not p.is_symlink())
    return sorted(found, key=lambda p: float(p.name.rsplit("consumed_samples=", 1)[1]))


def checkpoint_tensors(weights_dir: Path, tmp_path: Path) -> Dict[str, torch.Tensor]:
    """The model tensors of a checkpoint according to PyTorch's own DCP converter (``dcp_to_torch_save``), split per
    layer as the consolidated outputs name them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reference = tmp_path / f"reference-{weights_dir.parent.name}.pt"
    dcp_to_torch_save(str(weights_dir), str(reference))
    tensors = {}
    for key, value in torch.load(reference, weights_only=False).items():
        if not key.startswith("module.") or "_extra_state" in key or not isinstance(value, torch.Tensor):
            continue
        name = key[len("module.") :]
        if ".layers." in name:
            head, tail = name.split(".layers.", 1)
            tensors.update({f"{head}.layers.{layer}.{tail}": value[layer] for layer in range(value.shape[0])})
        else:
            tensors[name] = value
    return tensors


if __name__ == "__main__":
    arguments = dict((item.split("=", 1)[0], json.loads(item.split("=", 1)[1])) for item in sys.argv[3:])
    main(Path(sys.argv[1]), int(sys.argv[2]), arguments)
