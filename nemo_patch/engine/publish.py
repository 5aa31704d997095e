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

Output is written into a hidden temporary directory next to its final place, ``<parent>/.consolidated.tmp-<pid>-<id>@
<host>``, and renamed to its final name when complete (``os.replace`` of a directory is atomic on POSIX filesystems),
so a reader sees either no output directory or a complete one (:func:`staged_output` wraps a whole consolidation in
that). A process killed half-way (SIGKILL, node failure)
leaves its temporary directory; :func:`remove_stale_tmp_dirs` removes those whose process is gone, which the strategy
does when a fit starts and the CLI does before it consolidates a checkpoint.

Imports the standard library, torch (for DCP's exception type) and the engine's errors and names only; never NeMo,
Lightning or megatron-core, and nothing outside the engine.
"""

import contextlib
import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Iterator, List, Mapping, Optional, Union

from torch.distributed.checkpoint.api import CheckpointException

from nemo_patch.engine.errors import ConsolidationError, OutputExistsError
from nemo_patch.engine.output_layout import CONSOLIDATED_DIRNAME

__all__ = [
    "TMP_PREFIX",
    "fsync_dir",
    "link_consolidated_output",
    "link_output",
    "make_tmp_dir",
    "publish_dir",
    "remove_stale_tmp_dirs",
    "staged_output",
    "tmp_dirs_of",
]

logger = logging.getLogger(__name__)

#: Prefix of temporary output directories; they are never visible under the final name.
TMP_PREFIX = ".consolidated.tmp-"
_TMP_NAME = re.compile(r"^\.consolidated\.tmp-(?:[a-z]+-)?(?P<pid>\d+)-[0-9a-f]+(?:@(?P<host>.*))?$")


def _host() -> str:
    return socket.gethostname() or "localhost"


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(kind: str = "") -> str:
    """A unique temporary name, ``.consolidated.tmp-<kind><pid>-<id>@<host>``, naming this process and host."""
    return f"{TMP_PREFIX}{kind}{os.getpid()}-{uuid.uuid4().hex[:12]}@{_host()}"


def make_tmp_dir(parent: Path, kind: str = "") -> Path:
    """Create a hidden, uniquely named directory in ``parent`` (permissions follow the umask).

    Raises:
        OSError: if ``parent`` cannot be written.
    """
    path = Path(parent) / tmp_name(kind)
    path.mkdir()
    return path


def publish_dir(tmp_dir: Path, output_dir: Path, overwrite: bool = True) -> None:
    """Rename ``tmp_dir`` to ``output_dir``.

    Args:
        tmp_dir: the complete output, in the same directory as ``output_dir``.
        output_dir: the final name. An existing one is moved aside first, then removed, so there is no moment where
            neither the old nor the new output is complete under that name.
        overwrite: if ``False``, an existing ``output_dir`` raises :class:`FileExistsError` instead.

    Raises:
        FileExistsError: ``output_dir`` exists and ``overwrite`` is ``False``.
        OSError: if the rename fails.
    """
    old = None
    if output_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{output_dir} exists")
        old = make_tmp_dir(output_dir.parent, "old-")
        os.replace(output_dir, old / output_dir.name)
    os.replace(tmp_dir, output_dir)
    fsync_dir(output_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tmp_dirs_of(parent: Path, pid: int) -> List[Path]:
    """The temporary entries in ``parent`` made by process ``pid`` of this host."""
    found = []
    for path in Path(parent).glob(f"{TMP_PREFIX}*"):
        match = _TMP_NAME.match(path.name)
        if match and int(match.group("pid")) == pid and match.group("host") in (None, _host()):
            found.append(path)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmp_dirs(parent: Path, keep_pid: Optional[int] = None) -> List[Path]:
    """Remove temporary output in ``parent`` left by processes of this host that no longer run.

    Entries made on another host are left alone (their process cannot be checked from here); entries of ``keep_pid``
    and of live processes are kept.

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
        match = _TMP_NAME.match(path.name)
        if match is None or match.group("host") not in (None, _host()):
            continue
        pid = int(match.group("pid"))
        if pid == keep_pid or _alive(pid):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if not path.exists():
            removed.append(path)
            logger.info("Removed %s, left by consolidation process %d that no longer runs", path, pid)
    return removed


@contextlib.contextmanager
def staged_output(
    checkpoint_dir: Path, output_dir: Path, overwrite: bool, failure: str, kind: str = ""
) -> Iterator[Path]:
    """A hidden temporary directory next to ``output_dir``, published as ``output_dir`` when the block ends normally
    and removed when it does not (whatever the exception, Ctrl-C included). Temporary output that killed processes
    left in ``output_dir``'s parent or in ``checkpoint_dir`` is removed first.

    Args:
        checkpoint_dir: the checkpoint being consolidated.
        output_dir: the final output directory.
        overwrite: replace an existing ``output_dir`` (atomically) instead of raising :class:`OutputExistsError`.
        failure: how a failure message starts, e.g. ``"Consolidating <ckpt>"``.
        kind: a tag in the temporary name (``"hf-"``).

    Raises:
        ConsolidationError: the output cannot be written (``OSError`` naming the directory), or any other error of the
            block, wrapped as ``"<failure> failed: <type>: <message>"``; a :class:`ConsolidationError` of the block
            passes unchanged.
        OutputExistsError: ``output_dir`` appeared meanwhile and ``overwrite`` is ``False``.
    """
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        for parent in {output_dir.parent, checkpoint_dir}:
            remove_stale_tmp_dirs(parent)
        tmp_dir = make_tmp_dir(output_dir.parent, kind)
    except OSError as error:
        raise ConsolidationError(
            f"Cannot write the output of {checkpoint_dir} in {output_dir.parent}: {error}"
        ) from error
    try:
        yield tmp_dir
        publish_dir(tmp_dir, output_dir, overwrite=overwrite)
    except ConsolidationError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    except FileExistsError as error:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise OutputExistsError(f"{output_dir} exists (overwrite it with --force)") from error
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ConsolidationError(f"{failure} failed: {type(error).__name__}: {error}") from error
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def link_output(
    source_output: Union[str, Path], output_dir: Union[str, Path], replace_files: Optional[Mapping[str, bytes]] = None
) -> Path:
    """Publish ``output_dir`` with the same files as ``source_output``, without recomputing them.

    Files are hard-linked where the filesystem allows and copied otherwise, into a staging directory next to
    ``output_dir`` that is then renamed into place (an existing ``output_dir`` is replaced atomically).

    Args:
        source_output: an existing output directory.
        output_dir: the new output directory (its parent must exist).
        replace_files: file name -> bytes written (and fsynced) instead of linking that file of ``source_output``.

    Returns:
        ``output_dir``.

    Raises:
        OSError: if the files cannot be linked, copied or written (nothing is left behind).
    """
    source_output, output_dir = Path(source_output), Path(output_dir)
    replace_files = dict(replace_files or {})
    tmp_dir = make_tmp_dir(output_dir.parent)
    try:
        for source in sorted(source_output.iterdir()):
            target = tmp_dir / source.name
            if source.name in replace_files:
                with open(target, "wb") as handle:
                    handle.write(replace_files[source.name])
                    handle.flush()
                    os.fsync(handle.fileno())
                continue
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
        publish_dir(tmp_dir, output_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return output_dir


def link_consolidated_output(
    source_output: Union[str, Path], checkpoint_dir: Union[str, Path], output_name: str = CONSOLIDATED_DIRNAME
) -> Path:
    """Give ``checkpoint_dir`` a ``consolidated/`` with the same files as ``source_output``, without recomputing.

    For NeMo's ``-last`` copy of a checkpoint: the weights are the same, so are the outputs (``metadata.json``'s
    ``source_checkpoint`` is relative, ``../weights``, and stays right). Files are hard-linked where the filesystem
    allows and copied otherwise; the directory is published atomically.

    Args:
        source_output: an existing ``consolidated/`` directory.
        checkpoint_dir: the checkpoint directory that receives ``consolidated/``.
        output_name: the name of the new directory (``hf`` for a Hugging Face export).

    Returns:
        The new ``<checkpoint_dir>/consolidated``.

    Raises:
        OSError: if the files cannot be linked or copied (nothing is left behind).
    """
    return link_output(source_output, Path(checkpoint_dir) / output_name)
