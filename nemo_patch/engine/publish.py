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

"""Publish a consolidation's output all at once, and clean up what a killed one left behind.

A hidden temporary directory (:func:`staged_output`), locked by its creator for its whole life (:func:`make_tmp_dir`),
is renamed to the output's name when complete (:func:`publish_dir`), so a reader sees either no output or a complete
one; what a killed process left is a temporary directory whose lock nobody holds (:func:`remove_stale_tmp_dirs`).
"""

import contextlib
import errno
import functools
import logging
import os
import re
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Union

from torch.distributed.checkpoint.api import CheckpointException

from nemo_patch.engine.errors import ConsolidationError, OutputExistsError
from nemo_patch.engine.output_target import describe_entry, is_replaceable_output

__all__ = [
    "LOCKLESS_STALE_SECONDS",
    "TMP_LOCK_NAME",
    "TMP_PREFIX",
    "fsync_dir",
    "link_output",
    "make_tmp_dir",
    "publish_dir",
    "remove_stale_tmp_dirs",
    "remove_tmp_dir",
    "staged_output",
    "tmp_dirs_of",
]

logger = logging.getLogger(__name__)

#: Prefix of temporary output directories; they are never visible under the final name.
TMP_PREFIX = ".consolidated.tmp-"
_TMP_NAME = re.compile(r"^\.consolidated\.tmp-(?:[a-z]+-)?(?P<pid>\d+)-[0-9a-f]+(?:@(?P<host>.*))?$")
#: The lock file in a temporary directory; its creator holds ``flock(LOCK_EX)`` on it while the directory is in use.
TMP_LOCK_NAME = ".consolidation.lock"
#: Age (seconds since the last change of its entries) after which a temporary directory without a lock file is stale.
LOCKLESS_STALE_SECONDS = 15 * 60

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)
_NOFOLLOW_CLOEXEC = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)  # POSIX only

_held: Dict[str, int] = {}  # temporary directory -> the descriptor holding its lock
_held_guard = threading.Lock()


def _host() -> str:
    return socket.gethostname() or "localhost"


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock_now(fd: int) -> None:
    """Take an exclusive ``flock`` on ``fd`` without waiting; ``OSError`` when another process holds it, or there is
    no ``flock`` here (``ENOTSUP`` without ``fcntl``, which Windows lacks)."""
    try:
        if os.name != "posix":
            raise ImportError(f"no fcntl on {sys.platform}")
        import fcntl
    except ImportError as error:
        raise OSError(errno.ENOTSUP, f"no flock here: {error}") from error
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def make_tmp_dir(parent: Path, kind: str = "") -> Path:
    """Create a hidden, uniquely named directory in ``parent`` (permissions follow the umask), holding its lock.

    The lock (``flock(LOCK_EX)`` on :data:`TMP_LOCK_NAME` in it; forked writers share it) is held until the directory
    is published (:func:`publish_dir`) or removed (:func:`remove_tmp_dir`). Where the filesystem has no ``flock`` no
    lock file is kept, and the directory is protected by its age.

    Raises:
        OSError: if ``parent`` cannot be written.
    """
    path = Path(parent) / f"{TMP_PREFIX}{kind}{os.getpid()}-{uuid.uuid4().hex[:12]}@{_host()}"
    path.mkdir()
    lock = path / TMP_LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW_CLOEXEC, 0o666)
    except OSError as error:
        logger.debug("No lock file in %s: %s", path, error)
        return path
    try:
        _lock_now(fd)
    except OSError as error:  # no flock here: a lock file nobody holds would read as stale
        os.close(fd)
        lock.unlink(missing_ok=True)
        logger.debug("Cannot lock %s (%s); it is protected by its age instead", lock, error)
        return path
    with _held_guard:
        _held[str(path)] = fd
    return path


def _release(path: Path) -> None:
    """Close the descriptor holding ``path``'s lock (never ``LOCK_UN``: a forked writer may share it)."""
    with _held_guard:
        fd = _held.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def remove_tmp_dir(path: Path) -> None:
    """Remove a temporary directory of :func:`make_tmp_dir` and its contents, then release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    _release(path)


@functools.lru_cache(maxsize=None)
def _libc_renameat2() -> Any:
    """libc's ``renameat2`` (glibc 2.28 and later), or ``None`` (off Linux, or an older libc); imports ``ctypes``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (ImportError, OSError, AttributeError):  # a Python built without ctypes, or no such symbol
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """``renameat2(AT_FDCWD, source, AT_FDCWD, target, flags)``; ``False`` where libc, the kernel or the filesystem
    lacks it or the flag, so the caller falls back; any other failure raises its ``OSError``."""
    function = _libc_renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    import ctypes  # loaded already: _libc_renameat2 found the function through it

    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(source), None, str(target))


