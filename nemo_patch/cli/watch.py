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

"""``nemo-consolidate --watch ROOT``: a sidecar that consolidates a run's checkpoints as they finish.

What it consolidates, links and points ``LATEST`` at, its log lines and exit codes: docs/sidecar.md.
"""

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, TextIO, Tuple

from nemo_patch.cli.progress import human_size
from nemo_patch.engine.errors import ConsolidationError, UnfinishedCheckpointError, UnsupportedFormatError
from nemo_patch.runs.run_checkpoints import (
    MEGATRON_LAYOUT,
    NEMO_LAYOUT,
    RunCheckpoint,
    RunListing,
    list_run_checkpoints,
)
from nemo_patch.training import latest
from nemo_patch.training.policy import ConsolidationPolicy

__all__ = ["WatchStopped", "Watcher", "human_size", "output_is_complete", "positive_seconds", "same_state"]

logger = logging.getLogger(__name__)

#: At most this many different log lines are remembered so as to be said once.
_SEEN_REASONS_LIMIT = 10_000

#: Writes one checkpoint's output (see :class:`Watcher`).
Consolidate = Callable[[RunCheckpoint, Path, Path, Callable[[], None]], Tuple[int, int]]


class WatchStopped(BaseException):
    """SIGTERM or SIGINT reached the watcher while it consolidated: the output being written is abandoned."""


def _printable(text: object) -> str:
    """``text`` with what is not printable escaped (``\\n``, ``\\x1b``, ``\\udcff``): a checkpoint named with a
    newline or a terminal escape must not write a second log line or a forged one."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(text))


def _one_line(error: BaseException) -> str:
    """An error's message on one line (a message quoting torch's may have several)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


class _SavedAgain(RuntimeError):
    """The checkpoint was saved again under its name while it was consolidated (another ``.metadata``)."""


def _stat_key(path: Path) -> Optional[Tuple[int, ...]]:
    """What changes when a file is replaced or rewritten: device, inode, size, mtime and ctime (``None``: absent)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _weights(checkpoint: Path) -> Path:
    return checkpoint / "weights" if (checkpoint / "weights").is_dir() else checkpoint


def output_is_complete(checkpoint: Path, output_dir: Path) -> bool:
    """Whether ``output_dir`` is a complete output of ``checkpoint`` as saved now: its ``metadata.json`` records the
    checkpoint's current ``.metadata`` fingerprint and save identity (where it records one), and lists files that all
    exist with the recorded sizes (hf: its ``config.json`` exists). A linked output is complete only when it records
    that the two checkpoints hold the same trainer state (``"linked"``, :func:`same_state`)."""
    from nemo_patch.engine.digests import source_fingerprint
    from nemo_patch.engine.safe_files import read_json_file
    from nemo_patch.engine.save_identity import SaveIdentity, save_identity

    try:
        if not stat.S_ISDIR(os.lstat(output_dir).st_mode):  # a link planted there is nobody's output
            return False
        manifest = read_json_file(output_dir / "metadata.json")
        weights = _weights(checkpoint)
        if not isinstance(manifest, dict) or manifest.get("source_metadata") != source_fingerprint(weights):
            return False
        if "linked_from" in manifest and not isinstance(manifest.get("linked"), dict):
            return False
        if "save" in manifest:
            recorded = SaveIdentity.from_json(manifest["save"])
            if recorded.fingerprint != save_identity(checkpoint, allow_unfinished=True, read_run=False).fingerprint:
                return False
        if manifest.get("format") == "hf":
            return (output_dir / "config.json").is_file()
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return False
        for name, entry in files.items():
            size = entry.get("size") if isinstance(entry, dict) else None
            if "/" in name or name.startswith("."):
                return False
            info = os.lstat(output_dir / name)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                return False
        return True
    except (ConsolidationError, OSError, ValueError, TypeError, AttributeError):
        return False


#: Bytes read at a time when two files' contents are compared.
_COMPARE_CHUNK = 4 << 20


def _same_bytes(one: Path, other: Path) -> bool:
    """Whether two regular files hold the same bytes (opened without following a link; OSError if either cannot)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    with open(os.open(one, flags), "rb") as first, open(os.open(other, flags), "rb") as second:
        a, b = os.fstat(first.fileno()), os.fstat(second.fileno())
        if not (stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode)) or a.st_size != b.st_size:
            return False
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            return True
        while True:
            chunk = first.read(_COMPARE_CHUNK)
            if chunk != second.read(_COMPARE_CHUNK):
                return False
            if not chunk:
                return True


