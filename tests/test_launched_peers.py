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

"""A multi-process ``nemo-consolidate`` (:mod:`nemo_patch.cli.distributed`) whose peer is lost or differs.

The slow tests launch 2 or 3 real ranks on this host as ``srun`` would (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` on
loopback and a free ``MASTER_PORT``), on a copy of the real checkpoint of the ``each_run`` fit. A fault is real: the
chosen rank sends itself ``SIGKILL`` or ``SIGSTOP`` as its share of the parts starts (rank 0 has created the
temporary output and sent the jobs), after writing the time to a file; every other rank must end within
``--timeout`` plus :data:`SLACK` of that moment, with exit code 15 and one line naming the lost rank.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from nemo_patch.cli.distributed import DEFAULT_TIMEOUT, PeerError, arguments_digest
from nemo_patch.cli.nemo_consolidate import build_parser, main
from nemo_patch.engine.publish import TMP_PREFIX

#: Seconds a surviving rank may take beyond ``--timeout`` (or, for a killed peer, at all) to end, on a loaded 2-core
#: machine.
SLACK = 20.0

#: A rank: ``nemo_patch.cli.nemo_consolidate.main``; with ``FAULT=kill|stop`` it signals itself as its share starts.
RANK_PROGRAM = r"""
import os, signal, sys, time, warnings

warnings.filterwarnings("ignore", message=r"The pynvml package is deprecated", category=FutureWarning)
if os.environ.get("FAULT"):
    import nemo_patch.cli.distributed as distributed

    real_run_parts = distributed.run_parts

    def run_parts(*args, **kwargs):
        with open(os.environ["FAULT_TIME"], "w") as stamp:
            stamp.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if os.environ["FAULT"] == "kill" else signal.SIGSTOP)
        return real_run_parts(*args, **kwargs)

    distributed.run_parts = run_parts
from nemo_patch.cli.nemo_consolidate import main