def publish_dir(tmp_dir: Path, output_dir: Path, overwrite: bool = True) -> None:
    """Rename ``tmp_dir`` to ``output_dir``, then release ``tmp_dir``'s lock.

    An existing ``output_dir`` is replaced only when it is a previous output of this package or an empty directory
    (:func:`.output_target.is_replaceable_output`): where ``renameat2(RENAME_EXCHANGE)`` works (Linux 3.15+ on ext4,
    XFS, Btrfs, tmpfs, ...) the two names are exchanged atomically and the old output removed; elsewhere (NFS, some
    FUSE filesystems) the old output is moved into a temporary directory first (moved back if the second rename
    fails), so for microseconds nothing is under ``output_dir``'s name.

    Args:
        tmp_dir: the complete output, on ``output_dir``'s filesystem (from :func:`make_tmp_dir`).
        output_dir: the final name.
        overwrite: if ``False``, an existing ``output_dir`` raises :class:`FileExistsError` instead.

    Raises:
        FileExistsError: ``output_dir`` exists and ``overwrite`` is ``False``, or it is something this function does
            not replace (the message says what is there).
        OSError: if the rename fails.
    """
    tmp_dir, output_dir = Path(tmp_dir), Path(output_dir)
    exists = os.path.lexists(output_dir)
    if exists and not overwrite:
        raise FileExistsError(f"{output_dir} exists")
    if exists and not is_replaceable_output(output_dir):
        raise FileExistsError(
            f"{output_dir}: it is {describe_entry(output_dir)}; only a previous output or an empty directory is "
            "replaced"
        )
    (tmp_dir / TMP_LOCK_NAME).unlink(missing_ok=True)  # not part of the output; the lock stays held until published
    old = None
    if not exists:
        if overwrite or not _renameat2(tmp_dir, output_dir, _RENAME_NOREPLACE):
            os.replace(tmp_dir, output_dir)
    elif _renameat2(tmp_dir, output_dir, _RENAME_EXCHANGE):
        old = tmp_dir  # now holds the previous output
    else:
        old = make_tmp_dir(output_dir.parent, "old-")
        try:
            os.replace(output_dir, old / output_dir.name)
        except BaseException:
            remove_tmp_dir(old)
            raise
        try:
            os.replace(tmp_dir, output_dir)
        except BaseException:
            try:
                os.replace(old / output_dir.name, output_dir)
            except OSError:
                logger.error("Could not put the previous %s back; it is in %s", output_dir, old / output_dir.name)
                (old / TMP_LOCK_NAME).unlink(missing_ok=True)  # kept for LOCKLESS_STALE_SECONDS at least
                _release(old)
                raise
            remove_tmp_dir(old)
            raise
    fsync_dir(output_dir.parent)
    _release(tmp_dir)
    if old is not None:
        remove_tmp_dir(old)


def _pid_of(path: Path) -> Optional[int]:
    """The process id a temporary entry's name holds, if it is one of this host's."""
    match = _TMP_NAME.match(path.name)
    return int(match.group("pid")) if match and match.group("host") in (None, _host()) else None


def tmp_dirs_of(parent: Path, pid: int) -> List[Path]:
    """The temporary entries in ``parent`` made by process ``pid`` of this host."""
    return [path for path in Path(parent).glob(f"{TMP_PREFIX}*") if _pid_of(path) == pid]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lockless_stale(path: Path, pid: int) -> bool:
    """A temporary entry without a lock file: stale when unchanged for :data:`LOCKLESS_STALE_SECONDS` and its process
    does not run here."""
    try:
        age = time.time() - os.lstat(path).st_mtime
    except OSError:
        return False
    return age >= LOCKLESS_STALE_SECONDS and not _alive(pid)


def _open_lock(lock: Path) -> Optional[int]:
    """A descriptor of ``lock``; ``-1`` when there is no such file, ``None`` when it cannot be opened."""
    for flags in (os.O_RDWR, os.O_RDONLY):  # write access, for filesystems that emulate flock with fcntl locks
        try:
            return os.open(lock, flags | _NOFOLLOW_CLOEXEC)
        except FileNotFoundError:
            return -1
        except PermissionError:
            continue
        except OSError:
            return None
    return None


