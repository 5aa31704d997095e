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

"""The best checkpoint of a run by its monitored metric, found offline from what NeMo recorded (docs/cadences.md).

``ModelCheckpoint``'s own state in the newest finished checkpoint's ``weights/common.pt`` is read (safely, by
:func:`.save_identity.read_common_state`), else the metric in the checkpoint names (``...--val_loss=1.23-step=9-...``),
as NeMo's ``nemo_topk_check_previous_run`` reads it on resume, ``-last`` copies left out. The best checkpoint is never
replaced by another one. Imports the standard library, and torch when reading ``common.pt``; never NeMo or Lightning.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from nemo_patch.engine.checkpoint_layout import inspect_checkpoint
from nemo_patch.engine.errors import (
    CheckpointNotFoundError,
    ConsolidationError,
    NotACheckpointError,
    UnfinishedCheckpointError,
)
from nemo_patch.engine.save_identity import read_common_state
from nemo_patch.runs.checkpoint_root import checkpoint_root, checkpoints_newest_first, is_copy_name

__all__ = [
    "NOT_A_METRIC",
    "BestCheckpoint",
    "NoMonitoredMetricError",
    "find_best_checkpoint",
    "read_checkpoint_callback_state",
    "read_common_state",
]


class NoMonitoredMetricError(ConsolidationError):
    """The best checkpoint of a run was asked for (``nemo-consolidate --best``, or ``--watch --frequency best``), but
    the run recorded no monitored metric: no ``ModelCheckpoint(monitor=...)`` metric in its checkpoints' state and none
    in their names (a watcher whose run monitors a metric but ranked no checkpoint by ``--until-idle`` too)."""

    exit_code, summary = 14, "--best for a run that recorded no monitored metric"
    #: ``True`` when the run monitors a metric but has ranked no checkpoint by it yet (a later save may be ranked):
    #: a watcher (``--watch --frequency best``) waits; otherwise the run records no monitored metric at all.
    transient: bool = False


#: ``ModelCheckpoint(monitor=...)`` values that rank checkpoints by time, not by a metric.
NOT_A_METRIC = (None, "step", "epoch")
#: NeMo's ``ModelCheckpoint`` defaults, used for the checkpoint names when no state says otherwise.
DEFAULT_MONITOR, DEFAULT_MODE = "val_loss", "min"

_MODE_IN_KEY = re.compile(r"'mode': '(min|max)'")
_NUMBER = r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"


@dataclass(frozen=True)
class BestCheckpoint:
    """The best finished checkpoint of a run.

    Attributes:
        checkpoint_dir: the checkpoint directory.
        monitor: the metric's name (e.g. ``"val_loss"``).
        value: its value for this checkpoint.
        mode: ``"min"`` or ``"max"``.
        source: where this was read: ``"ModelCheckpoint state in <ckpt>/weights/common.pt"`` or
            ``"checkpoint names"``.
    """

    checkpoint_dir: Path
    monitor: str
    value: float
    mode: str
    source: str

    def record(self) -> Dict[str, Any]:
        """``{"monitor", "value", "mode"}`` as ``metadata.json`` records it."""
        return {"monitor": self.monitor, "value": self.value, "mode": self.mode}


def _finished(checkpoint_dir: Path) -> bool:
    try:
        return inspect_checkpoint(checkpoint_dir, allow_unfinished=True).finished
    except ConsolidationError:
        return False


def read_checkpoint_callback_state(checkpoint_dir: Path) -> Optional[Tuple[Dict[str, Any], Optional[str]]]:
    """``ModelCheckpoint``'s state stored in a checkpoint, and its ``mode``, or ``None`` when there is none or it
    cannot be read safely (:func:`read_common_state`).

    Args:
        checkpoint_dir: a NeMo 2 checkpoint directory (``weights/common.pt`` is read).

    Returns:
        ``(state, mode)``: Lightning's ``ModelCheckpoint.state_dict()`` (``monitor``, ``best_model_path``,
        ``best_model_score``, ...) and the ``mode`` from the state's key (``None`` if it does not say).
    """
    payload = read_common_state(checkpoint_dir)
    callbacks = payload.get("callbacks") if payload is not None else None
    for key, state in (callbacks if isinstance(callbacks, dict) else {}).items():
        if isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(state, dict):
            mode = _MODE_IN_KEY.search(key)
            return state, mode.group(1) if mode else None
    return None


def _from_names(root: Path, candidates: List[Path], monitor: str, mode: str) -> BestCheckpoint:
    pattern = re.compile(rf"(?:^|-){re.escape(monitor)}=({_NUMBER})(?=-|$)")
    scored = []
    for candidate in candidates:
        match = pattern.search(candidate.name)
        if match and not is_copy_name(candidate.name) and _finished(candidate):
            scored.append((float(match.group(1)), candidate))
    if not scored:
        raise NoMonitoredMetricError(
            f"{root}: the run recorded no monitored metric: no ModelCheckpoint(monitor=...) metric in its "
            f"checkpoints' state, and no '{monitor}=<value>' in the names of its finished checkpoints. The best "
            "checkpoint can only be picked for a run saved with ModelCheckpoint(monitor='val_loss', mode='min') (or "
            "another logged metric), or whose ModelCheckpoint(filename=...) includes the metric (e.g. "
            "'{val_loss:.2f}-{step}'); pass --monitor/--mode when it is not val_loss/min."
        )
    value, best = (min if mode == "min" else max)(scored, key=lambda item: item[0])
    return BestCheckpoint(best, monitor, value, mode, "checkpoint names")


def find_best_checkpoint(
    path: Union[str, Path], monitor: Optional[str] = None, mode: Optional[str] = None
) -> BestCheckpoint:
    """The best finished checkpoint of a run, from ``ModelCheckpoint``'s state or the checkpoint names.

    Args:
        path: the run's checkpoint root (the directory holding the checkpoints, or the run directory holding
            ``checkpoints/``).
        monitor: the metric; default: the one ``ModelCheckpoint``'s state names, else ``"val_loss"``. When it
            differs from the state's, the names are read for it.
        mode: ``"min"`` or ``"max"``; default: the state's, else ``"min"``.

    Returns:
        A :class:`BestCheckpoint`.

    Raises:
        ValueError: ``mode`` is not ``"min"``/``"max"``.
        CheckpointNotFoundError: ``path`` is missing, or the best checkpoint NeMo recorded no longer exists.
        NotACheckpointError: ``path`` holds no checkpoint.
        UnfinishedCheckpointError: the best checkpoint NeMo recorded is unfinished.
        NoMonitoredMetricError: the run recorded no monitored metric (exit code 14).
    """
    if mode not in (None, "min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} does not exist or is not a directory")
    root = checkpoint_root(path)
    candidates = checkpoints_newest_first(root)
    if not candidates:
        raise NotACheckpointError(f"{root} holds no NeMo 2 checkpoint ('<name>/weights/' directories)")
    state: Dict[str, Any] = {}
    state_mode, source = None, "checkpoint names"
    for candidate in filter(_finished, candidates):  # the newest finished checkpoint's state is the run's last word
        recorded = read_checkpoint_callback_state(candidate)
        if recorded is not None:
            (state, state_mode), source = recorded, f"ModelCheckpoint state in {candidate.name}/weights/common.pt"
            break
    state_monitor = state.get("monitor")
    if state_monitor in NOT_A_METRIC or (monitor is not None and monitor != state_monitor):
        return _from_names(root, candidates, monitor or DEFAULT_MONITOR, mode or state_mode or DEFAULT_MODE)
    best_path, score = state.get("best_model_path"), state.get("best_model_score")
    if not best_path or score is None:
        error = NoMonitoredMetricError(
            f"{root}: ModelCheckpoint(monitor={state_monitor!r}) has ranked no checkpoint yet (no best_model_path in "
            "the newest finished checkpoint's state): was the metric logged before a checkpoint was saved?"
        )
        error.transient = True
        raise error
    best = root / Path(str(best_path)).name.removesuffix(".ckpt")
    named = f"the best checkpoint by {state_monitor} ({float(score):.6g}) that ModelCheckpoint recorded, {best.name},"
    if not best.is_dir():
        raise CheckpointNotFoundError(f"{named} does not exist in {root}; no other checkpoint is substituted")
    if not _finished(best):
        raise UnfinishedCheckpointError(f"{named} is unfinished; no other checkpoint is substituted")
    return BestCheckpoint(best, str(state_monitor), float(score), mode or state_mode or DEFAULT_MODE, source)
