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

"""``nemo-consolidate`` launched on several nodes: ``torchrun`` or SLURM's ``srun`` split one consolidation's writes.

Every process runs the same command line with ``--workers`` writer processes, on a filesystem all of them see (usage:
docs/parallel.md); rank 0 plans the output and cuts it into ``world size x workers`` parts. A ``gloo`` group of these
processes alone (``env://``) carries five messages, in this order:

1. every rank to every rank: the SHA-256 of its parsed arguments (:func:`arguments_digest`), before any work;
2. rank 0 to each rank: its share of the part jobs (before rank 0 starts its own), or that rank 0 failed before
   planning, or does the rest alone (a Hugging Face export, ``--verify`` of an existing output);
3. every rank to every rank, once its share is written (or failed): "done";
4. each rank to rank 0: its results (the tensors' digests) or its error;
5. rank 0 to each rank that reported: the exit code. Rank 0 publishes only when every part reported done.

Every message is a tensor (fixed-size, or JSON text as ``uint8`` after its length): nothing a peer sends is unpickled.
Each wait for a peer is bounded by ``--timeout``. gloo closes every connection of a process once one of its waits
times out, so each rank finds lost peers itself, in the all-to-all messages 1 and 3 (``monitored_barrier`` names them
on rank 0 only).
"""

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nemo_patch.cli.exit_codes import error_classes
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.parts import PartJob, PartResult, open_job_sources, run_parts, split_shares
from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.engine.tensor_sources import Sources
from nemo_patch.training.fit_end import capped_timedelta

__all__ = ["PeerError", "DEFAULT_TIMEOUT", "LaunchedGroup", "arguments_digest"]


class PeerError(ConsolidationError):
    """A peer process of a multi-process run (``torchrun``/``srun``, :mod:`nemo_patch.cli.distributed`) left the run
    (killed, crashed), did not answer within ``--timeout`` (frozen, hung), or was launched with different arguments;
    the message names the rank(s). Rank 0 publishes nothing unless every rank reported its part written."""

    exit_code, summary = (
        15,
        "a torchrun/srun peer process that failed, froze past --timeout or was launched with different arguments",
    )


#: How long a rank waits for another rank's next message (``--timeout``), in seconds.
DEFAULT_TIMEOUT = 3600.0

#: Arguments that change neither the output nor how the ranks wait: left out of :func:`arguments_digest`.
UNCOMPARED_ARGUMENTS = frozenset({"quiet"})

# One gloo tag per message (a message of bytes uses its tag for the length and the next one for the text), so that a
# message is never taken for another.
_ARGUMENTS, _PLAN, _DONE, _REPORT, _OUTCOME = 1, 10, 20, 30, 40

_LATE, _GONE = "late", "gone"


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def arguments_digest(arguments: Mapping[str, Any]) -> bytes:
    """The SHA-256 of a parsed command line (``vars(args)``): every argument but those of
    :data:`UNCOMPARED_ARGUMENTS`, each path resolved (absolute, symbolic links followed: the part jobs carry rank 0's
    paths, so every rank must see the same files under the same names)."""
    canonical = {
        name: str(Path(value).resolve()) if isinstance(value, Path) else value
        for name, value in arguments.items()
        if name not in UNCOMPARED_ARGUMENTS
    }
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, default=repr).encode()).digest()