def _remove_if_stale(path: Path, pid: int) -> Optional[str]:
    """Remove ``path`` if no process uses it; returns why it was stale, or ``None`` if it was kept."""
    if path.is_symlink() or not path.is_dir():
        if not _lockless_stale(path, pid):
            return None
        path.unlink(missing_ok=True)
        return "an old entry of a process that no longer runs"
    lock = path / TMP_LOCK_NAME
    fd = _open_lock(lock)
    if fd is None:
        return None
    if fd == -1:
        if not _lockless_stale(path, pid):
            return None
        shutil.rmtree(path, ignore_errors=True)
        return f"without a lock file, unchanged for {LOCKLESS_STALE_SECONDS // 60} minutes, process {pid} gone"
    try:
        try:
            _lock_now(fd)
        except OSError:  # held: in use (or locks do not work here: kept, as unknown)
            return None
        try:
            opened, current = os.fstat(fd), os.stat(lock, follow_symlinks=False)
        except OSError:  # unlinked meanwhile: being published
            return None
        if (opened.st_dev, opened.st_ino) != (current.st_dev, current.st_ino):
            return None
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return "its lock is held by no process"


def remove_stale_tmp_dirs(parent: Path, keep_pid: Optional[int] = None) -> List[Path]:
    """Remove temporary output in ``parent`` that no running process uses.

    A temporary directory is removed when its lock (:data:`TMP_LOCK_NAME`) can be taken at once: its creator and the
    writers that inherited the lock are gone (no process id decides that: they mislead across PID namespaces). One
    without a lock file is removed only when unchanged for :data:`LOCKLESS_STALE_SECONDS` and its name names a
    process that does not run here. Entries of another host (locks may not be seen across hosts) or of ``keep_pid``
    (NFS emulates ``flock`` with ``fcntl`` locks, which do not exclude their holder) are left alone.

    Args:
        parent: a checkpoint directory (the parent of ``consolidated/``).
        keep_pid: a process whose entries are never removed (default: this one).

    Returns:
        The removed paths.
    """
    keep_pid = os.getpid() if keep_pid is None else keep_pid
    removed: List[Path] = []
    try:
        entries = list(Path(parent).glob(f"{TMP_PREFIX}*"))
    except OSError:
        return removed
    for path in entries:
        pid = _pid_of(path)
        if pid is None or pid == keep_pid:
            continue
        why = _remove_if_stale(path, pid)
        if why is not None and not os.path.lexists(path):
            removed.append(path)
            logger.info("Removed %s, temporary output of a consolidation that no longer runs (%s)", path, why)
    return removed


def _make_output_parent(checkpoint_dir: Path, output_dir: Path) -> None:
    """Create ``output_dir``'s parent, never ``checkpoint_dir`` itself: ``FileNotFoundError`` when the output belongs
    inside it and it is gone (NeMo removed it meanwhile)."""
    checkpoint = Path(os.path.abspath(checkpoint_dir))
    parent = Path(os.path.abspath(output_dir.parent))
    if parent != checkpoint and checkpoint not in parent.parents:
        parent.mkdir(parents=True, exist_ok=True)
        return
    if not checkpoint.is_dir():
        raise FileNotFoundError(errno.ENOENT, "the checkpoint directory is gone (removed meanwhile?)", str(checkpoint))
    for directory in reversed([parent, *parent.parents][: len(parent.parts) - len(checkpoint.parts)]):
        directory.mkdir(exist_ok=True)  # no parents: fails if the checkpoint vanished meanwhile


