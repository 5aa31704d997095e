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

"""Real faults injected into a training run, for the fault tests. Not product code.

Each fault is real (a killed process, a read-only mount, a file-size limit, a signal); this module only picks the
moment. ``--fault`` values of :mod:`nemo_patch.testing.fit_run`:

* ``kill:<n>``: SIGKILL the consolidation process once the n-th request is half-way (its temporary output exists).
* ``hold:<n>``: SIGSTOP the consolidation process as soon as it has the n-th request, so that it is still in flight
  whenever ``fit`` ends (it only dies of the queue's SIGKILL after its SIGTERM grace).
* ``pause:<n>``: as ``hold``, but SIGCONT when training ends: the consolidations due meanwhile meet a busy process
  (deterministic skips with a small ``max_pending``), and the n-th still completes.
* ``readonly:<n>``: bind-mount the n-th consolidated checkpoint's directory read-only before its consolidation starts
  (needs root and mount permission, as on CI).
* ``fsize:<n>``: serve the n-th request in a consolidation process started with ``RLIMIT_FSIZE`` of 64 KiB (and
  retired after it): writing its output fails as on a full disk (``EFBIG``; Python ignores ``SIGXFSZ``).
* ``sigterm:<step>``: send SIGTERM to the training process at the end of that global step (NeMo's
  ``PreemptionCallback`` is added to the trainer for it).
* ``die:<step>``: at the start of the step after ``<step>`` (its async save issued, not finalized), SIGKILL this
  process and every process it started: the save never finishes.
* ``jobkill:<n>``: SIGKILL the whole job (this process and every process it started) once the n-th consolidation
  request is half-way (its temporary output exists): a job killed in the middle of a consolidation. The consolidation
  process is stopped there for a few of the journal's write intervals first (the journal names a request within one).
* ``keepfail:<n>``: the n-th keeping of an output before NeMo removes its checkpoint fails with ``ENOSPC`` (No
  space left on device), raised by the file linking after the staging directory was made (an injected ``OSError``).
* ``holdremoval:<n>``: hold NeMo's n-th asynchronous removal of a ``-last`` copy whose step's consolidation is still
  waiting or running, in NeMo's removal thread, after the strategy took the removal and before any file is deleted,
  until the training loop has seen that consolidation end (so the copy's link is due exactly while its removal is
  under way); what appears in the copy's directory meanwhile is recorded (:attr:`FaultInjector.records`). The window
  is forced, not waited for: the first consolidation request's process is stopped (``SIGSTOP``) as it starts and
  continued (``SIGCONT``) by the first held removal, so that request is still running when NeMo removes its copy.
* ``killremoval:<n>``: SIGKILL the whole job at NeMo's n-th removal of a checkpoint that holds a consolidated output,
  after the coordinator took the removal (the output kept under ``retained/``, ``LATEST``/``BEST`` moved off it) and
  before NeMo deletes any of its files: a job killed between the removal's record and the delete. The checkpoint is
  named in ``<root>/../killed-at-removal.json`` just before.

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import errno
import json
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from lightning.pytorch.callbacks import Callback

from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.training.callback import consolidation_of
from nemo_patch.training.journal import WRITE_INTERVAL

__all__ = ["FaultInjector", "parse_fault"]

FSIZE_LIMIT = 64 * 1024


def _retire_process(queue: Any) -> None:
    """End ``queue``'s consolidation process once it is idle (now, or when its current request has ended)."""
    server = queue._running.server if queue._running is not None else None
    if server is not None and server is queue._server:
        server.retire = True
    else:
        queue._discard_server()


_KINDS = (
    "kill",
    "hold",
    "pause",
    "readonly",
    "fsize",
    "sigterm",
    "die",
    "jobkill",
    "keepfail",
    "holdremoval",
    "killremoval",
)
#: ``killremoval``: the file beside the checkpoint root naming the checkpoint whose removal the job was killed in.
KILLED_AT_REMOVAL = "killed-at-removal.json"
#: Seconds a held removal waits at most for the training loop (it never deadlocks a run).
HOLD_REMOVAL_SECONDS = 120.0


def parse_fault(spec: str) -> Tuple[str, int]:
    """``"kill:1"`` -> ``("kill", 1)``.

    Raises:
        ValueError: for an unknown kind or a missing number.
    """
    kind, _, number = spec.partition(":")
    if kind not in _KINDS or not number.isdigit():
        raise ValueError(f"Invalid fault {spec!r}: expected {'|'.join(_KINDS)}:<n>")
    return kind, int(number)


