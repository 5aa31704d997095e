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

Launched by ``torchrun --nnodes N --nproc-per-node 1 ... -m nemo_patch <ckpt> ...`` (or ``srun -N N
--ntasks-per-node 1 python -m nemo_patch <ckpt> ...`` with ``MASTER_ADDR``/``MASTER_PORT`` set), every process runs
the same command line; each is one writer node with ``--workers`` writer processes of its own, on a filesystem all of
them see. Rank 0 reads the checkpoint's metadata, lays out and creates the output files in the temporary output
directory and cuts the tensors into ``world size x workers`` parts
(:func:`nemo_patch.engine.consolidate.consolidate_checkpoint`). A ``gloo`` process group of these processes alone
(``env://`` rendezvous) is used for three messages only: rank 0 broadcasts the part jobs (or that it failed before
planning), gathers every rank's result (the tensors' digests, or the error), and broadcasts the exit code. Rank 0
publishes only when every part reported done; any failed part fails the whole consolidation (nothing is published,
the temporary output is removed, rank 0 prints the error once) and every rank exits with its code.

Imports torch and the engine; never NeMo, Lightning or megatron-core.
"""

import datetime
import os
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.parts import PartJob, PartResult, open_job_sources, run_parts, split_shares
from nemo_patch.engine.tensor_sources import Sources

__all__ = ["LaunchedGroup"]

#: How long a rank waits for the others at each of the three messages (a part's whole write included), in seconds.
DEFAULT_TIMEOUT = 6 * 3600.0


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


class LaunchedGroup:
    """The processes a launcher started for one ``nemo-consolidate`` command, and their ``gloo`` group.

    Args:
        rank: this process's rank (``RANK``, else ``SLURM_PROCID``).
        world_size: how many processes (``WORLD_SIZE``, else ``SLURM_NTASKS``).
        timeout: seconds each collective may wait.
    """

    def __init__(self, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._planned = False

    @classmethod
    def from_environment(cls) -> Optional["LaunchedGroup"]:
        """The group ``torchrun`` (``RANK``, ``WORLD_SIZE``) or ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, with
        ``MASTER_ADDR`` and ``MASTER_PORT`` set) launched this process in, or ``None`` for a single process.

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
        return cls(rank, world_size)

    def init(self) -> None:
        """Join the ``gloo`` group (``env://`` rendezvous at ``MASTER_ADDR:MASTER_PORT``)."""
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size))
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout),
        )

    def parts(self, workers: int) -> int:
        """How many parts the consolidation is cut into: ``workers`` per rank."""
        return self.world_size * workers

    def run(self, jobs: List[PartJob], sources: Sources) -> List[PartResult]:
        """Rank 0's :data:`~nemo_patch.engine.consolidate.PartsRunner`: send each rank its jobs, fill rank 0's, and
        gather every rank's results.

        Raises:
            ConsolidationError: a part failed (its own error; another rank's names the rank).
        """
        shares = split_shares(jobs, self.world_size)
        dist.broadcast_object_list([("jobs", [[job.to_json() for job in share] for share in shares])], src=0)
        self._planned = True
        own_error: Optional[BaseException] = None
        status: Tuple[str, Any] = ("ok", [])
        try:
            status = ("ok", [result.to_json() for result in run_parts(shares[0], sources, len(shares[0]))])
        except Exception as error:  # noqa: BLE001 - the other ranks still report, then this error is raised
            own_error = error
        gathered: List[Any] = [None] * self.world_size
        dist.gather_object(status, gathered, dst=0)
        if own_error is not None:
            raise own_error
        results = []
        for rank, (state, payload) in enumerate(gathered):
            if state != "ok":
                error_type = type(payload) if isinstance(payload, ConsolidationError) else ConsolidationError
                raise error_type(f"rank {rank} of {self.world_size} failed its part: {payload}")
            results += [PartResult.from_json(text) for text in payload]
        return results

    def finish(self, code: int) -> None:
        """Rank 0: tell every rank how the consolidation ended (``code``, the exit code) and leave the group."""
        if self._planned:
            dist.broadcast_object_list([("exit", code)], src=0)
        else:
            dist.broadcast_object_list([("abort", code)], src=0)
        dist.destroy_process_group()

    def serve(self) -> int:
        """Ranks other than 0: fill the parts rank 0 sends, report them, and return rank 0's exit code."""
        message: List[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        kind, payload = message[0]
        if kind == "abort":
            dist.destroy_process_group()
            return int(payload)
        jobs = [PartJob.from_json(text) for text in payload[self.rank]]
        status: Tuple[str, Any]
        try:
            results = run_parts(jobs, open_job_sources(jobs[0]), len(jobs)) if jobs else []
            status = ("ok", [result.to_json() for result in results])
        except Exception as error:  # noqa: BLE001 - reported by rank 0, once
            status = ("error", error if isinstance(error, ConsolidationError) else f"{type(error).__name__}: {error}")
        dist.gather_object(status, None, dst=0)
        dist.broadcast_object_list(message, src=0)
        dist.destroy_process_group()
        return int(message[0][1])
