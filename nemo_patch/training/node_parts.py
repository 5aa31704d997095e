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

"""Consolidations written by several nodes during training, coordinated through files in the temporary output.

With ``ckpt_consolidation_nodes=N`` (> 1, ``safetensors`` format), global rank 0's consolidation process lays out and
creates the output files in its temporary output directory ``<ckpt>/.consolidated.tmp-.../``, cuts the tensors into
``N x workers`` parts, and writes ``.parts/plan.json`` there: the part jobs of each node
(:class:`nemo_patch.engine.parts.PartJob`), its host and process, and a deadline. It fills node 0's parts itself
(:class:`FilePartsRunner`). On each of nodes 1 to ``N - 1``, local rank 0 runs a watcher process
(:class:`NodePartWatcher`, ``python -m nemo_patch.training.node_parts``) that looks for plans under the run's
checkpoint directory, claims its node's share (``part-<r>.claimed``, created exclusively), fills it with its own
writer processes, and reports ``part-<r>.done`` (its results, renamed into place) or ``part-<r>.failed`` (the error).
Global rank 0 publishes (the directory rename) only when every node reported done; a node that fails, does not claim
its share within :data:`CLAIM_TIMEOUT` seconds, or does not report before the deadline fails the whole consolidation:
nothing is published, the temporary output is removed (its watchers then stop writing), and the failure is logged
once, by global rank 0. The training job's communicators are never used; the nodes need only a filesystem they share.

Node ranks outside ``1 .. N - 1`` and other local ranks do nothing. At teardown a watcher keeps serving until global
rank 0 has finished its consolidations (it touches ``<root>/.consolidation-closed``), up to
``ckpt_consolidation_timeout`` seconds.

Imports the standard library, torch (through the engine, in the consolidating processes) and the engine only; never
NeMo or Lightning.
"""

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.huge_pages import with_huge_pages
from nemo_patch.engine.parts import PartJob, PartResult, open_job_sources, run_parts, split_shares
from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.engine.tensor_sources import Sources
from nemo_patch.training.settings import WORKER_NICENESS

__all__ = [
    "CLAIM_TIMEOUT",
    "CLOSED_MARKER",
    "FilePartsRunner",
    "NodePartWatcher",
    "PARTS_DIRNAME",
    "close_marker",
    "serve",
]

logger = logging.getLogger(__name__)

#: The coordination directory inside a temporary output directory (removed before publishing).
PARTS_DIRNAME = ".parts"
_PLAN = "plan.json"
#: Seconds a node has to claim its share of a plan before the consolidation fails (its watcher polls every second).
CLAIM_TIMEOUT = 120.0
#: Touched in the checkpoint root by global rank 0 once its consolidations are over (teardown); watchers then stop.
CLOSED_MARKER = ".consolidation-closed"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class FilePartsRunner:
    """Global rank 0's :data:`~nemo_patch.engine.consolidate.PartsRunner` for ``nodes`` writing nodes.

    Args:
        nodes: how many nodes write (>= 2).
        workers: writer processes per node (each node gets ``workers`` parts).
        timeout: seconds from the plan to the last node's report.
        claim_timeout: seconds a node has to claim its share.
        poll: seconds between looks at the nodes' reports.
    """

    def __init__(
        self, nodes: int, workers: int, timeout: float, claim_timeout: float = CLAIM_TIMEOUT, poll: float = 0.2
    ) -> None:
        self.nodes, self.workers, self.timeout = nodes, workers, timeout
        self.claim_timeout, self.poll = min(claim_timeout, timeout), poll

    def parts(self) -> int:
        """How many parts the consolidation is cut into."""
        return self.nodes * self.workers

    def __call__(self, jobs: List[PartJob], sources: Sources) -> List[PartResult]:
        """Publish the plan, fill node 0's share, and collect the other nodes' results.

        Raises:
            ConsolidationError: a node's part failed (its error, naming the node), or a node did not claim or report
                in time.
        """
        shares = dict(enumerate(split_shares(jobs, self.nodes)))
        directory = Path(jobs[0].directory) / PARTS_DIRNAME
        directory.mkdir()
        started = time.monotonic()
        plan = {
            "nodes": self.nodes,
            "coordinator": f"{socket.gethostname()}:{os.getpid()}",
            "deadline": time.time() + self.timeout,
            "shares": {str(rank): [job.to_json() for job in share] for rank, share in shares.items() if rank},
        }
        _write_atomically(directory / _PLAN, json.dumps(plan))
        results = run_parts(shares[0], sources, len(shares[0]))
        waiting = set(range(1, self.nodes))
        while waiting:
            for rank in sorted(waiting):
                failed, done = directory / f"part-{rank}.failed", directory / f"part-{rank}.done"
                if failed.exists():
                    raise ConsolidationError(f"Node {rank} of {self.nodes} failed its part: {failed.read_text()}")
                if done.exists():
                    results += [PartResult.from_json(text) for text in json.loads(done.read_text())]
                    waiting.discard(rank)
            elapsed = time.monotonic() - started
            unclaimed = [rank for rank in waiting if not (directory / f"part-{rank}.claimed").exists()]
            if unclaimed and elapsed > self.claim_timeout:
                raise ConsolidationError(
                    f"Node(s) {', '.join(map(str, unclaimed))} of {self.nodes} did not take their part within "
                    f"{self.claim_timeout:.0f} s (is local rank 0 of each node running with ckpt_consolidation_nodes="
                    f"{self.nodes}, on a filesystem shared with global rank 0?)"
                )
            if waiting and elapsed > self.timeout:
                raise ConsolidationError(
                    f"Node(s) {', '.join(map(str, sorted(waiting)))} of {self.nodes} did not report their part "
                    f"within {self.timeout:.0f} s"
                )
            if waiting:
                time.sleep(self.poll)
        shutil.rmtree(directory)  # not part of the output
        return results


