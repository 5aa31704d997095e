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

"""Every rank leaves ``fit`` together while global rank 0 waits for its consolidations in the strategy's ``teardown``
(else the others' next collective would time out on rank 0): they wait for a key rank 0 sets in the job's rendezvous
store (a ``TCPStore`` client: no collective, nothing on the GPU), at most ``ConsolidationConfig.timeout`` +
:data:`GRACE_SECONDS`, then log one warning and leave.
"""

import datetime
import itertools
import logging
import os
from typing import Any, Optional

__all__ = ["GRACE_SECONDS", "MAX_WAIT_SECONDS", "FitEnd", "capped_timedelta"]

logger = logging.getLogger(__name__)

#: Seconds the other ranks wait beyond ``ConsolidationConfig.timeout``: what rank 0 may still need after its wait runs
#: out (stopping a consolidation, ending the idle process, reporting).
GRACE_SECONDS = 120.0
#: The longest wait asked of the store (about 31 years: ``timedelta`` and the stores' 64-bit nanoseconds overflow
#: beyond); a longer ``ConsolidationConfig.timeout`` means as long as it takes.
MAX_WAIT_SECONDS = 10.0**9
_KEY = "checkpoint_consolidation/fit_end/{}"
_CONNECT = datetime.timedelta(seconds=60)


def capped_timedelta(seconds: float) -> datetime.timedelta:
    """``seconds`` as a ``timedelta`` for a store or process group, at most :data:`MAX_WAIT_SECONDS` (``inf`` and
    ``nan`` included)."""
    return datetime.timedelta(seconds=seconds if seconds < MAX_WAIT_SECONDS else MAX_WAIT_SECONDS)


#: Teardowns of consolidating strategies in this process: every rank counts the same ones, so round ``n`` has the same
#: key on every rank.
_rounds = itertools.count()


def _store() -> Optional[Any]:
    """A client of the job's rendezvous store when this process is one of several ranks, else ``None``: the public
    ``torch.distributed.TCPStore`` at ``MASTER_ADDR``:``MASTER_PORT``, the store that ``init_process_group``'s
    ``env://`` (Lightning's launchers, SLURM) and torchrun's agent serve for the whole job."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        return dist.TCPStore(host, int(port), is_master=False, timeout=_CONNECT, wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store (another launcher, none reachable): the ranks do not wait
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
        """Every other rank: wait until global rank 0 has released them, at most ``timeout`` + :data:`GRACE_SECONDS`;
        ``False`` when it was lost or late (logged once)."""
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
