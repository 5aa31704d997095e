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

"""``MegatronStrategy(ckpt_consolidation_frequency=...)``: its arguments, validated when the strategy is made, and a
real fit on the CPU: a tiny GPT trained by NeMo's ``llm.train`` with NeMo's default async save and
``ModelCheckpoint(save_top_k=2)``, its newest checkpoint consolidated when ``fit`` ends (``"latest"``), compared
with the trained model's own ``state_dict`` and named by ``<root>/LATEST``, and the callbacks' hook called."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from nemo.lightning.pytorch.strategies import MegatronStrategy
from safetensors.torch import load_file

from nemo_patch.training import policy
from nemo_patch.training import queue as queue_module
from nemo_patch.training import worker
from nemo_patch.training.callback import consolidation_of
from nemo_patch.training.config import ConsolidationConfig
from nemo_patch.training.settings import ConsolidationSettings

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]


#: One real fit of a 2-layer GPT on the CPU, in a fresh interpreter (NeMo's and megatron-core's process-global state);
#: ``sys.argv[1]`` is the output directory. Saves after every global step through NeMo's ``ModelCheckpoint`` with
#: ``save_top_k=2`` (NeMo removes all but the two newest) and NeMo's default async save; the cadence is ``"latest"``.
#: Writes ``final_state.pt`` (the trained model's ``state_dict``) and ``report.json``. Only what CUDA-only code paths
#: need is stubbed, for the duration of ``fit``: no GPU on the CI runner.
FIT = """
import contextlib, json, sys
from pathlib import Path
from unittest import mock
import torch
from torch.overrides import TorchFunctionMode

class CudaToCpu(TorchFunctionMode):  # megatron-core and NeMo allocate on the current CUDA device
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        cuda = lambda d: str(d).startswith("cuda") or (isinstance(d, int) and not isinstance(d, bool))
        if cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        if getattr(func, "__name__", "") in ("to", "cuda"):
            kwargs.pop("non_blocking", None)
            args = tuple("cpu" if i > 0 and cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)

def on_cpu():
    from megatron.core.tensor_parallel import random as mcore_random
    stream = type("NoStream", (), {"__init__": lambda s, *a, **k: None, "wait_stream": lambda s, *a: None})
    noop, receiver = (lambda *a, **k: None), (lambda self, *a, **k: self)
    stack = contextlib.ExitStack()
    for target, name, value in (
        (torch.cuda, "Stream", stream), (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "current_device", lambda: 0), (torch.cuda, "synchronize", noop),
        (torch.cuda, "manual_seed", noop), (torch.cuda, "manual_seed_all", noop), (torch.cuda, "empty_cache", noop),
        (torch.Tensor, "cuda", receiver), (torch.nn.Module, "cuda", receiver),
        (mcore_random.CudaRNGStatesTracker, "fork", lambda self, name="": contextlib.nullcontext()),
        (mcore_random.CudaRNGStatesTracker, "add", noop),
    ):
        stack.enter_context(mock.patch.object(target, name, value))
    stack.enter_context(CudaToCpu())
    return stack

def main():
    import lightning.pytorch as pl
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec
    from nemo.lightning.pytorch.plugins import MegatronDataSampler
    from torch.utils.data import DataLoader

    out, hooks, observed = Path(sys.argv[1]), [], []
    from nemo_patch.training.schedule import ConsolidationObserver, register_observer

    class Published(ConsolidationObserver):  # an extension's observer, registered as an extension registers it
        def on_published(self, save):
            observed.append(save.path.name)

    register_observer(Published)

    class Hooks(pl.Callback):
        def on_consolidation_end(self, trainer, pl_module, result):
            hooks.append({"checkpoint": Path(result.checkpoint_dir).name, "global_step": result.global_step})

    class Tokens(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.seq_length, self.micro_batch_size, self.global_batch_size = 16, 2, 2
            self.data_sampler = MegatronDataSampler(seq_len=16, micro_batch_size=2, global_batch_size=2)
        def train_dataloader(self):
            tokens = torch.randint(0, 128, (64, 17), generator=torch.Generator().manual_seed(0))
            mask = ~torch.tril(torch.ones(16, 16, dtype=torch.bool))
            batches = [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(16),
                        "position_ids": torch.arange(16), "attention_mask": mask[None]} for t in tokens]
            return DataLoader(batches, batch_size=2)

    config = llm.GPTConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=16, vocab_size=128,
        make_vocab_size_divisible_by=128, transformer_layer_spec=local_layer_spec, params_dtype=torch.float32,
        bf16=False, use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False)
    optim = nl.MegatronOptimizerModule(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0))
    model = llm.GPTModel(config, optim=optim)
    strategy = nl.MegatronStrategy(ckpt_consolidation_frequency="latest")  # NeMo's default: ckpt_async_save=True
    trainer = nl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, strategy=strategy, callbacks=[Hooks()], limit_val_batches=0,
        plugins=nl.MegatronMixedPrecision(precision="32"), num_sanity_val_steps=0, enable_progress_bar=False)
    checkpoint = nl.ModelCheckpoint(every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                                    filename="tiny--{step}-{consumed_samples}")
    log = nl.NeMoLogger(log_dir=str(out), name="tiny", ckpt=checkpoint, use_datetime_version=False)
    with on_cpu():
        llm.train(model, Tokens(), trainer, log=log, tokenizer=None)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save(state, out / "final_state.pt")
    root = out / "tiny" / "checkpoints"
    (out / "report.json").write_text(json.dumps({
        "hooks": hooks, "observed": observed, "async_save": strategy.async_save, "global_step": trainer.global_step,
        "latest": str(root / "LATEST") if (root / "LATEST").is_symlink() else None,
        "latest_target": str((root / "LATEST").resolve()) if (root / "LATEST").is_symlink() else None}))

