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

"""Consolidated outputs outlive NeMo's top-k retention, and ``LATEST`` never names a removed checkpoint.

Before NeMo's ``ModelCheckpoint(save_top_k=...)`` removes a checkpoint that holds a complete output, the output is
given a second home, ``<root>/retained/<checkpoint name>/consolidated/`` (within ``ConsolidationConfig.keep``), and
``LATEST`` and ``BEST`` move off the checkpoint. Never imports NeMo or Lightning.
"""

import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from nemo_patch.engine.checkpoint_layout import UNFINISHED_SUFFIX, is_marked_unfinished
from nemo_patch.engine.output_layout import METADATA_FILENAME, RETAINED_DIRNAME, post_command_log_path
from nemo_patch.engine.publish import link_output, remove_stale_tmp_dirs
from nemo_patch.runs.checkpoint_root import is_copy_name, without_copy_suffix
from nemo_patch.training.latest import (
    BEST_NAME,
    LATEST_NAME,
    moves_forward,
    output_order,
    pointed_output,
    read_output_metadata,
    remove_latest_pointer,
    set_aside_non_link,
    update_latest_pointer,
)
from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver, files_gone

__all__ = ["RETAINED_DIRNAME", "ConsolidatedOutput", "Observer", "consolidated_outputs", "output_run"]
__all__ += ["prune_retained", "repair_best", "repoint_best", "repoint_latest", "retain_output", "retained_name"]
__all__ += ["same_output_files"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsolidatedOutput:
    """A complete consolidated output of a run.

    Attributes:
        entry: what ``LATEST`` names for it: a checkpoint directory, or ``<root>/retained/<name>``.
        output_dir: ``<entry>/consolidated`` (or ``<entry>/hf``).
        global_step: from its ``metadata.json`` (``-1`` if unknown).
        retained: whether it lives under ``retained/``.
        run: the id of the training run that made it (``"run"`` in its ``metadata.json``); ``None`` when it records
            none (made before run ids were recorded, or offline).
    """

    entry: Path
    output_dir: Path
    global_step: int
    retained: bool
    run: Optional[str] = None


def retained_name(checkpoint_dir: Path) -> str:
    """The retained entry's name for a checkpoint: its own name, without NeMo's ``-last`` suffix (``-last-v1``, ...
    included: the copy holds its step's output)."""
    return without_copy_suffix(Path(checkpoint_dir).name)


def _run_of(metadata: Dict[str, Any]) -> Optional[str]:
    run = metadata.get("run")
    return run if isinstance(run, str) else None


def output_run(output_dir: Path) -> Optional[str]:
    """The run that made the output (``"run"`` in its ``metadata.json``), ``None`` if it records none."""
    metadata = read_output_metadata(output_dir)
    return None if metadata is None else _run_of(metadata)


def consolidated_outputs(root: Path, output_name: str) -> List[ConsolidatedOutput]:
    """Every complete consolidated output of a checkpoint root, newest first.

    Outputs inside checkpoints that NeMo marked unfinished (being saved or being removed) are left out. Among outputs
    of the same global step, one inside a checkpoint comes before a retained one, and a step's own checkpoint before
    its ``-last`` copy.

    Args:
        root: the checkpoint root (NeMo's ``ModelCheckpoint.dirpath``).
        output_name: ``consolidated`` or ``hf``.
    """
    found: List[ConsolidatedOutput] = []
    try:
        candidates = [(path, False) for path in root.iterdir() if not path.is_symlink() and path.is_dir()]
    except OSError:
        return []
    retained_root = root / RETAINED_DIRNAME
    if retained_root.is_dir():
        candidates += [(path, True) for path in retained_root.iterdir() if path.is_dir()]
    for entry, retained in candidates:
        if entry.name.startswith(".") or (not retained and entry.name == RETAINED_DIRNAME):
            continue
        if not retained and (entry.name.endswith(UNFINISHED_SUFFIX) or is_marked_unfinished(entry)):
            continue
        metadata = read_output_metadata(entry / output_name)
        if metadata is not None:
            step = metadata.get("global_step")
            step = int(step) if isinstance(step, int) else -1
            found.append(ConsolidatedOutput(entry, entry / output_name, step, retained, _run_of(metadata)))
    # among outputs of one global step (a checkpoint name reused by another run or fit, each kept under retained/),
    # the one kept last first: its metadata.json was written when it was kept
    found.sort(
        key=lambda o: (o.global_step, not o.retained, not is_copy_name(o.entry.name), _written(o.output_dir)),
        reverse=True,
    )
    return found


def _written(output_dir: Path) -> int:
    """When ``<output_dir>/metadata.json`` was written (nanoseconds), ``0`` if unknown."""
    try:
        return (output_dir / METADATA_FILENAME).stat().st_mtime_ns
    except OSError:
        return 0


def retained_entry_of(root: Path, output_name: str, checkpoint_dir: Path, run: Optional[str] = None) -> Optional[Path]:
    """The retained entry that holds the output of ``checkpoint_dir`` (by its ``metadata.json``'s ``retained_from``),
    ``None`` if none: while the checkpoint's output is there, only one holding its very files; once it is gone, the
    one of ``run`` (``None``: an entry that records no run) kept last."""
    retained_root = root / RETAINED_DIRNAME
    name = retained_name(checkpoint_dir)
    source = Path(checkpoint_dir) / output_name
    check_files = read_output_metadata(source) is not None
    found = []
    try:
        entries = [path for path in retained_root.iterdir() if path.is_dir() and not path.name.startswith(".")]
    except OSError:
        return None
    for entry in entries:
        metadata = read_output_metadata(entry / output_name) or {}  # bounded, never a FIFO
        kept_from = metadata.get("retained_from")
        if not isinstance(kept_from, str) or retained_name(Path(kept_from)) != name:
            continue
        if check_files and not same_output_files(source, entry / output_name):
            continue
        if not check_files and _run_of(metadata) != run:
            continue
        found.append((_written(entry / output_name), entry.name, entry))
    return max(found)[2] if found else None


def same_output_files(one: Path, other: Path) -> bool:
    """Whether two outputs hold the same files (hard links: the first tensor file of ``one`` is ``other``'s)."""
    try:
        first = min(path.name for path in one.iterdir() if path.name.endswith(".safetensors"))
        return os.path.samefile(one / first, other / first)
    except (OSError, ValueError):
        return False


def retain_output(checkpoint_dir: Path, output_name: str) -> Optional[Path]:
    """Give ``<checkpoint_dir>/<output_name>`` a second home under ``<root>/retained/``, atomically.

    Args:
        checkpoint_dir: a checkpoint about to be removed (its parent is the root).
        output_name: ``consolidated`` or ``hf``.

    Returns:
        The retained entry ``<root>/retained/<name>`` (``<name>-v<N>`` when an entry of that name holds another
        output), or ``None`` if the checkpoint holds no complete output or another output (retained, or the step's
        own checkpoint's for a ``-last`` copy) holds its very files.

    Raises:
        OSError: the files cannot be linked or copied (nothing is left behind: no entry, no staging directory).
    """
    source = checkpoint_dir / output_name
    metadata = read_output_metadata(source)
    if metadata is None:
        return None
    retained_root, name = checkpoint_dir.parent / RETAINED_DIRNAME, retained_name(checkpoint_dir)
    if same_output_files(source, retained_root / name / output_name):  # kept already (a -last copy's step's output)
        return None
    # another run or fit saved a checkpoint of the same name: the first free <name>-v<N>, as NeMo versions a name
    entry, version = retained_root / name, 0
    while (entry / output_name).exists() or entry.is_symlink() or (entry.exists() and not entry.is_dir()):
        version += 1
        entry = retained_root / f"{name}-v{version}"
    if is_copy_name(checkpoint_dir.name) and _held_elsewhere(checkpoint_dir, output_name):
        return None
    created = not entry.exists()
    entry.mkdir(parents=True, exist_ok=True)
    metadata["retained_from"] = checkpoint_dir.name
    kept_log = post_command_log_path(entry / output_name)
    log_kept = _keep_post_command_log(post_command_log_path(source), kept_log)
    post_command = metadata.get("post_command")
    if isinstance(post_command, dict) and log_kept:  # the metadata names the log's new home once it is there
        post_command["log"] = os.path.abspath(kept_log)  # absolute, as the post command wrote it: a relative log_dir
    if isinstance(metadata.get("source_checkpoint"), str):  # still names the removed checkpoint's weights
        original = (source / metadata["source_checkpoint"]).resolve()
        metadata["source_checkpoint"] = os.path.relpath(original, entry / output_name)
    rewritten = (json.dumps(metadata, indent=2, sort_keys=True) + "\n").encode()
    try:
        link_output(source, entry / output_name, replace_files={METADATA_FILENAME: rewritten})
    except BaseException:
        if log_kept:
            kept_log.unlink(missing_ok=True)
        if created:  # link_output removed its staging directory: the entry is empty again
            with contextlib.suppress(OSError):
                entry.rmdir()
        raise
    return entry


def _held_elsewhere(checkpoint_dir: Path, output_name: str) -> bool:
    """Whether another complete output of the root holds the same files as the checkpoint's (a ``-last`` copy's)."""
    source = checkpoint_dir / output_name
    others = consolidated_outputs(checkpoint_dir.parent, output_name)
    return any(other.entry != checkpoint_dir and same_output_files(source, other.output_dir) for other in others)


def _keep_post_command_log(log: Path, kept: Path) -> bool:
    """Hard-link (else copy) the post command's log of a retained output to ``kept`` through a temporary name
    renamed over it (nothing is written through a link); ``True`` once ``kept`` is the log. A failure is logged."""
    if not log.is_file() or log.is_symlink():
        return False
    staging = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
    try:
        staging.unlink(missing_ok=True)
        try:
            os.link(log, staging, follow_symlinks=False)
        except OSError:
            shutil.copy2(log, staging)
        os.replace(staging, kept)
        return True
    except OSError as error:
        staging.unlink(missing_ok=True)
        logger.warning("Could not keep the post command's log %s beside %s: %s", log, kept.parent, error)
        return False


def prune_retained(root: Path, output_name: str, keep: Optional[int], run: Optional[str] = None) -> List[Path]:
    """Remove retained entries of ``run`` that are not among its newest ``keep`` consolidated outputs.

    Args:
        root: the checkpoint root.
        output_name: ``consolidated`` or ``hf``.
        keep: ``None`` removes nothing; ``N >= 0`` keeps the newest ``N`` outputs, counting those inside checkpoints.
        run: the run whose outputs are counted and pruned (``None``: the outputs that record no run); the outputs of
            other runs sharing the root are left alone.

    Returns:
        The removed entries (``LATEST`` is not touched here: see :func:`repoint_latest`). The entry ``BEST`` names
        is kept whatever ``keep`` says.
    """
    if keep is None:
        return []
    removed = []
    best = _pointer_target(root, BEST_NAME)
    for output in [output for output in consolidated_outputs(root, output_name) if output.run == run][keep:]:
        if output.retained and output.entry != best:
            shutil.rmtree(output.entry, ignore_errors=True)
            removed.append(output.entry)
            logger.info("Removed retained consolidated output %s (ConsolidationConfig.keep=%d)", output.entry, keep)
    return removed


def _pointer_target(root: Path, name: str = LATEST_NAME) -> Optional[Path]:
    link = root / name
    if not link.is_symlink():
        return None
    return Path(os.path.normpath(root / os.readlink(link)))


def _owner(target: Path, output_name: str, run: Optional[str]) -> Tuple[Optional[str], Optional[int], bool]:
    """Whose output a pointer names: ``(run, global step, readable)`` from its ``metadata.json``; when that cannot be
    read (the output is gone), ``(run, None, False)``: the caller's run, the one that looks after the pointer."""
    metadata = read_output_metadata(target / output_name)
    if metadata is None:
        return run, None, False
    step = metadata.get("global_step")
    return _run_of(metadata), int(step) if isinstance(step, int) else None, True


def _run_label(run: Optional[str]) -> str:
    return f"run {run}" if run is not None else "outputs that record no run"


def repoint_best(root: Path, output_name: str, removing: Path, run: Optional[str] = None) -> Optional[Path]:
    """Keep ``<root>/BEST`` off a checkpoint that is being removed: move it to the checkpoint's retained output
    (:func:`retain_output` ran first), or remove it when that output is not kept (logged as a warning). It never moves
    to another run's output.

    Args:
        run: the run that looks after ``BEST`` (taken as its owner when the output it names cannot be read).

    Returns:
        What ``BEST`` names afterwards (``None``: no pointer).
    """
    target = _pointer_target(root, BEST_NAME)
    removing = Path(os.path.normpath(removing))
    if target != removing:
        return target
    owner, _, _ = _owner(target, output_name, run)
    why = _why(removing)
    return _best_to_retained(root, output_name, removing, owner, why, f"{why} and its consolidated output is not kept")


def repair_best(root: Path, output_name: str, run: Optional[str] = None) -> Optional[Path]:
    """Keep ``<root>/BEST`` on a complete output when its checkpoint went without this package moving it (e.g. NeMo
    deleted it directly): to the checkpoint's retained output of ``run`` (the run that looks after ``BEST``; the
    output that ``BEST`` named cannot tell its own any more) if there is one, else ``BEST`` is removed (a warning).

    Returns:
        What ``BEST`` names afterwards (``None``: no pointer).
    """
    target = _pointer_target(root, BEST_NAME)
    if target is None or read_output_metadata(target / output_name) is not None:
        return target
    gone = f"it named {os.path.relpath(target, root)}, which holds no complete output any more"
    return _best_to_retained(root, output_name, target, run, "its checkpoint is gone", gone)


def _best_to_retained(
    root: Path, output_name: str, gone: Path, run: Optional[str], moved: str, removed: str
) -> Optional[Path]:
    """Point ``BEST`` at ``gone``'s retained output of ``run`` (logged with why it ``moved``), else remove it (a
    warning saying why it was ``removed``); returns what ``BEST`` names afterwards."""
    entry = retained_entry_of(root, output_name, gone, run)
    if entry is not None and read_output_metadata(entry / output_name) is not None:
        update_latest_pointer(entry, root, name=BEST_NAME)
        logger.info("BEST moved from %s to %s (%s)", gone.name, os.path.relpath(entry, root), moved)
        return entry
    remove_latest_pointer(root, BEST_NAME)
    logger.warning("BEST removed: %s", removed)
    return None


def repoint_latest(
    root: Path, output_name: str, removing: Optional[Path] = None, run: Optional[str] = None
) -> Optional[Path]:
    """Keep ``<root>/LATEST`` on a complete output of the run that owns it when the checkpoint it names is being
    removed or is gone.

    The owner is the run the named output's ``metadata.json`` records (``run`` when it is gone). ``LATEST`` moves to
    another output holding the same files, else to the owner's newest output below its global step; when the owner
    has none left, it is removed (one log line): it never names another run's weights.

    Args:
        root: the checkpoint root.
        output_name: ``consolidated`` or ``hf``.
        removing: a checkpoint about to be removed (``LATEST`` must not name it any more).
        run: the run that looks after ``LATEST`` (``None``: outputs that record no run).

    Returns:
        What ``LATEST`` names afterwards (``None``: no pointer). Nothing changes while ``LATEST`` names a complete
        output that is not ``removing``.
    """
    target = _pointer_target(root)
    if target is None:
        return None
    removing = Path(os.path.normpath(removing)) if removing is not None else None
    if target != removing and read_output_metadata(target / output_name) is not None:
        return target
    owner, step, readable = _owner(target, output_name, run)
    own = [o for o in consolidated_outputs(root, output_name) if o.entry != removing and o.run == owner]
    same = [o for o in own if readable and same_output_files(target / output_name, o.output_dir)]
    older = [o for o in own if step is None or o.global_step < step]
    remaining = same or older
    if remaining:
        update_latest_pointer(remaining[0].entry, root)
        logger.info(
            "LATEST moved from %s to %s (%s)", target.name, os.path.relpath(remaining[0].entry, root), _why(removing)
        )
        return remaining[0].entry
    remove_latest_pointer(root)
    logger.info(
        "LATEST removed: %s and no other consolidated output of %s is left (outputs of other runs in %s are never "
        "taken for it)",
        _why(removing),
        _run_label(owner),
        root,
    )
    return None


def _why(removing: Optional[Path]) -> str:
    return "the checkpoint it named is gone" if removing is None else f"checkpoint {removing.name} is being removed"


class Observer(ConsolidationObserver):
    """A run's retention: outputs kept when NeMo removes their checkpoints (``ConsolidationConfig.keep``), ``LATEST``
    on the newest output, and ``LATEST``/``BEST`` moved off what is removed and repaired when training starts."""

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        #: ``(run, fit, global step)`` of the newest save this process pointed ``LATEST`` at: it only moves forward.
        self._latest: Optional[Tuple[str, int, int]] = None

    def on_train_start(self, root: Optional[Path]) -> None:
        # NeMo keeping at most one checkpoint drops a due consolidation not started when the next one is saved
        policy = self.coordinator.policy
        save_top_k = getattr(self.coordinator.checkpoint_callback, "save_top_k", -1)
        if policy.consolidates_periodically and 0 <= save_top_k <= 1:
            logger.warning(
                "ModelCheckpoint(save_top_k=%d) removes each checkpoint as soon as the next one is saved: a "
                "checkpoint due for consolidation (ckpt_consolidation_frequency=%r) is dropped whenever the "
                "consolidation process is still busy with an earlier one at that moment. Consolidated outputs "
                "themselves are kept under <root>/%s/ (ConsolidationConfig.keep). To consolidate every due "
                "checkpoint, keep more checkpoints (a larger save_top_k, or -1) or save less often than a "
                "consolidation takes; ckpt_consolidation_frequency='latest' consolidates only the final one.",
                save_top_k,
                str(policy),
                RETAINED_DIRNAME,
            )
        if root is None:
            return
        retained = root / RETAINED_DIRNAME
        for entry in list(retained.iterdir()) if retained.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink():
                remove_stale_tmp_dirs(entry)  # left by a consolidation process that was killed
        name = self.coordinator.settings.output_dirname
        with self.coordinator.lock:
            for pointer in (LATEST_NAME, BEST_NAME):
                repaired = self._set_aside(root, pointer)
                outputs = consolidated_outputs(root, name) if repaired and pointer == LATEST_NAME else []
                outputs = [output for output in outputs if output.run == self.coordinator.run_id]
                if outputs:
                    try:
                        update_latest_pointer(outputs[0].entry, root)
                    except OSError:
                        logger.exception("Could not point LATEST at %s", outputs[0].entry)
                self.move_pointer_off(root, pointer, None)

    def before_removal(self, checkpoint_dir: Path) -> None:
        """Keep the checkpoint's output (within ``keep``) and move ``LATEST``/``BEST`` off it, each step on its own: a
        failure to keep (disk full, a link limit) is logged, leaves no entry behind, and the pointers still move."""
        coordinator = self.coordinator
        name, keep, root = coordinator.settings.output_dirname, coordinator.settings.config.keep, checkpoint_dir.parent
        if keep == 0 and read_output_metadata(checkpoint_dir / name) is not None:
            logger.info(
                "The consolidated output of %s goes with its checkpoint, which NeMo is removing "
                "(ConsolidationConfig.keep=0)",
                checkpoint_dir.name,
            )
        if keep != 0:
            try:
                entry = retain_output(checkpoint_dir, name)
            except OSError as error:
                entry = None
                logger.error(
                    "Could not keep the consolidated output of %s before its removal (%s): it goes with the "
                    "checkpoint; LATEST and BEST move to a remaining output",
                    checkpoint_dir,
                    error,
                )
            else:
                lost = entry is None and read_output_metadata(checkpoint_dir / name) is not None
                if lost and not _held_elsewhere(checkpoint_dir, name):
                    logger.warning(
                        "The consolidated output of %s was not kept: it goes with its checkpoint, which NeMo is "
                        "removing",
                        checkpoint_dir.name,
                    )
            if entry is not None:
                logger.info(
                    "Kept the consolidated output of %s as %s (%s): NeMo is removing the checkpoint "
                    "(ConsolidationConfig.keep=%s)",
                    checkpoint_dir.name,
                    entry,
                    _run_label(output_run(entry / name)),
                    keep,
                )
                save = coordinator._outputs.get(checkpoint_dir)
                if save is not None and save.output == checkpoint_dir / name:
                    save.output = entry / name
        try:
            prune_retained(root, name, keep, coordinator.run_id)
        except OSError:
            logger.exception("Could not prune the retained outputs in %s", root)
        self.move_pointer_off(root, LATEST_NAME, checkpoint_dir)
        self.move_pointer_off(root, BEST_NAME, checkpoint_dir)

    def on_published(self, save: CheckpointSave) -> None:
        self._point_latest(save)
        keep = self.coordinator.settings.config.keep
        if keep is not None:  # a new output may push a retained one out of the newest N
            with self.coordinator.lock:
                try:
                    prune_retained(
                        save.path.parent, self.coordinator.settings.output_dirname, keep, self.coordinator.run_id
                    )
                except OSError:
                    logger.exception("Could not prune the retained outputs in %s", save.path.parent)
                self.move_pointer_off(save.path.parent, LATEST_NAME, None)

    def on_newest(self, save: CheckpointSave) -> None:
        self._point_latest(save)

    def _point_latest(self, save: CheckpointSave) -> None:
        """``LATEST`` -> ``save``, unless it names a later save already, by (run order, fit, global step): a late
        or an earlier run's output never moves it back. Against another run's output (a sidecar, a run sharing the
        root) the recorded saves are compared (:func:`.latest.moves_forward`), unless :meth:`_superseded`."""
        run = save.run if save.run is not None else getattr(self.coordinator, "run_id", None)
        order = (run or "", save.fit, save.global_step)
        if self._latest is not None and order < self._latest:
            why = f"{save.path} (global step {save.global_step}) is older"
            logger.debug("LATEST stays on global step %d: %s", self._latest[2], why)
            return
        name = self.coordinator.settings.output_dirname
        current = pointed_output(save.path.parent, (name,))
        if current is not None and current != save.path / name:
            now, mine = output_order(current), output_order(save.path / name)
            own = mine.run if mine is not None else run  # the run the output records (none: made offline)
            if (
                now is not None
                and now.run != own
                and not moves_forward(mine, now)
                and not self._superseded(own, current)
            ):
                newer = f"it names a newer save ({_run_label(now.run)}) than {save.path.name}'s"
                logger.info("LATEST stays on %s: %s", current.parent.name, newer)
                return
        self._latest = order
        self.point(save.path)

    def _superseded(self, run: Optional[str], current: Path) -> bool:
        """Whether this fit's own output (``run`` is the training run's) supersedes the ``current`` output of another
        run, whose save finished before this fit started (a rollback, or a resume of an older run)."""
        from nemo_patch.engine.save_identity import recorded_identity

        started = getattr(self.coordinator, "fit_started_ns", None)
        if run is None or run != getattr(self.coordinator, "run_id", None) or started is None:
            return False
        identity = recorded_identity(current)
        return identity is not None and 0 < identity.finished_ns < started

    def link_files(self, output: Path, copy: CheckpointSave) -> Dict[str, bytes]:
        """An output kept under ``retained/`` had its ``metadata.json`` rewritten for that place: the copy's names its
        own weights again."""
        name = self.coordinator.settings.output_dirname
        if copy.copy_of is None or output == copy.copy_of.path / name:
            return {}
        metadata = read_output_metadata(output)  # bounded, a regular file only
        if metadata is None:  # unreadable since it was published: the copy gets the files as they are
            return {}
        metadata.pop("retained_from", None)
        if isinstance(metadata.get("source_checkpoint"), str):
            metadata["source_checkpoint"] = os.path.relpath(copy.path / "weights", copy.path / name)
        return {METADATA_FILENAME: (json.dumps(metadata, indent=2, sort_keys=True) + "\n").encode()}

    def point(self, checkpoint_dir: Path, pointer: str = LATEST_NAME) -> None:
        """Point ``LATEST`` (or ``BEST``) at a checkpoint whose output was published, unless its removal has started;
        what took the pointer's place (e.g. a directory a sync tool made) is moved aside first (a warning)."""
        with self.coordinator.lock:
            if checkpoint_dir in self.coordinator.deleting or files_gone(checkpoint_dir):
                return
            for attempt in (1, 2):  # the second after moving aside what took the pointer's place
                try:
                    update_latest_pointer(checkpoint_dir, name=pointer)
                    return
                except OSError:
                    if attempt == 2 or not self._set_aside(checkpoint_dir.parent, pointer):
                        logger.exception("Could not point %s at %s", pointer, checkpoint_dir)
                        return

    def _set_aside(self, root: Path, pointer: str) -> bool:
        """Move aside what took ``<root>/<pointer>``'s place (not a symlink); ``True`` if something was moved."""
        try:
            aside = set_aside_non_link(root, pointer)
        except OSError as error:
            logger.error("%s in %s is not a symlink and cannot be moved aside: %s", pointer, root, error)
            return False
        if aside is not None:
            logger.warning(
                "%s in %s was a directory or file, not the symlink this package keeps there (e.g. a copy made by a "
                "tool that follows symlinks): moved it to %s and made %s a symlink again",
                pointer,
                root,
                aside.name,
                pointer,
            )
        return aside is not None

    def move_pointer_off(self, root: Path, pointer: str, removing: Optional[Path]) -> None:
        """Keep ``pointer`` off ``removing`` (and off a gone output); if it cannot be moved, remove it (logged)."""
        name, run = self.coordinator.settings.output_dirname, self.coordinator.run_id
        try:
            if pointer == LATEST_NAME:
                repoint_latest(root, name, removing=removing, run=run)
            elif removing is not None:
                repoint_best(root, name, removing, run)
            else:
                repair_best(root, name, run)
        except OSError as error:
            try:
                remove_latest_pointer(root, pointer)
                logger.error("Could not move %s (%s): removed it, so that it does not dangle", pointer, error)
            except OSError:
                logger.exception("Could not move or remove %s in %s", pointer, root)