def _tensor_files(weights: Path, layout: str) -> Dict[str, Path]:
    """The files of a save whose bytes are its tensors, by path relative to ``weights``: the ``*.distcp`` shards, or
    every file of each zarr array (not ``common.pt``: it holds the trainer's state; not ``.metadata``: it names the
    save). OSError if ``weights`` cannot be listed or an array holds a symbolic link."""
    found: Dict[str, Path] = {}
    with os.scandir(weights) as entries:
        for entry in entries:
            if layout != "zarr" and entry.name.endswith(".distcp"):
                found[entry.name] = Path(entry.path)
            elif (
                layout == "zarr"
                and entry.is_dir(follow_symlinks=False)
                and os.path.lexists(os.path.join(entry.path, ".zarray"))
            ):
                for directory, dirs, files in os.walk(entry.path, followlinks=False):
                    for name in dirs + files:
                        path = Path(directory) / name
                        if path.is_symlink():
                            raise OSError(errno.ELOOP, "a symbolic link in a zarr array", str(path))
                        if name in files:
                            found[str(path.relative_to(weights))] = path
    return found


def _same_dcp_metadata(one: Path, other: Path) -> bool:
    """Whether two DCP ``.metadata`` files (read as a consolidation reads them) describe the same tensors in the same
    places, ``storage_meta`` (it names the save) aside. OSError or ``pickle.UnpicklingError`` if either cannot."""
    from nemo_patch.engine.metadata_checks import read_dcp_metadata

    a, b = (read_dcp_metadata(path.parent) for path in (one, other))
    fields = ("state_dict_metadata", "storage_data", "planner_data", "mcore_data")
    return all(getattr(a, name, None) == getattr(b, name, None) for name in fields)


def same_state(one: Path, other: Path) -> Optional[str]:
    """Whether two finished checkpoints of a root hold one trainer state, so that one's output is the other's too (a
    save and NeMo's ``-last`` copy of it are two saves: their identities' fingerprints differ).

    Args:
        one, other: checkpoint directories (NeMo's, or Megatron-LM ``iter_<N>``).

    Returns:
        ``"run"`` when both record the same training run (the overlay's run id) and global step and have the same
        shard files by name and size; ``"bytes"`` when neither records a run (stock NeMo) and their tensors' files,
        ``metadata.json`` and DCP ``.metadata`` (but for the save's id) are equal; ``None`` otherwise.

    Raises:
        ConsolidationError: either's save identity cannot be read (unfinished, unreadable).
    """
    import pickle

    from nemo_patch.engine.save_identity import save_identity

    a, b = save_identity(one), save_identity(other)
    if a.layout != b.layout or a.global_step is None or a.global_step != b.global_step:
        return None
    wa, wb = _weights(one), _weights(other)
    try:
        files_a, files_b = _tensor_files(wa, a.layout), _tensor_files(wb, b.layout)
        if sorted(files_a) != sorted(files_b) or not files_a:
            return None
        if a.run is not None or b.run is not None:
            same_sizes = all(os.lstat(files_a[name]).st_size == os.lstat(files_b[name]).st_size for name in files_a)
            return "run" if a.run == b.run and same_sizes else None
        side = "metadata.json"
        if (os.path.lexists(wa / side) or os.path.lexists(wb / side)) and not _same_bytes(wa / side, wb / side):
            return None
        if a.layout != "zarr" and not _same_dcp_metadata(wa / ".metadata", wb / ".metadata"):
            return None
        return "bytes" if all(_same_bytes(files_a[name], files_b[name]) for name in sorted(files_a)) else None
    except (OSError, pickle.UnpicklingError):
        return None


