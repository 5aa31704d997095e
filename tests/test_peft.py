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

"""LoRA fine-tuning through NeMo's own ``llm.finetune`` on the CPU (issue #12): the PEFT callback rebuilds the
checkpoint IO and saves adapter-only checkpoints; consolidation stays on and writes ``adapter_model.safetensors``.

NeMo 2.7.3's LoRA needs two Transformer-Engine-absent fixes on this machine, in the CPU harness only (stub 9 of
``nemo_patch.testing.cpu_harness``)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_fit
from safetensors.torch import load_file

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.testing.fit_run import LORA_ALPHA, LORA_DIM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(imported_llama, tmp_path_factory):
    """4 LoRA steps from the imported Llama, a checkpoint every 2, NeMo's default async save, ``"each"``; the
    newest checkpoint's adapters merged offline in both formats and compared with the trained model's logits."""
    out = tmp_path_factory.mktemp("lora")
    report = run_fit(
        out, model_from=imported_llama / "nemo", peft="lora", frequency="each", max_steps=4, save_every=2,
        async_save=True, lr=0.01, probe_merged=True,
    )  # fmt: skip
    report["out"] = out
    report["root"] = out / "tiny_gpt" / "checkpoints"
    return report


def test_lora_checkpoints_are_consolidated_as_adapters(lora_run, imported_llama):
    assert lora_run["consolidation_errors"] == [] and lora_run["consolidations"] == 2
    root = lora_run["root"]
    assert lora_run["latest"] == lora_run["latest_target"] == "tiny_gpt--step=3-consumed_samples=8.0"
    for entry in lora_run["checkpoints"]:  # both saves and the -last copy
        output = root / entry["name"] / "consolidated"
        assert sorted(p.name for p in output.iterdir()) == ["adapter_model.safetensors", "metadata.json"], entry
        meta = json.loads((output / "metadata.json").read_text())
        assert meta["kind"] == "adapter" and meta["base_checkpoint"] == str(imported_llama / "nemo")
        assert meta["tensor_count"] == 8  # 2 layers x (linear_qkv, linear_proj) x (linear_in, linear_out)
        peft = meta["peft"]
        assert peft["method"] == "nemo.collections.llm.peft.lora.LoRA"
        assert (peft["dim"], peft["alpha"], peft["target_modules"]) == (
            LORA_DIM,
            LORA_ALPHA,
            ["linear_qkv", "linear_proj"],
        )
    # Every adapter tensor equals megatron-core's own reading of the distributed checkpoint, bit for bit.
    newest = root / lora_run["latest"]
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch.testing.mcore_compare", newest / "weights", newest / "consolidated"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1]) == {"compared": 8}, proc.stderr


def test_the_cli_writes_adapters_and_says_so(lora_run, tmp_path, capsys):
    newest = lora_run["root"] / lora_run["latest"]
    assert main([str(newest), "--out", str(tmp_path / "out"), "--verify"]) == 0
    assert ": 8 adapter tensors, " in capsys.readouterr().out
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == (
        newest / "consolidated" / "adapter_model.safetensors"
    ).read_bytes()
    # The Hugging Face format of adapters alone: a PEFT directory through NeMo's HFLlamaPEFTExporter.
    peft_dir = lora_run["out"] / "probe-merged" / "peft"
    assert {"adapter_model.safetensors", "adapter_config.json", "metadata.json"} <= {
        p.name for p in peft_dir.iterdir()
    }
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (LORA_DIM, LORA_ALPHA, "LORA")
    meta = json.loads((peft_dir / "metadata.json").read_text())
    assert meta["kind"] == "adapter" and meta["exporter"].endswith("HFLlamaPEFTExporter")


def test_merged_and_peft_outputs_give_the_trained_models_logits(lora_run):
    """The merged safetensors output in a plain megatron-core model (no adapters), the merged Hugging Face output in
    ``AutoModelForCausalLM`` and the Hugging Face PEFT directory on the base model compute the logits of the trained
    model with its adapters (fp32)."""
    assert lora_run["max_abs_merged_logit_diff"] < 1e-5
    assert lora_run["max_abs_merged_hf_logit_diff"] < 1e-5
    # Unmerged: peft.PeftModel.from_pretrained(<the base's transformers model>, <hf adapter dir>).
    assert lora_run["max_abs_peft_logit_diff"] < 1e-5


def test_merged_adapters_stream_to_the_files_of_nemos_exporter_on_the_whole_model(lora_run, tmp_path):
    """``merge_adapters=True`` with ``--format hf``: the streamed export (base + LoRA delta read per tensor through the
    engine) writes the same files, byte for byte, as NeMo's exporter on the whole merged model."""
    from nemo_patch.export.hf import export_hf_checkpoint

    newest = lora_run["root"] / lora_run["latest"]
    export_hf_checkpoint(newest, tmp_path / "streamed", merge_adapters=True, verify=True)
    export_hf_checkpoint(newest, tmp_path / "whole", merge_adapters=True, stream=False)
    names = sorted(path.name for path in (tmp_path / "whole").iterdir())
    assert "model.safetensors" in names and sorted(path.name for path in (tmp_path / "streamed").iterdir()) == names
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_the_merge_is_nemos_lora_merge_with_the_alpha_over_dim_scale(lora_run, imported_llama, tmp_path):
    newest = lora_run["root"] / lora_run["latest"]
    merged_dir = lora_run["out"] / "probe-merged" / "safetensors"
    merged = load_file(merged_dir / "model.safetensors")
    adapters = load_file(newest / "consolidated" / "adapter_model.safetensors")
    assert main([str(imported_llama / "nemo"), "--out", str(tmp_path / "base"), "--quiet"]) == 0
    base = load_file(tmp_path / "base" / "model.safetensors")
    assert sorted(merged) == sorted(base)  # the base model's tensors, nothing of the adapters' names
    scale = LORA_ALPHA / LORA_DIM
    assert scale == 2.0  # alpha != dim: a merge that forgot the scale would be off by the delta
    wrapped = {name.split(".adapter.")[0] + ".weight" for name in adapters}
    assert len(wrapped) == 4  # 2 layers x (linear_qkv, linear_proj)
    for name, tensor in merged.items():
        if name in wrapped:
            prefix = name.removesuffix(".weight")
            delta = adapters[f"{prefix}.adapter.linear_out.weight"] @ adapters[f"{prefix}.adapter.linear_in.weight"]
            assert delta.abs().max() > 1e-4, name  # training moved the adapter away from its zero init
            assert torch.equal(tensor, base[name] + scale * adapters[f"{prefix}.adapter.linear_out.weight"]
                               @ adapters[f"{prefix}.adapter.linear_in.weight"]), name  # fmt: skip
        else:
            assert torch.equal(tensor, base[name]), name
    meta = json.loads((merged_dir / "metadata.json").read_text())
    assert meta["kind"] == "model" and meta["merged_adapters"] == {
        "method": "nemo.collections.llm.peft.lora.LoRA",
        "alpha": LORA_ALPHA,
        "dim": LORA_DIM,
    }


