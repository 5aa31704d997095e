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

"""Faults injected for real: a consolidation process killed half-way, a read-only checkpoint directory, a full disk
(file-size limit), preemption by SIGTERM, a save that never finished, and a concurrent ``LATEST`` reader.

Training must carry on (or stop as NeMo stops it) and nothing that looks like a consolidated checkpoint but is not may
be left behind. The faults themselves come from ``nemo_patch.testing.faults``; see each test for what is real."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, run_fit

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.engine.publish import TMP_LOCK_NAME, TMP_PREFIX
from nemo_patch.training.latest import LATEST_NAME, update_latest_pointer
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.retention import RETAINED_DIRNAME
from nemo_patch.training.schedule import CheckpointSave


def _root(out: Path) -> Path:
    return out / "tiny_gpt" / "checkpoints"


def _leftovers(root: Path):
    """Temporary consolidation output anywhere under a checkpoint root."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(f"{TMP_PREFIX}*"))


def _checkpoints(root: Path):
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name != RETAINED_DIRNAME),
        key=lambda p: p.stat().st_mtime,
    )


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def _mount_permitted() -> bool:
    probe = Path("/tmp") / f"nemo-patch-mount-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "--bind", str(probe), str(probe)], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=False)
        return ok
    finally:
        probe.rmdir()


# --- 1. the consolidation process is killed with SIGKILL half-way ---------------------------------------------------


