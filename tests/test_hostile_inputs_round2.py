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

"""Hostile or unusual inputs, second round: each once crashed or misbehaved; each test drives the real code (the CLI on
a real checkpoint where the input is a checkpoint), one section per input."""

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from nemo_patch.cli.nemo_consolidate import build_parser
from nemo_patch.cli.nemo_consolidate import main as consolidate_main
from nemo_patch.engine.adapter_settings import peft_settings
from nemo_patch.engine.safe_files import read_json_file
from nemo_patch.export.errors import UntrustedContextError
from nemo_patch.runs.post_command import PLACEHOLDERS, check_placeholders, run_post_command
from nemo_patch.training.config import validate_max_shard_size
from nemo_patch.training.worker import WORKER_NICENESS

#: 200,000 nested arrays: valid JSON, far deeper than the parser's recursion limit.
DEEP_JSON = "[" * 200_000 + "]" * 200_000


def run_cli(args: List[str]) -> Tuple[int, List[str], List[str]]:
    """``nemo-consolidate`` in-process; returns (exit code, stdout lines, stderr lines)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            code = consolidate_main(args + ["--workers", "1"])
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    lines = [line for line in stderr.getvalue().splitlines() if line.strip() and "pynvml" not in line]
    return code, stdout.getvalue().splitlines(), lines


# --- 1. JSON nested too deeply -----------------------------------------------------------------------------------


def test_json_nested_too_deeply_is_invalid_json_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text(DEEP_JSON)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_json_file(path)


@pytest.mark.slow
def test_weights_metadata_json_nested_too_deeply_is_read_as_one_that_is_not_json(checkpoint_copy, tmp_path):
    """megatron-core's ``weights/metadata.json`` that cannot be read as JSON makes the directory a plain DCP one
    (``checkpoint_layout.sharded_backend``): the same for one nested too deeply as for one that is invalid JSON."""
    outputs = []
    for name, text in [("invalid", "{"), ("deep", DEEP_JSON)]:
        (checkpoint_copy / "weights" / "metadata.json").write_text(text)
        code, out, err = run_cli([str(checkpoint_copy), "--out", str(tmp_path / name)])
        assert code == 0 and err == [] and len(out) == 1 and out[0].startswith("Consolidated "), (name, out, err)
        outputs.append(load_file(tmp_path / name / "model.safetensors"))
    assert outputs[0].keys() == outputs[1].keys() and len(outputs[0]) == 28
    assert all(torch.equal(outputs[0][key], outputs[1][key]) for key in outputs[0])


@pytest.mark.slow
def test_a_tokenizer_json_nested_too_deeply_gives_an_unknown_tokenizer_size(checkpoint_copy, tmp_path):
    tokenizer = checkpoint_copy / "context" / "nemo_tokenizer" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text(DEEP_JSON)
    code, out, err = run_cli([str(checkpoint_copy), "--out", str(tmp_path / "out")])
    assert code == 0 and err == [] and len(out) == 1, (out, err)
    metadata = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert metadata["vocab_size"] == {"padded": 128, "tokenizer": None}


@pytest.mark.slow
def test_an_io_json_nested_too_deeply_is_a_context_that_cannot_be_read(checkpoint_copy, tmp_path):
    """``--format hf``: exit 16 (a context that cannot be read is not trusted, as ``context_trust`` documents) in one
    line; ``--verify``: a warning that names and shapes were not compared, and the output is written."""
    (checkpoint_copy / "context" / "io.json").write_text(DEEP_JSON)
    code, out, err = run_cli([str(checkpoint_copy), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert code == UntrustedContextError.exit_code == 16, err
    assert len(err) == 1 and err[0].startswith("nemo-consolidate: error: Cannot read ") and "io.json" in err[0], err
    assert "nested too deeply" in err[0] and not (tmp_path / "hf").exists()
    parser = build_parser()
    parser.format_help()  # makes the exit-code epilog
    assert f"{UntrustedContextError.exit_code} {UntrustedContextError.summary}" in parser.epilog

    code, out, err = run_cli([str(checkpoint_copy), "--verify", "--out", str(tmp_path / "verified")])
    assert code == 0 and len(out) == 1 and out[0].endswith(", verified"), (out, err)
    assert len(err) == 1 and err[0].startswith("nemo-consolidate: warning: names and shapes not compared"), err
    assert "nested too deeply" in err[0]


# --- 2. a timeout beyond timedelta -------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [1e14, float(sys.maxsize)])
def test_the_other_ranks_wait_for_rank_0_under_any_accepted_timeout(monkeypatch, caplog, timeout):
    """``timedelta(seconds=1e14)`` overflows: the other ranks left ``fit`` at once, with a false warning. They wait for
    rank 0's release (here after 1 s), on a real store."""
    import torch.distributed as dist

    from nemo_patch.training import fit_end
    from nemo_patch.training.config import validate_timeout

    assert validate_timeout(timeout, "ConsolidationConfig.timeout") == timeout  # an accepted value
    store = dist.HashStore()
    monkeypatch.setattr(fit_end, "_store", lambda: store)
    end = fit_end.FitEnd(timeout)
    threading.Timer(1.0, end.release).start()  # rank 0, once its consolidations are over
    start = time.monotonic()
    assert end.wait()
    assert 0.9 <= time.monotonic() - start < 30
    assert not [r for r in caplog.records if r.name == fit_end.__name__ and r.levelname == "WARNING"]


