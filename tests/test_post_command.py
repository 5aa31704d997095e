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

"""The command run after an output is published (``--post-command``): placeholders and environment, its log, its
timeout, metrics from its JSON lines, and its result in ``metadata.json``; the real CLI on a real checkpoint."""

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from nemo_patch.runs.post_command import PostCommandResult, check_placeholders, parse_metrics_line, run_post_command


@pytest.fixture()
def output(tmp_path) -> Path:
    """A directory shaped like a published output: a ``metadata.json`` to record into."""
    out = tmp_path / "ckpt" / "consolidated"
    out.mkdir(parents=True)
    (out / "metadata.json").write_text(json.dumps({"format_version": 2, "global_step": 6}))
    return out


def _recorded(output: Path) -> dict:
    return json.loads((output / "metadata.json").read_text())["post_command"]


def test_placeholders_environment_log_and_metrics(output):
    command = (
        "echo out={output} fmt={format} step={global_step} ckpt={checkpoint}; "
        'echo env=$NEMO_CONSOLIDATED_OUTPUT,$NEMO_CONSOLIDATED_GLOBAL_STEP; echo to stderr >&2; '
        """echo '{{"eval/perplexity": 12.5, "eval/tokens": 100}}'; echo '{{"eval/perplexity": 11.0}}'; """
        """echo '{{"not": "a number"}}'"""
    )
    result = run_post_command(command, output, "safetensors", 6, output.parent, timeout=60)
    assert result.ok and result.returncode == 0 and not result.timed_out
    assert result.metrics == {"eval/perplexity": 11.0, "eval/tokens": 100.0}  # later lines win
    log = Path(result.log).read_text()
    assert f"out={output} fmt=safetensors step=6 ckpt={output.parent}\n" in log
    assert f"env={output},6" in log and "to stderr" in log
    assert Path(result.log) == output.parent / "consolidated.post-command.log"  # beside the output, not in it
    assert sorted(p.name for p in output.iterdir()) == ["metadata.json"]
    recorded = _recorded(output)
    assert recorded["returncode"] == 0 and recorded["metrics"] == result.metrics and recorded["command"] == command


def test_a_path_with_spaces_and_quotes_reaches_the_command_as_one_argument(tmp_path):
    out = tmp_path / "it's a dir" / "consolidated"
    out.mkdir(parents=True)
    (out / "metadata.json").write_text("{}")
    result = run_post_command("test -d {output} && printf %s {output}", out, "hf", None, out.parent, timeout=60)
    assert result.ok and Path(result.log).read_text() == str(out)


def test_a_failing_command_is_recorded_as_failed(output):
    result = run_post_command("echo partial; exit 3", output, "safetensors", 6, output.parent, timeout=60)
    assert not result.ok and result.returncode == 3 and "exited 3" in result.describe()
    assert _recorded(output)["returncode"] == 3


def test_a_hanging_command_and_its_children_are_stopped_at_the_timeout(output):
    started = time.monotonic()
    result = run_post_command("sleep 300 & sleep 300; echo never", output, "safetensors", 6, output.parent, timeout=2)
    assert time.monotonic() - started < 30
    assert result.timed_out and not result.ok and "timed out" in result.describe()
    assert "never" not in Path(result.log).read_text()
    assert _recorded(output)["timed_out"] is True


def test_a_noisy_command_is_logged_whole_and_its_metrics_still_found(output, tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text("import sys\nsys.stdout.write('x' * 3000000 + '\\n')\nprint('{\"m\": 1}')\n")
    result = run_post_command(f"{sys.executable} {script}", output, "safetensors", 6, output.parent, timeout=60)
    assert result.ok and result.metrics == {"m": 1.0}
    assert Path(result.log).stat().st_size > 3000000


@pytest.mark.parametrize("command", ["echo {outptu}", "echo {0}"])
def test_an_unknown_placeholder_is_refused_before_running(output, command):
    with pytest.raises(ValueError, match="unknown placeholder"):
        run_post_command(command, output, "safetensors", 6, output.parent, timeout=60)


@pytest.mark.parametrize(
    "line, metrics",
    [
        ('{"a": 1, "b": 2.5}', {"a": 1.0, "b": 2.5}),
        ("  {\"a\": -1e3}  ", {"a": -1000.0}),
        ('{"a": true}', None),
        ('{"a": NaN}', None),
        ('{"a": "1"}', None),
        ("{}", None),
        ("[1]", None),
        ("plain text", None),
        ('{"": 1}', None),
    ],
)
def test_metrics_lines(line, metrics):
    assert parse_metrics_line(line) == metrics


@pytest.mark.slow
def test_the_cli_runs_it_after_publishing_and_exits_17_when_it_fails(tp2_checkpoint, tmp_path, capsys):
    from nemo_patch.cli.nemo_consolidate import main

    checkpoint = tmp_path / tp2_checkpoint.name
    shutil.copytree(tp2_checkpoint, checkpoint, ignore=shutil.ignore_patterns("consolidated"))
    out = tmp_path / "out"
    command = "ls {output} > /dev/null && echo '{{\"eval/score\": 0.5}}'"
    assert main([str(checkpoint), "--out", str(out), "--workers", "1", "--post-command", command]) == 0
    assert "metrics {'eval/score': 0.5}" in capsys.readouterr().out
    assert json.loads((out / "metadata.json").read_text())["post_command"]["metrics"] == {"eval/score": 0.5}
    code = main(
        [str(checkpoint), "--out", str(out), "--force", "--quiet", "--workers", "1", "--post-command", "false"]
    )
    err = capsys.readouterr().err
    assert code == 17 and len(err.strip().splitlines()) == 1 and "PostCommandError: post command exited 1" in err
    assert (out / "model.safetensors").is_file()  # the output stays published: it is complete
    assert json.loads((out / "metadata.json").read_text())["post_command"]["returncode"] == 1


def test_a_command_asked_to_stop_is_stopped_with_its_children_and_recorded_as_stopped(output):
    started = time.monotonic()
    result = run_post_command(
        "echo '{{\"m\": 1}}'; sleep 300 & sleep 300", output, "safetensors", 6, output.parent, timeout=600,
        should_stop=lambda: time.monotonic() - started > 1,
    )  # fmt: skip
    assert time.monotonic() - started < 30
    assert result.stopped and not result.timed_out and not result.ok and result.metrics == {"m": 1.0}
    assert "was stopped after" in result.describe()
    assert _recorded(output)["stopped"] is True


def test_a_result_round_trips_through_json_and_a_partial_one_is_read_with_empty_values():
    result = PostCommandResult("cmd", 3, 1.5, False, "/x.log", {"a": 1.0})
    assert PostCommandResult.from_json(result.to_json()) == result
    lost = PostCommandResult.from_json({"stopped": True, "error": "the consolidation process ended", "metrics": 7})
    assert lost.stopped and not lost.ok and lost.returncode is None and lost.metrics == {} and lost.command == ""
    assert "was stopped after 0.0 s (the consolidation process ended)" in lost.describe()


def test_placeholders_are_checked_without_running_anything():
    assert check_placeholders("echo {output} {{literal}}") == "echo '' {literal}"
    with pytest.raises(ValueError, match="unknown placeholder 'out'"):
        check_placeholders("echo {out}")
