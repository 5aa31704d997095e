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

"""The examples of ``docs/after-consolidation.md`` are what they claim: every Python block parses, every post command
it gives is one ``ConsolidationConfig`` takes, and the perplexity script, run on a tiny Hugging Face Llama directory
(the ``hf`` output's form), prints one metrics line with the model's perplexity on the text."""

import ast
import json
import math
import re
import subprocess
import sys

import pytest
from conftest import REPO

from nemo_patch.runs.post_command import parse_metrics_line
from nemo_patch.training.config import validate_post_command

PAGE = REPO / "docs" / "after-consolidation.md"


def _python_blocks() -> list:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_every_block_parses_and_every_post_command_is_taken():
    blocks = _python_blocks()
    commands = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.keyword) and node.arg == "post_command":  # ConsolidationConfig(post_command=...)
                commands.append(ast.literal_eval(node.value))
    assert len(blocks) >= 6 and len(commands) >= 5
    assert any("huggingface-cli upload" in c for c in commands) and any("aws s3 cp" in c for c in commands)
    for command in commands:
        assert validate_post_command(command, "--post-command") == command


@pytest.mark.slow
def test_the_perplexity_script_prints_the_perplexity_of_the_model_on_the_text(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_patch.testing.tiny_llama import make_tiny_hf_llama

    model_dir = make_tiny_hf_llama(tmp_path / "hf")
    script = next(block for block in _python_blocks() if block.startswith("# /opt/eval/eval_perplexity.py"))
    (tmp_path / "eval_perplexity.py").write_text(script)
    text = " ".join(f"t{(7 * i) % 120}" for i in range(60))
    (tmp_path / "heldout.txt").write_text(text)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "eval_perplexity.py"), str(model_dir), str(tmp_path / "heldout.txt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if parse_metrics_line(line)]
    metrics = json.loads(line)
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = math.exp(model(ids, labels=ids).loss.item())
    assert metrics["eval/heldout_tokens"] == ids.shape[1] - 1
    assert math.isclose(metrics["eval/heldout_perplexity"], expected, rel_tol=1e-5) and expected > 1


@pytest.mark.slow
def test_the_perplexity_of_each_hf_output_reaches_tensorboard_at_its_step(imported_llama, tmp_path):
    """The docs' perplexity script as the post command of a real fine-tune of the tiny Llama with ``hf`` outputs: its
    metric is in TensorBoard at each consolidated checkpoint's global step, equal to transformers' own perplexity of
    that output on the text."""
    import torch
    from conftest import run_fit
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = next(block for block in _python_blocks() if block.startswith("# /opt/eval/eval_perplexity.py"))
    (tmp_path / "eval_perplexity.py").write_text(script)
    text = " ".join(f"t{(7 * i) % 120}" for i in range(60))
    (tmp_path / "heldout.txt").write_text(text)
    report = run_fit(
        tmp_path / "ft", model_from=imported_llama / "nemo", format="hf", frequency="every_n:2", max_steps=4,
        save_every=1, max_pending=8, tensorboard=True, lr=1e-2,
        post_command=f"{sys.executable} {tmp_path / 'eval_perplexity.py'} {{output}} {tmp_path / 'heldout.txt'}",
    )  # fmt: skip
    events = EventAccumulator(report["tensorboard_dir"])
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("eval/heldout_perplexity")}
    root = tmp_path / "ft" / "tiny_gpt" / "checkpoints"
    outputs = {}
    for checkpoint in root.iterdir():
        meta = checkpoint / "hf" / "metadata.json"
        if meta.is_file() and not checkpoint.name.endswith("-last"):
            recorded = json.loads(meta.read_text())
            assert recorded["post_command"]["returncode"] == 0
            outputs[recorded["global_step"]] = checkpoint / "hf"
    assert sorted(outputs) == sorted(logged) == [2, 4]  # every_n:2 of the saves at steps 1 to 4
    tokenizer = AutoTokenizer.from_pretrained(outputs[2])
    ids = tokenizer(text, return_tensors="pt").input_ids
    for step, output in outputs.items():
        model = AutoModelForCausalLM.from_pretrained(output, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            expected = math.exp(model(ids, labels=ids).loss.item())
        assert math.isclose(logged[step], expected, rel_tol=1e-4), (step, logged[step], expected)
    assert logged[2] != logged[4]  # the weights trained between the two
