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

"""``nemo-consolidate``: inputs, options, and one exit code per failure, with nothing partial left behind."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_fit
from safetensors import safe_open
from safetensors.torch import load_file

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.engine.publish import TMP_LOCK_NAME, TMP_PREFIX
from nemo_patch.training import latest
from nemo_patch.training.latest import locate_checkpoint, update_latest_pointer


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(TMP_PREFIX))


def _cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _run_root(checkpoint_copy, tmp_path, names):
    """A checkpoint root holding copies of one checkpoint under NeMo-style names."""
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    for name in names:
        shutil.copytree(checkpoint_copy, root / name)
    return root


def test_checkpoint_dir_and_weights_dir_give_the_same_files(checkpoint_copy, tmp_path, capsys):
    code, out, err = _cli(capsys, checkpoint_copy, "--verify")
    assert code == 0, err
    assert out.startswith(f"Consolidated {checkpoint_copy} -> {checkpoint_copy / 'consolidated'}: 28 tensors")
    assert out.strip().endswith(", verified") and err == ""  # one summary line; no progress bar off a terminal
    code, _, err = _cli(capsys, checkpoint_copy / "weights", "--out", tmp_path / "again")
    assert code == 0, err
    first = json.loads((checkpoint_copy / "consolidated" / "metadata.json").read_text())["files"]
    second = json.loads((tmp_path / "again" / "metadata.json").read_text())["files"]
    assert first == second


def test_a_root_takes_latest_else_the_newest_finished_checkpoint(checkpoint_copy, tmp_path, capsys):
    names = ["m--step=1-consumed_samples=4.0", "m--step=3-consumed_samples=8.0", "m--step=5-consumed_samples=12.0"]
    root = _run_root(checkpoint_copy, tmp_path, names)
    (root / f"{names[2]}-unfinished").touch()  # NeMo's marker: the newest save never finished
    code, out, err = _cli(capsys, root)
    assert code == 0, err
    assert f"-> {root / names[1] / 'consolidated'}" in out
    update_latest_pointer(root / names[0])
    code, out, err = _cli(capsys, root.parent)  # the run directory holding checkpoints/
    assert code == 0, err
    assert f"-> {root / names[0] / 'consolidated'}" in out
    assert not (root / names[2] / "consolidated").exists()


def test_a_root_takes_a_steps_own_checkpoint_before_its_last_copy(checkpoint_copy, tmp_path, capsys):
    names = ["m--step=1-consumed_samples=4.0", "m--step=1-consumed_samples=4.0-last"]
    root = _run_root(checkpoint_copy, tmp_path, names)
    for older, newer in (names, reversed(names)):  # whichever of the two is newer on disk
        os.utime(root / older, (1_000_000_000, 1_000_000_000))
        os.utime(root / newer, (2_000_000_000, 2_000_000_000))
        code, out, err = _cli(capsys, root, "--force")
        assert code == 0, err
        assert f"-> {root / names[0] / 'consolidated'}" in out
    assert not (root / names[1] / "consolidated").exists()


def test_a_root_skips_a_checkpoint_that_top_k_removal_deletes_meanwhile(checkpoint_copy, tmp_path, monkeypatch):
    names = ["m--step=1-consumed_samples=4.0", "m--step=3-consumed_samples=8.0"]
    root = _run_root(checkpoint_copy, tmp_path, names)
    inspect = latest.inspect_checkpoint

    def removed_once_listed(path, allow_unfinished=False):
        if Path(path).name == names[1]:
            shutil.rmtree(path)  # what NeMo's top-k removal does in a live run, between listing and inspecting
        return inspect(path, allow_unfinished)

    monkeypatch.setattr(latest, "inspect_checkpoint", removed_once_listed)
    assert locate_checkpoint(root).checkpoint_dir == root / names[0]


def test_dtype_cast_and_sharding(checkpoint_copy, tmp_path, capsys):
    code, _, err = _cli(
        capsys, checkpoint_copy, "--dtype", "bf16", "--max-shard-size", "100KB", "--out", tmp_path / "o"
    )
    assert code == 0, err
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # 153 KB of bf16 weights in files of at most 100 KB
    assert json.loads((tmp_path / "o" / "metadata.json").read_text())["dtype"] == "bfloat16"
    code, _, err = _cli(capsys, checkpoint_copy, "--out", tmp_path / "fp32")
    reference = load_file(tmp_path / "fp32" / "model.safetensors")
    for filename in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "o" / filename), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[name].to(torch.bfloat16))


def test_stale_temporary_output_of_a_killed_process_is_removed(checkpoint_copy, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = checkpoint_copy / f"{TMP_PREFIX}{int(dead.stdout)}-0123456789ab@{os.uname().nodename}"
    (stale / "x").mkdir(parents=True)
    (stale / TMP_LOCK_NAME).touch()  # its lock, which no process holds any more
    code, _, err = _cli(capsys, checkpoint_copy)
    assert code == 0, err
    assert not stale.exists() and _leftovers(checkpoint_copy) == []


# --- one exit code and a one-line reason per failure; nothing partial left -----------------------------------


def _assert_failed(capsys, argv, code, reason, checkpoint=None):
    got, out, err = _cli(capsys, *argv)
    assert got == code, err
    assert out == "" and len(err.strip().splitlines()) == 1 and reason in err, err
    assert err.startswith("nemo-consolidate: error: ")
    if checkpoint is not None:
        assert _leftovers(checkpoint) == []


def test_missing_path_exits_3(tmp_path, capsys):
    _assert_failed(capsys, [tmp_path / "nope"], 3, "does not exist")


def test_not_a_checkpoint_exits_4(tmp_path, capsys):
    (tmp_path / "some-dir").mkdir()
    _assert_failed(capsys, [tmp_path], 4, "is neither a NeMo 2 checkpoint nor a checkpoint root")
    (tmp_path / "file").write_text("x")
    _assert_failed(capsys, [tmp_path / "file"], 4, "is not a NeMo 2 checkpoint: expected a 'weights/' directory")


def test_unfinished_checkpoint_exits_5_unless_explicitly_allowed(checkpoint_copy, capsys):
    marker = checkpoint_copy.parent / f"{checkpoint_copy.name}-unfinished"
    marker.touch()
    _assert_failed(capsys, [checkpoint_copy], 5, "unfinished checkpoint (NeMo's unfinished marker is present)")
    _assert_failed(capsys, [checkpoint_copy], 5, "its save never ended (--allow-unfinished consolidates what it")
    assert not (checkpoint_copy / "consolidated").exists()
    code, _, err = _cli(capsys, checkpoint_copy, "--allow-unfinished")
    assert code == 0 and "warning:" in err and "--allow-unfinished" in err
    marker.unlink()
    (checkpoint_copy / "weights" / ".metadata").unlink()  # DCP writes it last: the save never got there
    _assert_failed(capsys, [checkpoint_copy, "--force"], 5, "(no '.metadata')")


def test_unsupported_formats_exit_6_and_say_which(checkpoint_copy, tmp_path, capsys):
    other = tmp_path / "other-ckpt"  # a sharded_backend megatron-core may write that is neither torch_dist nor zarr
    (other / "weights").mkdir(parents=True)
    (other / "weights" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch"}))
    _assert_failed(capsys, [other], 6, "is a 'torch' checkpoint, not 'torch_dist' or 'zarr'")
    fsdp = tmp_path / "fsdp-ckpt"  # NeMo's fsdp_dtensor layout: DCP files directly in the checkpoint directory
    shutil.copytree(checkpoint_copy / "weights", fsdp)
    shutil.copytree(checkpoint_copy / "context", fsdp / "context")
    _assert_failed(capsys, [fsdp], 6, "is an 'fsdp_dtensor' checkpoint")


def test_existing_output_exits_7_without_force(checkpoint_copy, capsys):
    assert _cli(capsys, checkpoint_copy)[0] == 0
    before = (checkpoint_copy / "consolidated" / "metadata.json").stat().st_ino
    _assert_failed(capsys, [checkpoint_copy], 7, "consolidated exists (overwrite it with --force)", checkpoint_copy)
    assert (checkpoint_copy / "consolidated" / "metadata.json").stat().st_ino == before
    assert _cli(capsys, checkpoint_copy, "--force")[0] == 0
    assert (checkpoint_copy / "consolidated" / "metadata.json").stat().st_ino != before


def test_truncated_shard_and_metadata_exit_8_naming_the_file(checkpoint_copy, capsys):
    shard = checkpoint_copy / "weights" / "__0_0.distcp"
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    _assert_failed(capsys, [checkpoint_copy], 8, "of __0_0.distcp, which has", checkpoint_copy)
    assert not (checkpoint_copy / "consolidated").exists()
    (checkpoint_copy / "weights" / ".metadata").write_bytes(b"\x80\x04garbage")
    _assert_failed(capsys, [checkpoint_copy], 8, "Cannot read the checkpoint metadata file", checkpoint_copy)


def test_a_flipped_bit_in_tensor_data_exits_8_naming_the_file(checkpoint_copy, capsys):
    """``torch.load`` does not check the CRC-32 of the records it reads; the consolidation does."""
    from nemo_patch.engine.metadata_checks import read_dcp_metadata

    metadata = read_dcp_metadata(checkpoint_copy / "weights")
    index, info = next(
        (index, info) for index, info in metadata.storage_data.items() if index.fqn.endswith("linear_fc1.weight")
    )
    shard = checkpoint_copy / "weights" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01  # inside the tensor's stored bytes
    shard.write_bytes(bytes(data))
    reason = f"{info.relative_path}, record at byte {info.offset}: corrupt data (Bad CRC-32"
    _assert_failed(capsys, [checkpoint_copy], 8, reason, checkpoint_copy)
    assert not (checkpoint_copy / "consolidated").exists()


def test_verify_catches_a_corrupted_output_tensor_exit_9(checkpoint_copy, capsys):
    assert _cli(capsys, checkpoint_copy)[0] == 0
    code, out, _ = _cli(capsys, checkpoint_copy, "--verify")  # an existing output: checked, not rewritten
    assert code == 0 and out.startswith("Verified ") and "28 tensors match" in out
    output = checkpoint_copy / "consolidated" / "model.safetensors"
    data = bytearray(output.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the last tensor's data; the header still parses
    output.write_bytes(bytes(data))
    _assert_failed(capsys, [checkpoint_copy, "--verify"], 9, f"in {output} differs from module.")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--format", "onnx"], "argument --format: invalid choice: 'onnx' (choose from 'safetensors', 'hf')"),
        (
            ["--dtype", "int8"],
            "argument --dtype: Invalid --dtype 'int8': expected one of 'bf16', 'fp16', 'fp32'.",
        ),
        (
            ["--post-command", " "],
            "argument --post-command: Invalid --post-command ' ': expected a shell command such",
        ),
        (["--max-shard-size", "lots"], 'Invalid --max-shard-size \'lots\': expected an integer number of bytes'),
        (["--frequency", "each"], "--frequency only with --watch"),
    ],
)
def test_bad_arguments_exit_2_with_usage(checkpoint_copy, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main([str(checkpoint_copy), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: nemo-consolidate ") and message in err


@pytest.mark.parametrize("text", ["\u00b2", "1\u00b2", "\u2460"])
def test_workers_in_digits_int_cannot_read_exit_2_with_the_option_s_message(capsys, text):
    """Superscript and circled digits are digits to ``str.isdigit`` but not to ``int``: the option's own message,
    not int()'s."""
    with pytest.raises(SystemExit) as info:
        main(["ckpt", "--workers", text])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"Invalid --workers {text!r}: expected a whole number of writer processes" in err


