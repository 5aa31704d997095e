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

"""Every rank leaves ``fit`` together while global rank 0 waits for its consolidations.

At the end of ``fit`` (normally or by an exception) global rank 0 waits in the strategy's ``teardown`` for running and
queued consolidations, up to ``ConsolidationConfig.timeout`` (default 30 minutes). Were the other ranks to leave
``fit`` meanwhile, the next collective they run (``trainer.validate()``, an end-of-run barrier, NeMo's next ``fit``)
would wait on rank 0 inside the training job's process group and fail at its timeout (10 minutes for NCCL by
default). So the other ranks wait in their own ``teardown`` until rank 0 has finished (:meth:`FitEnd.wait`), and rank
0 releases them once its wait is over (:meth:`FitEnd.release`): every rank leaves ``fit`` at the same time and the
next collective finds every rank there.

The wait is no collective: rank 0 sets a key in the job's rendezvous store (the store ``torch.distributed`` was
initialised with, to which every rank already holds a connection), and the other ranks wait for that key with a
timeout of their own, ``ConsolidationConfig.timeout`` + :data:`GRACE_SECONDS`, measured on each rank's own clock. No
process-group timeout applies, no communicator is created, and no NCCL or gloo operation is pending meanwhile. Should
rank 0 be lost (its process gone, the store closed with it) or not release them in that time, the other ranks log one
warning and leave ``fit``.

Imports the standard library and ``torch.distributed`` only.
"""

import datetime
import itertools
import logging
from typing import Any, Optional

__all__ = ["GRACE_SECONDS", "MAX_WAIT_SECONDS", "FitEnd", "capped_timedelta"]

logger = logging.getLogger(__name__)

#: Seconds the other ranks wait beyond ``ConsolidationConfig.timeout``: what rank 0 may still need after its wait runs
#: out (stopping a consolidation: SIGTERM, 5 s, SIGKILL; ending the idle process: up to 10 s; logging the metrics).
GRACE_SECONDS = 120.0
#: The longest wait asked of the store (about 31 years): any longer ``ConsolidationConfig.timeout`` (1e14, sys.maxsize)
#: means as long as it takes. ``datetime.timedelta`` ends at 999,999,999 days, and the stores count the timeout in
#: 64-bit nanoseconds from now: from about 9.2e9 s a ``HashStore`` times out at once or never wakes.
MAX_WAIT_SECONDS = 10.0**9
_KEY = "nemo_patch/fit_end/{}"


def capped_timedelta(seconds: float) -> datetime.timedelta:
    """``seconds`` as the ``timedelta`` a store or process group takes, at most :data:`MAX_WAIT_SECONDS` (``inf`` and
    ``nan`` included): a longer wait means as long as it takes, where ``timedelta`` or the store would overflow."""
    return datetime.timedelta(seconds=seconds if seconds < MAX_WAIT_SECONDS else MAX_WAIT_SECONDS)


#: Teardowns of consolidating strategies in this process: every rank counts the same ones, so round ``n`` has the same
#: key on every rank (also across several ``fit``/``validate`` calls, and several trainers, in one job).
_rounds = itertools.count()


def _store() -> Optional[Any]:
    """The job's rendezvous store when this process is one of several ranks, else ``None``."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (another launcher, an older torch): the ranks do not wait
        return None


class FitEnd:
    """One end of ``fit`` (a strategy's ``teardown``) on a job of several ranks.

    Args:
        timeout: ``ConsolidationConfig.timeout``, the longest global rank 0 waits for its consolidations.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._store = _store()
        self._key = _KEY.format(next(_rounds)) if self._store is not None else None

    def release(self) -> None:
        """Global rank 0, once its consolidations are over (or given up): let the other ranks leave ``fit``."""
        if self._store is None:
            return
        try:
            self._store.set(self._key, b"1")
        except Exception as error:  # noqa: BLE001 - they will time out by themselves; nothing to do here
            logger.debug("Could not release the other ranks at the end of fit: %s", error)

    def wait(self) -> bool:
        """Every other rank: wait until global rank 0 has released them, at most ``timeout`` + :data:`GRACE_SECONDS`
        (or :data:`MAX_WAIT_SECONDS`, when that is less).

        Returns:
            ``True`` when rank 0 released them (or there is nothing to wait for), ``False`` when it was lost or late
            (logged once).
        """
        if self._store is None:
            return True
        limit = self.timeout + GRACE_SECONDS
        logger.info(
            "Waiting for global rank 0's checkpoint consolidations to end before leaving fit (at most %.0f s)", limit
        )
        try:
            self._store.wait([self._key], capped_timedelta(limit))
        except Exception as error:  # noqa: BLE001 - DistStoreError, a closed connection: rank 0 is gone or late
            text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            logger.warning(
                "Global rank 0 did not end its checkpoint consolidations within %.0f s "
                "(ConsolidationConfig.timeout + %.0f s), or was lost (%s): leaving fit without it",
                limit,
                GRACE_SECONDS,
                text,
            )
            return False
        return True
