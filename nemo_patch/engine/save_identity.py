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

"""Which save a checkpoint holds: one identity for every layout the engine reads, owned here.

A checkpoint's name and global step do not say which save it holds: NeMo saves again under one name (a second
``fit``, ``-last`` copies), megatron-core rewrites ``iter_<N>`` in place (a rollback) and writes ``.metadata`` last,
and every zarr save writes a byte-identical ``metadata.json``. A :class:`SaveIdentity`'s ``fingerprint`` differs
between any two saves: it hashes the digest of the file the format writes last (``.metadata``, or ``metadata.json``
for ``zarr``) with the name, size, inode, ``st_mtime_ns`` and ``st_ctime_ns`` of every file of the weights (a
rewritten file gets new times, a replaced one a new inode, and no writer can set ``st_ctime_ns``; the device number
is left out: it differs between mounts). A save is visibly in progress when a shard or chunk file is newer than the
last-written file (as is a copy made without keeping times: ``cp -r``).

The identity is read before and after a consolidation reads the checkpoint (:func:`check_unchanged`) and recorded in
every output's ``metadata.json`` as ``"save"``. ``run`` is the run id the consolidation callback stored in
``weights/common.pt`` (:func:`read_common_state`), else ``None``.

Imports the standard library and the engine's errors, layout and safe-file helpers; torch only when ``common.pt`` is
read.
"""

import hashlib
import json
import logging
import os
import pathlib
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Tuple, Union, cast

from nemo_patch.engine.errors import ConsolidationError, CorruptShardError, UnfinishedCheckpointError

__all__ = [
    "saved_again_error",
    "saved_again_instead",
    "SaveIdentity",
    "check_unchanged",
    "in_progress",
    "is_save_changed",
    "order_key",
    "recorded_identity",
    "save_identity",
    "global_step_in_name",
    "global_step_of",
    "read_common_state",
]

#: ``SaveIdentity.layout`` values.
TORCH_DIST, ZARR, MEGATRON_LM = "torch_dist", "zarr", "megatron_lm"
_LAYOUTS = (TORCH_DIST, ZARR, MEGATRON_LM)
#: The largest last-written file hashed (as ``digests.source_fingerprint`` allowed): 1 GiB.
_MAX_LAST_BYTES = 1 << 30
#: What a run id may be (as ``training/callback.py`` accepts one).
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_ITERATION = re.compile(r"^iter_[0-9]{7,18}$")
_HEX = re.compile(r"[0-9a-f]{64}")
#: The top-level files of a DCP (torch_dist) save that are its weights (besides ``*.distcp``).
_DCP_FILES = (".metadata", "common.pt", "metadata.json")
_ZARR_FILES = ("common.pt", "metadata.json")
#: The last-written files' digests by (path, size, inode, mtime_ns, ctime_ns): a watcher asks again at every poll, and
#: a file rewritten or replaced has another change time or inode.
_DIGESTS: Dict[Tuple[Any, ...], str] = {}
_DIGESTS_KEPT = 4096
#: The largest ``common.pt`` read (megatron-core's holds a few MB of non-tensor state).
MAX_COMMON_BYTES = 1 << 30
#: NeMo's ``ModelCheckpoint`` names: ``step=<N>`` with ``N`` the global step - 1.
_STEP_IN_NAME = re.compile(r"step=([0-9]+)")
logger = logging.getLogger(__name__)


def saved_again_error(message: str) -> CorruptShardError:
    """A :class:`~.errors.CorruptShardError` (one class per exit code) for a checkpoint saved again while it was read,
    marked ``save_changed`` (:func:`is_save_changed`)."""
    error = CorruptShardError(message)
    error.save_changed = True  # type: ignore[attr-defined]
    return error


def is_save_changed(error: BaseException) -> bool:
    """Whether ``error`` says that the checkpoint was saved again while it was read (:func:`saved_again_error`)."""
    return bool(getattr(error, "save_changed", False))


