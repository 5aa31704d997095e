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

"""End-to-end: after each consolidation of a real fit, the post command and the callbacks' hooks.

Two real fits of the tiny GPT on the CPU, each with a hook-recording callback:

* ``each`` (saves at global steps 2, 4, 6, 8): the post command reads the embedding from each published
  ``model.safetensors`` with ``safetensors`` and prints its L2 norm as a metric, which must reach TensorBoard at the
  checkpoint's global step; at step 2 it is noisy (3 MB on stdout, lines on stderr), at step 6 it then hangs until its
  own timeout, at step 8 it then exits 3; the consolidation of step 4 fails (a file-size limit), so no command runs
  for it and ``on_consolidation_failed`` is called. A second callback's ``on_consolidation_end`` raises every time.
* ``best`` with ``ConsolidationConfig(max_pending=1)``: the first best output's post command never ends by itself, so
  the later best checkpoints wait (one is skipped beyond the bound) while training goes on; the end of ``fit`` stops
  waiting after ``ConsolidationConfig.timeout`` and the command is stopped, recorded as such, and the hook still
  called for its output (kept under ``retained/``: NeMo's top-k removal of its checkpoint waited for it).
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import run_fit

from nemo_patch.testing.hook_recorder import HOOK_ERROR

pytestmark = pytest.mark.slow

POST_TIMEOUT = 6.0
EVAL_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from safetensors import safe_open

output, step = Path(sys.argv[1]), int(sys.argv[2])
ancestors, pid = [], os.getppid()
while pid > 1 and not any("nemo_patch.training.worker" in part for part in ancestors):
    ancestors.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\\0", b" ").decode())
    pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
sys.stderr.write(f"run by: {ancestors[-1]}\\nCUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}\\n")
with safe_open(str(output / "model.safetensors"), framework="numpy") as weights:
    name = next(name for name in weights.keys() if "word_embeddings" in name)
    norm = float((weights.get_tensor(name).astype("float64") ** 2).sum() ** 0.5)
print(json.dumps({"eval/embedding_norm": norm}), flush=True)
if step == 2:
    sys.stdout.write("x" * 3_000_000 + "\\n{not json\\n")
    sys.stderr.write("warning: noisy\\n" * 10000)
elif step == 6:
    time.sleep(600)
elif step == 8:
    sys.exit(3)
"""


def _hooks(out: Path) -> list:
    return [json.loads(line) for line in (out / "hooks.jsonl").read_text().splitlines()]