@contextlib.contextmanager
def _held(checkpoint: Path) -> Iterator[bool]:
    """An exclusive, non-blocking ``flock`` on the checkpoint's directory while the block runs: ``True`` when this
    process holds it (or the filesystem has no ``flock``), ``False`` when another watcher does."""
    try:
        fd = os.open(checkpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield True  # gone: the consolidation finds out and says so
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                yield False
                return
            logger.debug("No flock on %s (%s): two watchers are kept apart by the atomic publish only", checkpoint,
                         error)  # fmt: skip
        yield True
    finally:
        os.close(fd)


@dataclass
class _Tally:
    """What the watcher did, for the summary line."""

    consolidated: int = 0
    bytes: int = 0
    linked: int = 0
    removed: int = 0
    failed: int = 0
    exit_code: int = 0
    already_done: Set[int] = field(default_factory=set)  # global steps whose output it found complete, not its own
    started: float = field(default_factory=time.monotonic)


@dataclass
class Watcher:
    """Consolidates the finished checkpoints of ``root`` that ``policy`` picks (see the module docstring).

    Args:
        root: the save directory watched.
        policy: the parsed ``--frequency``.
        consolidate: writes one checkpoint's output: called with the checkpoint, its output directory, the staging
            directory and a check to run right before publishing (it raises when the checkpoint is no longer
            finished); returns ``(tensor count, bytes)``; raises :class:`ConsolidationError` on failure.
        output_name: ``"consolidated"`` or ``"hf"``.
        until_idle: seconds without a newly finished checkpoint (and nothing due) after which :meth:`run` returns;
            ``None``: run until stopped.
        poll_interval: seconds between listings of ``root``.
        best: ``(monitor, mode)`` for ``best`` cadences (``None`` entries: what NeMo recorded).
        after_publish: called with the checkpoint and its published output (the post command).
        out: where the one line per consolidation and the summary go (default: ``sys.stdout``).
    """

    root: Path
    policy: ConsolidationPolicy
    consolidate: "Consolidate"
    output_name: str = "consolidated"
    until_idle: Optional[float] = None
    poll_interval: float = 10.0
    best: "tuple[Optional[str], Optional[str]]" = (None, None)
    after_publish: Optional[Callable[[RunCheckpoint, Path], Optional[int]]] = None
    out: Optional[TextIO] = None
    tally: _Tally = field(default_factory=_Tally)
    stopping: bool = False
    _index: Dict[int, int] = field(default_factory=dict)  # global step -> its count in its cadence phase
    _phase_counts: Dict[int, int] = field(default_factory=dict)
    _given_up: Set["tuple[Path, str]"] = field(default_factory=set)  # (checkpoint, which save) that failed
    _said: Set["tuple[Path, str]"] = field(default_factory=set)
    _last_finished: float = field(default_factory=time.monotonic)
    _busy: bool = False
    layout: Optional[str] = None
    _complete: Dict[Path, Tuple[Any, ...]] = field(default_factory=dict)  # output -> what it was complete as
    _states: Dict[Tuple[Any, ...], Optional[str]] = field(default_factory=dict)  # two saves -> same_state's answer
    _orders: Dict[Path, Tuple[Any, Any]] = field(default_factory=dict)  # output -> (metadata.json's stat, its order)
    _swept: bool = False  # stale staging directories removed (at the first listing of the root)
    _published: Set[int] = field(default_factory=set)  # global steps this watcher consolidated
    _no_best: Optional[ConsolidationError] = None  # why no best checkpoint is known yet (a "best" cadence)

    def say(self, line: str) -> None:
        """One line of the watcher's log (stdout), flushed."""
        print(_printable(line), file=sys.stdout if self.out is None else self.out, flush=True)

    # -- what is due ------------------------------------------------------------------------------------------------

    def _count(self, steps: List[int]) -> None:
        """Give each newly seen finished global step its index in its cadence phase."""
        new = [step for step in steps if step not in self._index]
        for step in new:
            phase = self.policy.phase_at(step)
            start = phase.start_step if phase is not None else -1
            self._phase_counts[start] = self._phase_counts.get(start, 0) + 1
            self._index[step] = self._phase_counts[start]
        if new:
            self._last_finished = time.monotonic()

    def _output(self, checkpoint: RunCheckpoint) -> Path:
        return checkpoint.path / self.output_name

    @staticmethod
    def _metadata_file(checkpoint: Path) -> Path:
        weights = _weights(checkpoint)
        metadata = weights / ".metadata"
        return metadata if os.path.lexists(metadata) else weights / "metadata.json"

    def _is_complete(self, checkpoint: Path, output: Path) -> bool:
        """:func:`output_is_complete`, read again only when the checkpoint's ``.metadata``, the output directory or its
        ``metadata.json`` changed (:func:`_stat_key`): a poll of thousands of outputs costs ``stat`` calls."""
        key = (_stat_key(self._metadata_file(checkpoint)), _stat_key(output), _stat_key(output / "metadata.json"))
        if None not in key and self._complete.get(output) == key:
            return True
        self._complete.pop(output, None)
        if not output_is_complete(checkpoint, output):
            return False
        if None not in key:
            self._complete[output] = key
        return True

    def _best_step(self, listing: RunListing) -> Optional[int]:
        if self.layout != NEMO_LAYOUT or not listing.finished:
            return None
        from nemo_patch.runs.best_checkpoint import NoMonitoredMetricError, find_best_checkpoint

        try:
            best = find_best_checkpoint(self.root, *self.best)
        except NoMonitoredMetricError as error:
            if not error.transient:
                raise  # the run records no monitored metric: exit 14, as --best does
            self._no_best = error
            self._once(self.root, f"no best checkpoint yet: {error}")
            return None
        except ConsolidationError as error:
            self._once(self.root, f"no best checkpoint now: {error}")
            return None
        self._no_best = None
        steps = [c.global_step for c in listing.finished if c.path.name == best.checkpoint_dir.name]
        return steps[0] if steps else None

    def due(self, listing: RunListing) -> List[List[RunCheckpoint]]:
        """The steps to consolidate now, oldest first, each as its checkpoints (the one to read first)."""
        groups: Dict[int, List[RunCheckpoint]] = {}
        for checkpoint in listing.finished:
            groups.setdefault(checkpoint.global_step, []).append(checkpoint)
        self._count(sorted(groups))
        wanted = [
            step
            for step in groups
            if (phase := self.policy.phase_at(step)) is not None
            and phase.cadence != "best"
            and self.policy.is_due(step, self._index[step])
        ]
        newest = max(groups, default=None)
        if self.policy.consolidates_at_fit_end and newest is not None and newest not in wanted:
            wanted.append(newest)
        best = self._best_step(listing) if self.policy.uses_best else None
        if best is not None and (phase := self.policy.phase_at(best)) is not None and phase.cadence == "best":
            wanted.append(best)
        due = []
        for step in sorted(set(wanted)):
            group = groups[step]
            done = next((c for c in group if self._is_complete(c.path, self._output(c))), None)
            if done is not None:
                if step not in self._published:
                    self.tally.already_done.add(step)
                self._link_copies(done, group)
                rest = []
                for checkpoint in group:
                    if self._is_complete(checkpoint.path, self._output(checkpoint)):
                        self._point_latest(checkpoint)
                    else:
                        rest.append(checkpoint)  # another save of this step (another run's): consolidated on its own
                if not rest:
                    continue
                group = rest
            if all((c.path, self._save_of(c.path)) in self._given_up for c in group):
                continue
            due.append(group)
        return due

    # -- doing it ---------------------------------------------------------------------------------------------------

    def _save_of(self, checkpoint: Path) -> str:
        """Which save of ``checkpoint`` this is (its identity's fingerprint; ``""`` while unreadable or mid-save)."""
        from nemo_patch.engine.save_identity import save_identity

        try:
            return save_identity(checkpoint, read_run=False).fingerprint
        except ConsolidationError:
            return ""

    def _once(self, path: Path, line: str) -> None:
        if (path, line) not in self._said and len(self._said) < _SEEN_REASONS_LIMIT:
            self._said.add((path, line))
            self.say(line)

    def _still_finished(self, checkpoint: RunCheckpoint) -> bool:
        try:
            listing = list_run_checkpoints(self.root, self.layout)
        except OSError:
            return False
        return any(found.path == checkpoint.path for found in listing.finished)

    def _check_still_finished(self, checkpoint: RunCheckpoint, save: str) -> Callable[[], None]:
        """The check before publishing: ``checkpoint`` is still listed as finished, and is still the save that was
        read (``save``: a checkpoint saved again meanwhile may have been read half from each save)."""

        def check() -> None:
            if not self._still_finished(checkpoint):
                raise ConsolidationError(f"{checkpoint.path} was removed or marked unfinished meanwhile")
            if self._save_of(checkpoint.path) != save:
                raise _SavedAgain(f"{checkpoint.path} was saved again while it was consolidated")

        return check

    def _consolidate_group(self, group: List[RunCheckpoint]) -> None:
        """Consolidate the first checkpoint of a step that is not held by another watcher; link the others."""
        for checkpoint in group:
            with _held(checkpoint.path) as mine:
                if not mine:
                    self._once(checkpoint.path, f"{checkpoint.path.name}: another watcher is consolidating it")
                    continue
                if self._is_complete(checkpoint.path, self._output(checkpoint)):  # done meanwhile, by another
                    self.tally.already_done.add(checkpoint.global_step)
                    return
                if self._consolidate_one(checkpoint):
                    self._link_copies(checkpoint, group)
                    self._point_latest(checkpoint)
                return

    def _consolidate_one(self, checkpoint: RunCheckpoint) -> bool:
        output, started = self._output(checkpoint), time.monotonic()
        save = self._save_of(checkpoint.path)
        self._busy = True
        try:
            if self.stopping:
                raise WatchStopped
            count, size = self.consolidate(checkpoint, output, self.root, self._check_still_finished(checkpoint, save))
        except Exception as error:  # noqa: BLE001 - any failure of one checkpoint is one line; the watcher goes on
            self._busy = False
            return self._failed(checkpoint, save, error)
        finally:
            self._busy = False
        self.tally.consolidated += 1
        self._published.add(checkpoint.global_step)
        self.tally.bytes += size
        self.say(f"Consolidated {checkpoint.path.name} (global step {checkpoint.global_step}) -> {output}: "
                 f"{count} tensors, {human_size(size)} in {time.monotonic() - started:.1f} s")  # fmt: skip
        if self.after_publish is not None and (code := self.after_publish(checkpoint, output)):
            self.tally.failed += 1
            self.tally.exit_code = code
        return True

    def _failed(self, checkpoint: RunCheckpoint, save: str, error: Exception) -> bool:
        """Say why ``checkpoint`` was not consolidated (one line); ``False``."""
        if not checkpoint.path.exists() or not self._still_finished(checkpoint):
            self.tally.removed += 1
            self.say(f"{checkpoint.path.name}: removed or marked unfinished by the trainer while it was "
                     "consolidated; nothing published")  # fmt: skip
            return False
        from nemo_patch.engine.save_identity import is_save_changed

        if isinstance(error, UnfinishedCheckpointError) and not save:  # visibly being saved: due once it finishes
            self._given_up.add((checkpoint.path, save))  # its fingerprint is "" until then
            self._once(checkpoint.path, f"{checkpoint.path.name}: {_one_line(error)}")
            return False
        if (
            isinstance(error, _SavedAgain)
            or is_save_changed(error)
            or (save and self._save_of(checkpoint.path) not in (save, ""))
        ):
            self.tally.removed += 1  # the save that was read is gone; the new one is due at the next poll
            self.say(f"{checkpoint.path.name}: saved again while it was consolidated; nothing published, the new save "
                     "is consolidated next")  # fmt: skip
            return False
        code = error.exit_code if isinstance(error, ConsolidationError) else ConsolidationError.exit_code
        message = _one_line(error) if isinstance(error, ConsolidationError) else (
            f"unexpected {type(error).__name__}: {_one_line(error)}")  # fmt: skip
        self.tally.failed += 1
        self.tally.exit_code = code
        self._given_up.add((checkpoint.path, save))
        self.say(f"error: {checkpoint.path.name} (global step {checkpoint.global_step}): {message} "
                 f"(exit code {code}; not retried unless saved again)")  # fmt: skip
        return False

    def _same_state(self, one: RunCheckpoint, other: RunCheckpoint) -> Optional[str]:
        """:func:`same_state`, asked once per pair of saves (again when either's ``.metadata`` changes)."""
        key = (one.path, other.path, *(_stat_key(self._metadata_file(c.path)) for c in (one, other)))
        if key in self._states:
            return self._states[key]
        try:
            how = same_state(one.path, other.path)
        except ConsolidationError as error:
            self._once(other.path, f"{other.path.name}: not compared with {one.path.name}: {_one_line(error)}")
            return None
        if None not in key and len(self._states) < _SEEN_REASONS_LIMIT:
            self._states[key] = how
        return how

    def _link_copies(self, source: RunCheckpoint, group: List[RunCheckpoint]) -> None:
        """Give the other checkpoints of ``source``'s step that hold the same trainer state (NeMo's ``-last`` copies:
        :func:`same_state`) that output as hard links, with a ``metadata.json`` of their own: the copy's ``.metadata``
        and save identity, ``"linked_from"`` and ``"linked"`` (the origin's save, ``"run"`` or ``"bytes"``)."""
        from nemo_patch.engine.digests import source_fingerprint
        from nemo_patch.engine.publish import link_output
        from nemo_patch.engine.safe_files import read_json_file
        from nemo_patch.engine.save_identity import recorded_identity, save_identity

        complete = [c for c in group if c.path != source.path and self._is_complete(c.path, self._output(c))]
        for other in group:
            target = self._output(other)
            if other.path == source.path or any(c.path == other.path for c in complete):
                continue
            found = [(c, how) for c in [source] + complete if (how := self._same_state(c, other)) is not None][:1]
            if not found:
                self._once(other.path, f"{other.path.name} (global step {other.global_step}) holds another save than "
                                       f"{source.path.name}: not linked to its output")  # fmt: skip
                continue
            origin, how = found[0]
            try:
                manifest = read_json_file(self._output(origin) / "metadata.json")
                fingerprint = source_fingerprint(_weights(other.path))
                origin_save = recorded_identity(self._output(origin))
                manifest.update(
                    source_metadata=fingerprint,
                    linked_from=origin.path.name,
                    save=save_identity(other.path).as_json(),
                    linked={"same": how, "save": None if origin_save is None else origin_save.as_json()},
                )
                text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
                check = self._check_still_finished(other, self._save_of(other.path))
                # staged in the root, as a consolidation is: nothing is created inside the copy's directory before the
                # rename (NeMo's removal of the copy would meet it); published only if the copy is still that save
                link_output(self._output(origin), target, {"metadata.json": text.encode()}, self.root, check)
            except (OSError, ValueError, AttributeError, ConsolidationError, _SavedAgain) as error:
                self._once(other.path, f"{other.path.name}: not linked to {origin.path.name}'s output: "
                                       f"{_one_line(error)}")  # fmt: skip
                continue
            self.tally.linked += 1
            self.say(f"Linked {other.path.name} (global step {other.global_step}) -> {origin.path.name}'s output "
                     f"(the same state: {'same run and step' if how == 'run' else 'byte-equal weights'})")  # fmt: skip

    def _order(self, output: Path) -> Any:
        """:func:`nemo_patch.training.latest.output_order`, read again when the output's ``metadata.json`` changed."""
        key = _stat_key(output / "metadata.json")
        known = self._orders.get(output)
        if key is not None and known is not None and known[0] == key:
            return known[1]
        order = latest.output_order(output)
        if key is not None and len(self._orders) < _SEEN_REASONS_LIMIT:
            self._orders[output] = (key, order)
        return order

    def _point_latest(self, checkpoint: RunCheckpoint) -> None:
        """``ROOT/LATEST`` -> ``checkpoint`` unless the output it names (in a checkpoint or ``retained/``) is of a
        newer save (:func:`nemo_patch.training.latest.moves_forward`)."""
        from nemo_patch.training.retention import same_output_files

        link = self.root / latest.LATEST_NAME
        try:
            if link.is_symlink() and os.readlink(link) == checkpoint.path.name:
                return
            current = latest.pointed_output(self.root, (self.output_name, "consolidated", "hf"))
            if current is not None and not latest.moves_forward(
                self._order(self._output(checkpoint)), self._order(current)
            ):
                return
            if current is not None and checkpoint.copy and same_output_files(current, self._output(checkpoint)):
                return  # a -last copy holding the output LATEST names (its links): LATEST stays on the step's own
            aside = latest.set_aside_non_link(self.root)
            if aside is not None:
                self.say(f"{link} was not a symbolic link; moved to {aside.name}")
            latest.update_latest_pointer(checkpoint.path, self.root)
        except OSError as error:
            self._once(link, f"{link} not updated: {error}")

    def _keep_latest_live(self, listing: RunListing) -> None:
        """When the checkpoint ``ROOT/LATEST`` names was removed or holds no output any more, move ``LATEST`` to the
        newest output left (a checkpoint's or one under ``retained/``), or remove it when none is left."""
        from nemo_patch.engine.checkpoint_layout import is_marked_unfinished
        from nemo_patch.engine.output_layout import RETAINED_DIRNAME

        link = self.root / latest.LATEST_NAME
        try:
            if not link.is_symlink():
                return
            target = Path(os.path.normpath(self.root / os.readlink(link)))
            names = (self.output_name, "consolidated", "hf")
            if target.parent == self.root and target.is_dir() and not is_marked_unfinished(target):
                if any(self._is_complete(target, target / name) for name in names):
                    return
            elif target.parent == self.root / RETAINED_DIRNAME and any(self._order(target / n) for n in names):
                return
            left: List[Tuple[Any, Path]] = []
            for checkpoint in listing.finished:
                if checkpoint.path != target and self._is_complete(checkpoint.path, self._output(checkpoint)):
                    left.append((self._order(self._output(checkpoint)), checkpoint.path))
            retained = self.root / RETAINED_DIRNAME
            for entry in sorted(retained.iterdir()) if retained.is_dir() and not retained.is_symlink() else []:
                order = self._order(entry / self.output_name)
                if entry != target and order is not None and not entry.is_symlink():
                    left.append((order, entry))
            newest: Optional[Tuple[Any, Path]] = None
            for order, entry in left:
                if newest is None or (order is not None and latest.moves_forward(order, newest[0])):
                    newest = (order, entry)
            if newest is None:
                latest.remove_latest_pointer(self.root)
                self.say(f"LATEST removed: {target.name} was removed and no other consolidated output is left")
                return
            latest.update_latest_pointer(newest[1], self.root)
            self.say(f"LATEST moved from {target.name} to {os.path.relpath(newest[1], self.root)}: its checkpoint "
                     "was removed")  # fmt: skip
        except OSError as error:
            self._once(link, f"{link} not updated: {_one_line(error)}")

    # -- the loop ---------------------------------------------------------------------------------------------------

    def _check_layout(self, listing: RunListing) -> None:
        if listing.layout is None or self.layout is not None:
            return
        self.layout = listing.layout
        if self.layout == MEGATRON_LAYOUT and self.output_name != "consolidated":
            raise UnsupportedFormatError(
                f"{self.root} is a Megatron-LM / Megatron-Bridge save directory: --format hf exports NeMo 2 "
                "checkpoints only (take its safetensors output to Hugging Face with Megatron-Bridge's AutoBridge)"
            )
        if self.layout == MEGATRON_LAYOUT and self.policy.uses_best:
            raise UnsupportedFormatError(f"{self.root} is a Megatron-LM / Megatron-Bridge save directory: it records "
                                         "no monitored metric for a 'best' cadence")  # fmt: skip
        self.say(f"Watching {self.root} ({'NeMo 2' if self.layout == NEMO_LAYOUT else 'Megatron-LM'} layout), "
                 f"frequency {self.policy}")  # fmt: skip

    def scan(self) -> bool:
        """List the root once and consolidate what is due; ``True`` when something was due."""
        listing = list_run_checkpoints(self.root, self.layout)
        self._check_layout(listing)
        if not self._swept:
            self._swept = True
            self._remove_stale_staging()
        for path, why in listing.not_finished.items():
            if not why.startswith("unfinished"):
                self._once(path, f"skipped {path.name}: {why}")
        due = self.due(listing)
        for group in due:
            if self.stopping:
                break
            self._consolidate_group(group)
        if not self.stopping:
            self._keep_latest_live(listing if not due else list_run_checkpoints(self.root, self.layout))
        return bool(due)

    def _remove_stale_staging(self) -> None:
        """:func:`nemo_patch.engine.publish.remove_stale_tmp_dirs` in ``ROOT``; one line per removal."""
        from nemo_patch.engine.publish import remove_stale_tmp_dirs

        try:
            removed = remove_stale_tmp_dirs(self.root)
        except OSError as error:
            self._once(self.root, f"stale staging directories in {self.root} not removed: {_one_line(error)}")
            return
        for path in removed:
            self.say(f"Removed {path.name}: staging left by a watcher or consolidation that no longer runs")

    def _stop(self, signum: int, frame: Any) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.say(f"Stopping on {signal.Signals(signum).name}")
        if self._busy:
            raise WatchStopped

    def run(self) -> int:
        """Watch until idle or stopped; returns the exit code (0, or the last failed consolidation's)."""
        from nemo_patch.engine.errors import CheckpointNotFoundError
        from nemo_patch.runs.best_checkpoint import NoMonitoredMetricError

        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        appeared = self.root.is_dir()
        try:
            if not appeared:
                self.say(f"Waiting for {self.root} to appear")
            while not self.stopping:
                try:
                    appeared = appeared or self.root.is_dir()
                    busy = self.scan() if self.root.is_dir() else False
                except WatchStopped:
                    self.say("The output being written was abandoned; nothing half-written is published")
                    break
                except NoMonitoredMetricError as error:  # a "best" cadence for a run that records no metric
                    self._end_with(error)
                    break
                except OSError as error:  # EACCES, ESTALE, EIO on the root: said once, tried again next poll
                    self._once(self.root, f"cannot list {self.root} now: {_one_line(error)}; trying again")
                    busy = False
                idle = time.monotonic() - self._last_finished
                if self.until_idle is not None and not busy and idle >= self.until_idle:
                    if not appeared:
                        never = f"{self.root} never appeared in {self.until_idle:g} s (--until-idle): a mistyped root?"
                        self._end_with(CheckpointNotFoundError(never))
                    elif self._no_best is not None:
                        self._end_with(self._no_best)  # a "best" cadence that never found a best checkpoint
                    break
                deadline = time.monotonic() + self.poll_interval
                while not self.stopping and time.monotonic() < deadline:
                    time.sleep(min(0.2, self.poll_interval))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        tally = self.tally
        self.say(
            f"Watched {self.root} for {time.monotonic() - tally.started:.0f} s: {tally.consolidated} consolidated "
            f"({human_size(tally.bytes)}), {len(tally.already_done)} already done, {tally.linked} linked, "
            f"{tally.removed} removed while read, {tally.failed} failed"
        )
        return tally.exit_code

    def _end_with(self, error: ConsolidationError) -> None:
        """The watch ends with ``error``: one ``error:`` line, and its exit code."""
        self.say(f"error: {_one_line(error)} (exit code {error.exit_code})")
        self.tally.exit_code = error.exit_code


# -- the command line -------------------------------------------------------------------------------------------------

#: Options (argparse's names) of a one-checkpoint run that mean nothing to the watcher.
ONE_CHECKPOINT_OPTIONS = ("out", "best", "force", "allow_unfinished", "merge_adapters", "base_checkpoint")


def given_options(args: argparse.Namespace, names: Iterable[str]) -> List[str]:
    """The flags (``--base-checkpoint``) of the options ``names`` (argparse's ``dest``) given on the command line."""
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name, None) not in (None, False)]