# --- 3. a checkpoint path that is not UTF-8 -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_checkpoint_name_that_is_not_utf8_is_printed_escaped(checkpoint_copy, tmp_path):
    """With stdout strict UTF-8, the summary line named the path after the output was published: a traceback and exit
    code 1, and a rerun found the output there (exit 7). Now one line, the byte shown as ``\\xff``."""
    name = os.fsdecode(b"ckpt-\xff")
    shutil.move(checkpoint_copy, tmp_path / name)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    command = [sys.executable, "-W", "ignore", "-m", "nemo_patch", "--workers", "1"]
    proc = subprocess.run(command + [name], cwd=tmp_path, env=env, capture_output=True, timeout=600)
    stdout, stderr = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")  # valid UTF-8, as asked
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.splitlines() == [stdout.strip()] and stderr == ""
    assert stdout.startswith("Consolidated ckpt-\\xff -> ckpt-\\xff/consolidated: 28 tensors"), stdout
    assert (tmp_path / name / "consolidated" / "model.safetensors").is_file()

    proc = subprocess.run(command + [name + "-gone"], cwd=tmp_path, env=env, capture_output=True, timeout=600)
    assert proc.returncode == 3 and proc.stdout == b""
    assert proc.stderr.decode("utf-8").strip() == "nemo-consolidate: error: ckpt-\\xff-gone does not exist"


# --- 4. a plain dcp.save directory ---------------------------------------------------------------------------------


def test_a_plain_dcp_save_directory_is_consolidated(tmp_path):
    """torch's ``FileSystemWriter`` records ``storage_meta.checkpoint_id`` as a ``pathlib.PosixPath``: the restricted
    unpickler refused it (exit 8)."""
    import torch.distributed.checkpoint as dcp

    state = {
        "module.embedding.word_embeddings.weight": torch.randn(16, 8),
        "module.decoder.final_layernorm.weight": torch.randn(8),
        "module.output_layer.weight": torch.randn(16, 8, dtype=torch.bfloat16),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    assert b"PosixPath" in (tmp_path / "dcp" / ".metadata").read_bytes()
    code, out, err = run_cli([str(tmp_path / "dcp"), "--out", str(tmp_path / "out"), "--verify"])
    assert code == 0 and err == [] and len(out) == 1 and out[0].endswith(", verified"), (out, err)
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = {key.removeprefix("module."): value for key, value in state.items()}  # megatron's wrapper prefix
    assert written.keys() == expected.keys()
    assert all(
        written[key].dtype == value.dtype and torch.equal(written[key], value) for key, value in expected.items()
    )


def test_a_dcp_checkpoint_id_pickled_by_python_3_13_is_read(tmp_path):
    """Python 3.13 pickles a ``PosixPath`` under ``pathlib._local``."""
    import torch.distributed.checkpoint as dcp

    from nemo_patch.engine.metadata_checks import read_dcp_metadata

    dcp.save({"module.decoder.final_layernorm.weight": torch.ones(4)}, checkpoint_id=str(tmp_path / "dcp"))
    metadata = read_dcp_metadata(tmp_path / "dcp")
    assert str(metadata.storage_meta.checkpoint_id) == str(tmp_path / "dcp")
    written = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())  # torch's own file, as torch reads it
    data = pickle.dumps(written, protocol=2)  # GLOBAL "module\nname": renamed in place, no frame lengths to fix
    assert data.count(b"cpathlib\nPosixPath\n") == 1
    (tmp_path / "dcp" / ".metadata").write_bytes(data.replace(b"cpathlib\n", b"cpathlib._local\n"))
    assert str(read_dcp_metadata(tmp_path / "dcp").storage_meta.checkpoint_id) == str(tmp_path / "dcp")