@contextlib.contextmanager
def staged_output(
    checkpoint_dir: Path,
    output_dir: Path,
    overwrite: bool,
    failure: str,
    kind: str = "",
    staging_dir: Optional[Union[str, Path]] = None,
    before_publish: Optional[Callable[[], None]] = None,
) -> Iterator[Path]:
    """A hidden temporary directory next to ``output_dir`` (or in ``staging_dir``), published as ``output_dir`` when
    the block ends normally and removed when it does not (whatever the exception, Ctrl-C included). Temporary output
    that killed processes left there or in ``checkpoint_dir`` is removed first.

    Args:
        checkpoint_dir: the checkpoint being consolidated.
        output_dir: the final output directory.
        overwrite: replace an existing ``output_dir`` (only a previous output or an empty directory; as
            :func:`publish_dir` does) instead of raising :class:`OutputExistsError`.
        failure: how a failure message starts, e.g. ``"Consolidating <ckpt>"``.
        kind: a tag in the temporary name (``"hf-"``).
        staging_dir: where the temporary directory is made instead of ``output_dir``'s parent (on the same
            filesystem); the sidecar stages in the run's root, where a trainer removing the checkpoint never looks.
        before_publish: called right before the rename; what it raises is raised, and nothing is published.

    Raises:
        ConsolidationError: the output cannot be written (``OSError`` naming the directory), or any other error of the
            block, wrapped as ``"<failure> failed: <type>: <message>"``; a :class:`ConsolidationError` of the block
            passes unchanged.
        OutputExistsError: ``output_dir`` appeared meanwhile and ``overwrite`` is ``False``, or what is there is
            neither a previous output nor an empty directory (callers check that first:
            :func:`.output_target.check_output_target`).
    """
    try:
        _make_output_parent(checkpoint_dir, output_dir)
        staging = output_dir.parent if staging_dir is None else Path(staging_dir)
        for parent in {staging, checkpoint_dir}:
            remove_stale_tmp_dirs(parent)
        tmp_dir = make_tmp_dir(staging, kind)
    except OSError as error:
        raise ConsolidationError(
            f"Cannot write the output of {checkpoint_dir} in {output_dir.parent}: {error}"
        ) from error
    try:
        yield tmp_dir
        if before_publish is not None:
            before_publish()
        publish_dir(tmp_dir, output_dir, overwrite=overwrite)
    except BaseException as error:  # Ctrl-C included
        remove_tmp_dir(tmp_dir)
        # unchanged: the engine's own errors, and BaseExceptions other than DCP's CheckpointException
        if isinstance(error, ConsolidationError) or not isinstance(error, (Exception, CheckpointException)):
            raise
        if isinstance(error, FileExistsError) and overwrite:  # something appeared there that is not replaced
            raise OutputExistsError(f"Refusing to publish over {error}") from error
        if isinstance(error, FileExistsError):
            raise OutputExistsError(f"{output_dir} exists (overwrite it with --force)") from error
        raise ConsolidationError(f"{failure} failed: {type(error).__name__}: {error}") from error


def link_output(
    source_output: Union[str, Path],
    output_dir: Union[str, Path],
    replace_files: Optional[Mapping[str, bytes]] = None,
    staging_parent: Optional[Union[str, Path]] = None,
    before_publish: Optional[Callable[[], None]] = None,
) -> Path:
    """Publish ``output_dir`` with the same files as ``source_output``, without recomputing them.

    Files are hard-linked where the filesystem allows and copied otherwise (never through a symbolic link), into a
    staging directory then published with :func:`publish_dir`.

    Args:
        source_output: an existing output directory (regular files only).
        output_dir: the new output directory (its parent must exist).
        replace_files: file name -> bytes written (and fsynced) instead of linking that file of ``source_output``.
        staging_parent: where the staging directory is made, on ``output_dir``'s filesystem (default: its parent).
        before_publish: called right before the rename; what it raises publishes nothing.

    Returns:
        ``output_dir``.

    Raises:
        OSError: the files cannot be linked, copied or written, or ``source_output`` holds something else than a
            regular file (nothing is left behind); ``FileExistsError``: as :func:`publish_dir`.
    """
    source_output, output_dir = Path(source_output), Path(output_dir)
    replace_files = dict(replace_files or {})
    tmp_dir = make_tmp_dir(output_dir.parent if staging_parent is None else Path(staging_parent))
    try:
        for source in sorted(source_output.iterdir()):
            target = tmp_dir / source.name
            if source.name == TMP_LOCK_NAME:  # the staging directory holds its own
                continue
            if source.name in replace_files:
                with open(target, "xb") as handle:
                    handle.write(replace_files[source.name])
                    handle.flush()
                    os.fsync(handle.fileno())
                continue
            if not stat.S_ISREG(os.lstat(source).st_mode):
                raise OSError(errno.EINVAL, "not a regular file in the output", str(source))
            try:
                os.link(source, target, follow_symlinks=False)
            except OSError:
                shutil.copy2(source, target, follow_symlinks=False)
        if before_publish is not None:
            before_publish()
        publish_dir(tmp_dir, output_dir)
    except BaseException:
        remove_tmp_dir(tmp_dir)
        raise
    return output_dir