@dataclass(frozen=True)
class SaveIdentity:
    """Which save of a checkpoint: its layout, run, global step, fingerprint and when it finished.

    Attributes:
        layout: ``"torch_dist"`` (NeMo), ``"zarr"`` (NeMo ``save_ckpt_format='zarr'``) or ``"megatron_lm"``
            (Megatron-LM / Megatron-Bridge ``iter_<N>``).
        run: the training run's id the checkpoint records (the callback's state ``"run_id"``), or ``None``.
        global_step: the global step (NeMo: ``step=<N>`` in the name, else ``common.pt``; Megatron-LM: ``N``), or
            ``None`` when unknown.
        fingerprint: 64 hex digits (sha256) that differ between any two saves (see the module docstring).
        finished_ns: ``st_mtime_ns`` of the file the format writes last (0 when it is missing, only with
            ``allow_unfinished``): an order for saves whose run is unknown.
    """

    layout: str
    run: Optional[str]
    global_step: Optional[int]
    fingerprint: str
    finished_ns: int

    def as_json(self) -> Dict[str, Any]:
        """The identity as ``metadata.json`` records it under ``"save"``."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "SaveIdentity":
        """The identity :meth:`as_json` gave.

        Raises:
            ValueError: ``data`` is not such an object (a field missing or of another type).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a save identity is a JSON object, not {type(data).__name__}")
        layout, run, step = data.get("layout"), data.get("run"), data.get("global_step")
        fingerprint, finished = data.get("fingerprint"), data.get("finished_ns")
        if layout not in _LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}")
        if run is not None and not (isinstance(run, str) and _RUN_ID.fullmatch(run)):
            raise ValueError(f"malformed run {run!r}")
        if step is not None and not (type(step) is int and step >= 0):
            raise ValueError(f"malformed global_step {step!r}")
        if not (isinstance(fingerprint, str) and _HEX.fullmatch(fingerprint)):
            raise ValueError(f"malformed fingerprint {fingerprint!r}")
        if not (type(finished) is int and finished >= 0):
            raise ValueError(f"malformed finished_ns {finished!r}")
        return cls(layout, run, step, fingerprint, finished)

    def same_save(self, other: Optional["SaveIdentity"]) -> bool:
        """Whether ``other`` is the same save (same fingerprint and layout)."""
        return other is not None and (self.layout, self.fingerprint) == (other.layout, other.fingerprint)


def _weights_dir(path: Path) -> Tuple[Path, Path]:
    """(checkpoint directory, weights directory) of a checkpoint, its ``weights/``, or an ``iter_<N>``."""
    if stat.S_ISDIR(_lstat_mode(path / "weights")):
        return path, path / "weights"
    if path.name == "weights" and path.parent.name != "":
        return path.parent, path
    return path, path


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _backend(weights_dir: Path) -> str:
    from nemo_patch.engine.checkpoint_layout import _json

    return str(_json(weights_dir / "metadata.json").get("sharded_backend", "torch_dist"))


def _key(relative: str, status: os.stat_result) -> List[Any]:
    return [relative, status.st_size, status.st_ino, status.st_mtime_ns, status.st_ctime_ns]


def _files(weights_dir: Path, zarr: bool) -> Tuple[List[List[Any]], int]:
    """Every file of the weights as ``[name, size, inode, mtime_ns, ctime_ns]`` (sorted), and the newest
    ``st_mtime_ns`` of a shard or chunk file (0 when none).

    A symbolic link is recorded as itself and as the file it names (the readers decide whether it may be read).

    Raises:
        CorruptShardError: ``weights_dir`` cannot be listed.
    """
    entries: List[List[Any]] = []
    newest = 0
    try:
        with os.scandir(weights_dir) as found:
            top = sorted(found, key=lambda entry: entry.name)
        for entry in top:
            status = entry.stat(follow_symlinks=False)
            if not zarr and (entry.name in _DCP_FILES or entry.name.endswith(".distcp")):
                status = _add(entries, entry.name, entry.path, status)
                if entry.name.endswith(".distcp"):
                    newest = max(newest, status.st_mtime_ns)
            elif zarr and entry.name in _ZARR_FILES:
                _add(entries, entry.name, entry.path, status)
            elif zarr and stat.S_ISDIR(status.st_mode) and os.path.lexists(os.path.join(entry.path, ".zarray")):
                newest = max(newest, _array_files(Path(entry.path), entry.name, entries))
            elif zarr and stat.S_ISLNK(status.st_mode):  # a linked array: the zarr reader refuses it
                _add(entries, entry.name, entry.path, status)
    except OSError as error:
        raise CorruptShardError(f"Cannot list the files of {weights_dir}: {error}") from error
    return sorted(entries), newest