# --- 5. post-command placeholders ----------------------------------------------------------------------------------

UNQUOTING = ["{output!r}", "{output!s}", "{output!a}", "{output[0]}", "{output.__class__}", "{output:>40}",
             "{output:{format}}", "{checkpoint[1:]}", "{global_step!r:}"]  # fmt: skip


@pytest.mark.parametrize("placeholder", UNQUOTING)
def test_a_placeholder_with_a_conversion_spec_index_or_attribute_is_refused(placeholder):
    with pytest.raises(ValueError, match=r"use \{output\}, \{format\}, \{global_step\} or \{checkpoint\}, each bare"):
        check_placeholders(f"python eval.py {placeholder}")
    code, _, err = run_cli(["ckpt", "--post-command", f"python eval.py {placeholder}"])
    assert code == 2 and err[0].startswith("usage: nemo-consolidate"), err
    assert err[-1].startswith("nemo-consolidate: error: argument --post-command: Invalid --post-command:"), err


def test_bare_placeholders_are_replaced_shell_quoted_and_nothing_else_runs(tmp_path):
    assert check_placeholders(" ".join(f"{{{name}}}" for name in PLACEHOLDERS) + " {{x}}") == "'' '' '' '' {x}"
    output = tmp_path / "$(touch pwned)"
    output.mkdir()
    result = run_post_command("printf %s {output}", output, "safetensors", 6, tmp_path / "ckpt", timeout=30)
    assert result.ok and not (tmp_path / "pwned").exists()
    assert Path(result.log).read_text() == str(output)
    with pytest.raises(ValueError, match=r"placeholder '\{output!r\}' has a conversion or format spec"):
        run_post_command("printf %s {output!r}", output, "safetensors", 6, tmp_path / "ckpt", timeout=30)
    assert not (tmp_path / "pwned").exists()


# --- 6. NEMO_PATCH_WORKER_NICENESS ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, niceness",
    [("²", WORKER_NICENESS), ("٣", WORKER_NICENESS), ("1" * 5000, WORKER_NICENESS), ("20", WORKER_NICENESS),
     ("-1", WORKER_NICENESS), ("", WORKER_NICENESS), (" 7 ", 7), ("0", 0), ("019", 19)],
)  # fmt: skip
def test_the_worker_niceness_ignores_values_that_are_not_0_to_19(monkeypatch, value, niceness):
    from nemo_patch.training import worker

    monkeypatch.setenv("NEMO_PATCH_WORKER_NICENESS", value)
    assert worker._niceness() == niceness


