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

"""One consolidation written by several processes: part jobs, and a pool of writer processes on this node.

A :class:`PartJob` is plain JSON, run by a writer process on this node (:func:`run_parts`) or on another node by a
runner the caller gives; a failure in any part stops the others with the part's own error. Never imports NeMo,
Lightning or megatron-core.
"""

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from nemo_patch.engine import casting  # noqa: F401 (registers the dtype casts a part job may need)
from nemo_patch.engine.checkpoint_layout import inspect_checkpoint
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.part_writer import Placement, split_parts, write_part
from nemo_patch.engine.process_limits import die_with_parent
from nemo_patch.engine.safetensors_writer import OutputFile
from nemo_patch.engine.stage_times import stage_times
from nemo_patch.engine.tensor_sources import Sources, open_sources

__all__ = [
    "MAX_WORKERS",
    "write_parts",
    "PartJob",
    "PartResult",
    "default_workers",
    "open_job_sources",
    "run_part",
    "run_parts",
    "split_shares",
]

#: Most writer processes per node by default: beyond about 8, one node's storage bandwidth, not CPU, is the limit.
MAX_WORKERS = 8


def default_workers(share: int = 1) -> int:
    """The default number of writer processes on this node: the CPU cores this process may use, divided by ``share``,
    at least 1 and at most :data:`MAX_WORKERS`. The CLI uses the whole node (``share=1``); a training run leaves most
    cores to training and its data loaders (``share=4``: 1 writer on a 2-core machine, 8 on a 32-core or larger one).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores // share))


def split_shares(jobs: Sequence["PartJob"], count: int) -> List[List["PartJob"]]:
    """Cut the parts of one consolidation into ``count`` consecutive shares of equal length, one per node or launched
    rank: share ``r`` holds parts ``r * k`` to ``r * k + k - 1``, ``k = len(jobs) // count``.

    Raises:
        ValueError: ``count`` < 1, or ``len(jobs)`` is not a multiple of it (the parts were not cut per share).
    """
    if count < 1 or len(jobs) % count:
        raise ValueError(f"{len(jobs)} parts cannot be split into {count} equal shares")
    per_share = len(jobs) // count
    return [list(jobs[rank * per_share : (rank + 1) * per_share]) for rank in range(count)]


@dataclass(frozen=True)
class PartJob:
    """Everything a process needs to fill one part of a consolidation's output.

    Attributes:
        checkpoint_dir: the checkpoint being consolidated.
        directory: the temporary output directory holding the created files.
        placements: the tensors to write and where.
        dtype: the output's floating-point dtype as a ``torch`` attribute name (``"bfloat16"``), ``None`` as stored.
        merge_adapters: merge a LoRA adapter checkpoint's adapters into its base model.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint if not where NeMo recorded it.
        index: this part's number (for messages).
    """

    checkpoint_dir: str
    directory: str
    placements: Tuple[Placement, ...]
    dtype: Optional[str] = None
    merge_adapters: bool = False
    base_checkpoint: Optional[str] = None
    index: int = 0

    def to_json(self) -> str:
        """The job as one JSON object."""
        return json.dumps(dict(self.__dict__, placements=[p.to_dict() for p in self.placements]), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PartJob":
        """The job :meth:`to_json` wrote.

        Raises:
            ValueError: not such a JSON object.
        """
        try:
            data = json.loads(text)
            data["placements"] = tuple(Placement(**item) for item in data["placements"])
            return cls(**data)
        except (TypeError, KeyError, ValueError) as error:
            raise ValueError(f"not a consolidation part job: {text[:200]!r} ({error})") from error


@dataclass
class PartResult:
    """What filling one part did.

    Attributes:
        digests: tensor name -> BLAKE3 hex digest of its data bytes.
        nbytes: tensor-data bytes written.
        stage_seconds: busy seconds per stage (:mod:`.stage_times`).
    """

    digests: Dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    stage_seconds: Dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        """The result as one JSON object."""
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PartResult":
        """The result :meth:`to_json` wrote."""
        return cls(**json.loads(text))


def open_job_sources(job: PartJob) -> Sources:
    """The :class:`~.tensor_sources.Sources` a part job reads from (opened from its checkpoint)."""
    location = inspect_checkpoint(job.checkpoint_dir, allow_unfinished=True)  # the coordinator checked it
    dtype = None if job.dtype is None else getattr(torch, job.dtype)
    return open_sources(location, dtype, job.merge_adapters, job.base_checkpoint)


def run_part(
    job: PartJob, sources: Optional[Sources] = None, progress: Callable[[int], None] = lambda nbytes: None
) -> PartResult:
    """Fill one part in this process, with one torch thread (a writer's work is memory copies, which torch's intra-op
    threads only slow down: 2.0 CPU-seconds against 1.2 for one writer of the 2.55 GB benchmark checkpoint).

    Args:
        job: the part.
        sources: the consolidation's :class:`~.tensor_sources.Sources` if this process has them
            (else they are opened from ``job``).
        progress: called with each tensor's bytes once written.

    Raises:
        ConsolidationError: or a subclass naming the cause (an unreadable shard file names the file).
        OSError: the output files cannot be written.
    """
    before = stage_times.snapshot()
    sources = open_job_sources(job) if sources is None else sources
    names = [placement.name for placement in job.placements]
    specs = {output.spec.name: output.spec for output in sources.outputs}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        digests = write_part(Path(job.directory), job.placements, specs, sources.producer(names=names), progress)
    finally:
        torch.set_num_threads(threads)
    after = stage_times.snapshot()
    seconds = {stage: after[stage] - before.get(stage, 0.0) for stage in after}
    return PartResult(digests, sum(placement.nbytes for placement in job.placements), seconds)


#: The consolidating process's sources, inherited by forked writers (spawned writers open their own).
_INHERITED: Dict[str, Sources] = {}


def _writer_main(job_json: str, connection: Any, counter: Any, parent: Optional[int]) -> None:
    # A killed consolidation leaves no writers behind. The signal is asked for here, in the child, after the fork: a
    # parent that died in between sends none, so ``parent`` (recorded before the fork) is checked once it is asked for.
    die_with_parent(parent)
    torch.set_num_threads(1)  # one writer per core; also keeps a forked child away from the parent's thread pool
    stage_times.reset()

    def progress(nbytes: int) -> None:
        with counter.get_lock():
            counter.value += nbytes

    try:
        job = PartJob.from_json(job_json)
        result = run_part(job, _INHERITED.get(job.checkpoint_dir), progress)
        connection.send(("ok", result.to_json()))
    except BaseException as error:  # noqa: B902 - every failure must reach the coordinator
        try:
            connection.send(("error", error))
        except Exception:  # an exception that cannot be pickled
            connection.send(("error", ConsolidationError(f"{type(error).__name__}: {error}")))
    finally:
        connection.close()


#: Modules whose presence means this process has state a forked child must not inherit (process groups, helper
#: threads, allocators): NeMo's model building for a verification, a ``torchrun`` rank's gloo group.
_NOT_FORK_SAFE = ("nemo", "megatron.core", "lightning", "transformer_engine", "apex")


def _fork_is_safe() -> bool:
    """Whether writers may be forked from this process: Linux ``fork``, and nothing started that a child cannot
    carry on (CUDA, a ``torch.distributed`` group, NeMo or megatron-core imported). The consolidation process of a
    training run and a plain command-line consolidation qualify."""
    import torch.distributed

    return (
        "fork" in multiprocessing.get_all_start_methods()
        and not torch.cuda.is_initialized()
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
        and not any(name in sys.modules for name in _NOT_FORK_SAFE)
    )


def _context() -> Any:
    """``fork`` where :func:`_fork_is_safe`, else ``forkserver`` (a fresh interpreter that imports this module once
    and forks every writer from there), else ``spawn``."""
    if _fork_is_safe():
        return multiprocessing.get_context("fork")
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        return context
    return multiprocessing.get_context("spawn")


def _describe(process: Any) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code} without a result"


def run_parts(
    jobs: Sequence[PartJob],
    sources: Sources,
    workers: int = 1,
    progress: Optional[Callable[[int], None]] = None,
    poll: float = 0.2,
) -> List[PartResult]:
    """Fill ``jobs`` on this node: in this process when ``workers`` is 1, else one writer process per job.

    Args:
        jobs: the parts (at most ``workers`` of them when ``workers`` > 1).
        sources: this process's :class:`~.tensor_sources.Sources` of the consolidation.
        workers: 1 for this process alone.
        progress: called with the total bytes written so far, as writers report it.
        poll: seconds between progress reports.

    Returns:
        One :class:`PartResult` per job, in order.

    Raises:
        ConsolidationError: a part failed (its own error, re-raised) or its writer died (naming the part, the process
            and its signal or exit code); the other writers are killed first.
        OSError: the output files cannot be written.
    """
    if workers == 1 or len(jobs) <= 1:
        done = [0]

        def step(nbytes: int) -> None:
            done[0] += nbytes
            if progress is not None:
                progress(done[0])

        return [run_part(job, sources, step) for job in jobs]
    context = _context()
    counter = context.Value("q", 0)
    _INHERITED.clear()
    if context.get_start_method() == "fork":
        _INHERITED[jobs[0].checkpoint_dir] = sources
    # A forked or spawned writer's parent is this process; a forkserver's writers are the forkserver's children (it
    # exits once this process is gone, and they with it).
    parent = os.getpid() if context.get_start_method() != "forkserver" else None
    writers = []
    try:
        for job in jobs:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=_writer_main,
                args=(job.to_json(), send, counter, parent),
                name=f"consolidation-part-{job.index}",
            )
            process.start()
            send.close()
            writers.append((job, process, receive))
        results: Dict[int, PartResult] = {}
        while len(results) < len(jobs):
            waiting = [(i, w) for i, w in enumerate(writers) if i not in results]
            handles = [w[2] for _, w in waiting] + [w[1].sentinel for _, w in waiting]
            ready = multiprocessing.connection.wait(handles, poll)
            for i, (job, process, receive) in waiting:
                if receive in ready or process.sentinel in ready:
                    try:
                        status, payload = receive.recv()
                    except EOFError:
                        process.join()
                        raise ConsolidationError(
                            f"The writer process {process.pid} of part {job.index} {_describe(process)}"
                        ) from None
                    if status != "ok":
                        raise payload
                    results[i] = PartResult.from_json(payload)
            if progress is not None:
                progress(counter.value)
        return [results[i] for i in range(len(jobs))]
    finally:
        _INHERITED.clear()
        for _, process, receive in writers:
            if process.is_alive():
                process.kill()
            process.join()
            receive.close()


def write_parts(
    consolidation: Any,
    location: Any,
    sources: Sources,
    directory: Path,
    layout: Sequence[OutputFile],
    count: int,
    progress: Optional[Callable[[int], None]],
) -> List[PartResult]:
    """Fill the created ``layout`` of ``consolidation`` (a :class:`.consolidate.ConsolidationSteps`)
    in ``count`` parts: with its ``parts_runner`` when it has one, else with :func:`run_parts` on this node.

    Raises:
        ConsolidationError: a part failed (its own error).
    """
    dtype = None if consolidation.dtype is None else str(consolidation.dtype).removeprefix("torch.")
    merge = consolidation.merge_adapters and sources.merge is not None
    base = None if consolidation.base_checkpoint is None else str(consolidation.base_checkpoint)
    jobs = [
        PartJob(str(location.checkpoint_dir), str(directory), tuple(part), dtype, merge, base, index)
        for index, part in enumerate(split_parts(layout, count))
    ]
    if consolidation.parts_runner is not None:
        return list(consolidation.parts_runner(jobs, sources))
    return run_parts(jobs, sources, consolidation.workers, progress)
