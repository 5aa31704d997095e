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

"""The journal of due consolidations: ``<root>/.consolidation-due.json`` lists those waiting or running.

A job killed (SIGKILL, a lost node) leaves it behind; the next run of the same root consolidates what it lists when
training starts (while each checkpoint is still the files it recorded), or says once that it cannot. The journal is
never trusted, is written atomically off the training thread, and never fails training.
"""

import contextlib
import json
import logging
import os
import re
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from nemo_patch.engine.output_layout import METADATA_FILENAME, RETAINED_DIRNAME
from nemo_patch.training.background import PollingWorker
from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver, files_gone, weights_identity

__all__ = ["JOURNAL_NAME", "JOURNAL_VERSION", "Observer", "read_journal", "write_journal"]

logger = logging.getLogger(__name__)

#: The journal, in the checkpoint root (hidden: no tool takes it for a checkpoint).
JOURNAL_NAME = ".consolidation-due.json"
#: The version this package writes and reads (a newer one is not resumed).
JOURNAL_VERSION = 1
_JOURNAL_MAX_BYTES = 4 << 20
#: Temporary files of the journal's writes, and of the ``LATEST``/``BEST`` replacements (``latest.py``): a job killed
#: during one leaves it behind.
_JOURNAL_TMP = re.compile(re.escape(JOURNAL_NAME) + r"\.tmp-\d+-[0-9a-f]+")
_POINTER_TMP = re.compile(r"\.(?:LATEST|BEST)\.tmp-\d+-[0-9a-f]{12}")
#: What a run id read from a journal may be (it goes into ``metadata.json`` and log lines), as the callback checks.
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
#: Age (seconds) from which such a temporary file is a killed job's leftover.
LEFTOVER_SECONDS = 60.0
#: Seconds the end of ``fit`` waits at most for the journal's last write.
FLUSH_SECONDS = 30.0
#: Seconds between the writer thread's looks for a state to write: a state handed over is on disk after at most this
#: plus the time of the write.
WRITE_INTERVAL = 0.05
#: Seconds an idle writer thread waits for more work before it ends (the next handoff starts another).
_IDLE_SECONDS = 60.0
#: Bytes of an untrusted name shown in a log line.
_SHOWN = 80