@pytest.mark.slow
def test_a_worker_given_a_superscript_niceness_consolidates_at_the_default_one(checkpoint_copy, tmp_path):
    """``"²".isdigit()`` is true and ``int("²")`` raises: the consolidation process ended before its work."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, runpy, sys\n"
        "sys.argv = ['worker', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('nemo_patch.training.worker', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print(e.code, os.nice(0))\n"
    )
    env = {**os.environ, "NEMO_PATCH_WORKER_NICENESS": "²"}
    proc = subprocess.run([sys.executable, str(probe), str(checkpoint_copy)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)  # fmt: skip
    assert proc.stdout.strip().splitlines()[-1:] == [f"0 {min(os.nice(0) + WORKER_NICENESS, 19)}"], proc.stderr[-3000:]
    assert (checkpoint_copy / "consolidated" / "model.safetensors").is_file()


# --- 7. shard sizes as transformers reads them ---------------------------------------------------------------------

SIZES = ["5GB", "5Gb", "5gb", "5gB", "5GiB", "5gib", "5Gib", "500MB", "500Mb", "500mb", "500MiB", "500mib", "1KB",
         "1Kb", "3kb", "7kB", "10KiB", "10kib", "9 Gb", "12345kb", "1000MIB", "15gb", "16Kb"]  # fmt: skip


@pytest.mark.parametrize("text", SIZES)
def test_shard_sizes_are_read_as_transformers_reads_them(text):
    """transformers' ``save_pretrained(max_shard_size=...)`` reads a final lowercase ``b`` as bits: ``"5Gb"`` is
    625,000,000 bytes, not 5,000,000,000."""
    from transformers.utils.hub import convert_file_size_to_int

    expected = convert_file_size_to_int(text)
    assert validate_max_shard_size(text, "max_shard_size") == expected
    assert build_parser().parse_args(["ckpt", "--max-shard-size", text]).max_shard_size == expected


def test_a_size_in_bits_below_one_byte_is_refused():
    with pytest.raises(ValueError, match='an integer number of bytes >= 1 or a size such as "5GB"'):
        validate_max_shard_size("7b", "max_shard_size")
    assert validate_max_shard_size("8b", "max_shard_size") == 1 and validate_max_shard_size("7B", "x") == 7


def test_a_json_side_file_that_is_a_device_or_a_fifo_is_read_as_none(tmp_path):
    """megatron-core's ``metadata.json`` linked to ``/dev/zero`` (or a FIFO) is no JSON object, and nothing is read
    from it: a device or a FIFO has size 0 (a megabyte of zeros was read and decoded as UTF-32 JSON)."""
    from nemo_patch.engine.checkpoint_layout import _json

    (tmp_path / "zero.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "big.json").write_text('{"sharded_backend": "zarr", "pad": "' + "x" * (1 << 20) + '"}')
    (tmp_path / "small.json").write_text('{"sharded_backend": "zarr"}')
    assert [_json(tmp_path / name) for name in ("zero.json", "fifo.json", "big.json")] == [{}, {}, {}]
    assert _json(tmp_path / "small.json") == {"sharded_backend": "zarr"}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    transform=st.dictionaries(
        st.one_of(st.text(max_size=8), st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False)),
        st.recursive(
            st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
            max_leaves=6,
        ),
        max_size=6,
    )
)
def test_a_crafted_model_transform_gives_settings_or_none_never_an_error(tmp_path, transform):
    """``context/model.yaml`` is the checkpoint's: a ``model_transform`` whose keys are not all strings (YAML allows
    ``1: 2`` or ``null: x``) made ``peft_settings`` raise ``TypeError`` from sorting them (or ``AttributeError`` on
    ``key.startswith``), crashing the consolidation or export of an adapter checkpoint instead of treating its settings
    as unknown."""
    yaml = pytest.importorskip("yaml")
    transform = {**transform, "_target_": "nemo.collections.llm.peft.lora.LoRA", "dim": 8}
    (tmp_path / "context").mkdir(exist_ok=True)
    (tmp_path / "context" / "model.yaml").write_text(yaml.safe_dump({"model_transform": transform}))

    found = peft_settings(tmp_path)

    assert found is not None and found["dim"] == 8
    assert all(isinstance(key, str) and (key == "method" or not key.startswith("_")) for key in found)

    def plain(value):
        return not isinstance(value, (list, dict)) or (
            isinstance(value, list) and all(not isinstance(item, (list, dict)) for item in value)
        )

    kept = {key: value for key, value in transform.items() if isinstance(key, str) and key[:1] != "_" and plain(value)}
    assert found == {"method": transform["_target_"], **kept}
