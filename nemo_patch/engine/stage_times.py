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

"""Where a consolidation's time goes: busy seconds per stage (:data:`STAGES`), summed over threads and processes.

``metadata`` (read the checkpoint's metadata, plan the outputs, lay out and create the files), ``read_crc`` (load
stored records and check their CRC-32), ``placement`` (copy each loaded chunk into its place in the output tensor,
casting if asked), ``hashing`` (BLAKE3 of each output tensor), ``write`` (copy the bytes into the output files),
``fsync`` (the ``fdatasync`` calls beside the writes, then the final ``fsync``). Stages overlap (a writer reads the
next tensor while it writes, hashes and syncs the current one; several writers run at once), so the sum is more than
the wall time; the largest stage is the bottleneck. Standard library only.
"""

import contextlib
import threading
import time
from typing import Dict, Iterator, Mapping

__all__ = ["STAGES", "StageTimes", "stage_times"]

#: The stages, in pipeline order.
STAGES = ("metadata", "read_crc", "placement", "hashing", "write", "fsync")


class StageTimes:
    """Thread-safe busy seconds per stage (:data:`STAGES`) of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: Dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to ``stage``."""
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the time the block takes to ``stage``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def merge(self, other: Mapping[str, float]) -> None:
        """Add another process's :meth:`snapshot` to this one."""
        for stage, seconds in other.items():
            self.add(stage, seconds)

    def snapshot(self) -> Dict[str, float]:
        """Seconds per stage so far."""
        with self._lock:
            return dict(self._seconds)

    def reset(self) -> None:
        """Back to zero."""
        with self._lock:
            self._seconds = dict.fromkeys(STAGES, 0.0)


#: This process's stage times; the engine adds to it, a part's result carries a snapshot of it.
stage_times = StageTimes()