def _show(value: Any) -> str:
    """An untrusted value for a log line: its repr, cut short (a name cannot forge a line)."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def write_journal(root: Path, due: List[Dict[str, Any]], run: Optional[str] = None) -> None:
    """Write ``<root>/.consolidation-due.json`` listing ``due`` atomically, or remove it when ``due`` is empty.

    The new journal is written into a new temporary file beside it (``O_CREAT|O_EXCL|O_NOFOLLOW``) and renamed over
    the old one, which replaces a symlink or file planted there instead of writing through it. A temporary file is
    removed when the write fails.

    Raises:
        OSError: the journal cannot be written or removed (disk full, read-only root, a directory in its place).
    """
    path = root / JOURNAL_NAME
    if not due:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # a directory: not a journal of this run's
            path.unlink()
        return
    data = (json.dumps({"version": JOURNAL_VERSION, "run": run, "due": due}, indent=1) + "\n").encode()
    tmp = root / f"{JOURNAL_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_journal(root: Path) -> Tuple[List[Any], Optional[str], Optional[str]]:
    """Read ``<root>/.consolidation-due.json`` without trusting it.

    Returns:
        ``(entries, run, problem)``: the raw entries (not checked yet) and the run that wrote it, or ``([], None,
        why)`` when it is not a journal this package can resume (``why``: one phrase for the log line), or
        ``([], None, None)`` when there is none.
    """
    path = root / JOURNAL_NAME
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)  # never blocks on a FIFO, never follows a link
    except FileNotFoundError:
        return [], None, None
    except OSError as error:
        if os.path.islink(path):
            return [], None, "it is a symbolic link, not the file this package writes"
        return [], None, f"it cannot be opened ({error.strerror or error})"
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            why = "this run cannot keep a journal while it is there"
            return [], None, f"it is a directory, not the file this package writes ({why})"
        if not stat.S_ISREG(info.st_mode):
            return [], None, "it is not a regular file"
        if info.st_size > _JOURNAL_MAX_BYTES:
            return [], None, f"it is {info.st_size} bytes, more than a journal ever is ({_JOURNAL_MAX_BYTES})"
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(_JOURNAL_MAX_BYTES + 1)  # until the end of the file, or one byte too many
    except OSError as error:
        return [], None, f"it cannot be read ({error.strerror or error})"
    finally:
        os.close(fd)
    if len(data) > _JOURNAL_MAX_BYTES:
        return [], None, f"it is more than {_JOURNAL_MAX_BYTES} bytes, more than a journal ever is"
    try:
        journal = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return [], None, "it is not valid JSON (truncated or corrupt)"
    if not isinstance(journal, dict) or not isinstance(journal.get("due"), list):
        return [], None, "it is not a journal of due consolidations (no 'due' list)"
    version = journal.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return [], None, f"its version is {_show(version)}, not one this package writes"
    if version > JOURNAL_VERSION:
        why = f"it was written by a newer nemo-patch (journal version {version}; this one reads {JOURNAL_VERSION})"
        return [], None, f"{why}: consolidate what it lists with that version or with nemo-consolidate"
    run = journal.get("run")
    return journal["due"], run if isinstance(run, str) and _RUN.fullmatch(run) else None, None


def _entry_path(root: Path, entry: Any) -> Tuple[Optional[Path], Optional[str]]:
    """``(checkpoint, None)`` for an entry naming a plain directory inside ``root`` (not a symlink: an output would be
    written where it points), ``(None, None)`` for one that is gone, else ``(None, why)``."""
    name = entry.get("checkpoint") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name:
        return None, "names no checkpoint"
    if "/" in name or "\0" in name or name in (".", "..") or len(name.encode("utf-8", "surrogateescape")) > 255:
        return None, "names a path, not a checkpoint inside the root"
    if name.startswith(".") or name in (RETAINED_DIRNAME, "LATEST", "BEST"):
        return None, "names no checkpoint (a hidden entry, retained/ or a pointer)"
    path = root / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as error:
        return None, f"cannot be looked at ({error.strerror or error})"
    if stat.S_ISLNK(info.st_mode):
        return None, "is a symbolic link (an output would be written where it points)"
    if not stat.S_ISDIR(info.st_mode):
        return None, "is not a directory"
    return path, None


def _identity(value: Any) -> Optional[Tuple[int, ...]]:
    """A recorded :func:`weights_identity` (a list of integers), else ``None``."""
    if not isinstance(value, list) or not value or len(value) > 16:
        return None
    if not all(isinstance(part, int) and not isinstance(part, bool) for part in value):
        return None
    return tuple(value)


def _portable(identity: Tuple[int, ...]) -> Tuple[int, ...]:
    """A :func:`weights_identity` without its devices (``st_dev`` differs between the nodes that mount one file
    system): inodes, sizes and times only."""
    parts, i = [], 0
    while i < len(identity):
        if identity[i] == -1:  # a missing file
            parts.append(-1)
            i += 1
        else:
            parts += identity[i + 1 : i + 4]
            i += 4
    return tuple(parts)


def _unchanged_since(checkpoint: Path, identity: Optional[Tuple[int, ...]], journal_mtime_ns: int) -> bool:
    """Whether ``checkpoint`` is still the save the entry names: its weights' files have the recorded identity (same
    inodes, sizes and times; an entry of an older journal without one: files not newer than the journal)."""
    now = weights_identity(checkpoint)
    if identity is not None:
        return _portable(now) == _portable(identity)
    mtimes = []
    for name in (".metadata", "metadata.json"):
        with contextlib.suppress(OSError):
            mtimes.append(os.stat(checkpoint / "weights" / name).st_mtime_ns)
    return bool(mtimes) and max(mtimes) <= journal_mtime_ns


class Observer(ConsolidationObserver):
    """Keeps a run's journal current (off the training thread), and resumes an earlier run's when training starts."""

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        #: What each root's journal lists on disk (as far as this run wrote it); only the writer's ``sync`` (or a
        #: flush) touches it, with the writer's write lock held.
        self._journals: Dict[Path, List[Dict[str, Any]]] = {}
        #: Journals whose last write failed (warned once until a write succeeds again).
        self._failing: Dict[Path, bool] = {}
        #: Held while the journals are written: one sync at a time, so the newest state taken is the one written last.
        self._write_lock = threading.Lock()
        self._writer = PollingWorker("consolidation-journal", WRITE_INTERVAL, _IDLE_SECONDS)
        self._sync_handed = False

    @property
    def run(self) -> Optional[str]:
        """The run the journal's entries belong to (the coordinator's ``run_id``, when it has one)."""
        run = getattr(self.coordinator, "run_id", None)
        return run if isinstance(run, str) else None

    def _entries(self) -> Dict[Path, List[Dict[str, Any]]]:
        queue = self.coordinator._queue
        run = self.run
        entries: Dict[Path, List[Dict[str, Any]]] = {}
        for save in queue.outstanding() if queue is not None else []:
            identity = save.identity if save.identity is not None else weights_identity(save.path)
            entry: Dict[str, Any] = {
                "checkpoint": save.path.name,
                "global_step": save.global_step,
                "run": save.run or run,
                "identity": list(identity),
            }
            if save.best is not None:
                entry["best"] = save.best
            copies = [{"checkpoint": c.path.name, "identity": list(c.identity or ())} for c in save.copies]
            if copies:
                entry["copies"] = copies
            entries.setdefault(save.path.parent, []).append(entry)
        return entries

    def on_changed(self) -> None:
        """Have the writer thread sync the journals, returning at once while ``fit`` runs; once the coordinator closed
        (the end of ``fit``, the teardown), bring them up to date before returning."""
        if not self._sync_handed:  # one sync, at the writer's next look, for every change signalled until it starts
            self._sync_handed = True
            self._writer.hand(self._handed_sync)
        if not getattr(self.coordinator, "fitting", True):
            self.flush()

    def flush(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Bring the journals up to date now (after a write in progress); ``False`` after ``timeout``."""
        done = self._writer.drain(timeout)
        if not done:
            logger.warning("The consolidation journal was not written within %.0f s; going on", timeout)
        return done

    def _handed_sync(self) -> None:
        self._sync_handed = False  # cleared first: a change from now on hands another sync
        try:
            with self._write_lock:
                self._sync()
        except Exception:  # noqa: BLE001 - the journal never ends the run
            logger.exception("Could not bring the consolidation journal up to date; training goes on")

    def _sync(self) -> None:
        """Write the journal of each root whose waiting/running consolidations differ from what it lists (removed when
        none is left); a root whose write fails is retried at the next change."""
        with self.coordinator.lock:
            entries = self._entries()
        for root in set(entries) | set(self._journals):
            now = entries.get(root, [])
            if self._journals.get(root, []) == now:
                continue
            try:
                write_journal(root, now, self.run)
            except Exception as error:  # noqa: BLE001 - the journal never ends the run
                self._written(root, error)
                continue
            self._written(root, None)
            if now:
                self._journals[root] = now
            else:
                self._journals.pop(root, None)

    def _written(self, root: Path, error: Optional[BaseException]) -> None:
        """One warning when a journal's writes start failing, one line when they work again."""
        path = root / JOURNAL_NAME
        failing, self._failing[path] = self._failing.get(path, False), error is not None
        if error is None:
            if failing:
                logger.info("The consolidation journal %s is written again", path)
        elif not failing:
            logger.warning(
                "Could not write the consolidation journal %s (%s): a job killed now would not resume the "
                "consolidations due; retrying at the next change, training goes on",
                path,
                error,
            )

    def on_train_start(self, root: Optional[Path]) -> None:
        """Queue the consolidations an earlier run of ``root`` left due (its journal), or say why not; remove the
        temporary files a killed job left behind. Never raises."""
        if root is None:
            return
        try:
            self._remove_leftovers(root)
            self._resume(root)
        except Exception:  # noqa: BLE001 - the journal never ends the run
            logger.exception("Could not resume the consolidation journal %s; training goes on", root / JOURNAL_NAME)
        with self._write_lock:
            self._journals[root] = [{"stale": True}]  # rewritten (or removed) by the next sync
        self.on_changed()

    @staticmethod
    def _remove_leftovers(root: Path) -> None:
        """Remove the journal's temporary files and the pointers' temporary links (never followed) a killed job left,
        once older than :data:`LEFTOVER_SECONDS` (a sidecar may be replacing ``LATEST`` right now)."""
        now = time.time()
        for entry in os.scandir(root):
            pointer = _POINTER_TMP.fullmatch(entry.name)
            if pointer is None and _JOURNAL_TMP.fullmatch(entry.name) is None:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if now - info.st_mtime < LEFTOVER_SECONDS or stat.S_ISDIR(info.st_mode):
                continue
            if pointer is not None and not stat.S_ISLNK(info.st_mode):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                logger.debug("Removed %s, left by a job killed while it wrote it", entry.path)

    def _resume(self, root: Path) -> None:
        path = root / JOURNAL_NAME
        listed, journal_run, problem = read_journal(root)
        if problem is not None:
            directory = os.path.isdir(path) and not os.path.islink(path)
            if directory:  # said now: its writes' failures are not said again
                with self._write_lock:
                    self._failing[path] = True
            logger.warning(
                "Not resuming the consolidation journal %s: %s%s",
                path,
                problem,
                "" if directory else "; this run " "replaces it",
            )
            return
        if not listed:
            return
        try:
            journal_mtime = os.lstat(path).st_mtime_ns
        except OSError:
            journal_mtime = 0
        coordinator = self.coordinator
        name = coordinator.settings.output_dirname
        resumed: List[CheckpointSave] = []
        gone: List[str] = []
        refused: List[str] = []
        changed: List[str] = []
        seen = set()
        for entry in listed:
            checkpoint, why = _entry_path(root, entry)
            if why is not None:
                refused.append(f"{_show(entry.get('checkpoint') if isinstance(entry, dict) else entry)} ({why})")
                continue
            if checkpoint is None or checkpoint in seen:
                if checkpoint is None:
                    gone.append(_show(entry.get("checkpoint")))
                continue
            seen.add(checkpoint)
            if (checkpoint / name / METADATA_FILENAME).is_file():
                continue  # finished since (e.g. by a consolidation process that outlived the job)
            if files_gone(checkpoint):
                gone.append(_show(checkpoint.name))
                continue
            if not _unchanged_since(checkpoint, _identity(entry.get("identity")), journal_mtime):
                changed.append(_show(checkpoint.name))
                continue
            step = entry.get("global_step")
            step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else -1
            save = CheckpointSave(checkpoint, step, written=True, fit=coordinator.fit)
            best = entry.get("best")
            save.best = best if isinstance(best, dict) else None
            save.due, save.identity = True, weights_identity(checkpoint)
            # the output belongs to the run that saved the checkpoint
            save.run = entry.get("run") if _RUN.fullmatch(str(entry.get("run"))) else journal_run
            self._resume_copies(root, entry, save)
            resumed.append(save)
        if refused:
            logger.warning(
                "Not resuming %d entr%s of the consolidation journal %s: %s",
                len(refused),
                "y" if len(refused) == 1 else "ies",
                path,
                "; ".join(refused[:5]) + ("; ..." if len(refused) > 5 else ""),
            )
        if changed:
            logger.warning(
                "Not resuming the consolidation of %s listed in %s: the checkpoint is not the save the journal names "
                "(saved again since, or the journal or root was copied); consolidate it with nemo-consolidate",
                ", ".join(changed),
                path,
            )
        if gone:
            logger.warning(
                "The consolidation of %s was due when an earlier run of %s ended without finishing it (the job was "
                "killed?), and cannot be done now: the checkpoint is gone or unfinished",
                ", ".join(gone),
                root,
            )
        if resumed:
            other = sorted({save.run for save in resumed if save.run is not None and save.run != self.run})
            logger.warning(
                "Consolidating %s now: due when an earlier run of %s ended without finishing it (the job was "
                "killed?)%s",
                ", ".join(save.path.name for save in resumed),
                root,
                f"; saved by run {', '.join(_show(run) for run in other)}" if other else "",
            )
            coordinator.queue.submit_all(resumed, bounded=False)

    @staticmethod
    def _resume_copies(root: Path, entry: Dict[str, Any], save: CheckpointSave) -> None:
        """The entry's ``-last`` copies that are still the files it recorded (not saved since) wait for its output."""
        listed = entry.get("copies")
        for listed_copy in listed if isinstance(listed, list) else []:
            copy_path, _ = _entry_path(root, listed_copy)
            identity = _identity(listed_copy.get("identity")) if isinstance(listed_copy, dict) else None
            if copy_path is None or identity is None or copy_path == save.path:
                continue
            if not files_gone(copy_path) and _portable(weights_identity(copy_path)) == _portable(identity):
                copy = CheckpointSave(copy_path, save.global_step, written=True, fit=save.fit, due=True)
                copy.copy_of, copy.identity, copy.run = save, identity, save.run
                save.copies.append(copy)