def _add(entries: List[List[Any]], name: str, path: str, status: os.stat_result) -> os.stat_result:
    """Record a file (a link: itself, and the file it names when there is one); the status of what it names."""
    entries.append(_key(name, status))
    if stat.S_ISLNK(status.st_mode):
        try:
            status = os.stat(path)
        except OSError:
            return status
        entries.append(_key(f"{name} ->", status))
    return status


def _array_files(directory: Path, relative: str, entries: List[List[Any]]) -> int:
    """Add every file under a zarr array directory (not following links) to ``entries``; the newest chunk mtime."""
    newest = 0
    with os.scandir(directory) as found:
        for entry in sorted(found, key=lambda entry: entry.name):
            status = entry.stat(follow_symlinks=False)
            name = f"{relative}/{entry.name}"
            if stat.S_ISDIR(status.st_mode):  # dimension_separator "/": chunk files in nested directories
                newest = max(newest, _array_files(Path(entry.path), name, entries))
                continue
            entries.append(_key(name, status))
            if entry.name != ".zarray":
                newest = max(newest, status.st_mtime_ns)
    return newest


def global_step_in_name(name: str) -> Optional[int]:
    """The global step of a checkpoint from NeMo's ``step=<N>`` in its name (``N`` is the global step - 1), or
    ``None`` when the name has none."""
    match = _STEP_IN_NAME.search(name)
    return int(match.group(1)) + 1 if match else None


def read_common_state(checkpoint_dir: Path) -> Optional[Dict[str, Any]]:
    """The state Lightning stored in a NeMo 2 checkpoint's ``weights/common.pt`` (``global_step``, ``callbacks``, ...),
    or ``None`` when there is none or it cannot be read safely: ``torch.load(weights_only=True)`` allowing ``pathlib``
    paths only, of a regular file of at most :data:`MAX_COMMON_BYTES` bytes whose zip members are checked first."""
    import torch

    from nemo_patch.engine.record_checks import open_record
    from nemo_patch.engine.safe_files import open_regular

    common = checkpoint_dir / "weights" / "common.pt"
    try:
        with (
            open_regular(common) as handle,
            torch.serialization.safe_globals([pathlib.PosixPath, pathlib.WindowsPath]),
        ):
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_COMMON_BYTES:
                raise OSError(f"{common} is larger than {MAX_COMMON_BYTES} bytes")
            # members checked first (uncompressed, inside the file, sharing no data) so that what torch.load
            # allocates is bounded by the file's size; their CRC-32 on the way
            window, finish = open_record(handle, 0, size, str(common))
            payload = torch.load(cast(IO[bytes], window), map_location="cpu", weights_only=True)
            finish()
    except Exception as error:  # missing, or needs a class we do not unpickle
        logger.debug("Not reading %s: %s", common, error)
        return None
    return payload if isinstance(payload, dict) else None


def _run_of(checkpoint_dir: Path) -> Optional[str]:
    """The run id the consolidation callback stored in ``weights/common.pt``, or ``None``."""
    payload = read_common_state(checkpoint_dir)
    callbacks = payload.get("callbacks") if payload is not None else None
    for key, state in (callbacks if isinstance(callbacks, dict) else {}).items():
        if isinstance(key, str) and key.startswith("ConsolidationCallback") and isinstance(state, dict):
            run = state.get("run_id")
            if isinstance(run, str) and _RUN_ID.fullmatch(run):
                return run
    return None