def _hold_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Make each consolidation process started from now on block in its first tensor read, half-way (its temporary
    output exists by then), until it is killed: a ``sitecustomize`` module on ``PYTHONPATH`` replaces
    ``DCPRegionReader.read`` in those processes only (a FIFO in place of a shard no longer blocks: the engine refuses
    anything but a regular file). Returns the function that lets later processes read again."""
    site = tmp_path / "hold-reads"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "import time\n"
        "if os.environ.get('NEMO_PATCH_TEST_HOLD_READS') == '1':\n"
        "    from nemo_patch.engine import dcp_reader\n"
        "\n"
        "    def _held(self, *args, **kwargs):\n"
        "        while True:\n"
        "            time.sleep(1)\n"
        "\n"
        "    dcp_reader.DCPRegionReader.read = _held\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("NEMO_PATCH_TEST_HOLD_READS", "1")
    return lambda: monkeypatch.delenv("NEMO_PATCH_TEST_HOLD_READS")


@pytest.mark.slow
def test_killed_consolidation_leaves_nothing_and_training_carries_on(tmp_path, capsys):
    report = run_fit(tmp_path, frequency="each", max_steps=6, save_every=2, max_pending=8, fault="kill:1")
    root = _root(tmp_path)
    assert report["global_step"] == 6  # training carried on to the end
    assert len(report["consolidation_errors"]) == 1 and "signal SIGKILL" in report["consolidation_errors"][0]
    first = root / report["checkpoints"][0]["name"]
    assert not (first / "consolidated").exists()
    assert [c["consolidated"] for c in report["checkpoints"][1:]] == [True] * (len(report["checkpoints"]) - 1)
    assert _leftovers(root) == []  # the queue removed the killed process's temporary output
    # A later consolidation of the same checkpoint succeeds.
    assert main([str(first), "--quiet"]) == 0 and (first / "consolidated" / "model.safetensors").is_file()


@pytest.mark.slow
def test_half_written_output_of_a_killed_process_is_removed_by_the_next_cli_run(
    checkpoint_copy, tmp_path, monkeypatch
):
    """The process is held in its first read, half-way (its temporary output exists), for sure."""
    restore = _hold_reads(tmp_path, monkeypatch)
    cli = subprocess.Popen([sys.executable, "-m", "nemo_patch", str(checkpoint_copy)], cwd=REPO)
    deadline = time.monotonic() + 120
    while not list(checkpoint_copy.glob(f"{TMP_PREFIX}{cli.pid}-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(checkpoint_copy.glob(f"{TMP_PREFIX}{cli.pid}-*")), "the process never started writing"
    cli.kill()  # SIGKILL: nothing of ours runs in that process any more
    cli.wait()
    assert not (checkpoint_copy / "consolidated").exists()
    assert len(list(checkpoint_copy.glob(f"{TMP_PREFIX}*"))) == 1  # what a dead node leaves behind
    restore()
    assert main([str(checkpoint_copy), "--quiet"]) == 0
    assert sorted(p.name for p in checkpoint_copy.iterdir()) == ["consolidated", "context", "weights"]


@pytest.mark.slow
def test_queue_reports_a_killed_child_and_consolidates_the_same_checkpoint_later(
    checkpoint_copy, tmp_path, monkeypatch
):
    restore = _hold_reads(tmp_path, monkeypatch)
    done = []
    queue = ConsolidationQueue(lambda save, error: done.append(error))
    save = CheckpointSave(checkpoint_copy, 6, written=True)
    queue.submit(save)
    pid = queue._running.process.pid
    deadline = time.monotonic() + 120
    while not list(checkpoint_copy.glob(f"{TMP_PREFIX}{pid}-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    queue._running.process.kill()
    assert queue.wait(timeout=60)
    assert len(done) == 1 and "signal SIGKILL" in done[0]
    assert sorted(p.name for p in checkpoint_copy.iterdir()) == ["context", "weights"]  # temp output removed
    restore()
    queue.submit(save)
    assert queue.wait(timeout=120) and done[1] is None


def _proc_children(pid: int):
    children = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


def _alive(pid: int) -> bool:
    """Running or sleeping (a zombie nobody reaps, e.g. in a container whose init does not, has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_consolidating_processes_see_no_gpu_no_job_ranks_die_with_their_parent_and_go_first_on_oom(
    checkpoint_copy, tmp_path, monkeypatch
):
    """A training rank's stand-in (a process with the job's rank variables and a GPU visible) starts a consolidation
    with 2 writers, held in their reads. The consolidation process and each writer: ``CUDA_VISIBLE_DEVICES=""``, none
    of the job's rank variables, ``oom_score_adj`` 500 above the stand-in's; and SIGKILLing the stand-in ends them all
    (held, nothing else would end them)."""
    _hold_reads(tmp_path, monkeypatch)
    job = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "NODE_RANK": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8",
           "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}  # fmt: skip
    for name, value in {**job, "CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_ID": "42"}.items():
        monkeypatch.setenv(name, value)
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from nemo_patch.training.queue import ConsolidationQueue\n"
        "from nemo_patch.training.schedule import CheckpointSave\n"
        "from nemo_patch.training.config import ConsolidationConfig\n"
        "from nemo_patch.training.settings import ConsolidationSettings\n"
        "settings = ConsolidationSettings(config=ConsolidationConfig(workers=2))\n"
        "queue = ConsolidationQueue(lambda save, error: None, settings)\n"
        "queue.submit(CheckpointSave(Path(sys.argv[1]), 6, written=True))\n"
        "print(queue._running.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", code, str(checkpoint_copy)], stdout=subprocess.PIPE, cwd=REPO)
    try:
        consolidation = int(rank.stdout.readline())
        deadline = time.monotonic() + 120
        while len(_proc_children(consolidation)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        writers = _proc_children(consolidation)
        assert len(writers) == 2, "the writers never started"
        own = int(Path("/proc/self/oom_score_adj").read_text())
        for pid in [consolidation, *writers]:
            environ = dict(
                item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
            )
            assert environ["CUDA_VISIBLE_DEVICES"] == ""
            assert sorted(set(job) & set(environ)) == [] and environ["SLURM_JOB_ID"] == "42"
            assert int(Path(f"/proc/{pid}/oom_score_adj").read_text()) == min(1000, own + 500)
        rank.kill()  # the training rank dies: SIGKILL, nothing of it runs any more
        rank.wait()
        deadline = time.monotonic() + 30
        while any(map(_alive, [consolidation, *writers])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, [consolidation, *writers]))
    finally:
        rank.kill()
        rank.wait()


