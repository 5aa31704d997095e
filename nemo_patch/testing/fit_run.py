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

"""Train the tiny NeMo GPT on the CPU and report what happened to its checkpoints: the demo's and tests' engine.

``python -m nemo_patch.testing.fit_run --out DIR [--frequency F] [--save-consolidated] [--max-steps N]
[--save-every N] [--async-save] [--stock] [--probe-logits] [--json FILE]`` runs one real fit (``llm.train`` with
``nl.Trainer``, ``nl.MegatronStrategy``, NeMo's ``ModelCheckpoint`` and ``NeMoLogger``, resuming from ``DIR`` if it
holds checkpoints) inside :func:`nemo_patch.testing.cpu_harness.megatron_on_cpu`, and writes a JSON report.
Test/demo aid only.

Nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["CHECKPOINT_FILENAME", "MONITORED_FILENAME", "checkpoint_report", "retained_report", "run_tiny_fit"]

#: ``ModelCheckpoint`` file-name template: NeMo's ``step`` here is the 0-based index of the last training step.
CHECKPOINT_FILENAME = "tiny_gpt--{step}-{consumed_samples}"
#: The same with a monitored metric (``METRIC`` is replaced by its name), as NeMo's top-k needs it in the name.
MONITORED_FILENAME = "tiny_gpt--{METRIC:.4f}-{step}-{consumed_samples}"
#: LoRA rank and alpha of ``--peft lora`` (alpha != rank: the merge scale alpha / rank is 2, not 1).
LORA_DIM = 8
LORA_ALPHA = 16


def retained_report(checkpoint_root: Path) -> List[Dict[str, Any]]:
    """One entry per output kept under ``<root>/retained/`` after NeMo removed its checkpoint: ``name``,
    ``global_step`` (from its ``metadata.json``) and ``bytes`` of its files."""
    from nemo_patch.training.retention import RETAINED_DIRNAME

    entries = []
    retained = checkpoint_root / RETAINED_DIRNAME
    for entry in sorted(retained.iterdir()) if retained.is_dir() else []:
        output = entry / "consolidated" if (entry / "consolidated").is_dir() else entry / "hf"
        if not (output / "metadata.json").is_file():
            continue
        metadata = json.loads((output / "metadata.json").read_text())
        size = sum(f.stat().st_size for f in output.iterdir())
        entries.append({"name": entry.name, "global_step": metadata.get("global_step"), "bytes": size})
    return entries


def checkpoint_report(checkpoint_root: Path, steps: Optional[Dict[str, int]] = None) -> List[Dict[str, Any]]:
    """One entry per checkpoint directory under ``checkpoint_root``, sorted by name.

    Args:
        checkpoint_root: the ``checkpoints/`` directory of a run.
        steps: checkpoint name -> global step, for checkpoints this process saw finish.

    Returns:
        Dicts with ``name``, ``global_step`` (``None`` if unknown), ``consolidated`` (bool) and ``consolidated_bytes``.
    """
    from nemo_patch.training.retention import RETAINED_DIRNAME

    entries = []
    for path in sorted(
        p
        for p in checkpoint_root.iterdir()
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".") and p.name != RETAINED_DIRNAME
    ):
        out = path / "consolidated" if (path / "consolidated").is_dir() else path / "hf"
        entries.append(
            {
                "name": path.name,
                "global_step": (steps or {}).get(path.name),
                "consolidated": out.is_dir(),
                "consolidated_bytes": sum(f.stat().st_size for f in out.iterdir()) if out.is_dir() else 0,
            }
        )
    return entries


def run_tiny_fit(
    out: Path,
    frequency: Optional[str] = None,
    save_consolidated: Optional[bool] = None,
    max_steps: int = 6,
    fits: int = 1,
    save_every: int = 2,
    async_save: bool = False,
    stock: bool = False,
    probe_logits: bool = False,
    max_pending: Optional[int] = None,
    max_shard_size: Optional[int] = None,
    timeout: Optional[float] = None,
    tp: int = 1,
    pp: int = 1,
    lr: float = 1e-3,
    tie_embeddings: bool = True,
    restore_from: Optional[Path] = None,
    devices: Optional[int] = None,
    num_nodes: int = 1,
    weights_only: bool = False,
    model_from: Optional[Path] = None,
    output_format: Optional[str] = None,
    probe_hf: bool = False,
    faults: Sequence[str] = (),
    save_top_k: int = -1,
    monitor: Optional[str] = None,
    keep: Optional[int] = None,
    snapshot_checkpoints: bool = False,
    snapshot_copies: bool = False,
    wait_for_consolidation: bool = False,
    strategy_args: Sequence[str] = (),
    config_args: Sequence[str] = (),
    swap_io: Optional[str] = None,
    precision: str = "32",
    peft: Optional[str] = None,
    probe_merged: bool = False,
    validate_every: Optional[int] = None,
    val_minimum_at: Optional[int] = None,
    device: str = "cpu",
    distributed_optimizer: bool = False,
    layer_spec: str = "local",
    tensorboard: bool = False,
    barrier_after_fit: bool = False,
    pg_timeout: Optional[float] = None,
    post_command: Optional[str] = None,
    post_command_timeout: Optional[float] = None,
    record_hooks: bool = False,
    raising_hook: bool = False,
    new_run: bool = False,
    resume_from: Optional[Path] = None,
) -> Dict[str, Any]:
    """Train the tiny GPT for ``max_steps`` global steps, saving every ``save_every``; resume if ``out`` has a run.

    Args:
        out: the NeMoLogger ``log_dir``; checkpoints land in ``out/tiny_gpt/checkpoints``.
        frequency: ``ckpt_consolidation_frequency`` (``None``: not passed).
        save_consolidated: ``save_consolidated`` (``None``: not passed).
        max_steps: trainer ``max_steps``.
        fits: how many times ``fit`` runs on the same trainer and model (the first through ``llm.train``, the others
            as ``trainer.fit(model, data)``: global steps start again from 0, the weights go on from the last fit's).
        save_every: ``ModelCheckpoint(every_n_train_steps=...)``.
        async_save: ``ckpt_async_save`` of the strategy.
        stock: check that ``nl.MegatronStrategy`` is NeMo's own class (run with ``NEMO_PATCH_DISABLE=1``).
        probe_logits: after ``fit``, compare the trained model's logits with a fresh TP=1 model loaded from
            ``LATEST/consolidated`` through :func:`nemo_patch.load_consolidated_into`.
        max_pending: ``ConsolidationConfig.max_pending`` (``None``: not given).
        max_shard_size: ``ConsolidationConfig.max_shard_size`` (``None``: not given).
        timeout: ``ConsolidationConfig.timeout`` (``None``: not given).
        tp: tensor-parallel size; pp: pipeline-parallel size. ``tp * pp`` CPU processes (gloo) are launched by
            Lightning, each running this same command.
        lr: Adam learning rate; ``0`` keeps the weights as initialised or restored.
        tie_embeddings: share the input embedding with the output layer.
        restore_from: a checkpoint to load the model weights from (NeMo's ``RestoreConfig``, resharded to this run's
            TP/PP layout; optimizer state is not loaded).
        devices: CPU processes (default ``tp * pp``; more gives data parallelism).
        num_nodes: the trainer's ``num_nodes``; above 1 each "node" is a process launched on its own (``torchrun
            --nnodes N --node-rank r``), all on this host, sharing ``out``.
        weights_only: ``ModelCheckpoint(save_weights_only=True)``: checkpoints without optimizer state.
        model_from: fine-tune the model of this NeMo checkpoint instead of the tiny GPT: its class, config and
            tokenizer from ``context/``, its weights through ``RestoreConfig`` (e.g. an imported Hugging Face Llama).
        output_format: ``ConsolidationConfig.format`` (``None``: not given).
        probe_hf: after ``fit``, compare the trained model's logits with ``transformers``'
            ``AutoModelForCausalLM`` loaded from ``LATEST/hf`` (``max_abs_hf_logit_diff`` in the report).
        save_top_k: ``ModelCheckpoint(save_top_k=...)`` (``1``: NeMo removes each older checkpoint as a new one lands).
        monitor: ``ModelCheckpoint(monitor=..., mode="min")`` (e.g. ``reduced_train_loss``), its value in the
            checkpoint names; ``"step"``: ``mode="max"``, top-k by recency as with ``None``, but resumable (NeMo
            2.7.3's ``nemo_topk_check_previous_run`` fails on resume with ``monitor=None`` and ``save_top_k >= 0``);
            ``None``: no monitored metric.
        keep: ``ConsolidationConfig.keep`` (``None``: not given).
        snapshot_checkpoints: hard-link every finished checkpoint's ``weights/`` into ``<out>/snapshots/<name>`` as
            soon as it is seen (:class:`nemo_patch.testing.snapshots.CheckpointSnapshots`), so that outputs kept after
            NeMo removed their checkpoint can still be compared with the checkpoint they came from.
        snapshot_copies: as ``snapshot_checkpoints``, but the files are copied, not hard-linked (the checkpoint's files
            keep their inodes, link counts and change times; a checkpoint rewritten in place leaves its snapshot).
        wait_for_consolidation: wait at the end of each step until consolidations are done
            (:class:`nemo_patch.testing.pacing.WaitForConsolidation`), so they keep up with the saves as in a real run.
        strategy_args: more ``MegatronStrategy`` arguments as ``name=value`` (``value`` read as JSON when it parses,
            e.g. ``save_ckpt_format=zarr``, ``ckpt_parallel_save=false``, ``ckpt_torch_dist_multiproc=2``).
        config_args: more ``ConsolidationConfig`` fields as ``name=value`` (read as ``strategy_args`` are, e.g.
            ``workers=2``, ``dtype=bf16``, ``merge_adapters=true``); with the options above that give config fields,
            they make the strategy's ``ckpt_consolidation`` (not passed when none is given).
        swap_io: replace the checkpoint IO in a callback's ``setup`` as NeMo's PEFT callback does
            (:class:`nemo_patch.testing.io_swap.SwapCheckpointIO`: ``"stock"`` or ``"custom"``).
        peft: ``"lora"``: fine-tune with ``llm.finetune`` and NeMo's ``LoRA`` on ``linear_qkv`` and ``linear_proj``
            (rank :data:`LORA_DIM`, alpha :data:`LORA_ALPHA`: alpha != rank, so a merge that forgets the scale shows);
            needs ``model_from``. NeMo's PEFT callback then saves adapter-only checkpoints.
        probe_merged: after a ``peft`` run, merge the adapters of ``LATEST`` offline in both formats and report how
            far the merged models' logits are from the trained model-with-adapters' (see :func:`_probe_merged_logits`).
        precision: the trainer's ``nl.MegatronMixedPrecision`` precision, ``"32"`` (default), ``"bf16-mixed"`` or
            ``"16-mixed"``: the parameters, and so the checkpoint's weights, are in that dtype.
        validate_every: validate (2 batches) every that many global steps, and let ``ModelCheckpoint`` save at the
            end of each validation instead of every ``save_every`` steps; the report's ``val_loss`` maps each
            validated global step to NeMo's logged ``val_loss``.
        val_minimum_at: train on data that makes the validation loss go down until about this global step, then up
            (:class:`nemo_patch.testing.tiny_gpt.TinyTokenDataModule`).
        device: ``"cpu"`` (inside :func:`nemo_patch.testing.cpu_harness.megatron_on_cpu`) or ``"cuda"`` (GPUs, no
            harness: ``scripts/gpu_check.py``).
        distributed_optimizer: megatron-core's distributed optimizer (CUDA only).
        layer_spec: ``"local"`` or ``"te"`` (Transformer Engine; CUDA only); see :func:`tiny_gpt.tiny_gpt_config`.
        tensorboard: add a TensorBoard logger; the report's ``tensorboard_dir`` is where it wrote its events.
        barrier_after_fit: right after ``fit`` returns, every rank runs ``torch.distributed.barrier()`` on the job's
            process group, as a script that validates or synchronises after training does; each rank writes
            ``<out>/after-fit-rank<r>.json`` (:func:`nemo_patch.testing.collectives.barrier_after_fit`).
        pg_timeout: from the start of training, the job's process group times out after this many seconds
            (:class:`nemo_patch.testing.collectives.ProcessGroupTimeout`).
        post_command: ``ConsolidationConfig.post_command`` (``None``: not given).
        post_command_timeout: ``ConsolidationConfig.post_command_timeout`` (``None``: not given).
        record_hooks: record every ``on_consolidation_end``/``on_consolidation_failed`` call in ``<out>/hooks.jsonl``
            (:class:`nemo_patch.testing.hook_recorder.RecordConsolidationHooks`).
        raising_hook: add a callback whose ``on_consolidation_end`` raises
            (:class:`nemo_patch.testing.hook_recorder.RaisingConsolidationHook`); the report's ``raising_hook_calls``
            counts its calls.
        new_run: start a new run in ``out`` even if it holds checkpoints (``AutoResume(resume_if_exists=False)``).
        resume_from: resume from this checkpoint (``AutoResume(resume_from_path=...)``), e.g. an older one of the run
            (a rollback).
        faults: faults to inject (:mod:`nemo_patch.testing.faults`); a ``sigterm`` fault adds NeMo's
            ``PreemptionCallback``. A ``sys.exit`` inside ``fit`` (the preemption path) is reported as ``system_exit``.

    Returns:
        A JSON-able report: ``strategy_class``, ``checkpoints`` (see :func:`checkpoint_report`), ``latest``,
        ``finished_count``, and with ``probe_logits`` the ``max_abs_logit_diff``.
    """
    import torch
    from nemo import lightning as nl
    from nemo.collections import llm

    import nemo_patch
    from nemo_patch.testing import tiny_gpt
    from nemo_patch.testing.cpu_harness import megatron_on_cpu
    from nemo_patch.training.callback import consolidation_of

    kwargs: Dict[str, Any] = {"ckpt_async_save": async_save}
    if frequency is not None:
        kwargs["ckpt_consolidation_frequency"] = frequency
    if save_consolidated is not None:
        kwargs["save_consolidated"] = save_consolidated
    options: List[Tuple[str, Any]] = [("max_pending", max_pending), ("max_shard_size", max_shard_size)]
    options += [("timeout", timeout), ("keep", keep), ("post_command", post_command)]
    options += [("post_command_timeout", post_command_timeout), ("format", output_format)]
    config = {name: value for name, value in options if value is not None}
    for item in config_args:
        name, _, text = item.partition("=")
        try:
            config[name] = json.loads(text)
        except ValueError:
            config[name] = text
    if config:
        from nemo_patch.training.config import ConsolidationConfig

        kwargs["ckpt_consolidation"] = ConsolidationConfig(**config)
    if stock and nemo_patch.overlay_applied():
        raise RuntimeError("--stock needs NEMO_PATCH_DISABLE=1, so that NeMo runs without the overlay")
    kwargs.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    for item in strategy_args:
        name, _, text = item.partition("=")
        try:
            kwargs[name] = json.loads(text)
        except ValueError:
            kwargs[name] = text
    if pp > 1:
        kwargs["pipeline_dtype"] = torch.float32
    strategy = nl.MegatronStrategy(**kwargs)
    from nemo_patch.testing.faults import FaultInjector
    from nemo_patch.testing.snapshots import CheckpointSnapshots

    injectors = [FaultInjector(spec) for spec in faults]
    callbacks: List[Any] = list(injectors)
    if snapshot_checkpoints or snapshot_copies:
        callbacks.append(CheckpointSnapshots(out / "snapshots", copy=snapshot_copies))
    if swap_io is not None:
        from nemo_patch.testing.io_swap import SwapCheckpointIO

        callbacks.append(SwapCheckpointIO(swap_io))
    if wait_for_consolidation:
        from nemo_patch.testing.pacing import WaitForConsolidation

        callbacks.append(WaitForConsolidation())
    raising = None
    if record_hooks or raising_hook:
        from nemo_patch.testing.hook_recorder import RaisingConsolidationHook, RecordConsolidationHooks

        if record_hooks:
            callbacks.append(RecordConsolidationHooks(out / "hooks.jsonl"))
        if raising_hook:
            raising = RaisingConsolidationHook()
            callbacks.append(raising)
    if pg_timeout is not None:
        from nemo_patch.testing.collectives import ProcessGroupTimeout

        callbacks.append(ProcessGroupTimeout(pg_timeout))
    if any(injector.kind == "sigterm" for injector in injectors):
        from nemo.lightning.pytorch.callbacks import PreemptionCallback

        callbacks.append(PreemptionCallback())
    from nemo_patch.testing.val_history import ValLossHistory

    history = ValLossHistory()
    if validate_every is not None:  # the trainer's callbacks go into the checkpoint context, which NeMo unpickles
        callbacks.append(history)
    trainer = tiny_gpt.make_trainer(
        strategy,
        max_steps=max_steps,
        callbacks=callbacks,
        devices=devices or tp * pp,
        num_nodes=num_nodes,
        precision=precision,
        validate_every=validate_every,
        accelerator="gpu" if device == "cuda" else "cpu",
    )
    checkpoint_options: Dict[str, Any] = {"save_weights_only": weights_only, "save_top_k": save_top_k}
    if monitor == "step":
        checkpoint_options.update(monitor=monitor, mode="max", filename=CHECKPOINT_FILENAME)
    elif monitor is not None:
        checkpoint_options.update(monitor=monitor, mode="min", filename=MONITORED_FILENAME.replace("METRIC", monitor))
    else:
        checkpoint_options.update(filename=CHECKPOINT_FILENAME)
    checkpoint_options["tensorboard"] = tensorboard
    log = tiny_gpt.make_logger(out, save_every=None if validate_every else save_every, **checkpoint_options)
    if model_from is not None:
        from nemo.lightning import io

        context = io.load_context(str(Path(model_from) / "context"), subpath="model")
        model = type(context)(context.config, optim=tiny_gpt.cpu_adam(lr, precision), tokenizer=context.tokenizer)
        restore_from = model_from
    else:
        config = tiny_gpt.tiny_gpt_config(tie_embeddings=tie_embeddings, layer_spec=layer_spec)
        model = tiny_gpt.tiny_gpt_model(config, lr, precision, distributed_optimizer)
    if restore_from is not None:
        restore = nl.RestoreConfig(path=str(restore_from), load_optim_state=False)
        # As NeMo's fine-tuning recipes: start from the restore path, or resume this run's newest checkpoint.
        resume = nl.AutoResume(restore_config=restore, resume_if_exists=True, resume_ignore_no_checkpoint=True)
    elif resume_from is not None:
        resume = nl.AutoResume(resume_from_path=str(resume_from))
    else:
        resume = nl.AutoResume(resume_if_exists=not new_run, resume_ignore_no_checkpoint=True)
    report: Dict[str, Any] = {"strategy_class": f"{type(strategy).__module__}.{type(strategy).__qualname__}"}
    with megatron_on_cpu() if device == "cpu" else contextlib.nullcontext():
        start = time.perf_counter()
        data = tiny_gpt.TinyTokenDataModule(
            global_batch_size=2 * (devices or tp * pp) * num_nodes // (tp * pp), val_minimum_at=val_minimum_at
        )
        try:
            if peft is not None:
                adapter = llm.peft.LoRA(target_modules=["linear_qkv", "linear_proj"], dim=LORA_DIM, alpha=LORA_ALPHA)
                llm.finetune(model, data, trainer, peft=adapter, log=log, resume=resume, tokenizer=None)
            else:
                llm.train(model, data, trainer, log=log, resume=resume, tokenizer=None)
                for _ in range(fits - 1):
                    trainer.fit(model, data)
        except SystemExit as stop:  # NeMo's PreemptionCallback ends fit with sys.exit(0) after its final save
            report["system_exit"] = stop.code
        finally:
            for injector in injectors:
                injector.cleanup()
        fit_seconds = time.perf_counter() - start
        if barrier_after_fit:
            from nemo_patch.testing.collectives import barrier_after_fit as barrier

            report["after_fit"] = barrier(out)
        root = out / "tiny_gpt" / "checkpoints"
        if probe_logits:
            report["max_abs_logit_diff"] = _probe_logits(model, root)
        if probe_hf:
            report["max_abs_hf_logit_diff"] = _probe_hf_logits(model, root / "LATEST" / "hf")
        if probe_merged:
            report.update(_probe_merged_logits(model, root / "LATEST", out / "probe-merged"))

    consolidation = consolidation_of(strategy.checkpoint_io)
    schedule = consolidation.schedule if consolidation is not None else None
    steps = {save.path.name: save.global_step for save in schedule.history} if schedule else {}
    report["checkpoints"] = checkpoint_report(root, steps)
    latest = nemo_patch.read_latest_pointer(root)
    report["latest"] = latest.name if latest else None
    link = root / "LATEST"
    report["latest_target"] = os.readlink(link) if link.is_symlink() else None
    best_link = root / "BEST"
    report["best_target"] = os.readlink(best_link) if best_link.is_symlink() else None
    report["val_loss"] = history.values
    report["tensorboard_dir"] = trainer.logger.log_dir if tensorboard and trainer.logger else None
    report["finished_count"] = schedule.finished_count if schedule else None
    queue = consolidation._queue if consolidation is not None else None
    report["skipped"] = [save.path.name for save in queue.skipped] if queue else []
    report["fault_records"] = [record for injector in injectors for record in injector.records]
    report["dropped_by_removal"] = [save.path.name for save in getattr(consolidation, "dropped_by_removal", [])]
    report["retained"] = retained_report(root)
    report["completed_steps"] = [step for step, _, error in queue.completed if error is None] if queue else []
    report["resumed_from"] = str(trainer.ckpt_path) if trainer.ckpt_path else None
    from nemo_patch.training.callback import ConsolidationCallback

    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, ConsolidationCallback)]
    # the per-step hooks, and the saves' waits for a pass still running on the coordinator's stepper thread
    report["blocked_seconds"] = sum(cb.blocked_seconds for cb in callbacks) + getattr(
        consolidation, "synced_seconds", 0.0
    )
    report["consolidation_seconds"] = sum(seconds for _, seconds, _ in queue.completed) if queue else 0.0
    report["consolidations"] = len(queue.completed) if queue else 0
    report["warm_requests"] = queue.warm_requests if queue else 0
    report["processes_started"] = queue.processes_started if queue else 0
    report["consolidation_errors"] = [error for _, _, error in queue.completed if error] if queue else []
    report["end_wait_seconds"] = queue.waited_seconds if queue else 0.0
    report["fit_seconds"] = fit_seconds
    report["raising_hook_calls"] = raising.calls if raising is not None else None
    report["global_rank_zero"] = trainer.is_global_zero
    report["global_step"] = trainer.global_step
    report["run_id"] = getattr(consolidation, "run_id", None)
    return report


def _probe_batch() -> Dict[str, Any]:
    """The fixed batch every logit probe compares on (2 sequences, seed 0)."""
    import torch

    from nemo_patch.testing import tiny_gpt

    generator = torch.Generator().manual_seed(0)
    return tiny_gpt.causal_batch(
        torch.randint(0, tiny_gpt.VOCAB_SIZE, (2, tiny_gpt.SEQ_LENGTH + 1), generator=generator)
    )


def _probe_logits(model: Any, root: Path) -> float:
    """Max |logit difference| between the trained model and a fresh one loaded from ``LATEST/consolidated``."""
    import torch
    from megatron.core.models.gpt import GPTModel as MCoreGPTModel

    import nemo_patch

    trained = next(m for m in model.modules() if isinstance(m, MCoreGPTModel)).eval()
    parameter = next(trained.parameters())
    # on a GPU node both models on the GPU: Lightning's teardown moved the trained one to the CPU, and megatron-core's
    # attention takes its buffer from the current CUDA device
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else parameter.device
    trained = trained.to(device)
    fresh = model.config.configure_model(tokenizer=None).eval()
    nemo_patch.load_consolidated_into(fresh, root / "LATEST" / "consolidated")
    fresh = fresh.to(device=device, dtype=parameter.dtype)  # bf16 weights stay the same bits
    batch = {key: value.to(device) for key, value in _probe_batch().items()}
    with torch.no_grad():
        expected = trained(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        actual = fresh(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return float((expected - actual).abs().max())


def _probe_merged_logits(model: Any, checkpoint: Path, out: Path) -> Dict[str, float]:
    """Merge the adapters of the LoRA checkpoint ``checkpoint`` with ``nemo-consolidate --merge-adapters`` in both
    formats (into ``out/safetensors`` and ``out/hf``) and compare with the trained model-with-adapters: the
    ``safetensors`` output loaded into a plain model (no adapters) of the same config, the ``hf`` one with
    ``AutoModelForCausalLM``; and the unmerged Hugging Face PEFT directory (``out/peft``) loaded with
    ``peft.PeftModel.from_pretrained`` onto the base checkpoint's own ``hf`` export (``out/base-hf``). Returns
    ``max_abs_merged_logit_diff``, ``max_abs_merged_hf_logit_diff`` and ``max_abs_peft_logit_diff``."""
    import torch
    from megatron.core.models.gpt import GPTModel as MCoreGPTModel
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import nemo_patch
    from nemo_patch.cli.nemo_consolidate import main as nemo_consolidate
    from nemo_patch.engine.adapter_settings import adapter_base
    from nemo_patch.engine.checkpoint_layout import inspect_checkpoint

    base = adapter_base(inspect_checkpoint(checkpoint).weights_dir)
    for args in (
        [str(checkpoint), "--merge-adapters", "--out", str(out / "safetensors")],
        [str(checkpoint), "--merge-adapters", "--format", "hf", "--trust-context", "--out", str(out / "hf")],
        [str(checkpoint), "--format", "hf", "--trust-context", "--out", str(out / "peft")],
        [str(base), "--format", "hf", "--trust-context", "--out", str(out / "base-hf")],
    ):
        if nemo_consolidate([*args, "--quiet", "--verify"]) != 0:
            raise RuntimeError(f"nemo-consolidate {' '.join(args)} failed")
    trained = next(m for m in model.modules() if isinstance(m, MCoreGPTModel)).eval()
    plain = model.config.configure_model(tokenizer=None).eval()
    nemo_patch.load_consolidated_into(plain, out / "safetensors")
    hf_model = AutoModelForCausalLM.from_pretrained(str(out / "hf"), torch_dtype=torch.float32).eval()
    base_model = AutoModelForCausalLM.from_pretrained(str(out / "base-hf"), torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base_model, str(out / "peft")).eval()
    batch = _probe_batch()
    with torch.no_grad():
        expected = trained(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        merged = plain(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        merged_hf = hf_model(input_ids=batch["tokens"]).logits
        with_adapters = peft_model(input_ids=batch["tokens"]).logits
    return {
        "max_abs_peft_logit_diff": float((expected - with_adapters).abs().max()),
        "max_abs_merged_logit_diff": float((expected - merged).abs().max()),
        "max_abs_merged_hf_logit_diff": float((expected - merged_hf).abs().max()),
    }


def _probe_hf_logits(model: Any, hf_dir: Path) -> float:
    """Max |logit difference| between the trained NeMo model and ``AutoModelForCausalLM`` loaded from ``hf_dir``."""
    import torch
    from megatron.core.models.gpt import GPTModel as MCoreGPTModel
    from transformers import AutoModelForCausalLM

    trained = next(m for m in model.modules() if isinstance(m, MCoreGPTModel)).eval()
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    batch = _probe_batch()
    with torch.no_grad():
        expected = trained(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        actual = hf_model(input_ids=batch["tokens"]).logits
    return float((expected - actual).abs().max())


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frequency", default=None)
    parser.add_argument("--save-consolidated", choices=["true", "false"], default=None)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--fits", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--probe-logits", action="store_true")
    parser.add_argument("--max-pending", type=int, default=None)
    parser.add_argument("--max-shard-size", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--untied-embeddings", action="store_true")
    parser.add_argument("--restore-from", type=Path, default=None)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--weights-only", action="store_true")
    parser.add_argument("--model-from", type=Path, default=None)
    parser.add_argument("--format", default=None)
    parser.add_argument("--probe-hf", action="store_true")
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--save-top-k", type=int, default=-1)
    parser.add_argument("--monitor", default=None)
    parser.add_argument("--keep", type=int, default=None)
    parser.add_argument("--snapshot-checkpoints", action="store_true")
    parser.add_argument("--snapshot-copies", action="store_true")
    parser.add_argument("--wait-for-consolidation", action="store_true")
    parser.add_argument("--strategy-arg", action="append", default=[])
    parser.add_argument("--config-arg", action="append", default=[])
    parser.add_argument("--swap-io", choices=["stock", "custom"], default=None)
    parser.add_argument("--peft", choices=["lora"], default=None)
    parser.add_argument("--probe-merged", action="store_true")
    parser.add_argument("--precision", choices=["32", "bf16-mixed", "16-mixed"], default="32")
    parser.add_argument("--validate-every", type=int, default=None)
    parser.add_argument("--val-minimum-at", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--layer-spec", choices=["local", "te"], default="local")
    parser.add_argument("--tensorboard", action="store_true")
    parser.add_argument("--barrier-after-fit", action="store_true")
    parser.add_argument("--pg-timeout", type=float, default=None)
    parser.add_argument("--post-command", default=None)
    parser.add_argument("--post-command-timeout", type=float, default=None)
    parser.add_argument("--record-hooks", action="store_true")
    parser.add_argument("--raising-hook", action="store_true")
    parser.add_argument("--new-run", action="store_true")
    parser.add_argument("--resume-from", type=Path, default=None)
    parser.add_argument("--info-logs", action="store_true", help="show nemo_patch's INFO log lines")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.info_logs:
        import logging

        logging.getLogger("nemo_patch").setLevel(logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.WARNING)
            # the training side's lines are NeMo's (integration.use_nemo_logging): not a second time in this format
            logging.getLogger().handlers[0].addFilter(lambda record: not record.name.startswith("nemo_patch.training"))
    save_consolidated = None if args.save_consolidated is None else args.save_consolidated == "true"
    report = run_tiny_fit(
        args.out,
        frequency=args.frequency,
        save_consolidated=save_consolidated,
        max_steps=args.max_steps,
        fits=args.fits,
        save_every=args.save_every,
        async_save=args.async_save,
        stock=args.stock,
        probe_logits=args.probe_logits,
        max_pending=args.max_pending,
        max_shard_size=args.max_shard_size,
        timeout=args.timeout,
        tp=args.tp,
        pp=args.pp,
        lr=args.lr,
        tie_embeddings=not args.untied_embeddings,
        restore_from=args.restore_from,
        devices=args.devices,
        num_nodes=args.num_nodes,
        weights_only=args.weights_only,
        model_from=args.model_from,
        output_format=args.format,
        probe_hf=args.probe_hf,
        faults=args.fault,
        save_top_k=args.save_top_k,
        monitor=args.monitor,
        keep=args.keep,
        snapshot_checkpoints=args.snapshot_checkpoints,
        snapshot_copies=args.snapshot_copies,
        wait_for_consolidation=args.wait_for_consolidation,
        strategy_args=args.strategy_arg,
        config_args=args.config_arg,
        swap_io=args.swap_io,
        precision=args.precision,
        peft=args.peft,
        probe_merged=args.probe_merged,
        validate_every=args.validate_every,
        val_minimum_at=args.val_minimum_at,
        device=args.device,
        distributed_optimizer=args.distributed_optimizer,
        layer_spec=args.layer_spec,
        tensorboard=args.tensorboard,
        barrier_after_fit=args.barrier_after_fit,
        pg_timeout=args.pg_timeout,
        post_command=args.post_command,
        post_command_timeout=args.post_command_timeout,
        record_hooks=args.record_hooks,
        raising_hook=args.raising_hook,
        new_run=args.new_run,
        resume_from=args.resume_from,
    )
    if not report.get("global_rank_zero", True):
        return 0  # the other ranks of a multi-process run report nothing
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
