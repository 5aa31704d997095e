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

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, List, Tuple

from lightning.pytorch.callbacks import Callback

from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.training.io_chain import find_base_checkpoint_io

__all__ = ["FaultInjector", "parse_fault"]

FSIZE_LIMIT = 64 * 1024


def parse_fault(spec: str) -> Tuple[str, int]:
    """``"kill:1"`` -> ``("kill", 1)``.

    Raises:
        ValueError: for an unknown kind or a missing number.
    """
    kind, _, number = spec.partition(":")
    if kind not in ("kill", "hold", "pause", "readonly", "fsize", "sigterm", "die") or not number.isdigit():
        raise ValueError(f"Invalid fault {spec!r}: expected kill|hold|pause|readonly|fsize|sigterm|die:<n>")
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


class FaultInjector(Callback):
    """Injects one fault (see the module docstring) into the run it is a callback of."""

    def __init__(self, spec: str) -> None:
        self.kind, self.number = parse_fault(spec)
        self.mounts: List[Path] = []
        self.started = 0
        self.paused: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.kind in ("kill", "hold", "pause", "readonly", "fsize") and trainer.is_global_zero:
            queue = find_base_checkpoint_io(trainer.strategy.checkpoint_io).queue
            if self.kind == "pause":  # the requests made while it is paused must meet a ready, busy process
                queue.start_process()
                deadline = time.monotonic() + 300
                while not queue.process_ready and time.monotonic() < deadline:
                    time.sleep(0.05)
            start = queue._start  # the moment a request is handed to the consolidation process

            def faulty_start(save: Any) -> None:
                self.started += 1
                if self.started != self.number:
                    return start(save)
                if self.kind == "readonly":
                    subprocess.run(["mount", "--bind", str(save.path), str(save.path)], check=True)
                    self.mounts.append(save.path)
                    subprocess.run(["mount", "-o", "remount,bind,ro", str(save.path)], check=True)
                    return start(save)
                if self.kind == "fsize":
                    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, hard))
                    queue.retire_process()  # a process started now inherits the limit; the running one did not
                    try:
                        return start(save)
                    finally:
                        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                        queue.retire_process()  # started under the limit: the next request must not get it
                start(save)
                if self.kind in ("hold", "pause"):
                    self.paused = queue._running.process
                    queue._running.process.send_signal(signal.SIGSTOP)
                    return None
                threading.Thread(target=self._kill_half_way, args=(queue, save), daemon=True).start()

            queue._start = faulty_start

    @staticmethod
    def _kill_half_way(queue: Any, save: Any) -> None:
        running = queue._running
        deadline = time.monotonic() + 60
        while running is not None and running.process.poll() is None and time.monotonic() < deadline:
            if any(p.is_dir() for p in save.path.glob(f"{TMP_PREFIX}{running.process.pid}-*")):
                running.process.send_signal(signal.SIGKILL)
                return
            time.sleep(0.001)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.kind == "pause" and self.paused is not None and self.paused.poll() is None:
            self.paused.send_signal(signal.SIGCONT)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.kind == "die" and trainer.global_step == self.number:
            for pid in _descendants(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.kind == "sigterm" and trainer.global_step == self.number:
            os.kill(os.getpid(), signal.SIGTERM)

    def cleanup(self) -> None:
        """Undo the read-only mounts."""
        for path in self.mounts:
            subprocess.run(["umount", str(path)], check=False)
        self.mounts.clear()