def global_step_of(checkpoint_dir: Path, megatron_lm: bool = False) -> Optional[int]:
    """The global step of the save in ``checkpoint_dir`` (the one rule of every caller): ``N`` of a Megatron-LM
    ``iter_<N>`` (``megatron_lm``); else ``M + 1`` for NeMo's ``step=<M>`` in its name; else ``global_step`` in its
    ``weights/common.pt`` (a renamed checkpoint); else ``None``."""
    if megatron_lm:
        return int(checkpoint_dir.name[len("iter_") :])
    step = global_step_in_name(checkpoint_dir.name)
    if step is None:
        step = (read_common_state(checkpoint_dir) or {}).get("global_step")
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
    return step


def _read_identity(checkpoint_dir: Path, read_run: bool) -> Tuple[SaveIdentity, Optional[str]]:
    """The identity of what ``checkpoint_dir`` holds now, and why its save is unfinished (``None``: finished)."""
    from nemo_patch.engine.safe_files import read_regular_file

    checkpoint_dir, weights_dir = _weights_dir(checkpoint_dir)
    zarr = _backend(weights_dir) == "zarr"
    if zarr:
        layout = ZARR
    elif weights_dir == checkpoint_dir and _ITERATION.match(checkpoint_dir.name):
        layout = MEGATRON_LM
    else:
        layout = TORCH_DIST
    last = weights_dir / ("metadata.json" if zarr else ".metadata")
    files, newest = _files(weights_dir, zarr)
    digest, finished, unfinished = "", 0, None
    try:
        status = os.lstat(last)
        digest = _DIGESTS.get((str(last), *_key("", status)), "")
        if not digest:
            data = read_regular_file(last, _MAX_LAST_BYTES)
            after = os.lstat(last)
            if _key("", status) != _key("", after):
                raise saved_again_error(f"{last} changed while it was read: {checkpoint_dir} is being saved again")
            digest = hashlib.sha256(data).hexdigest()
            if len(_DIGESTS) >= _DIGESTS_KEPT:
                _DIGESTS.clear()
            _DIGESTS[(str(last), *_key("", status))] = digest
    except FileNotFoundError:
        unfinished = f"{checkpoint_dir} is an unfinished checkpoint (no '{last.name}'): its save never ended"
    except OSError as error:
        raise CorruptShardError(f"Cannot read {last}: {error}") from error
    else:
        finished = status.st_mtime_ns
        if newest > finished:
            unfinished = (
                f"{checkpoint_dir} is being saved (a {'chunk' if zarr else 'shard'} file is newer than "
                f"'{last.name}', which its format writes last): it is consolidated once the save finishes (a copy "
                "made without keeping times looks the same: copy with 'cp -a')"
            )
    text = json.dumps([layout, last.name, digest, files], separators=(",", ":"))
    fingerprint = hashlib.sha256(text.encode()).hexdigest()
    run = _run_of(checkpoint_dir) if read_run and layout != MEGATRON_LM else None
    return (
        SaveIdentity(layout, run, global_step_of(checkpoint_dir, layout == MEGATRON_LM), fingerprint, finished),
        unfinished,
    )


