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

"""Consolidation off the training path: one long-lived process per run (global rank 0), fed by a small bounded queue.

:class:`ConsolidationQueue` hands its requests, one at a time, to one ``python -m <package>.worker --serve`` process
that lives for the whole run. Protocol: one JSON line per request on its stdin, ``{"checkpoint", "global_step",
"best", "run"}``; on its stdout ``{"ready": true}`` once it has imported what it needs, then one line per ended
request, ``{"error": null | "<one-line reason>"}`` (``{"published": true}`` before it when a post command runs). A
process that dies fails the request it was serving, and the next request starts a new one.
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
from typing import IO, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, cast

from nemo_patch.engine.publish import tmp_dirs_of
from nemo_patch.training.schedule import CheckpointSave, RequestState
from nemo_patch.training.settings import ConsolidationSettings
from nemo_patch.training.worker import PROCESS_LAUNCHERS

__all__ = ["ConsolidationQueue"]

logger = logging.getLogger(__name__)

#: The module the consolidation process runs (``python -m``).
WORKER_MODULE = "nemo_patch.training.worker"
_POLL_SECONDS = 0.05
_TERMINATE_GRACE_SECONDS = 5.0
#: Seconds an idle process gets to exit by itself once its stdin is closed, before it is killed.
_CLOSE_GRACE_SECONDS = 10.0

#: Called when a request ends: ``(save, error)`` with ``error`` ``None`` on success, else a one-line reason.
DoneCallback = Callable[[CheckpointSave, Optional[str]], None]

#: The only moves between request states, each under the queue's lock. A request taken off the queue is RUNNING in
#: the same locked step, so a removal of its checkpoint either drops it while it waits or waits until it has ended.
_NEXT = {
    RequestState.NONE: {RequestState.WAITING},
    RequestState.WAITING: {RequestState.RUNNING, RequestState.SKIPPED, RequestState.DROPPED},
    RequestState.RUNNING: {RequestState.PUBLISHED, RequestState.FAILED},
    # Ended requests may be made again (e.g. an on-demand consolidation of a checkpoint whose request failed).
    RequestState.PUBLISHED: {RequestState.WAITING},
    RequestState.FAILED: {RequestState.WAITING},
    RequestState.SKIPPED: {RequestState.WAITING},
    RequestState.DROPPED: {RequestState.WAITING},
}


class _Process:
    """The run's consolidation process: its request pipe (stdin), result pipe (stdout) and log file (stderr)."""

    def __init__(self, process: subprocess.Popen, log_file: IO[bytes]) -> None:
        self.process = process
        self.log_file = log_file
        self.retire = False  # end it once the request it serves has ended
        self.ready = False  # it has imported what it needs and serves requests
        self.published = False  # the request it serves published its output (its post command runs)
        self._received = b""
        self._stdout = cast(IO[bytes], process.stdout)  # a pipe: the queue starts it so
        os.set_blocking(self._stdout.fileno(), False)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, line: bytes) -> bool:
        """Write one request line; ``False`` if the process is gone."""
        if self.process.stdin is None or not self.alive:
            return False
        try:
            self.process.stdin.write(line)
        except OSError:
            return False
        return True

    def result(self) -> Optional[Tuple[Optional[str], Dict[str, object]]]:
        """The next result line as ``(error, line)``, or ``None`` while none has arrived (never blocks)."""
        while True:
            while b"\n" not in self._received:
                try:
                    chunk = os.read(self._stdout.fileno(), 65536)
                except BlockingIOError:
                    return None
                if not chunk:  # end of file: the process is gone
                    return None
                self._received += chunk
            line, self._received = self._received.split(b"\n", 1)
            try:
                message = json.loads(line)
                if message.get("ready") is True:
                    self.ready = True
                    continue
                if message.get("published") is True:
                    self.published = True
                    continue
                error = message["error"]
            except (ValueError, KeyError, TypeError, AttributeError):
                self.published = False
                return (f"unreadable result line from the consolidation process: {line[:200]!r}", {})
            self.published = False
            return (None if error is None else str(error), message)

    def lost_result(self) -> Tuple[Optional[str], Dict[str, object]]:
        """The result of the request the ended process served without answering: its death's reason, or, when it had
        published the output already (and died in its post command), success with the command's loss."""
        reason = self.death_reason()
        if not self.published:
            return (reason, {})
        self.published = False
        return (None, {"post_command": {"stopped": True, "error": f"the consolidation process ended: {reason}"}})

    def last_line(self) -> Optional[str]:
        """The last non-empty line the process printed; read only once it has exited (the file offset is shared)."""
        try:
            self.log_file.seek(0)
            text = self.log_file.read().decode(errors="replace")
        except (OSError, ValueError):
            return None
        return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), None)

    def terminate(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; waits for the exit."""
        self.process.terminate()
        self._wait(_TERMINATE_GRACE_SECONDS)

    def _wait(self, seconds: float) -> None:
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        """End the idle process: close its stdin (a ready one exits at once); kill it after
        :data:`_CLOSE_GRACE_SECONDS`, or at once while it is still importing."""
        try:
            if self.alive and not self.ready:
                self.result()  # idle: only its ready line can come
                if not self.ready:
                    self.process.kill()
            with contextlib.suppress(OSError):
                if self.process.stdin is not None:
                    self.process.stdin.close()
            self._wait(_CLOSE_GRACE_SECONDS)
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.log_file.close()

    def death_reason(self) -> str:
        """Why the (ended) process ended, in one line."""
        code = self.process.wait()
        if code < 0:  # killed by a signal: what it printed last is not the reason
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"consolidation process was killed by signal {name}"
        return self.last_line() or f"consolidation process exited with exit code {code}"


class _Running:
    """The request being consolidated (RUNNING since it left the queue) and, once handed over, its process."""

    def __init__(self, save: CheckpointSave, server: Optional[_Process] = None) -> None:
        self.save = save
        self.server = server
        self.started = time.monotonic()

    @property
    def process(self) -> subprocess.Popen:
        if self.server is None:
            raise RuntimeError("not handed to a consolidation process yet")
        return self.server.process


class ConsolidationQueue:
    """Runs consolidations in the run's consolidation process, one at a time, first come first served.

    The training loop's thread calls it; :meth:`remove_checkpoint` may come from NeMo's async removal thread. Every
    change of a request's state happens under one lock (the caller's, shared), together with the ``is_gone`` check.

    Args:
        on_done: called from :meth:`poll` or :meth:`wait` when a request ends.
        settings: the run's settings: ``max_pending`` requests may wait behind the running one (when one more would
            exceed it, the oldest waiting one is skipped and logged); the process gets the whole value.
        on_dropped: called, without the lock, for a request dropped because its checkpoint is removed.
        lock: the lock that guards the request states (default: a new one).
        is_gone: tells, under the lock, whether a request's checkpoint is removed or being removed.

    Raises:
        ValueError: ``settings.config.max_pending`` < 0.
    """

    def __init__(
        self,
        on_done: DoneCallback,
        settings: ConsolidationSettings = ConsolidationSettings(),
        on_dropped: Optional[Callable[[CheckpointSave], None]] = None,
        lock: Optional[threading.RLock] = None,
        is_gone: Optional[Callable[[CheckpointSave], bool]] = None,
    ) -> None:
        if settings.config.max_pending < 0:
            raise ValueError(f"max_pending must be >= 0, got {settings.config.max_pending}")
        self._on_done = on_done
        self._on_dropped = on_dropped or (lambda save: None)
        self.settings = settings
        self._max_pending = settings.config.max_pending
        self._settings_json = settings.to_json()  # serialised once, for every process this queue starts
        self._pending: Deque[CheckpointSave] = deque()
        self._running: Optional[_Running] = None
        self._server: Optional[_Process] = None
        self._deferred_removals: List[Callable[[], None]] = []
        self._lock = lock if lock is not None else threading.RLock()
        self._is_gone = is_gone or (lambda save: False)
        self._warned_skip = False
        #: Requests skipped because the queue was full; ``(global step, seconds, error)`` per ended request; seconds
        #: waited in :meth:`wait`; requests handed to a process already running; processes started.
        self.skipped: List[CheckpointSave] = []
        self.completed: List[Tuple[int, float, Optional[str]]] = []
        self.waited_seconds = 0.0
        self.warm_requests = 0
        self.processes_started = 0

    @property
    def busy(self) -> bool:
        """Whether a consolidation is running or waiting."""
        return self._running is not None or bool(self._pending)

    @property
    def process(self) -> Optional[subprocess.Popen]:
        """The consolidation process, while one is alive (serving a request or idle)."""
        return self._server.process if self._server is not None and self._server.alive else None

    @property
    def process_ready(self) -> bool:
        """Whether the consolidation process has said it is ready (imported what it needs); never blocks."""
        server = self._server
        if server is not None and not server.ready and self._running is None:
            server.result()  # idle: only its ready line can come
        return server is not None and server.ready

    def outstanding(self) -> List[CheckpointSave]:
        """The running request (first) and the waiting ones, oldest first."""
        with self._lock:
            running = [self._running.save] if self._running is not None else []
            return running + list(self._pending)

    def _move(self, save: CheckpointSave, state: RequestState) -> None:
        """Change a request's state (lock held) along :data:`_NEXT`; another move is a bug (``RuntimeError``)."""
        if state not in _NEXT[save.state]:
            raise RuntimeError(f"consolidation request of {save.path}: {save.state.name} -> {state.name} is no move")
        save.state = state

    def submit(self, save: CheckpointSave, bounded: bool = True) -> None:
        """Queue ``save`` for consolidation and start it if nothing is running (see :meth:`submit_all`)."""
        self.submit_all([save], bounded)

    def submit_all(self, saves: Sequence[CheckpointSave], bounded: bool = True) -> None:
        """Queue saves that finished together (oldest first) and start the first if nothing is running. One whose
        checkpoint is gone is dropped; one already waiting or running is left as it is.

        Args:
            bounded: skip the oldest waiting requests while more than ``max_pending`` wait, once the process is ready
                (its start-up is not falling behind) and never those of a burst on arrival (NeMo's async save
                finalizes in bursts); ``False`` when ``fit`` ends.
        """
        if not saves:
            return
        bounded = bounded and self.process_ready
        burst = {id(save) for save in saves} if len(saves) > 1 else set()
        dropped = []
        with self._lock:
            for save in saves:
                if save.state.outstanding:
                    continue
                self._move(save, RequestState.WAITING)
                if self._is_gone(save):
                    self._move(save, RequestState.DROPPED)
                    dropped.append(save)
                else:
                    self._pending.append(save)
            waiting = self._max_pending + (0 if self._running else 1)  # may wait: one more while none runs
            while bounded and len(self._pending) > waiting and id(self._pending[0]) not in burst:
                skipped = self._pending.popleft()
                self._move(skipped, RequestState.SKIPPED)
                self.skipped.append(skipped)
                (logger.debug if self._warned_skip else logger.warning)(
                    "Consolidation queue full (1 running, %d waiting): skipping checkpoint %s (global step %d)%s",
                    self._max_pending,
                    skipped.path,
                    skipped.global_step,
                    "" if self._warned_skip else "; further skips are logged at debug level",
                )
                self._warned_skip = True
        for save in dropped:
            self._on_dropped(save)
        self.poll()

    def poll(self) -> None:
        """Reap an ended request and hand the next one to the process (RUNNING in the same locked step that takes it
        off the queue; dropped if its checkpoint is gone by then). Returns at once."""
        running = self._running
        if running is not None and running.server is not None:
            result = running.server.result()
            if result is None and not running.server.alive:
                result = running.server.result() or running.server.lost_result()  # it may have answered first
            if result is not None:
                self._finish(running, *result)
        dropped, start = [], None
        with self._lock:
            while self._running is None and self._pending:
                save = self._pending.popleft()
                if self._is_gone(save):
                    self._move(save, RequestState.DROPPED)
                    dropped.append(save)
                    continue
                self._move(save, RequestState.RUNNING)
                self._running, start = _Running(save), save
        for save in dropped:
            self._on_dropped(save)
        if start is not None:
            self._start(start)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for running and queued consolidations.

        Returns:
            ``True`` if everything ended; ``False`` if the timeout ran out: the process is then terminated and the
            waiting requests dropped (logged).
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
            for save in dropped:
                self._move(save, RequestState.DROPPED)
        running = self._running
        logger.error(
            "Checkpoint consolidation did not finish within %.1f s: stopping %s, dropping %d queued (%s)",
            timeout,
            running.save.path if running else "nothing",
            len(dropped),
            ", ".join(str(save.path) for save in dropped) or "none",
        )
        self._stop_running()
        return False

    def remove_checkpoint(self, checkpoint_dir: Path, remove: Callable[[], None]) -> bool:
        """Run ``remove`` now, dropping a waiting request of the checkpoint, or, while it is being consolidated, once
        that has ended (decided in one locked step). Returns whether it ran now."""
        checkpoint_dir = Path(checkpoint_dir)
        with self._lock:
            dropped = [save for save in self._pending if save.path == checkpoint_dir]
            self._pending = deque(save for save in self._pending if save.path != checkpoint_dir)
            for save in dropped:
                self._move(save, RequestState.DROPPED)
            running = self._running
            deferred = running is not None and running.save.path == checkpoint_dir
            if deferred:
                self._deferred_removals.append(remove)
        for save in dropped:
            self._on_dropped(save)
        if deferred:
            return False
        remove()
        return True

    def start_process(self) -> None:
        """Start the consolidation process now unless one is alive (a failure is logged; the first request retries)."""
        if self.process is not None:
            return
        self._discard_server()  # one that exited while idle (e.g. killed): reap it
        try:
            self._server = self._spawn()
        except OSError as error:
            logger.debug("Could not start the consolidation process: %s", error)

    def close(self) -> None:
        """End the consolidation process (at teardown, after :meth:`wait`); a request still running fails."""
        self._stop_running()
        self._discard_server()

    def _stop_running(self) -> None:
        running = self._running
        if running is not None:
            if running.server is None:  # never handed over (cannot happen between the training thread's calls)
                self._finish(running, "stopped before it was handed to the consolidation process")
                return
            running.server.terminate()  # a post command running is stopped and answered for (worker.py)
            self._finish(running, *(running.server.result() or running.server.lost_result()))

    def _spawn(self) -> _Process:
        """Start a consolidation process in ``--serve`` mode (``OSError`` if it cannot be started)."""
        args = [sys.executable, "-m", WORKER_MODULE, "--serve", "--settings", self._settings_json]
        env: Mapping[str, str] = os.environ
        for launch in PROCESS_LAUNCHERS:  # an extension's (worker.py): its module as --extension, its environment
            args, env = launch(args, env)
        # Its output goes to an anonymous temporary file (the checkpoint directory may be read-only).
        log_file = tempfile.TemporaryFile()
        try:
            process = subprocess.Popen(
                args,
                bufsize=0,  # unbuffered pipes: each request line is written at once
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=None if env is os.environ else dict(env),
                close_fds=True,
            )
        except OSError:
            log_file.close()
            raise
        self.processes_started += 1
        return _Process(process, log_file)

    def _discard_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def _start(self, save: CheckpointSave) -> None:
        """Hand ``save`` to the consolidation process, starting one if none is alive (or failing the request)."""
        running = cast(_Running, self._running)  # save's, made RUNNING by the caller
        request = {"checkpoint": str(save.path), "global_step": save.global_step, "best": save.best, "run": save.run}
        line = json.dumps(request) + "\n"
        server = self._server
        warm = server is not None and server.send(line.encode())
        if server is None or not warm:
            self._discard_server()  # it ended while idle (killed, out of memory, an unexpected error)
            try:
                server = self._server = self._spawn()
            except OSError as error:
                self._finish(running, f"cannot start the consolidation process: {error}", {})
                return
            server.send(line.encode())  # if it died at once, reaping it reports why
        self.warm_requests += warm
        running.server, running.started = server, time.monotonic()
        logger.info(
            "Consolidating %s (global step %d) in process %d%s",
            save.path,
            save.global_step,
            server.process.pid,
            "" if warm else " (started for it)",
        )

    def _finish(self, running: _Running, error: Optional[str], reply: Optional[Mapping[str, object]] = None) -> None:
        post_command = (reply or {}).get("post_command")
        running.save.post_command = post_command if isinstance(post_command, dict) else None
        with self._lock:
            self._running = None
            self._move(running.save, RequestState.FAILED if error is not None else RequestState.PUBLISHED)
        server = running.server
        if error is not None and server is not None:  # the engine removes its own temporary output; a killed one can't
            for path in tmp_dirs_of(running.save.path, server.process.pid):
                shutil.rmtree(path, ignore_errors=True)
        if server is not None and server is self._server and (server.retire or not server.alive):
            self._discard_server()
        running.save.seconds = time.monotonic() - running.started
        self.completed.append((running.save.global_step, running.save.seconds, error))
        try:
            self._on_done(running.save, error)
        finally:
            with self._lock:
                removals, self._deferred_removals = self._deferred_removals, []
            for remove in removals:
                remove()