def _ranks(ranks: Sequence[int], world_size: int) -> str:
    """``"rank 1 of 3"`` or ``"ranks 1, 2 of 3"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world_size}"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def _stderr_held() -> Iterator[None]:
    """Hold back file descriptor 2 (c10d's C++ logging: a stack trace per failed attempt to reach the store) in the
    block: dropped when it raises (the caller says why in one line), written out when it does not."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        sys.stderr.write(held.read().decode(errors="replace"))


def _error_of(report: Mapping[str, Any], prefix: str) -> ConsolidationError:
    """A peer's reported error as the :class:`ConsolidationError` subclass it named (its exit code kept)."""
    cls = error_classes().get(str(report.get("type")))
    if not (isinstance(cls, type) and issubclass(cls, ConsolidationError)):
        cls = ConsolidationError
    error = cls(f"{prefix}: {report.get('message')}")
    if isinstance(code := report.get("exit_code"), int) and code != error.exit_code:
        error.exit_code = code
    return error


class LaunchedGroup:
    """The processes a launcher started for one ``nemo-consolidate`` command, and their ``gloo`` group.

    Args:
        rank: this process's rank (``RANK``, else ``SLURM_PROCID``).
        world_size: how many processes (``WORLD_SIZE``, else ``SLURM_NTASKS``).
        timeout: seconds a rank waits for another rank's next message (``--timeout``).
    """

    def __init__(self, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.peers = [peer for peer in range(world_size) if peer != rank]
        self._joined = False
        self._planned = False  # rank 0: the jobs were sent
        self._released = False  # rank 0: the other ranks were told to exit, it does the rest alone
        self._reported: List[int] = []  # rank 0: the ranks whose report arrived (they wait for the exit code)
        self._timed_out = False  # a wait of this process timed out: gloo closed every connection of this process
        self._lost: Dict[int, str] = {}  # peer -> _LATE or _GONE
        self._sends: List[Tuple[int, Any, torch.Tensor]] = []  # (peer, work, tensor): kept until the transfer ends
        self._output_dir: Optional[Path] = None  # other ranks: rank 0's temporary output directory
        self._error: Optional[PeerError] = None  # rank 0: the lost peer it tells the ranks that reported about

    @classmethod
    def from_environment(cls, timeout: Optional[float] = None) -> Optional["LaunchedGroup"]:
        """The group ``torchrun`` (``RANK``, ``WORLD_SIZE``) or ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, with
        ``MASTER_ADDR`` and ``MASTER_PORT`` set) launched this process in, or ``None`` for a single process; its
        ranks wait ``timeout`` seconds for each other (default :data:`DEFAULT_TIMEOUT`).

        Raises:
            ConsolidationError: launched by ``srun`` without ``MASTER_ADDR``/``MASTER_PORT``.
        """
        world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS")
        rank = _env_int("RANK", "SLURM_PROCID")
        if world_size is None or world_size < 2 or rank is None:
            return None
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ConsolidationError(
                f"Launched as rank {rank} of {world_size} without MASTER_ADDR and MASTER_PORT: set them to a host and "
                "free port of the first node (torchrun sets them; with srun, export them)"
            )
        return cls(rank, world_size, DEFAULT_TIMEOUT if timeout is None else timeout)

    # --- joining and leaving ---

    def join(self, arguments: Mapping[str, Any]) -> None:
        """Join the ``gloo`` group (``env://`` at ``MASTER_ADDR:MASTER_PORT``) and compare every rank's ``arguments``
        (``vars(args)``) with rank 0's, by :func:`arguments_digest`, before any work; leaves the group on failure.

        Raises:
            PeerError: not every rank joined within the timeout, a rank was launched with different arguments (every
                rank raises it, naming the same ranks), or a rank was lost.
        """
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size))
        try:
            timeout = capped_timedelta(self.timeout)
            with _stderr_held():
                dist.init_process_group(
                    "gloo", init_method="env://", rank=self.rank, world_size=self.world_size, timeout=timeout
                )
        except Exception as error:  # noqa: BLE001 - the store's and gloo's errors have no common type
            raise PeerError(
                f"the {self.world_size} ranks did not all join at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} within --timeout {self.timeout:g} s (seen by rank {self.rank}: "
                f"{_first_line(error)}); nothing was written"
            ) from None
        self._joined = True
        try:
            digest = torch.frombuffer(
                bytearray(arguments_digest(dict(arguments, timeout=self.timeout))), dtype=torch.uint8
            )
            digests = self._exchange(digest, _ARGUMENTS, "compare arguments", "nothing was written")
            differing = [rank for rank, theirs in enumerate(digests) if not torch.equal(theirs, digests[0])]
            if differing:
                raise PeerError(
                    f"{_ranks(differing, self.world_size)} {'were' if len(differing) > 1 else 'was'} launched with "
                    "other arguments than rank 0 (the path, --out, --format, --dtype or another option, paths "
                    f"resolved; seen by rank {self.rank}): every rank must run the same command line; nothing was "
                    "written"
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let this rank's messages to the ranks not lost reach them (within the timeout), and leave the group."""
        if not self._joined:
            return
        deadline = time.monotonic() + self.timeout
        for peer, work, _ in self._sends:
            if peer not in self._lost and not self._timed_out:
                self._wait(work, deadline)
        self._sends.clear()
        self._joined = False
        with contextlib.suppress(Exception):  # leaving a group whose peers are gone
            dist.destroy_process_group()

    # --- messages ---

    def _failure(self, error: BaseException, deadline: float) -> str:
        """Why a wait for a peer failed: ``_LATE`` (a timeout, this one or an earlier one that closed every
        connection) or ``_GONE`` (the peer's connection closed)."""
        text = str(error).lower()
        if self._timed_out or "timed out" in text or "timeout" in text or time.monotonic() >= deadline:
            self._timed_out = True
            return _LATE
        return _GONE

    def _wait(self, work: Any, deadline: float) -> Optional[str]:
        """Wait for ``work`` until ``deadline``: ``None`` when done, else :meth:`_failure`'s reason."""
        try:
            work.wait(timeout=capped_timedelta(max(deadline - time.monotonic(), 0.001)))
            return None
        except RuntimeError as error:
            return self._failure(error, deadline)

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        with contextlib.suppress(RuntimeError):  # a closed connection: waiting for the peer's message finds it lost
            self._sends.append((peer, dist.isend(tensor, peer, tag=tag), tensor))

    def _send_text(self, text: str, peer: int, tag: int) -> None:
        data = text.encode()
        self._send(torch.tensor([len(data)], dtype=torch.int64), peer, tag)
        if data:
            self._send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, tag + 1)

    def _deliver(self, what: str) -> None:
        """Wait until every message sent so far has reached its peer (PeerError: a peer was lost before)."""
        deadline, lost = time.monotonic() + self.timeout, {}
        for peer, work, _ in self._sends:
            if peer not in lost and (reason := self._wait(work, deadline)) is not None:
                lost[peer] = reason
        self._sends.clear()
        self._lost.update(lost)
        if lost:
            raise self._peer_error(lost, what)

    def _receive(self, tensors: Mapping[int, torch.Tensor], tag: int, deadline: float) -> Dict[int, str]:
        """Receive ``tensors[peer]`` from each peer by ``deadline``; returns the peers lost meanwhile, each with why
        (also recorded in ``self._lost``)."""
        works, lost = {}, {}
        for peer, tensor in tensors.items():
            try:
                works[peer] = dist.irecv(tensor, peer, tag=tag)
            except RuntimeError as error:
                lost[peer] = self._failure(error, deadline)
        for peer, work in works.items():
            if (reason := self._wait(work, deadline)) is not None:
                lost[peer] = reason
        self._lost.update(lost)
        return lost

    def _receive_texts(self, peers: Sequence[int], tag: int, deadline: float) -> Tuple[Dict[int, str], Dict[int, str]]:
        """The text each of ``peers`` sent (:meth:`_send_text`) by ``deadline``, and the peers lost meanwhile."""
        lengths = {peer: torch.zeros(1, dtype=torch.int64) for peer in peers}
        lost = self._receive(lengths, tag, deadline)
        data = {peer: torch.empty(int(lengths[peer]), dtype=torch.uint8) for peer in peers if peer not in lost}
        lost.update(self._receive({peer: t for peer, t in data.items() if t.numel()}, tag + 1, deadline))
        return {peer: data[peer].numpy().tobytes().decode() for peer in data if peer not in lost}, lost

    def _exchange(
        self, tensor: torch.Tensor, tag: int, what: str, published: str = "nothing was published"
    ) -> List[torch.Tensor]:
        """An all-gather of ``tensor`` (the same shape on every rank); PeerError naming the peers lost before."""
        for peer in self.peers:
            self._send(tensor, peer, tag)
        theirs = {peer: torch.empty_like(tensor) for peer in self.peers}
        lost = self._receive(theirs, tag, time.monotonic() + self.timeout)
        if lost:
            raise self._peer_error(lost, what, published)
        return [tensor if rank == self.rank else theirs[rank] for rank in range(self.world_size)]

    def _peer_error(self, lost: Mapping[int, str], what: str, published: str = "nothing was published") -> PeerError:
        """The one-line error naming the ``lost`` peers (the peer -> reason of :meth:`_receive`)."""
        said = []
        late = sorted(peer for peer, reason in lost.items() if reason == _LATE)
        gone = sorted(peer for peer, reason in lost.items() if reason == _GONE)
        if gone:
            said.append(
                f"{_ranks(gone, self.world_size)} left the run before it could {what}: its connection closed "
                "(killed, crashed, or ended by an error of its own)"
            )
        if late:
            said.append(
                f"{_ranks(late, self.world_size)} did not {what} within --timeout {self.timeout:g} s (frozen, "
                "stopped, or slower than that)"
            )
        return PeerError(f"{'; '.join(said)}; seen by rank {self.rank}, {published}")

    # --- rank 0 ---

    def release(self) -> None:
        """Rank 0: tell the other ranks that it does the rest alone (they have no part in it and exit 0)."""
        if not self._planned and not self._released:
            self._released = True
            for peer in self.peers:
                self._send_text(json.dumps({"alone": True}), peer, _PLAN)

    def run(self, jobs: List[PartJob], sources: Sources) -> List[PartResult]:
        """Rank 0's :data:`~nemo_patch.engine.consolidate.PartsRunner`: send each rank its jobs, fill rank 0's, and
        collect every rank's results.

        Raises:
            ConsolidationError: a part failed (its own error; another rank's names the rank).
            PeerError: a rank was lost before it reported.
        """
        shares = split_shares(jobs, self.world_size)
        self._planned = True
        for peer in self.peers:
            self._send_text(json.dumps({"jobs": [job.to_json() for job in shares[peer]]}), peer, _PLAN)
        self._deliver("receive the parts to write")  # so that they can remove the output should rank 0 be lost
        own_error: Optional[BaseException] = None
        results: List[PartResult] = []
        try:
            results = run_parts(shares[0], sources, len(shares[0]))
        except Exception as error:  # noqa: BLE001 - the other ranks still report, then this error is raised
            own_error = error
        self._exchange(torch.ones(1, dtype=torch.uint8), _DONE, "finish writing its part")
        reports, lost = self._receive_texts(self.peers, _REPORT, time.monotonic() + self.timeout)
        self._reported = sorted(reports)
        if lost:
            self._error = self._peer_error(lost, "report its part")
            raise self._error
        if own_error is not None:
            raise own_error
        for rank in self.peers:
            report = json.loads(reports[rank])
            if "error" in report:
                raise _error_of(report["error"], f"rank {rank} of {self.world_size} failed its part")
            results += [PartResult.from_json(text) for text in report["results"]]
        return results

    def finish(self, code: int) -> None:
        """Rank 0: tell every rank still waiting how the consolidation ended (``code``, the exit code) and leave the
        group."""
        if not self._planned and not self._released:
            for peer in self.peers:
                self._send_text(json.dumps({"abort": code}), peer, _PLAN)
        outcome = {"exit": code} if self._error is None else {"exit": code, "lost": str(self._error)}
        for peer in self._reported:
            self._send_text(json.dumps(outcome), peer, _OUTCOME)
        self.close()

    # --- the other ranks ---

    def serve(self) -> int:
        """Ranks other than 0: fill the parts rank 0 sends, report them, and return rank 0's exit code; leaves the
        group.

        Raises:
            PeerError: a rank was lost (before the reports, rank 0's temporary output is removed if rank 0 was).
        """
        try:
            return self._serve()
        finally:
            self.close()

    def _serve(self) -> int:
        texts, lost = self._receive_texts([0], _PLAN, time.monotonic() + self.timeout)
        if lost:
            raise self._peer_error(lost, "send the parts to write", "nothing was written")
        plan = json.loads(texts[0])
        if "abort" in plan:
            return int(plan["abort"])
        if "alone" in plan:
            return 0
        jobs = [PartJob.from_json(text) for text in plan["jobs"]]
        if jobs:
            self._output_dir = Path(jobs[0].directory)
        report: Dict[str, Any]
        try:
            results = run_parts(jobs, open_job_sources(jobs[0]), len(jobs)) if jobs else []
            report = {"results": [result.to_json() for result in results]}
        except Exception as error:  # noqa: BLE001 - reported by rank 0, once
            if isinstance(error, ConsolidationError):
                failure = {"type": type(error).__name__, "exit_code": error.exit_code, "message": str(error)}
            else:
                failure = {"type": "ConsolidationError", "exit_code": 1, "message": f"{type(error).__name__}: {error}"}
            report = {"error": failure}
        try:
            self._exchange(torch.ones(1, dtype=torch.uint8), _DONE, "finish writing its part")
        except PeerError:  # rank 0 lost before every rank reported cannot publish: its temporary output is removed
            if 0 in self._lost and self._output_dir is not None and self._output_dir.name.startswith(TMP_PREFIX):
                shutil.rmtree(self._output_dir, ignore_errors=True)
            raise
        self._send_text(json.dumps(report), 0, _REPORT)
        texts, lost = self._receive_texts([0], _OUTCOME, time.monotonic() + self.timeout)
        if lost:
            raise self._peer_error(lost, "send the outcome", "whether rank 0 published the output is not known here")
        outcome = json.loads(texts[0])
        if "lost" in outcome:  # a peer rank 0 found lost, that this rank did not wait for
            raise PeerError(outcome["lost"])
        return int(outcome["exit"])