# --- 2. the output cannot be written: read-only directory, full disk ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, cause",
    [("readonly:1", "Read-only file system"), ("fsize:1", "File too large")],
    ids=["read-only-checkpoint-dir", "disk-full-file-size-limit"],
)
def test_unwritable_output_logs_one_error_and_the_next_checkpoint_is_consolidated(tmp_path, fault, cause):
    if fault.startswith("readonly") and not _mount_permitted():
        pytest.skip("a read-only bind mount needs mount permission (root on CI); this machine refuses it")
    report = run_fit(tmp_path, frequency="each", max_steps=6, save_every=2, max_pending=8, fault=fault)
    root = _root(tmp_path)
    first = root / report["checkpoints"][0]["name"]
    assert report["global_step"] == 6
    assert report["consolidation_errors"] == [report["consolidation_errors"][0]]
    assert str(first) in report["consolidation_errors"][0] and cause in report["consolidation_errors"][0]
    log = (tmp_path / "fit.log").read_text()
    errors = [line for line in log.splitlines() if "Consolidation of checkpoint" in line and "failed" in line]
    assert len(errors) == 1 and str(first) in errors[0] and cause in errors[0]
    assert not (first / "consolidated").exists()
    assert all(c["consolidated"] for c in report["checkpoints"][1:])
    assert _leftovers(root) == []
    assert os.readlink(root / LATEST_NAME) == report["checkpoints"][-1]["name"].removesuffix("-last")


# --- 4. a save that never finished is never consolidated ------------------------------------------------------------


@pytest.mark.slow
def test_a_save_that_never_finished_is_never_consolidated(tmp_path, capsys):
    """A first run leaves a finished checkpoint (global step 2). The resumed run and its async writer are SIGKILLed
    after the step-4 save was issued, before NeMo finalized it: its ``-unfinished`` marker stays."""
    run_fit(tmp_path, frequency="latest", max_steps=2, save_every=2, async_save=True)
    root = _root(tmp_path)
    (root / LATEST_NAME).unlink()
    for output in list(root.glob("*/consolidated")):  # as if never consolidated
        shutil.rmtree(output)
    with pytest.raises(pytest.fail.Exception, match=r"rc=-9"):
        run_fit(tmp_path, frequency="latest", max_steps=8, save_every=2, async_save=True, fault="die:4")
    unfinished = root / "tiny_gpt--step=3-consumed_samples=8.0"
    assert unfinished.is_dir() and (root / f"{unfinished.name}-unfinished").exists()
    assert not any(root.rglob("consolidated"))  # latest: nothing during training, and the run never ended
    # The CLI refuses it and says why; given the root, it takes the newest finished checkpoint.
    assert main([str(unfinished)]) == 5
    assert "NeMo's unfinished marker is present" in capsys.readouterr().err
    assert main([str(root), "--quiet"]) == 0
    assert sorted(p.parent.name for p in root.glob("*/consolidated")) == ["tiny_gpt--step=1-consumed_samples=4.0"]
    # A stale temporary directory of a killed consolidation process: removed when the strategy starts again.
    stale = root / "tiny_gpt--step=1-consumed_samples=4.0" / f"{TMP_PREFIX}{_dead_pid()}-0123456789ab@{os.uname()[1]}"
    stale.mkdir()
    (stale / TMP_LOCK_NAME).touch()  # its lock, which no process holds any more
    report = run_fit(tmp_path, frequency="latest", max_steps=6, save_every=2)  # resumes from global step 2
    assert not stale.exists()
    assert report["latest"] is not None and report["latest"] != unfinished.name
    assert not (unfinished / "consolidated").exists()


# --- 5. preemption: SIGTERM through NeMo's PreemptionCallback -------------------------------------------------------


@pytest.mark.slow
def test_preempted_latest_run_consolidates_its_final_checkpoint_before_exit(tmp_path):
    report = run_fit(tmp_path, frequency="latest", max_steps=20, save_every=2, fault="sigterm:3")
    root = _root(tmp_path)
    assert report["system_exit"] == 0 and report["global_step"] == 3  # NeMo stopped it at the signal
    assert report["consolidations"] == 1 and report["consolidation_errors"] == []
    latest = root / report["latest"]
    assert "step=2" in latest.name  # the checkpoint NeMo saved on preemption (global step 3)
    assert json.loads((latest / "consolidated" / "metadata.json").read_text())["global_step"] == 3
    assert _leftovers(root) == []