def test_console_script_and_module_entry_points(checkpoint_copy, tmp_path):
    """The installed ``nemo-consolidate`` script and ``python -m nemo_patch`` are the same command."""
    script = shutil.which("nemo-consolidate", path=os.path.dirname(sys.executable))
    assert script is not None, "the console script is not installed next to this interpreter"
    proc = subprocess.run([script, str(checkpoint_copy), "--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    proc = subprocess.run([sys.executable, "-m", "nemo_patch", str(tmp_path / "missing")], capture_output=True,
                          text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 3 and proc.stderr.strip().splitlines() == [
        f"nemo-consolidate: error: {tmp_path / 'missing'} does not exist"
    ]


@pytest.mark.slow
def test_a_checkpoint_written_by_stock_nemo_consolidates(tmp_path, capsys):
    """No overlay in the training run (``NEMO_PATCH_DISABLE=1``), so nothing of ours is in the checkpoint."""
    run_fit(tmp_path, stock=True, max_steps=2, save_every=2)
    root = tmp_path / "tiny_gpt" / "checkpoints"
    assert not any(p.name == "consolidated" for p in root.rglob("*"))
    code, out, err = _cli(capsys, root, "--verify")
    assert code == 0, err
    assert "28 tensors" in out and out.strip().endswith("verified")


def test_progress_bar_on_a_terminal(checkpoint_copy):
    """On a terminal (a pseudo-terminal here, 120 columns) stderr shows a bytes progress bar with a rate."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_patch", str(checkpoint_copy)], stdin=slave, stdout=slave, stderr=slave, cwd=REPO
    )
    os.close(slave)
    output = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0
    text = output.decode(errors="replace")
    assert "consolidating: 100%" in text and "B/s" in text, text[-2000:]
    assert re.search(r"\b(\d+k)/\1 \[", text), text[-2000:]  # bytes done / total (KiB), then time and rate
    assert "Consolidated " in text


def test_full_disk_fails_cleanly(checkpoint_copy, tmp_path, capsys):
    """A 64 KiB tmpfs as the output's file system: the write fails with ENOSPC; nothing is left on it."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)]).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here (CI runs as root and may)")
    try:
        code, out, err = _cli(capsys, checkpoint_copy, "--out", mount_point / "consolidated")
        assert code == 1 and "No space left on device" in err and len(err.strip().splitlines()) == 1
        assert os.listdir(mount_point) == []
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_verify_with_writer_processes_prints_only_the_summary(checkpoint_copy, tmp_path):
    # --verify imports NeMo for the context, so the writers start from a fresh interpreter (forkserver or spawn),
    # whose torch import must not print torch's pynvml FutureWarning either.
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch", str(checkpoint_copy), "--verify", "--workers", "2", "--quiet"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