def test_a_missing_base_checkpoint_exits_13_naming_it_and_writes_nothing(lora_run, imported_llama, tmp_path, capsys):
    import shutil

    copy = tmp_path / "adapter"
    shutil.copytree(lora_run["root"] / lora_run["latest"], copy, ignore=shutil.ignore_patterns("consolidated"))
    (copy / "weights" / "adapter_metadata.json").write_text(json.dumps({"model_ckpt_path": str(tmp_path / "gone")}))
    for output_format in ("safetensors", "hf"):
        out = tmp_path / output_format
        code = main([str(copy), "--merge-adapters", "--format", output_format, "--trust-context", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 13 and f"base checkpoint {tmp_path / 'gone'}" in err and "does not exist" in err, err
        assert "--base-checkpoint" in err and not out.exists() and not list(tmp_path.glob(".*tmp*"))
    # The base given where it is now (NeMo records the path as given, a relative one against the current directory).
    out = tmp_path / "merged"
    assert (
        main([str(copy), "--merge-adapters", "--base-checkpoint", str(imported_llama / "nemo"), "--out", str(out)])
        == 0
    )
    reference = lora_run["out"] / "probe-merged" / "safetensors" / "model.safetensors"
    assert (out / "model.safetensors").read_bytes() == reference.read_bytes()
    with pytest.raises(SystemExit) as usage:  # only meaningful with --merge-adapters
        main([str(copy), "--base-checkpoint", str(imported_llama / "nemo")])
    assert usage.value.code == 2 and "--base-checkpoint is only used with --merge-adapters" in capsys.readouterr().err


def test_a_tp2_lora_checkpoint_gives_the_same_adapter_and_merged_outputs_as_tp1(imported_llama, tmp_path):
    """LoRA at TP=2 (2 gloo processes: linear_qkv's adapter split on its output rows, linear_proj's on its input
    columns), then the same run resumed at TP=1 (NeMo re-shards the adapters on load) for one step with lr=0 and a
    fresh optimizer, so the TP=1 checkpoint holds the same adapter values in TP=1 layout: both consolidate to the same
    bytes, adapters and merged model alike; the TP=1 run merges during training
    (``ConsolidationConfig(merge_adapters=True)``)."""
    options = dict(model_from=imported_llama / "nemo", peft="lora", frequency="latest")
    tp2 = run_fit(tmp_path, tp=2, max_steps=2, lr=0.01, save_every=2, **options)
    # This run also merges during training (the strategy's ConsolidationConfig(merge_adapters=True)).
    merge = dict(strategy_arg=["ckpt_load_optimizer=false"], config_arg=["merge_adapters=true"])
    tp1 = run_fit(tmp_path, tp=1, max_steps=3, lr=0, save_every=1, **merge, **options)
    assert tp1["resumed_from"] and tp2["latest"] in tp1["resumed_from"]
    root = tmp_path / "tiny_gpt" / "checkpoints"
    first, second = root / tp2["latest"], root / tp1["latest"]
    assert {p.name for p in (first / "weights").glob("__1_*.distcp")} and not list((second / "weights").glob("__1_*"))
    assert tp1["consolidations"] == 1 and tp1["consolidation_errors"] == []
    adapters = first / "consolidated" / "adapter_model.safetensors"
    assert main([str(second), "--out", str(tmp_path / "tp1-adapters"), "--quiet"]) == 0
    assert adapters.read_bytes() == (tmp_path / "tp1-adapters" / "adapter_model.safetensors").read_bytes()
    assert load_file(adapters)["decoder.layers.1.self_attention.linear_qkv.adapter.linear_out.weight"].abs().max() > 0
    # Merged: offline from the TP=2 checkpoint == during training from the TP=1 one.
    assert main([str(first), "--merge-adapters", "--out", str(tmp_path / "tp2-merged"), "--quiet"]) == 0
    merged_during_training = second / "consolidated"
    meta = json.loads((merged_during_training / "metadata.json").read_text())
    assert meta["kind"] == "model" and meta["merged_adapters"]["alpha"] == LORA_ALPHA
    assert meta["base_checkpoint"] == str(imported_llama / "nemo")
    assert (tmp_path / "tp2-merged" / "model.safetensors").read_bytes() == (
        merged_during_training / "model.safetensors"
    ).read_bytes()