@pytest.mark.slow
def test_preemption_with_a_consolidation_in_flight_exits_within_the_timeout(tmp_path):
    report = run_fit(tmp_path, frequency="each", max_steps=20, save_every=1, max_pending=8, timeout=1.0,
                     fault=["sigterm:2", "hold:1"])  # fmt: skip
    root = _root(tmp_path)
    assert report["system_exit"] == 0
    # The first consolidation was held (SIGSTOP) so that it was still running: it was stopped at the timeout.
    assert report["end_wait_seconds"] < 1.0 + 5.0 + 2.0  # the timeout + SIGTERM grace before SIGKILL + slack
    assert any("timed out" in error or "signal" in error for error in report["consolidation_errors"])
    assert _leftovers(root) == []
    for entry in report["checkpoints"]:  # each checkpoint is either fully consolidated or has nothing
        output = root / entry["name"] / "consolidated"
        assert not output.exists() or (output / "metadata.json").is_file()


@pytest.mark.slow
def test_every_rank_leaves_fit_with_rank_0_so_a_collective_after_fit_does_not_time_out(tmp_path, monkeypatch):
    """2 processes (DP=2, gloo) whose process group times out after 20 s once training starts. Rank 0's first
    consolidation is held (SIGSTOP), so its teardown waits out the 30 s ``ConsolidationConfig.timeout`` and stops it
    (5 s more). Right after ``fit`` both ranks run a barrier: it succeeds on both, because rank 1 waited for rank 0 in
    its own teardown, on the rendezvous store, not inside the barrier."""
    monkeypatch.setenv("NEMO_TESTING", "1")  # NeMo's logger shows every rank's lines, not only global rank 0's
    report = run_fit(tmp_path, frequency="each", max_steps=2, save_every=2, devices=2, timeout=30.0, fault="hold:1",
                     pg_timeout=20, barrier_after_fit=True, info_logs=True)  # fmt: skip
    outcomes = [json.loads((tmp_path / f"after-fit-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [outcome["ok"] for outcome in outcomes] == [True, True], outcomes
    assert report["end_wait_seconds"] >= 30.0  # rank 0 did wait longer than the process-group timeout
    assert any("signal" in error for error in report["consolidation_errors"])  # the held one was stopped
    assert "Waiting for global rank 0's checkpoint consolidations to end" in (tmp_path / "fit.log").read_text()
    assert _leftovers(_root(tmp_path)) == []


def test_other_ranks_leave_fit_with_one_warning_when_rank_0_is_late_or_lost(monkeypatch, caplog):
    """The other ranks' end-of-fit wait on a real ``TCPStore``: released, late (the timeout and grace run out), and
    lost (the process hosting the store, rank 0's, is killed): each returns at once or at its timeout, never hangs."""
    import datetime

    import torch.distributed as dist

    from nemo_patch.training import fit_end

    host = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, torch.distributed as d\n"
         "store = d.TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False)\n"
         "print(store.port, flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        store = dist.TCPStore("127.0.0.1", int(host.stdout.readline()), 2, False, datetime.timedelta(seconds=30))
        monkeypatch.setattr(fit_end, "_store", lambda: store)
        monkeypatch.setattr(fit_end, "GRACE_SECONDS", 0.0)
        released = fit_end.FitEnd(timeout=30.0)
        released.release()  # rank 0's side of the same round
        assert released.wait()
        start = time.monotonic()
        assert not fit_end.FitEnd(timeout=0.5).wait()  # late
        assert time.monotonic() - start < 10
        lost = fit_end.FitEnd(timeout=60.0)
        threading.Timer(1.0, host.kill).start()
        start = time.monotonic()
        assert not lost.wait()
        assert time.monotonic() - start < 10  # at once, not after the 60 s
    finally:
        host.kill()
        host.wait()
    warnings = [r.getMessage() for r in caplog.records if r.name == fit_end.__name__ and r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("leaving fit without it" in warning for warning in warnings)


# --- 7. LATEST is never missing or dangling for a concurrent reader ------------------------------------------------


def test_latest_is_replaced_atomically_under_a_concurrent_reader(tmp_path):
    targets = [tmp_path / f"ckpt-{i}" for i in range(2)]
    for target in targets:
        (target / "consolidated").mkdir(parents=True)
        (target / "consolidated" / "metadata.json").write_text("{}")
    update_latest_pointer(targets[0])
    link, stop, problems, reads = tmp_path / LATEST_NAME, threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            try:
                (link / "consolidated" / "metadata.json").read_text()
                reads[0] += 1
            except OSError as error:
                problems.append(repr(error))

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(2000):
        update_latest_pointer(targets[i % 2])
    stop.set()
    thread.join()
    assert problems == [] and reads[0] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_NAME, "ckpt-0", "ckpt-1"]  # no temp links left


# --- 6. NeMo's top-k removal while consolidations are queued or running ---------------------------------------------


@pytest.mark.slow
def test_top_k_removal_during_consolidation_leaves_no_half_made_output(tmp_path):
    """``save_top_k=1``: NeMo removes every older checkpoint as soon as a newer one lands, while each consolidation
    (a fresh process, ~2 s) is still running or waiting; removals of those are deferred or the request dropped."""
    report = run_fit(tmp_path, frequency="each", max_steps=6, save_every=1, max_pending=8, save_top_k=1)
    root = _root(tmp_path)
    assert report["global_step"] == 6 and report["consolidation_errors"] == []
    log = (tmp_path / "fit.log").read_text()
    assert "Traceback" not in log and not re.search(r"^ERROR|\[NeMo E", log, re.MULTILINE)
    assert _leftovers(root) == []
    remaining = _checkpoints(root)
    assert len(remaining) <= 2  # the newest step and its -last copy; the rest were removed by NeMo
    kept = sorted((root / RETAINED_DIRNAME).iterdir()) if (root / RETAINED_DIRNAME).is_dir() else []
    for checkpoint in remaining + kept:  # outputs of removed checkpoints are kept, complete, under retained/
        output = checkpoint / "consolidated"
        assert (output / "metadata.json").is_file() and (output / "model.safetensors").is_file()
    assert len(kept) == len(set(report["completed_steps"]) - {6})  # every consolidation but the newest one's
    assert (root / LATEST_NAME).resolve() in remaining


# --- 9. nothing but the DCP metadata is unpickled --------------------------------------------------------------------


@pytest.mark.slow
def test_consolidation_unpickles_nothing_but_the_checkpoint_metadata(checkpoint_copy):
    """Python's audit hook reports every global that a standard pickle stream asks for. During a consolidation there
    is none: the DCP ``.metadata`` goes through this package's allowlisting unpickler (its own ``find_class``), stored
    tensors through ``torch.load(weights_only=True)`` (torch's restricted unpickler), and ``_extra_state`` payloads
    and ``common.pt`` are never read. The control at the end shows the hook does see an ordinary unpickling."""
    code = (
        "import json, sys, torch\n"
        "seen = []\n"
        "sys.addaudithook(lambda event, args: seen.append(f'{args[0]}.{args[1]}') if event == 'pickle.find_class'"
        " else None)\n"
        "from nemo_patch.engine.consolidate import consolidate_checkpoint\n"
        "consolidate_checkpoint(sys.argv[1])\n"
        "during = sorted(set(seen))\n"
        "torch.load(sys.argv[1] + '/weights/common.pt', weights_only=False)  # control: what it would take\n"
        "print(json.dumps([during, sorted(set(seen))]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(checkpoint_copy)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    during, control = json.loads(proc.stdout.strip().splitlines()[-1])
    assert during == []
    assert control, "the audit hook saw nothing even for torch.load(weights_only=False)"
    assert (checkpoint_copy / "consolidated" / "model.safetensors").is_file()