if __name__ == "__main__":
    main()
"""
#: Whether these tests run in NeMo's tree with the consolidation pull requests applied (else: with the overlay).
IN_NEMO = ConsolidationConfig.__module__.startswith("nemo.")


class TestMegatronStrategyConsolidation:
    def test_off_by_default_and_validated_when_made(self):
        assert consolidation_of(MegatronStrategy().checkpoint_io) is None
        strategy = MegatronStrategy(save_consolidated=True, ckpt_consolidation=ConsolidationConfig(dtype="bf16"))
        assert str(strategy.consolidation_settings.policy) == "each"
        assert consolidation_of(strategy.checkpoint_io).settings.config.dtype == "bf16"
        with pytest.raises(ValueError, match="ckpt_consolidation_frequency"):
            MegatronStrategy(ckpt_consolidation_frequency="every_n:0")
        with pytest.raises(ValueError, match="ckpt_consolidation"):
            MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation={"dtype": "bf16"})
        with pytest.raises(TypeError, match="did you mean 'ckpt_consolidation_frequency'"):
            MegatronStrategy(ckpt_consolidaton_frequency="each")

    def test_a_flat_keyword_is_deprecated_by_the_overlay_and_unknown_in_nemo(self):
        """A deliberate difference (docs/UPSTREAM.md): the overlay takes the flat keywords of its earlier versions
        with a warning; NeMo never had them and names the config field that replaces one."""
        if IN_NEMO:
            with pytest.raises(TypeError, match=r"did you mean 'ckpt_consolidation=ConsolidationConfig\(dtype=...\)'"):
                MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation_dtype="bf16")
            return
        with pytest.warns(DeprecationWarning, match=r"ckpt_consolidation=ConsolidationConfig\(dtype=...\)"):
            strategy = MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation_dtype="bf16")
        assert strategy.consolidation_settings.config.dtype == "bf16"

    def test_a_field_of_a_later_pull_request_is_not_one_until_it_lands(self):
        """A deliberate difference of the series' stages (docs/UPSTREAM.md): ``format`` comes with the Hugging Face
        export, which the overlay has and the consolidation pull requests do not add; in NeMo's tree it is not a
        field (nor are ``merge_adapters``, ``post_command``, ``post_command_timeout``)."""
        later = ("format", "merge_adapters", "post_command", "post_command_timeout")
        if IN_NEMO:
            assert not set(later) & {field.name for field in dataclasses.fields(ConsolidationConfig)}
            with pytest.raises(TypeError, match="unexpected keyword argument 'format'"):
                ConsolidationConfig(format="hf")
            return
        assert set(later) <= {field.name for field in dataclasses.fields(ConsolidationConfig)}
        strategy = MegatronStrategy(ckpt_consolidation=ConsolidationConfig(format="hf"))
        assert strategy.consolidation_settings.policy is None  # no cadence: consolidation stays off
        strategy = MegatronStrategy(
            ckpt_consolidation_frequency="each", ckpt_consolidation=ConsolidationConfig(format="hf")
        )
        assert consolidation_of(strategy.checkpoint_io).settings.config.format == "hf"

    @pytest.mark.slow
    def test_a_fit_with_async_save_and_top_k_removal_consolidates_its_latest_checkpoint(self, tmp_path):
        """The newest checkpoint's output is the trained model's weights; the checkpoints NeMo's top-k removed left
        nothing behind; ``<root>/LATEST`` names the newest checkpoint and ``on_consolidation_end`` was called once."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST")}
        proc = subprocess.run([sys.executable, "-c", FIT, str(tmp_path)], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["async_save"] and report["global_step"] == 4
        root = tmp_path / "tiny" / "checkpoints"
        kept = sorted(path for path in root.iterdir() if path.is_dir() and "step=" in path.name)
        steps = sorted(int(path.name.split("step=")[1].split("-")[0]) for path in kept if "-last" not in path.name)
        assert steps == [2, 3], [path.name for path in root.iterdir()]  # top-k removed steps 0 and 1, whole
        newest = next(path for path in kept if "step=3" in path.name and "-last" not in path.name)
        outputs = sorted(path.name for path in kept if (path / "consolidated").exists())
        assert newest.name in outputs and not any("step=2" in name for name in outputs), outputs
        tensors = load_file(newest / "consolidated" / "model.safetensors")
        final = torch.load(tmp_path / "final_state.pt", weights_only=True)
        # the checkpoint's names: the layer spec's map of the model's names (megatron-core's sharded_state_dict)
        renames = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
        expected = {}
        for name, tensor in final.items():
            for old, new in renames.items():
                name = re.sub(rf"(layers\.\d+\.){re.escape(old)}", rf"\g<1>{new}", name)
            if "_extra_state" not in name:
                expected[name.removeprefix("module.")] = tensor
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name]) for name in expected)
        assert report["observed"] == [newest.name]  # a registered observer sees the output published
        assert os.readlink(report["latest"]) == newest.name  # <root>/LATEST, relative
        assert report["hooks"] == [{"checkpoint": newest.name, "global_step": 4}]  # on_consolidation_end, once

    def test_a_launcher_and_an_extension_module_reach_the_consolidation_process(self, tmp_path, monkeypatch):
        """``worker.PROCESS_LAUNCHERS`` changes the process's command line and environment; the ``--extension``
        module it names is set up in the process, before it serves, with the training process's pid (docs/UPSTREAM.md:
        in NeMo's tree the process has imported torch by then)."""
        (tmp_path / "probe_extension.py").write_text(
            "import os, sys\n"
            "def extend_worker(parent):\n"
            "    open(os.environ['PROBE_OUT'], 'w').write(f'{parent} {\"torch\" in sys.modules}')\n"
        )

        def launch(args, environ):
            env = dict(environ, PROBE_OUT=str(tmp_path / "probe.txt"))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), environ.get("PYTHONPATH")]))
            return [*args, "--parent", str(os.getpid()), "--extension", "probe_extension"], env

        monkeypatch.setattr(worker, "PROCESS_LAUNCHERS", [launch])
        monkeypatch.setattr(queue_module, "PROCESS_LAUNCHERS", [launch])
        queue = queue_module.ConsolidationQueue(lambda save, error: None, ConsolidationSettings(frequency="each"))
        queue.start_process()
        try:
            deadline = time.monotonic() + 120
            while not queue._server.ready and queue._server.alive and time.monotonic() < deadline:
                queue._server.result()
                time.sleep(0.1)
            assert queue._server.ready
        finally:
            queue.close()
        parent, torch_imported = (tmp_path / "probe.txt").read_text().split()
        assert parent == str(os.getpid())
        # set up before the worker imports torch; in NeMo's tree ``import nemo.lightning`` (the package) already did
        assert torch_imported == str(IN_NEMO)

    def test_an_extension_adds_a_cadence_and_phases(self, monkeypatch):
        monkeypatch.setattr(policy, "_MORE_CADENCES", list(policy._MORE_CADENCES))
        monkeypatch.setattr(policy, "_PHASES", list(policy._PHASES))
        monkeypatch.setattr(policy, "ACCEPTED_FREQUENCIES", policy.ACCEPTED_FREQUENCIES)

        def phases(value, parse_cadence):
            return [parse_cadence(item)[0] for item in value.split(";")], False

        if not IN_NEMO:  # the overlay registered its own ("best", phases) when it was imported
            assert "best" in policy._MORE_CADENCES and policy._PHASES
        else:
            with pytest.raises(ValueError, match="'best' is not a cadence"):
                policy.parse_consolidation_frequency("best")
        policy.extend_cadences(("best",), phases, ' or "<cadence>;<cadence>@<global step>"')
        assert str(policy.parse_consolidation_frequency("each;best@10")) == "each; best@10"
        assert policy.ACCEPTED_FREQUENCIES.endswith(' or "<cadence>;<cadence>@<global step>"')