def _descendants(pid: int) -> List[int]:
    children: dict = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_job() -> None:
    """SIGKILL every process this one started, then this one: its whole process group where it leads one (the
    kernel's group kill also takes a process another thread is forking meanwhile, which a listing misses)."""
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector(Callback):
    """Injects one fault (see the module docstring) into the run it is a callback of."""

    def __init__(self, spec: str) -> None:
        self.kind, self.number = parse_fault(spec)
        self.mounts: List[Path] = []
        self.started = 0
        self.paused: Any = None
        #: What the fault observed, for the run's report (``holdremoval``: one entry per held removal).
        self.records: List[Dict[str, Any]] = []
        self._undo: List[Any] = []
        self._held: Optional[Dict[str, Any]] = None
        self._release = threading.Event()

    def __getstate__(self) -> Dict[str, Any]:
        """What a copy keeps (NeMo deep-copies the trainer's callbacks into each checkpoint's context): the spec and
        the records, not the live patches, event and held removal."""
        state = dict(self.__dict__)
        state.update(_undo=[], _held=None, _release=None, paused=None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._release = threading.Event()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._undo or not trainer.is_global_zero:  # patched once (a second fit on the trainer sets up again)
            return
        if self.kind == "keepfail":
            self._patch_keeping()
        if self.kind == "holdremoval":
            self._patch_removal(trainer)
        if self.kind == "killremoval":
            self._patch_removal_kill()

    def _patch_keeping(self) -> None:
        from nemo_patch.training import retention

        link_output, calls = retention.link_output, [0]

        def failing_link_output(source: Any, output_dir: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == self.number:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(output_dir))
            return link_output(source, output_dir, *args, **kwargs)

        setattr(retention, "link_output", failing_link_output)
        self._undo.append(lambda: setattr(retention, "link_output", link_output))

    def _patch_removal(self, trainer: Any) -> None:
        """Wrap NeMo's own deletion of a checkpoint (what ``MegatronStrategy.remove_checkpoint`` hands to the
        coordinator, which runs it once it has taken the removal and kept the checkpoint's output): see
        ``holdremoval`` in the module docstring."""
        from nemo_patch.training import integration

        remove_checkpoint, removals = integration.remove_checkpoint, [0]

        def held_remove_checkpoint(strategy: Any, checkpoint_dir: Any, remove: Any) -> None:
            path = Path(checkpoint_dir)

            def held_remove() -> None:
                source = self._source_of(trainer, path)
                if threading.current_thread() is not threading.main_thread() and source is not None:
                    removals[0] += 1
                    if removals[0] == self.number:
                        self._hold(path, source)
                remove()

            remove_checkpoint(strategy, checkpoint_dir, held_remove)

        setattr(integration, "remove_checkpoint", held_remove_checkpoint)
        self._undo.append(lambda: setattr(integration, "remove_checkpoint", remove_checkpoint))

    def _patch_removal_kill(self) -> None:
        """Wrap NeMo's own deletion of a checkpoint as the coordinator runs it (after its ``before_removal``): see
        ``killremoval`` in the module docstring."""
        from nemo_patch.training import integration

        remove_checkpoint, removals = integration.remove_checkpoint, [0]

        def killing_remove_checkpoint(strategy: Any, checkpoint_dir: Any, remove: Any) -> None:
            path = Path(checkpoint_dir)
            holds_output = any((path / name / "metadata.json").is_file() for name in ("consolidated", "hf"))

            def remove_or_kill() -> None:
                if holds_output:
                    removals[0] += 1
                    if removals[0] == self.number:  # the checkpoint it kills in, beside the checkpoint root
                        (path.parent.parent / KILLED_AT_REMOVAL).write_text(json.dumps({"checkpoint": str(path)}))
                        _kill_job()
                remove()

            remove_checkpoint(strategy, checkpoint_dir, remove_or_kill)

        setattr(integration, "remove_checkpoint", killing_remove_checkpoint)
        self._undo.append(lambda: setattr(integration, "remove_checkpoint", remove_checkpoint))

    @staticmethod
    def _source_of(trainer: Any, path: Path) -> Any:
        """The save whose output the ``-last`` copy at ``path`` waits for, while that one is waiting or running."""
        if not path.name.endswith("-last"):
            return None
        coordinator = consolidation_of(trainer.strategy.checkpoint_io)
        if coordinator is None:
            return None
        with coordinator.lock:
            for save in reversed(coordinator.schedule.history):
                if save.path == path and save.copy_of is not None and save.copy_of.state.outstanding:
                    return save.copy_of
        return None

    def _hold(self, path: Path, source: Any) -> None:
        before = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        self._held = {"path": path, "source": source}
        self._continue_paused()  # the source's consolidation may now end, while this removal is held
        released = self._release.wait(HOLD_REMOVAL_SECONDS)
        after = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        self.records.append(
            {
                "held": path.name,
                "source": source.path.name,
                "source_state": source.state.value,
                "released_by_training_loop": released,
                "appeared": sorted(set(after) - set(before)),
            }
        )
        self._held = None

    def _release_when_seen(self) -> None:
        """Release a held removal once its source's consolidation has ended and a later hook has run."""
        held = self._held
        if held is not None and not held["source"].state.outstanding:
            self._release.set()

    def _continue_paused(self) -> None:
        if self.paused is not None and self.paused.poll() is None:
            self.paused.send_signal(signal.SIGCONT)
        self.paused = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        kinds = ("kill", "hold", "pause", "readonly", "fsize", "jobkill", "holdremoval")
        if self.kind in kinds and trainer.is_global_zero:
            consolidation: Any = consolidation_of(trainer.strategy.checkpoint_io)
            queue = consolidation.queue
            if self.kind in ("pause", "holdremoval"):  # requests made while it is paused must meet a ready process
                queue.start_process()
                deadline = time.monotonic() + 300
                while not queue.process_ready and time.monotonic() < deadline:
                    time.sleep(0.05)
            start = queue._start  # the moment a request is handed to the consolidation process

            def faulty_start(save: Any) -> None:
                self.started += 1
                if self.started != (1 if self.kind == "holdremoval" else self.number):
                    return start(save)
                if self.kind == "readonly":
                    subprocess.run(["mount", "--bind", str(save.path), str(save.path)], check=True)
                    self.mounts.append(save.path)
                    subprocess.run(["mount", "-o", "remount,bind,ro", str(save.path)], check=True)
                    return start(save)
                if self.kind == "fsize":
                    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, hard))
                    _retire_process(queue)  # a process started now inherits the limit; the running one did not
                    try:
                        return start(save)
                    finally:
                        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                        _retire_process(queue)  # started under the limit: the next request must not get it
                start(save)
                if self.kind in ("hold", "pause", "holdremoval"):
                    self.paused = queue._running.process
                    queue._running.process.send_signal(signal.SIGSTOP)
                    return None
                job = self.kind == "jobkill"
                threading.Thread(target=self._kill_half_way, args=(queue, save, job), daemon=True).start()

            queue._start = faulty_start

    @staticmethod
    def _kill_half_way(queue: Any, save: Any, job: bool = False) -> None:
        running = queue._running
        deadline = time.monotonic() + 60
        while running is not None and running.process.poll() is None and time.monotonic() < deadline:
            if any(p.is_dir() for p in save.path.glob(f"{TMP_PREFIX}{running.process.pid}-*")):
                if job:  # held half-way while the journal's writer thread names it (within its interval), then killed
                    running.process.send_signal(signal.SIGSTOP)
                    time.sleep(4 * WRITE_INTERVAL)
                    _kill_job()
                running.process.send_signal(signal.SIGKILL)
                return
            time.sleep(0.001)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.kind in ("pause", "holdremoval"):
            self._continue_paused()
        self._release.set()  # a held removal never outlives the training loop

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.kind == "die" and trainer.global_step == self.number:
            _kill_job()
        if self.kind == "holdremoval":
            self._release_when_seen()  # the previous step's hooks (the consolidation callback's included) have run

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.kind == "sigterm" and trainer.global_step == self.number:
            os.kill(os.getpid(), signal.SIGTERM)

    def cleanup(self) -> None:
        """Undo the read-only mounts and the patches; release a held removal."""
        self._release.set()
        for path in self.mounts:
            subprocess.run(["umount", str(path)], check=False)
        self.mounts.clear()
        while self._undo:
            self._undo.pop()()
