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
training starts, or says once that it cannot. Standard library and the training side's schedule only.
"""

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from nemo_patch.engine.output_layout import METADATA_FILENAME
from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver, files_gone, weights_identity

__all__ = ["JOURNAL_NAME", "Observer"]

logger = logging.getLogger(__name__)

#: The journal, in the checkpoint root (hidden: no tool takes it for a checkpoint).
JOURNAL_NAME = ".consolidation-due.json"
_JOURNAL_MAX_BYTES = 4 << 20


class Observer(ConsolidationObserver):
    """Keeps a run's journal current, and resumes an earlier run's when training starts."""

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        self._journals: Dict[Path, List[Dict[str, Any]]] = {}
        self._warned = False

    def _entries(self) -> Dict[Path, List[Dict[str, Any]]]:
        queue = self.coordinator._queue
        entries: Dict[Path, List[Dict[str, Any]]] = {}
        for save in queue.outstanding() if queue is not None else []:
            entry: Dict[str, Any] = {"checkpoint": save.path.name, "global_step": save.global_step}
            if save.best is not None:
                entry["best"] = save.best
            copies = [{"checkpoint": c.path.name, "identity": list(c.identity or ())} for c in save.copies]
            if copies:
                entry["copies"] = copies
            entries.setdefault(save.path.parent, []).append(entry)
        return entries

    def on_changed(self) -> None:
        """Write the journal of each root whose waiting/running consolidations changed (removed when none is left).
        A journal that cannot be written is logged once at debug level (the run goes on)."""
        with self.coordinator.lock:
            entries = self._entries()
            for root in set(entries) | set(self._journals):
                now = entries.get(root, [])
                if self._journals.get(root, []) == now:
                    continue
                path = root / JOURNAL_NAME
                try:
                    if now:
                        tmp = root / f"{JOURNAL_NAME}.tmp-{os.getpid()}"
                        tmp.write_text(json.dumps({"version": 1, "due": now}, indent=1) + "\n")
                        os.replace(tmp, path)
                    else:
                        path.unlink(missing_ok=True)
                except OSError as error:
                    if not self._warned:
                        logger.debug("Could not write %s: %s", path, error)
                    self._warned = True
                    continue
                if now:
                    self._journals[root] = now
                else:
                    self._journals.pop(root, None)

    def on_train_start(self, root: Optional[Path]) -> None:
        """Queue the consolidations an earlier run of ``root`` left due (its journal), or say why it cannot."""
        if root is None:
            return
        path = root / JOURNAL_NAME
        try:
            if not path.is_file() or path.stat().st_size > _JOURNAL_MAX_BYTES:
                return
            listed = json.loads(path.read_text()).get("due", [])
        except (OSError, ValueError, AttributeError):
            logger.warning("Ignoring an unreadable %s", path)
            return
        coordinator = self.coordinator
        name = coordinator.settings.output_dirname
        resumed: List[CheckpointSave] = []
        gone: List[str] = []
        for entry in listed if isinstance(listed, list) else []:
            checkpoint = _entry_path(root, entry)
            if checkpoint is None or (checkpoint / name / METADATA_FILENAME).is_file():
                continue  # unreadable entry, or finished since (e.g. by a consolidation process that outlived it)
            if files_gone(checkpoint):
                gone.append(checkpoint.name)
                continue
            step = entry.get("global_step")
            save = CheckpointSave(checkpoint, step if isinstance(step, int) else -1, written=True, fit=coordinator.fit)
            save.best = entry.get("best") if isinstance(entry.get("best"), dict) else None
            save.due, save.identity = True, weights_identity(checkpoint)
            for listed_copy in entry.get("copies", []) if isinstance(entry.get("copies"), list) else []:
                copy_path = _entry_path(root, listed_copy)
                identity = listed_copy.get("identity") if isinstance(listed_copy, dict) else None
                if copy_path is None or not isinstance(identity, list):
                    continue
                if not files_gone(copy_path) and list(weights_identity(copy_path)) == identity:  # not saved since
                    copy = CheckpointSave(copy_path, save.global_step, written=True, fit=coordinator.fit, due=True)
                    copy.copy_of, copy.identity = save, tuple(identity)
                    save.copies.append(copy)
            resumed.append(save)
        if gone:
            logger.warning(
                "The consolidation of %s was due when an earlier run of %s ended without finishing it (the job was "
                "killed?), and cannot be done now: the checkpoint is gone or unfinished",
                ", ".join(gone),
                root,
            )
        if resumed:
            logger.warning(
                "Consolidating %s now: due when an earlier run of %s ended without finishing it (the job was killed?)",
                ", ".join(save.path.name for save in resumed),
                root,
            )
            coordinator.queue.submit_all(resumed, bounded=False)
        with coordinator.lock:
            self._journals[root] = [{"stale": True}]  # rewritten (or removed) by the sync below
        self.on_changed()


def _entry_path(root: Path, entry: Any) -> Optional[Path]:
    """The checkpoint a journal entry names: a plain directory name inside ``root``, else ``None``."""
    name = entry.get("checkpoint") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        return None
    return root / name