def add_watch_options(parser: argparse.ArgumentParser) -> None:
    """``--watch``, ``--frequency``, ``--until-idle`` and ``--poll-interval`` (the ``watch`` group)."""
    group = parser.add_argument_group("watch", "consolidate a run's checkpoints as they finish (a sidecar)")
    group.add_argument("--watch", action="store_true", help="path is a NeMo 2 checkpoint root or a Megatron-LM / "
                       "Megatron-Bridge save directory: consolidate its checkpoints as they finish, until stopped "
                       "(SIGTERM, SIGINT) or --until-idle")  # fmt: skip
    group.add_argument("--frequency", default=None, metavar="FREQ", help="with --watch: which finished checkpoints "
                       "(ckpt_consolidation_frequency's values: each, every_n:<k>, latest, best, phases; default "
                       "each)")  # fmt: skip
    group.add_argument("--until-idle", type=positive_seconds, default=None, metavar="SECONDS", help="with --watch: "
                       "exit once no checkpoint has finished for SECONDS and nothing is due")  # fmt: skip
    group.add_argument("--poll-interval", type=positive_seconds, default=None, metavar="SECONDS",
                       help="with --watch: seconds between listings of the root (default 10)")  # fmt: skip


def positive_seconds(value: str) -> float:
    """argparse's ``type=`` for a number of seconds > 0 (finite); a usage error names the value otherwise."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if 0 < seconds < float("inf"):
        return seconds
    raise argparse.ArgumentTypeError(f"Invalid number of seconds {value!r}: expected a number > 0.")


def check_watch_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Optional[ConsolidationPolicy]:
    """The parsed ``--frequency`` with ``--watch`` (``None`` without it); a usage error (exit 2) for watch options
    without ``--watch``, one-checkpoint options with it, or an invalid frequency."""
    from nemo_patch.training.policy import parse_consolidation_frequency

    if not args.watch:
        if given := given_options(args, ("frequency", "until_idle", "poll_interval")):
            parser.error(f"{', '.join(given)} only with --watch")
        return None
    if given := given_options(args, ONE_CHECKPOINT_OPTIONS):
        parser.error(f"--watch consolidates each checkpoint into its own directory: {', '.join(given)} cannot be used")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        parser.error("--watch runs as one process: do not launch it with torchrun or srun on several ranks")
    try:
        return parse_consolidation_frequency("each" if args.frequency is None else args.frequency)
    except ValueError as error:
        parser.error(str(error).replace("ckpt_consolidation_frequency", "--frequency"))


def _consolidator(args: argparse.Namespace, write_output: Callable[..., Any]) -> Consolidate:
    """The function that writes one checkpoint's output with ``write_output``
    (:func:`nemo_patch.cli.nemo_consolidate.write_output`: the command line's output options)."""
    from nemo_patch.cli.progress import progress_bar

    def consolidate(
        checkpoint: RunCheckpoint, output: Path, staging: Path, before_publish: Callable[[], None]
    ) -> "tuple[int, int]":
        log = not args.quiet and not sys.stderr.isatty()  # a job log: a progress line every --progress-interval
        progress, _ = progress_bar(log, sys.stderr, args.progress_interval, checkpoint.path.name)
        result = write_output(args, checkpoint.path, output, overwrite=True, global_step=checkpoint.global_step,
                              staging_dir=staging, before_publish=before_publish, progress=progress)  # fmt: skip
        return result.tensor_count, result.total_bytes

    return consolidate


def _post_command(args: argparse.Namespace) -> Optional[Callable[[RunCheckpoint, Path], Optional[int]]]:
    if args.post_command is None:
        return None
    from nemo_patch.runs.post_command import PostCommandError, run_post_command

    def run(checkpoint: RunCheckpoint, output: Path) -> Optional[int]:
        done = run_post_command(args.post_command, output, args.format, checkpoint.global_step, checkpoint.path,
                                timeout=args.post_command_timeout)  # fmt: skip
        print(_printable(f"Post command for {checkpoint.path.name}: {done.describe()}"), flush=True)
        return None if done.ok else PostCommandError.exit_code

    return run


def run_watch(args: argparse.Namespace, policy: ConsolidationPolicy, write_output: Callable[..., Any]) -> int:
    """``nemo-consolidate --watch``: returns the exit code (docs/sidecar.md)."""
    from nemo_patch.engine.output_target import refuse_remote
    from nemo_patch.runs.checkpoint_root import checkpoint_root

    try:
        refuse_remote(args.path, "the checkpoint root")  # exit 19: a URL would be watched as a local directory
        watcher = Watcher(
            root=Path(os.path.abspath(checkpoint_root(args.path) if Path(args.path).is_dir() else args.path)),
            policy=policy,
            consolidate=_consolidator(args, write_output),
            output_name="hf" if args.format == "hf" else "consolidated",
            until_idle=args.until_idle,
            poll_interval=10.0 if args.poll_interval is None else args.poll_interval,
            best=(args.monitor, args.mode),
            after_publish=_post_command(args),
        )
        return watcher.run()
    except ConsolidationError as error:
        print(f"nemo-consolidate: error: {error}", file=sys.stderr)
        return error.exit_code
