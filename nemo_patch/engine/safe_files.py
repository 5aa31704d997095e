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


"""Open the files of a checkpoint as a reader that trusts none of them: only regular files, only inside a directory.

A checkpoint may come from anywhere, and what it names is not trusted: a shard path in its metadata may hold ``../``
or be absolute, a shard file may be a symlink out of ``weights/``, and a file may be a FIFO (``open`` would wait
forever) or a device such as ``/dev/zero`` (reading it would never end). Every file the engine reads from a checkpoint
is opened here:

* :func:`resolve_inside` turns a name found in a checkpoint into a path that provably lies inside a given directory
  (symlinks resolved; the directory itself resolved first, so a symlinked checkpoint keeps working);
* :func:`open_regular` opens with ``O_NONBLOCK`` (a FIFO cannot block the open) and checks with ``fstat`` on the open
  descriptor that it is a regular file (no window between the check and the use);
* :func:`read_regular_file` and :func:`read_json_file` read whole small files (``.metadata``, ``metadata.json``,
  ``.zarray``, ``tokenizer.json``) with a size bound.

Standard library only; never torch, NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import json
import os
import stat
from pathlib import Path
from typing import IO, Any, Union

__all__ = [
    "MAX_JSON_BYTES",
    "UnsafeFileError",
    "open_regular",
    "read_json_file",
    "read_regular_file",
    "resolve_inside",
]

#: The most bytes a JSON side file (``metadata.json``, ``.zarray``, ``adapter_metadata.json``, ...) may have.
MAX_JSON_BYTES = 64 << 20


class UnsafeFileError(OSError):
    """A file a checkpoint names is outside the directory it must be in, or is not a regular file, or is too large."""


def resolve_inside(directory: Union[str, Path], name: Union[str, Path]) -> Path:
    """``directory / name`` with every symlink resolved, checked to lie inside ``directory`` (itself resolved).

    Args:
        directory: the directory the file must be in (e.g. a checkpoint's ``weights/``).
        name: a relative name read from the checkpoint.

    Returns:
        The resolved path.

    Raises:
        UnsafeFileError: ``name`` is absolute, or it (or a symlink on its way) leads outside ``directory``.
    """
    base = Path(directory).resolve()
    if Path(name).is_absolute():
        raise UnsafeFileError(f"{name}: an absolute path where a file inside {base} is expected")
    path = (base / name).resolve()
    if path != base and base not in path.parents:
        raise UnsafeFileError(f"{Path(directory) / name} leads outside {base} (to {path})")
    return path


def open_regular(path: Union[str, Path], mode: str = "rb") -> IO[bytes]:
    """Open ``path`` for reading, only if it is a regular file (never blocks on a FIFO, never opens a device).

    Raises:
        UnsafeFileError: it is not a regular file (a FIFO, socket, device or directory); the message names it.
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: Union[str, Path], limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes.

    Raises:
        UnsafeFileError: not a regular file, or larger than ``limit`` bytes (the message says both sizes).
        OSError: it cannot be read.
    """
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise UnsafeFileError(f"{path} has {size} bytes; at most {limit} are read")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFileError(f"{path} grew past {limit} bytes while it was read")
    return data


def read_json_file(path: Union[str, Path], limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in a regular file of at most ``limit`` bytes.

    Raises:
        UnsafeFileError: not a regular file, or too large.
        OSError: it cannot be read.
        ValueError: it is not valid UTF-8 JSON (``json.JSONDecodeError`` or ``UnicodeDecodeError``), or its arrays and
            objects are nested too deeply for the parser (``json`` raises ``RecursionError`` for that, e.g. for a file
            of 200,000 ``[``: a crafted file, never one a writer of checkpoints makes).
    """
    text = read_regular_file(path, limit).decode("utf-8")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON arrays or objects nested too deeply to be parsed") from None  # callers name the file