sys.exit(main(sys.argv[1:]))
"""


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Ranks:
    """``len(argvs)`` ranks of one launch, rank ``r`` running ``nemo-consolidate argvs[r]`` (``None``: never
    launched); ``fault`` is ``(rank, "kill"|"stop")``. Their stdout and stderr go to files in ``directory``."""

    def __init__(self, directory, argvs, fault=None):
        self.directory, self.fault_time = Path(directory), Path(directory) / "fault-time"
        port = _free_port()
        self.procs = []
        for rank, argv in enumerate(argvs):
            if argv is None:
                self.procs.append(None)
                continue
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "NEMO_PATCH_DISABLE") and not k.startswith(("SLURM_", "MASTER_"))
            }
            env.update(RANK=str(rank), WORLD_SIZE=str(len(argvs)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if fault is not None and fault[0] == rank:
                env.update(FAULT=fault[1], FAULT_TIME=str(self.fault_time))
            with (
                open(self.directory / f"rank{rank}.out", "w") as out,
                open(self.directory / f"rank{rank}.err", "w") as err,
            ):
                self.procs.append(
                    subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, *map(str, argv)], stdout=out, stderr=err,
                                     cwd=REPO, env=env)  # fmt: skip
                )

    def wait(self, ranks, limit=300):
        """Wait for ``ranks`` to end: each one's end time (``time.time()``), for those that ended within ``limit``."""
        ended, deadline = {}, time.time() + limit
        while len(ended) < len(ranks) and time.time() < deadline:
            for rank in ranks:
                if rank not in ended and self.procs[rank].poll() is not None:
                    ended[rank] = time.time()
            time.sleep(0.05)
        return ended

    def stderr(self, rank):
        return (self.directory / f"rank{rank}.err").read_text()

    def stop(self):
        """End every rank still there (a stopped one included) and reap it."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait(timeout=60)


def _argv(checkpoint, out, *extra, timeout):
    return [checkpoint, "--out", out, "--workers", "1", "--timeout", timeout, *extra]


def _assert_lost(ranks, victim, world_size, reason, timeout, out):
    """Every rank but ``victim`` ended within ``timeout`` + :data:`SLACK` of the fault with exit code 15 and exactly
    one line on stderr, naming the victim; nothing was published and no temporary output is left."""
    survivors = [rank for rank in range(world_size) if rank != victim]
    ended = ranks.wait(survivors, limit=timeout + 300)
    assert sorted(ended) == survivors, [ranks.stderr(rank)[-2000:] for rank in survivors]
    fault_time = float(ranks.fault_time.read_text())
    for rank in survivors:
        err = ranks.stderr(rank)
        assert ranks.procs[rank].returncode == PeerError.exit_code == 15, err[-3000:]
        assert ended[rank] - fault_time <= timeout + SLACK, (rank, ended[rank] - fault_time)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert re.match(rf"nemo-consolidate: error: rank {victim} of {world_size} {reason}", lines[0]), lines[0]
        assert f"seen by rank {rank}, nothing was published" in lines[0]
    assert not out.exists()
    assert not [path.name for path in out.parent.iterdir() if path.name.startswith(TMP_PREFIX)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size, victim", [(2, 1), (3, 0)])
def test_a_killed_rank_ends_every_other_rank_with_exit_code_15_at_once(checkpoint_copy, tmp_path, world_size, victim):
    """A killed rank is seen at once (its connection closes), well within the 60 s ``--timeout``. With rank 0 killed,
    the others remove its temporary output."""
    out = tmp_path / "outputs" / "out"
    out.parent.mkdir()
    ranks = Ranks(tmp_path, [_argv(checkpoint_copy, out, timeout=60)] * world_size, fault=(victim, "kill"))
    try:
        ranks.wait([victim], limit=300)
        assert ranks.procs[victim].returncode == -signal.SIGKILL, ranks.stderr(victim)[-3000:]
        _assert_lost(ranks, victim, world_size, "left the run before it could finish writing its part: its "
                     r"connection closed \(killed, crashed", timeout=0, out=out)  # fmt: skip
    finally:
        ranks.stop()


@pytest.mark.slow
@pytest.mark.parametrize("world_size, victim", [(3, 1), (2, 0)])
def test_a_frozen_rank_ends_every_other_rank_with_exit_code_15_after_the_timeout(
    checkpoint_copy, tmp_path, world_size, victim
):
    """A rank stopped by SIGSTOP (alive, connections open) is given up on after ``--timeout`` by every other rank."""
    out = tmp_path / "outputs" / "out"
    out.parent.mkdir()
    ranks = Ranks(tmp_path, [_argv(checkpoint_copy, out, timeout=10)] * world_size, fault=(victim, "stop"))
    try:
        _assert_lost(ranks, victim, world_size, r"did not finish writing its part within --timeout 10 s \(frozen, "
                     "stopped", timeout=10, out=out)  # fmt: skip
        assert ranks.procs[victim].poll() is None  # still stopped: nobody waited for it to end
    finally:
        ranks.stop()


@pytest.mark.slow
@pytest.mark.parametrize("world_size, odd, extra", [(3, 2, ["--dtype", "bf16"]), (2, 1, ["--out", "other"])])
def test_a_rank_launched_with_other_arguments_is_refused_by_every_rank(
    checkpoint_copy, tmp_path, world_size, odd, extra
):
    out = tmp_path / "outputs" / "out"
    out.parent.mkdir()
    argvs = [_argv(checkpoint_copy, out, timeout=60) for _ in range(world_size)]
    argvs[odd] += [tmp_path / "outputs" / value if value == "other" else value for value in extra]
    ranks = Ranks(tmp_path, argvs)
    try:
        assert sorted(ranks.wait(range(world_size))) == list(range(world_size))
        for rank in range(world_size):
            err = ranks.stderr(rank)
            assert ranks.procs[rank].returncode == 15, err[-3000:]
            assert err.splitlines() == [
                f"nemo-consolidate: error: rank {odd} of {world_size} was launched with other arguments than rank 0 "
                "(the path, --out, --format, --dtype or another option, paths resolved; seen by rank "
                f"{rank}): every rank must run the same command line; nothing was written"
            ], err[-3000:]
        assert not list(out.parent.iterdir())
    finally:
        ranks.stop()


@pytest.mark.slow
@pytest.mark.parametrize("launched, says", [(0, r"DistStoreError: .*1/2 clients joined"), (1, "DistNetworkError")])
def test_a_rank_that_never_joins_ends_the_launched_one_with_exit_code_15(checkpoint_copy, tmp_path, launched, says):
    argvs = [None, None]
    argvs[launched] = _argv(checkpoint_copy, tmp_path / "out", timeout=5)
    ranks = Ranks(tmp_path, argvs)
    try:
        started = time.time()
        assert ranks.wait([launched], limit=120) and ranks.procs[launched].returncode == 15
        assert time.time() - started <= 5 + 2 * SLACK  # the 5 s --timeout, and this process's start
        err = ranks.stderr(launched)
        assert re.fullmatch(
            r"nemo-consolidate: error: the 2 ranks did not all join at 127\.0\.0\.1:\d+ within --timeout 5 s "
            rf"\(seen by rank {launched}: {says}.*\); nothing was written\n",
            err,
        ), err[-3000:]
        assert not (tmp_path / "out").exists()
    finally:
        ranks.stop()


@pytest.mark.slow
def test_the_other_ranks_exit_0_at_once_when_rank_0_verifies_an_existing_output_alone(checkpoint_copy, tmp_path):
    shutil.rmtree(checkpoint_copy / "context")  # the tensors alone are compared: rank 0 need not import NeMo
    out = tmp_path / "out"
    assert main([str(checkpoint_copy), "--out", str(out), "--workers", "1", "--quiet"]) == 0
    # --timeout 1e14 ("no limit"): beyond what timedelta holds, so every wait is capped rather than overflowing.
    ranks = Ranks(tmp_path, [_argv(checkpoint_copy, out, "--verify", timeout="1e14")] * 2)
    try:
        assert sorted(ranks.wait([0, 1])) == [0, 1]
        assert [proc.returncode for proc in ranks.procs] == [0, 0], ranks.stderr(0)[-3000:]
        assert "tensors match" in (tmp_path / "rank0.out").read_text()
        assert not (tmp_path / "rank1.out").read_text() and not ranks.stderr(1)
    finally:
        ranks.stop()


def _args(*argv):
    return vars(build_parser().parse_args([str(value) for value in argv]))


def test_the_arguments_digest_resolves_paths_and_ignores_only_quiet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    digest = arguments_digest(_args(tmp_path / "real", "--out", tmp_path / "out"))
    assert len(digest) == 32
    assert arguments_digest(_args("real", "--out", "out")) == digest  # relative to the current directory
    assert arguments_digest(_args("link", "--out", "./out", "--quiet")) == digest  # symbolic link followed
    for argv in (["other"], ["real", "--dtype", "bf16"], ["real", "--format", "hf"], ["real", "--out", "elsewhere"],
                 ["real", "--timeout", "10"], ["real", "--force"], ["real", "--max-shard-size", "1GB"]):  # fmt: skip
        changed = argv if "--out" in argv else [*argv, "--out", "out"]
        assert arguments_digest(_args(*changed)) != digest, argv


@pytest.mark.parametrize("value", ["0", "-5", "never", "inf", "nan"])
def test_timeout_must_be_a_positive_number_of_seconds(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["/nonexistent", "--timeout", value])
    assert exit_info.value.code == 2
    assert f"argument --timeout: Invalid number of seconds {value!r}: expected a number > 0" in (
        capsys.readouterr().err
    )


def test_help_names_the_default_timeout_and_exit_code_15():
    help_text = " ".join(build_parser().format_help().split())
    assert DEFAULT_TIMEOUT == 3600.0 and "(default: 3600;" in help_text
    assert "15 a torchrun/srun peer process that failed, froze past --timeout or was launched with different " in (
        help_text
    )
