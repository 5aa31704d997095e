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

"""Consolidation off the training path: one separate OS process at a time, fed by a small bounded queue.

The training process (global rank 0 only) never consolidates itself. :class:`ConsolidationQueue` hands each request to
its own ``python -m nemo_patch.training.worker --wait`` process (:mod:`nemo_patch.training.worker`), one at a time,
with the run's :class:`~nemo_patch.training.settings.ConsolidationSettings` as one JSON argument and the request as
one JSON line on its stdin. The process for the next request is started as soon as one is handed out
(:meth:`ConsolidationQueue.prestart`; the strategy also starts one when training starts), so the interpreter's start
(about 2 s, mostly ``import torch``) overlaps with training instead of delaying each consolidation, while every
request still runs in a process of its own: a crash, a kill or a leak ends with its request. One that dies while it
waits is replaced. The training loop only ever polls (``Popen.poll``, microseconds); it waits only when ``fit`` ends,
up to a timeout.

Imports the standard library, the engine's publishing helpers and the training side's schedule and settings only:
never NeMo or Lightning.
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Callable, Deque, List, Optional, Tuple

from nemo_patch.engine.publish import tmp_dirs_of
from nemo_patch.training.schedule import CheckpointSave
from nemo_patch.training.settings import ConsolidationSettings

__all__ = ["ConsolidationQueue"]

logger = logging.getLogger(__name__)

#: The module the consolidation process runs (``python -m``).
WORKER_MODULE = "nemo_patch.training.worker"
_POLL_SECONDS = 0.05
_TERMINATE_GRACE_SECONDS = 5.0

#: Called when a request ends: ``(save, error)`` with ``error`` ``None`` on success, else a one-line reason.
DoneCallback = Callable[[CheckpointSave, Optional[str]], None]


class _Running:
    def __init__(self, save: CheckpointSave, process: subprocess.Popen, log_file: IO[bytes]) -> None:
        self.save = save
        self.process = process
        self.log_file = log_file
        self.started = time.monotonic()


class ConsolidationQueue:
    """Runs consolidations in a child process, one at a time, first come first served.

    Not thread-safe for :meth:`submit`/:meth:`poll` (the training loop calls them); :meth:`remove_checkpoint` may be
    called from NeMo's async checkpoint-removal thread and takes a lock.

    Args:
        on_done: called in the training process, from :meth:`poll` or :meth:`wait`, when a request ends.
        settings: the run's settings. ``max_pending`` requests may wait behind the running one; when a new request
            would exceed it, the oldest waiting request is skipped and logged (the first time with a warning, then at
            debug level). The whole value is handed to each consolidation process (its format and shard size).
        on_dropped: called (in the caller's thread) for a waiting request dropped because :meth:`remove_checkpoint`
            removes its checkpoint.

    Raises:
        ValueError: ``settings.max_pending`` < 0.
    """

    def __init__(
        self,
        on_done: DoneCallback,
        settings: ConsolidationSettings = ConsolidationSettings(),
        on_dropped: Optional[Callable[[CheckpointSave], None]] = None,
    ) -> None:
        if settings.max_pending < 0:
            raise ValueError(f"max_pending must be >= 0, got {settings.max_pending}")
        self._on_done = on_done
        self._on_dropped = on_dropped
        self.settings = settings
        self._max_pending = settings.max_pending
        self._settings_json = settings.to_json()  # serialised once, for every process this queue starts
        self._pending: Deque[CheckpointSave] = deque()
        self._running: Optional[_Running] = None
        self._deferred_removals: List[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._warned_skip = False
        #: Checkpoints whose request was skipped because the queue was full.
        self.skipped: List[CheckpointSave] = []
        #: ``(global step, wall seconds of the consolidation process, error or None)`` per ended request.
        self.completed: List[Tuple[int, float, Optional[str]]] = []
        #: Seconds spent inside :meth:`wait` (the end of ``fit`` waiting for consolidations).
        self.waited_seconds = 0.0
        #: Requests handed to a process that was started before the request came (:meth:`prestart`).
        self.warm_requests = 0
        self._spare: Optional[Tuple[subprocess.Popen, IO[bytes]]] = None
        self._prestarting = True

    @property
    def busy(self) -> bool:
        """Whether a consolidation is running or waiting."""
        return self._running is not None or bool(self._pending)

    def holds(self, save: CheckpointSave) -> bool:
        """Whether ``save`` is waiting or being consolidated."""
        with self._lock:
            return save in self._pending or (self._running is not None and self._running.save is save)

    def submit(self, save: CheckpointSave) -> None:
        """Queue ``save`` for consolidation and start it if nothing is running."""
        save.queued = True
        with self._lock:
            self._pending.append(save)
            while len(self._pending) > self._max_pending + (0 if self._running else 1):
                skipped = self._pending.popleft()
                self.skipped.append(skipped)
                log = logger.debug if self._warned_skip else logger.warning
                log(
                    "Consolidation queue full (1 running, %d waiting): skipping checkpoint %s (global step %d)%s",
                    self._max_pending,
                    skipped.path,
                    skipped.global_step,
                    "" if self._warned_skip else "; further skips are logged at debug level",
                )
                self._warned_skip = True
        self.poll()

    def poll(self) -> None:
        """Reap a finished child and start the next request; returns at once."""
        running = self._running
        if running is not None and running.process.poll() is not None:
            self._finish(running)
        if self._running is None:
            with self._lock:
                save = self._pending.popleft() if self._pending else None
            if save is not None:
                self._start(save)

    def wait(self, timeout: float) -> bool:
        """Wait until all running and queued consolidations have ended, at most ``timeout`` seconds.

        Returns:
            ``True`` if everything ended; ``False`` if the timeout ran out, in which case the running child is
            terminated (its temporary output removed) and waiting requests are dropped; both are logged.
        """
        start = time.monotonic()
        deadline = start + timeout
        try:
            while True:
                self.poll()
                if not self.busy:
                    return True
                if time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_SECONDS)
        finally:
            self.waited_seconds += time.monotonic() - start
        with self._lock:
            dropped = list(self._pending)
            self._pending.clear()
        running = self._running
        logger.error(
            "Checkpoint consolidation did not finish within %.1f s: stopping %s, dropping %d queued (%s)",
            timeout,
            running.save.path if running else "nothing",
            len(dropped),
            ", ".join(str(save.path) for save in dropped) or "none",
        )
        if running is not None:
            self._terminate(running)
        return False

    def remove_checkpoint(self, checkpoint_dir: Path, remove: Callable[[], None]) -> bool:
        """Remove a checkpoint without racing its consolidation (used for NeMo's top-k removal).

        A waiting request for it is dropped (reported to ``on_dropped``) and ``remove`` runs now; if it is being
        consolidated, ``remove`` runs as soon as its child has ended (so the child never reads a vanishing checkpoint
        and never leaves a half-made ``consolidated/`` behind).

        Returns:
            ``True`` if ``remove`` ran now, ``False`` if it was deferred.
        """
        checkpoint_dir = Path(checkpoint_dir)
        with self._lock:
            dropped = [save for save in self._pending if save.path == checkpoint_dir]
            self._pending = deque(save for save in self._pending if save.path != checkpoint_dir)
            running = self._running
            deferred = running is not None and running.save.path == checkpoint_dir
            if deferred:
                self._deferred_removals.append(remove)
        for save in dropped:
            if self._on_dropped is not None:
                self._on_dropped(save)
        if deferred:
            return False
        remove()
        return True

    def _spawn(self) -> Tuple[subprocess.Popen, IO[bytes]]:
        """Start a consolidation process in ``--wait`` mode: it imports what it needs, then reads one request.

        Raises:
            OSError: the process cannot be started.
        """
        args = [sys.executable, "-m", WORKER_MODULE, "--wait", "--settings", self._settings_json]
        env = dict(os.environ)
        for name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "LOCAL_WORLD_SIZE",
        ):
            env.pop(name, None)  # the child is not part of the training job's process group
        # The child's output goes to an anonymous temporary file (not into the checkpoint directory, which may be
        # read-only); its last line is the reason of a failure.
        log_file = tempfile.TemporaryFile()
        try:
            process = subprocess.Popen(
                args,
                bufsize=0,  # unbuffered stdin: the request line is written at once, and closing never flushes
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                close_fds=True,
            )
        except OSError:
            log_file.close()
            raise
        return process, log_file

    def prestart(self) -> None:
        """Start the process the next request will use, unless one is waiting already, or this queue was told to
        stop pre-starting and no request is waiting: its start-up then overlaps with training or with the running
        consolidation. A failure to start it is logged at debug level; the next request starts its own."""
        if not (self._prestarting or self._pending) or (self._spare is not None and self._spare[0].poll() is None):
            return
        self._discard_spare()  # one that exited while waiting (e.g. killed): reap it
        try:
            self._spare = self._spawn()
        except OSError as error:
            logger.debug("Could not pre-start a consolidation process: %s", error)

    def stop_prestarting(self) -> None:
        """``fit`` is ending: a process is pre-started only for requests already waiting; an idle one exits without
        work."""
        self._prestarting = False
        if not self._pending:
            self._discard_spare()

    def _discard_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is None:
            return
        process, log_file = spare
        try:
            with contextlib.suppress(OSError):
                if process.stdin is not None:
                    process.stdin.close()  # no request will come
            if process.poll() is None:  # still importing, or waiting: it holds nothing of value
                process.kill()
            process.wait()
        finally:
            log_file.close()

    def _start(self, save: CheckpointSave) -> None:
        line = json.dumps({"checkpoint": str(save.path), "global_step": save.global_step, "best": save.best}) + "\n"
        spare, self._spare = self._spare, None
        warm = spare is not None and spare[0].poll() is None and _hand_over(spare[0], line.encode())
        if spare is not None and not warm:
            self._spare = spare
            self._discard_spare()  # it exited while waiting (killed, out of memory): start another
        if spare is not None and warm:
            process, log_file = spare
        else:
            try:
                process, log_file = self._spawn()
            except OSError as error:
                self._on_done(save, f"cannot start the consolidation process: {error}")
                return
            _hand_over(process, line.encode())  # if it died at once, reaping it reports why
        self.warm_requests += warm
        self._running = _Running(save, process, log_file)
        logger.info(
            "Consolidating %s (global step %d) in process %d%s",
            save.path,
            save.global_step,
            process.pid,
            " (pre-started)" if warm else "",
        )
        self.prestart()

    def _finish(self, running: _Running) -> None:
        self._running = None
        code = running.process.returncode
        error = None
        if code < 0:  # killed by a signal: whatever it printed last is not the reason
            error = f"consolidation process was killed by {_describe_exit(code)}"
        elif code != 0:
            error = _last_line(running.log_file) or f"consolidation process exited with {_describe_exit(code)}"
        if code != 0:
            _remove_tmp_dirs(running.save.path, running.process.pid)
        running.log_file.close()
        running.save.seconds = time.monotonic() - running.started
        self.completed.append((running.save.global_step, running.save.seconds, error))
        try:
            self._on_done(running.save, error)
        finally:
            with self._lock:
                removals, self._deferred_removals = self._deferred_removals, []
            for remove in removals:
                remove()

    def _terminate(self, running: _Running) -> None:
        running.process.terminate()
        try:
            running.process.wait(_TERMINATE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()
        self._finish(running)


def _hand_over(process: subprocess.Popen, line: bytes) -> bool:
    """Write one request line to a waiting consolidation process and close its stdin; ``False`` if it is gone."""
    if process.stdin is None:
        return False
    try:
        process.stdin.write(line)
        process.stdin.close()
    except OSError:
        return False
    return True


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _last_line(log_file: IO[bytes]) -> Optional[str]:
    try:
        log_file.seek(0)
        text = log_file.read().decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _remove_tmp_dirs(parent: Path, pid: int) -> None:
    """Remove temporary output left by a child that died (their names carry the child's pid)."""
    for path in tmp_dirs_of(parent, pid):
        shutil.rmtree(path, ignore_errors=True)
