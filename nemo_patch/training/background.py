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

"""Work the training loop hands over without waiting for it, and without waking a thread to do it.

On a loaded host, a woken thread preempts the training thread inside its hook and holds the GIL the hook needs. A
:class:`PollingWorker` instead appends the work to a list; its one thread looks every ``interval`` seconds (by then the
hook has returned) and does what it finds, in order. Standard library only.
"""

import logging
import threading
import time
from typing import Callable, List, Optional

__all__ = ["PollingWorker"]

logger = logging.getLogger(__name__)


class PollingWorker:
    """One daemon thread doing handed-over work in order, ``interval`` seconds at most after it was handed over
    (plus the work before it).

    Args:
        name: the thread's name.
        interval: seconds between the thread's looks for work.
        idle_seconds: the thread ends after this long without work (the next :meth:`hand` starts another).
    """

    def __init__(self, name: str, interval: float = 0.05, idle_seconds: float = 60.0) -> None:
        self.name, self.interval, self.idle_seconds = name, interval, idle_seconds
        self._lock = threading.Lock()
        #: Held while work is taken and done: work is done in the order it was handed over, by one thread at a time.
        self._doing = threading.Lock()
        self._work: List[Callable[[], None]] = []
        self._thread: Optional[threading.Thread] = None
        #: The thread doing handed-over work now (its own drain does nothing: the work in progress is its caller).
        self._doer: Optional[int] = None

    def hand(self, work: Callable[[], None]) -> None:
        """Have ``work`` done by the worker's thread (returns at once; wakes no thread once it runs)."""
        with self._lock:
            self._work.append(work)
        self.start()

    def start(self) -> None:
        """Start the worker's thread now unless it runs (a thread's start takes about a millisecond)."""
        with self._lock:
            if self._thread is not None:
                return
            thread = self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        thread.start()

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Do the work handed over and not started yet in the calling thread, after the work in progress; ``False``
        when the work in progress did not end within ``timeout`` seconds (``None``: no limit). Called from inside
        handed-over work, it returns ``True`` at once."""
        if self._doer == threading.get_ident():
            return True
        if not self._doing.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self._do_handed()
        finally:
            self._doing.release()
        return True

    def _do_handed(self) -> bool:
        """Do the work handed over (``_doing`` held); ``False`` when there was none. A failure is logged."""
        with self._lock:
            work, self._work = self._work, []
        self._doer = threading.get_ident()
        try:
            for item in work:
                try:
                    item()
                except Exception:  # noqa: BLE001 - the training loop handed it over and went on
                    logger.exception("%s: background work failed", self.name)
        finally:
            self._doer = None
        return bool(work)

    def _run(self) -> None:
        idle = 0.0
        while True:
            time.sleep(self.interval)
            with self._doing:
                did = self._do_handed()
            idle = 0.0 if did else idle + self.interval
            if idle >= self.idle_seconds:
                with self._lock:
                    if not self._work:
                        self._thread = None
                        return