def _plans(root: Path) -> List[Path]:
    return sorted(root.glob(f"*/{TMP_PREFIX}*/{PARTS_DIRNAME}/{_PLAN}"))


def _fill(plan_path: Path, node_rank: int) -> bool:
    """Claim and fill this node's share of one plan; ``False`` when there is nothing (left) for it to do."""
    directory = plan_path.parent
    try:
        plan = json.loads(plan_path.read_text())
    except (OSError, ValueError):
        return False  # removed meanwhile (the consolidation failed) or not ours
    share = plan.get("shares", {}).get(str(node_rank))
    if not share or time.time() > float(plan.get("deadline", 0)):
        return False
    try:
        os.close(os.open(directory / f"part-{node_rank}.claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return False  # the temporary output is gone
    jobs = [PartJob.from_json(text) for text in share]
    try:
        results = run_parts(jobs, open_job_sources(jobs[0]), len(jobs))
        _write_atomically(directory / f"part-{node_rank}.done", json.dumps([r.to_json() for r in results]))
    except Exception as error:  # noqa: BLE001 - reported by global rank 0, once
        if directory.is_dir():
            try:
                _write_atomically(directory / f"part-{node_rank}.failed", f"{type(error).__name__}: {error}")
            except OSError:
                pass
    return True


def serve(root: Path, node_rank: int, stop: threading.Event, poll: float = 1.0) -> int:
    """Fill this node's share of every plan that appears under ``root`` until ``stop`` is set; returns how many.

    Args:
        root: the run's checkpoint directory (``ModelCheckpoint.dirpath``).
        node_rank: this node's rank (1 to ``nodes - 1``).
        stop: set to end the loop (between plans).
        poll: seconds between looks.
    """
    filled = 0
    while not stop.is_set():
        for plan_path in _plans(root):
            filled += _fill(plan_path, node_rank)
        stop.wait(poll)
    return filled


class NodePartWatcher:
    """A watcher process (:func:`serve`) on a node's local rank 0, for the length of a fit.

    Args:
        root: the run's checkpoint directory.
        node_rank: this node's rank.
        timeout: at :meth:`stop`, seconds to keep serving while global rank 0 has not touched :data:`CLOSED_MARKER`.
    """

    def __init__(self, root: Path, node_rank: int, timeout: float) -> None:
        self.root, self.node_rank, self.timeout = Path(root), node_rank, timeout
        self._process: Optional[subprocess.Popen] = None
        marker = self.root / CLOSED_MARKER
        self._closed_at = marker.stat().st_mtime_ns if marker.exists() else None

    def ensure_running(self) -> None:
        """Start the watcher process, or start it again if it died."""
        if self._process is not None and self._process.poll() is None:
            return
        if self._process is not None:
            logger.warning("The consolidation part watcher of node %d exited (%s); starting another",
                           self.node_rank, self._process.returncode)  # fmt: skip
        command = [sys.executable, "-m", "nemo_patch.training.node_parts", str(self.root), str(self.node_rank)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, env=with_huge_pages(os.environ))

    def _closed(self) -> bool:
        marker = self.root / CLOSED_MARKER
        return marker.exists() and marker.stat().st_mtime_ns != self._closed_at

    def stop(self) -> None:
        """Wait (up to ``timeout``) for global rank 0 to close, serving meanwhile, then end the watcher."""
        deadline = time.monotonic() + self.timeout
        while not self._closed() and time.monotonic() < deadline:
            self.ensure_running()
            time.sleep(1.0)
        if self._process is not None:
            if self._process.stdin is not None:
                self._process.stdin.close()  # the watcher ends after the plan it is filling
            try:  # between plans it ends within a poll; one still starting up needs its imports' time
                self._process.wait(timeout=max(30.0, self.timeout))
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


def close_marker(root: Path) -> None:
    """Global rank 0: tell the nodes' watchers that no more plans will come (touch :data:`CLOSED_MARKER`)."""
    marker = Path(root) / CLOSED_MARKER
    marker.touch()
    os.utime(marker)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m nemo_patch.training.node_parts <root> <node rank>``: serve until stdin closes."""
    parser = argparse.ArgumentParser(description="Fill this node's parts of the run's consolidations.")
    parser.add_argument("root", type=Path)
    parser.add_argument("node_rank", type=int)
    args = parser.parse_args(argv)
    try:
        os.nice(WORKER_NICENESS)  # as the consolidation process: training's threads come first
    except OSError:
        pass
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    serve(args.root, args.node_rank, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
