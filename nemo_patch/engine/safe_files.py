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

"""Open the files a checkpoint names as a reader that trusts none of them: regular files only, never blocking, with
size bounds (a FIFO would block ``open`` for ever, ``/dev/zero`` never ends). Standard library only."""

import json
import os
import stat
from pathlib import Path
from typing import IO, Any, Union

#: The most bytes a JSON side file (``metadata.json``, ``adapter_metadata.json``, ...) may have.
MAX_JSON_BYTES = 64 << 20


class UnsafeFileError(OSError):
    """A file is not a regular file, is too large, or lies outside the directory it must be in."""


def open_regular(path: Union[str, Path], mode: str = "rb") -> IO[bytes]:
    """Open ``path`` for reading if it is a regular file: opened with ``O_NONBLOCK``, checked with ``fstat``.

    Raises:
        UnsafeFileError: it is not a regular file. OSError: it cannot be opened.
    """
    nonblock = getattr(os, "O_NONBLOCK", 0)  # POSIX only, as FIFOs
    fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFileError(f"{path} is not a regular file")
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: Union[str, Path], limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes.

    Raises:
        UnsafeFileError: not a regular file, or larger than ``limit``. OSError: it cannot be read.
    """
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        # ``read(n)`` allocates ``n`` bytes first: the file's size (+1, to see it grow), never the limit
        data = handle.read(size + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise UnsafeFileError(f"{path} has {max(size, len(data))} bytes; at most {limit} are read")
    if len(data) > size:
        raise UnsafeFileError(f"{path} grew while it was read (from {size} bytes)")
    return data


def read_json_file(path: Union[str, Path], limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in a regular file of at most ``limit`` bytes.

    Raises:
        UnsafeFileError: not a regular file, or too large. OSError: it cannot be read.
        ValueError: not UTF-8 JSON, or nested too deeply for the parser (``json`` raises ``RecursionError``).
    """
    text = read_regular_file(path, limit).decode("utf-8")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON arrays or objects nested too deeply to be parsed") from None