def _scalars(report: dict, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(report["tensorboard_dir"])
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def _norm(output: Path) -> float:
    from safetensors.torch import load_file

    weights = load_file(str(output / "model.safetensors"))
    name = next(name for name in weights if "word_embeddings" in name)
    return float(weights[name].double().norm())


def test_post_commands_and_hooks_of_each_output_and_training_unaffected(tmp_path):
    script = tmp_path / "eval_embedding.py"
    script.write_text(EVAL_SCRIPT)
    out = tmp_path / "run"
    report = run_fit(
        out, frequency="each", max_steps=8, save_every=2, max_pending=8, fault="fsize:2",
        post_command=f"{sys.executable} {script} {{output}} {{global_step}}", post_command_timeout=POST_TIMEOUT,
        tensorboard=True, info_logs=True, record_hooks=True, raising_hook=True,
    )  # fmt: skip
    assert report["global_step"] == 8  # training reached its end
    calls = _hooks(out)
    ended = {call["global_step"]: call for call in calls if call["hook"] == "end"}
    failed = [call for call in calls if call["hook"] == "failed"]
    # once per published output (the -last copies get links, not consolidations); the failure once, without a command
    assert sorted(call["global_step"] for call in calls if call["hook"] == "end") == [2, 6, 8]
    assert [call["global_step"] for call in failed] == [4] and failed[0]["error"] and failed[0]["post_command"] is None
    assert report["completed_steps"] == [2, 6, 8] and len(report["consolidation_errors"]) == 1
    assert all(call["pl_module_is_the_model"] and call["format"] == "safetensors" for call in calls)
    assert any(call["after_train_end"] for call in ended.values())  # reaped when fit ended, still reported
    assert report["raising_hook_calls"] == 3  # a raising hook is still called for every output

    metrics = dict(_scalars(report, "eval/embedding_norm"))
    assert sorted(metrics) == [2, 6, 8]  # at the checkpoint's global step, also from the commands that failed later
    for step, call in ended.items():
        output = Path(call["output_dir"])
        assert call["output_exists"] and call["bytes"] > 0
        assert call["metrics"]["eval/embedding_norm"] == pytest.approx(_norm(output), rel=1e-9)
        assert metrics[step] == pytest.approx(_norm(output), rel=1e-6)  # TensorBoard keeps float32
        recorded = json.loads((output / "metadata.json").read_text())["post_command"]
        assert recorded == call["post_command"] == call["metadata"]["post_command"]
        log = Path(recorded["log"])
        assert log.parent == output.parent and "nemo_patch.training.worker" in log.read_text(errors="replace")
        assert "CUDA_VISIBLE_DEVICES=''" in log.read_text(errors="replace")  # the consolidation process's environment
    assert ended[2]["post_command_ok"] and ended[2]["post_command"]["returncode"] == 0
    noisy = Path(ended[2]["post_command"]["log"]).read_text()
    assert len(noisy) > 3_000_000 and "warning: noisy" in noisy and "{not json" in noisy
    hung = ended[6]["post_command"]
    assert (
        hung["timed_out"] and not ended[6]["post_command_ok"] and POST_TIMEOUT <= hung["seconds"] < POST_TIMEOUT + 10
    )
    assert ended[8]["post_command"]["returncode"] == 3 and not ended[8]["post_command_ok"]
    assert ended[6]["seconds"] < hung["seconds"]  # a consolidation's own time leaves its command's out

    log = (out / "fit.log").read_text()
    assert len(re.findall(r"RaisingConsolidationHook\.on_consolidation_end raised", log)) == 1  # logged once
    assert log.count(f"RuntimeError: {HOOK_ERROR}") == 1
    assert len(re.findall(r"\[NeMo W [^\]]*\] After publishing .* post command timed out after", log)) == 1
    assert len(re.findall(r"\[NeMo W [^\]]*\] After publishing .* post command exited 3 after", log)) == 1
    assert len(re.findall(r"\[NeMo I [^\]]*\] After publishing .* post command exited 0 after", log)) == 1


def test_a_command_that_runs_on_delays_later_consolidations_not_training_and_is_stopped_when_fit_ends(tmp_path):
    pids = tmp_path / "post-command-pids"
    command = f'echo $$ >> {pids}; echo "{{{{\\"eval/step\\": $NEMO_CONSOLIDATED_GLOBAL_STEP}}}}"; sleep 3600'
    out = tmp_path / "run"
    report = run_fit(
        out, frequency="best", monitor="val_loss", save_top_k=2, validate_every=2, val_minimum_at=6, lr=5e-3,
        max_steps=8, max_pending=1, timeout=8, post_command=command, tensorboard=True, info_logs=True,
        record_hooks=True,
    )  # fmt: skip
    assert report["global_step"] == 8 and sorted(map(int, report["val_loss"])) == [2, 4, 6, 8]
    # the first best output's command ran through training: one consolidation; the later best checkpoints (4 and 6)
    # waited behind it and were dropped when fit ended, or one was skipped beyond the bound (the bound holds once the
    # process is ready: on a loaded machine its start-up outlasts the saves of 4 and 6, and both wait)
    log = (out / "fit.log").read_text()
    (dropped,) = re.findall(r"\[NeMo E [^\]]*\] Checkpoint consolidation did not finish .* dropping (\d+) queued", log)
    assert report["completed_steps"] == [2] and len(report["skipped"]) + int(dropped) == 2
    if report["skipped"]:
        assert _scalars(report, "consolidation/skipped")[-1][1] >= 1
    assert 8 <= report["end_wait_seconds"] < 60  # the end of fit waited ConsolidationConfig.timeout, not the command
    calls = _hooks(out)
    assert [(call["hook"], call["global_step"]) for call in calls] == [("end", 2)]
    (call,) = calls
    assert call["after_train_end"] and call["output_exists"]
    assert "/retained/" in call["output_dir"]  # NeMo's removal of its checkpoint waited for the command, then kept it
    stopped = call["post_command"]
    assert stopped["stopped"] and not stopped["timed_out"] and not call["post_command_ok"]
    assert json.loads((Path(call["output_dir"]) / "metadata.json").read_text())["post_command"] == stopped
    assert _scalars(report, "eval/step") == [(2, 2.0)]
    (pid,) = [int(line) for line in pids.read_text().split()]
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing of the command's process group is left
    assert len(re.findall(r"\[NeMo W [^\]]*\] After publishing .* post command was stopped after", log)) == 1