def in_progress(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """Why the save ``checkpoint_dir`` holds is visibly unfinished (no last-written file, or a shard or chunk file
    newer than it), or ``None`` (also when it cannot be read: its reader says more)."""
    try:
        return _read_identity(Path(checkpoint_dir), read_run=False)[1]
    except CorruptShardError:
        return None


def save_identity(
    checkpoint_dir: Union[str, Path], allow_unfinished: bool = False, read_run: bool = True
) -> SaveIdentity:
    """The identity of the save a checkpoint holds now.

    Args:
        checkpoint_dir: a NeMo checkpoint (``<ckpt>/`` or its ``weights/``, ``torch_dist`` or ``zarr``), or a
            Megatron-LM / Megatron-Bridge ``iter_<N>`` directory.
        allow_unfinished: give the identity of what is there even when the save is unfinished (no last-written file,
            or a shard newer than it).
        read_run: read the run id from ``common.pt`` (``False``: ``run`` is ``None``; the fingerprint is the same).

    Returns:
        A :class:`SaveIdentity`.

    Raises:
        UnfinishedCheckpointError: the file the format writes last is missing, or a shard or chunk file is newer.
        CorruptShardError: the last-written file cannot be read (not a regular file, over 1 GiB), or the weights
            directory cannot be listed; a :func:`saved_again_error` when the last-written file changed while read.
    """
    identity, unfinished = _read_identity(Path(checkpoint_dir), read_run)
    if unfinished is not None and not allow_unfinished:
        raise UnfinishedCheckpointError(unfinished)
    return identity


def check_unchanged(
    checkpoint_dir: Union[str, Path], before: SaveIdentity, allow_unfinished: bool = False
) -> SaveIdentity:
    """Check, once a checkpoint has been read, that it still holds the save ``before`` (its identity before it was
    read) and that this save is finished.

    Args:
        checkpoint_dir: the checkpoint ``before`` was read from.
        before: :func:`save_identity` (``allow_unfinished=True``: the reader names a damaged shard first) taken
            before the checkpoint was read.
        allow_unfinished: accept a save that is visibly in progress, if it did not change.

    Returns:
        ``before``.

    Raises:
        CorruptShardError: it holds another save now: it was saved again while it was read (the message names it;
            :func:`is_save_changed` is true of it).
        UnfinishedCheckpointError: the same save, visibly in progress (a shard newer than the last-written file).
    """
    now, unfinished = _read_identity(Path(checkpoint_dir), read_run=False)
    if not now.same_save(before):
        raise saved_again_error(
            f"{checkpoint_dir} was saved again while it was read (its save identity changed); nothing published"
        )
    if unfinished is not None and not allow_unfinished:
        raise UnfinishedCheckpointError(unfinished)
    return before


def saved_again_instead(
    checkpoint_dir: Union[str, Path], before: SaveIdentity, error: BaseException
) -> Optional[CorruptShardError]:
    """What to raise instead of ``error``, a failure while reading the save ``before``: a :func:`saved_again_error`
    when the checkpoint holds another save now (the cause to report, which a sidecar retries), else ``None``.

    Args:
        checkpoint_dir: the checkpoint that was being read.
        before: its :func:`save_identity`, taken before it was read.
        error: what the read raised.
    """
    if is_save_changed(error):
        return None
    try:
        check_unchanged(checkpoint_dir, before, allow_unfinished=True)
    except CorruptShardError as changed:
        return changed if is_save_changed(changed) else None
    except (ConsolidationError, OSError):
        return None
    return None


def recorded_identity(output_dir: Union[str, Path]) -> Optional[SaveIdentity]:
    """The identity an output's ``metadata.json`` records under ``"save"``, or ``None`` when it records none, or it
    is missing, not a regular file, or malformed."""
    from nemo_patch.engine.safe_files import read_json_file

    try:
        manifest = read_json_file(Path(output_dir) / "metadata.json")
        return SaveIdentity.from_json(manifest.get("save") if isinstance(manifest, dict) else None)
    except (OSError, ValueError):
        return None


def order_key(identity: SaveIdentity, fit: int = 0) -> Tuple[Any, ...]:
    """The order ``LATEST`` and ``BEST`` move in: (run, fit, global step); run ids start with the run's UTC start time
    (``20261202T162711Z-3f9a1c0d``). A save of an unknown run sorts before every known run, by ``finished_ns``."""
    step = -1 if identity.global_step is None else identity.global_step
    if identity.run is None:
        return ("", fit, identity.finished_ns, step)
    return (identity.run, fit, step, identity.finished_ns)
