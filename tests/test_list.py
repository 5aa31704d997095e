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

"""``nemo-consolidate ROOT --list [--json] [--verify]`` over a real run's checkpoints (the session's ``each_run``: NeMo
saved and the overlay consolidated every checkpoint).

Oracles that are not the listing's own reading: the directory itself (names, ``LATEST``), Lightning's ``global_step``
in each checkpoint's ``weights/common.pt`` (``torch.load``), the ``safetensors`` library's view of each output's
tensors, ``os.stat`` sizes, and the overlay callback's ``run_id`` in ``common.pt``."""

import io
import json
import os
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from nemo_patch.cli.nemo_consolidate import main

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "int64"}


def listed(*argv: str) -> "tuple[int, str]":
    out = io.StringIO()
    with redirect_stdout(out):
        code = main([*argv])
    return code, out.getvalue()


def common_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "weights" / "common.pt", map_location="cpu", weights_only=False)


@pytest.fixture()
def root_copy(each_run, tmp_path) -> Path:
    """A private copy of ``each_run``'s checkpoint root (symbolic links kept)."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(each_run["root"], copy, symlinks=True)
    return copy


def test_list_json_describes_every_checkpoint_of_a_real_run(each_run):
    root = each_run["root"]
    code, out = listed(str(root.parent), "--list", "--json")  # the run directory, holding checkpoints/
    assert code == 0, out
    listing = json.loads(out)
    assert listing["root"] == str(root) and listing["layout"] == "nemo"
    on_disk = sorted(p.name for p in root.iterdir() if (p / "weights").is_dir() and not p.is_symlink())
    assert sorted(entry["name"] for entry in listing["checkpoints"]) == on_disk and listing["retained"] == []
    assert listing["latest"] == os.readlink(root / "LATEST")
    steps = [entry["global_step"] for entry in listing["checkpoints"]]
    assert steps == sorted(steps)
    for entry in listing["checkpoints"]:
        checkpoint = root / entry["name"]
        state = common_state(checkpoint)
        assert entry["global_step"] == state["global_step"], entry["name"]
        assert entry["finished"] and entry["consolidated"], entry
        assert entry["marks"] == (["LATEST"] if entry["name"] == listing["latest"] else [])
        callback = next(v for k, v in state["callbacks"].items() if k.startswith("ConsolidationCallback"))
        assert entry["run"] == callback["run_id"], entry
        (output,) = entry["outputs"]
        assert output["dir"] == "consolidated" and output["format"] == "safetensors" and output["complete"]
        # NeMo's -last copy holds its step's output (hard links made during training), recorded as that save's
        linked = checkpoint.name.endswith("-last")
        assert output["linked_from"] == (checkpoint.name.removesuffix("-last") if linked else None)
        if linked:
            source = root / output["linked_from"] / "consolidated" / "model.safetensors"
            assert (checkpoint / "consolidated" / "model.safetensors").stat().st_ino == source.stat().st_ino
        files = list((checkpoint / "consolidated").iterdir())
        assert output["bytes"] == sum(path.stat().st_size for path in files)
        dtypes = set()
        with safe_open(str(checkpoint / "consolidated" / "model.safetensors"), framework="pt") as tensors:
            for name in tensors.keys():
                dtypes.add(DTYPE_NAMES[tensors.get_tensor(name).dtype])
        assert output["dtype"] == sorted(dtypes)
        assert output["digests"] == "recorded" and output["post_command_status"] is None


def test_list_table_and_verify(root_copy):
    code, out = listed(str(root_copy), "--list", "--verify")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == f"checkpoints in {root_copy}:" and lines[1].split()[:3] == ["checkpoint", "global", "step"]
    rows = {line.split()[0]: line for line in lines[3:]}
    assert sorted(rows) == sorted(
        p.name for p in root_copy.iterdir() if (p / "weights").is_dir() and not p.is_symlink()
    )
    latest = os.readlink(root_copy / "LATEST")
    assert "<- LATEST" in rows[latest] and sum("<- LATEST" in row for row in rows.values()) == 1
    assert all(" verified " in row and " yes " in row for row in rows.values()), out


def test_a_changed_output_fails_verify_with_exit_9(root_copy, capsys):
    name = sorted(p.name for p in root_copy.iterdir() if (p / "weights").is_dir() and not p.is_symlink())[0]
    model = root_copy / name / "consolidated" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0x40  # a bit of the last tensor's data: the size and the header stay right
    model.write_bytes(bytes(data))
    code, out = listed(str(root_copy), "--list", "--json")
    assert code == 0 and {o["digests"] for e in json.loads(out)["checkpoints"] for o in e["outputs"]} == {"recorded"}
    code, out = listed(str(root_copy), "--list", "--json", "--verify")
    assert code == 9
    by_name = {entry["name"]: entry["outputs"][0] for entry in json.loads(out)["checkpoints"]}
    assert by_name[name]["digests"] == "FAILED" and "model.safetensors" in by_name[name]["digest_error"]
    assert {o["digests"] for n, o in by_name.items() if n != name} == {"verified"}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nemo-consolidate: error: 1 output(s) do not match"), err


def test_unfinished_outdated_and_post_command(root_copy):
    names = sorted(
        (p.name for p in root_copy.iterdir() if (p / "weights").is_dir() and not p.is_symlink()),
        key=lambda n: (len(n), n),
    )
    unfinished, saved_again, post = names[0], names[1], names[2]
    (root_copy / f"{unfinished}-unfinished").touch()  # NeMo's marker: a save in progress (or being removed)
    metadata = root_copy / saved_again / "weights" / ".metadata"
    metadata.write_bytes(metadata.read_bytes() + b"\0")  # another save under the same name: its output is outdated
    code, out = listed(str(root_copy / post), "--force", "--post-command", "exit 3")
    assert code == 17, out
    code, out = listed(str(root_copy), "--list", "--json")
    assert code == 0, out
    by_name = {entry["name"]: entry for entry in json.loads(out)["checkpoints"]}
    assert not by_name[unfinished]["finished"] and by_name[unfinished]["not_finished"] == "unfinished"
    assert by_name[saved_again]["finished"] and not by_name[saved_again]["consolidated"]
    assert by_name[saved_again]["outputs"][0]["complete"] is False
    assert by_name[post]["outputs"][0]["post_command_status"] == "exit 3"
    assert by_name[post]["outputs"][0]["post_command"]["returncode"] == 3
    code, table = listed(str(root_copy), "--list")
    rows = {line.split()[0]: line.split() for line in table.splitlines()[3:]}
    assert rows[saved_again][rows[saved_again].index("yes") + 1] == "outdated"
    assert rows[post][-2:] == ["exit", "3"]


def test_list_exit_codes(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--list"]) == 3
    assert main([str(tmp_path), "--list"]) == 4
    assert "holds no checkpoint" in capsys.readouterr().err
    (tmp_path / "ckpt" / "weights").mkdir(parents=True)
    assert main([str(tmp_path / "ckpt"), "--list"]) == 4
    assert f"is a checkpoint, not a checkpoint root: list {tmp_path}" in capsys.readouterr().err
    for argv, message in [(["--json"], "--json only with --list"), (["--list", "--watch"], "--watch cannot be used")]:
        with pytest.raises(SystemExit) as exit_:
            main([str(tmp_path), *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
