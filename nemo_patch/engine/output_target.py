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

"""Where a consolidation may publish its output, and what an overwrite may replace: nothing of the user's is lost.

Publishing renames a complete temporary directory over the output's name (:mod:`.publish`), so with ``overwrite``
whatever is there goes: :func:`check_output_target` says first whether that is safe. Imports no torch, so the CLI
checks its ``--out`` before importing torch.
"""

import os
import re
from pathlib import Path
from typing import List, Union

from nemo_patch.engine.errors import ConsolidationError, NotACheckpointError, OutputExistsError
from nemo_patch.engine.safe_files import read_json_file

__all__ = [
    "RemoteStorageError",
    "check_output_target",
    "describe_entry",
    "is_url",
    "is_consolidated_output",
    "is_replaceable_output",
    "refuse_an_output_as_checkpoint",
    "refuse_remote",
]

#: The checkpoint's subdirectories that no output may be on or inside.
PROTECTED_SUBDIRS = ("weights", "context")
#: A URL's scheme and its slashes; ``pathlib`` makes ``s3://b`` ``s3:/b``, so one slash is enough.
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/+")


class RemoteStorageError(ConsolidationError):
    """The checkpoint or the output was given as a URL (``s3://``, ``msc://``, ``gs://``, ``https://``, any
    ``scheme://``): remote storage is not read or written directly. Consolidate into a local (or mounted) directory
    and upload it from there."""

    exit_code, summary = 19, "a URL (s3://, msc://, ...) as the checkpoint or the output: local paths only"


def is_url(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a URL: ``<scheme>:/...`` with a scheme of two characters or more (``s3://b``, or ``s3:/b``
    as ``pathlib`` leaves it)."""
    return _URL.match(os.fspath(path)) is not None


def refuse_remote(path: Union[str, Path], what: str, advice: str = "") -> None:
    """Refuse ``path`` if it is a URL (see :class:`RemoteStorageError`); ``what`` names it (``"the output"``) and
    ``advice`` is added to the message (how to upload, where the caller can do it).

    Raises:
        RemoteStorageError: naming the URL as it was given (a path's ``s3:/b`` shown as ``s3://b``).
    """
    text = os.fspath(path)
    match = _URL.match(text)
    if match is None:
        return
    shown = text if "://" in text else f"{match.group('scheme')}://{text[match.end():]}"
    raise RemoteStorageError(
        f"{what[:1].upper()}{what[1:]} {shown} is a URL: remote storage is not read or written directly, and a "
        f"local directory of that name would be used instead; give a local or mounted directory{advice or ''}"
    )


def _resolved(path: Union[str, Path]) -> Path:
    """``path`` absolute, with every symbolic link of its existing part followed."""
    return Path(os.path.realpath(os.path.abspath(path)))


def is_consolidated_output(path: Union[str, Path]) -> bool:
    """Whether ``path`` is an output of a consolidation (``metadata.json`` with a ``format_version``, no
    ``weights/``)."""
    try:
        return (
            "format_version" in read_json_file(Path(path) / "metadata.json") and not (Path(path) / "weights").exists()
        )
    except (OSError, ValueError, TypeError):
        return False


def refuse_an_output_as_checkpoint(path: Union[str, Path]) -> None:
    """Refuse a consolidated output given where a checkpoint is expected, saying what to give instead.

    Raises:
        NotACheckpointError: ``path`` is an output (:func:`is_consolidated_output`).
    """
    if is_consolidated_output(path):
        raise NotACheckpointError(
            f"{path} is a consolidated output (metadata.json and safetensors files), not a distributed "
            "checkpoint: give the checkpoint directory that holds it (for one written elsewhere with --out, "
            "check it by verifying the checkpoint with this directory as the output)"
        )


def is_replaceable_output(path: Union[str, Path]) -> bool:
    """Whether an overwrite may replace what is at ``path``: nothing, an empty directory, or a previous output of this
    package (``metadata.json`` with ``format_version``, no ``weights/``). A symbolic link never is."""
    path = Path(path)
    if not os.path.lexists(path):
        return True
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        with os.scandir(path) as entries:
            if next(entries, None) is None:
                return True
    except OSError:
        return False
    return is_consolidated_output(path)


def describe_entry(path: Union[str, Path], limit: int = 3) -> str:
    """What is at ``path``, in a few words, for an error message."""
    path = Path(path)
    if path.is_symlink():
        return f"a symbolic link to {os.readlink(path)}"
    if not path.is_dir():
        return "a file" if path.exists() else "nothing"
    try:
        names: List[str] = sorted(os.listdir(path))
    except OSError as error:
        return f"a directory that cannot be listed ({error.strerror})"
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return f"a directory that is not a consolidated output (it holds {shown})"


def check_output_target(
    checkpoint_dir: Union[str, Path], output_dir: Union[str, Path], overwrite: bool, read_only: bool = False
) -> None:
    """Refuse an output directory whose publication would destroy the checkpoint or anything of the user's (called
    before anything is read or written).

    Args:
        checkpoint_dir: the checkpoint directory (``<ckpt>``, holding ``weights/``; for a bare DCP directory, the
            directory itself).
        output_dir: where the output is to be published.
        overwrite: an existing output is to be replaced (``--force``); if ``False``, any existing entry is refused.
        read_only: the output is only read (the verification of an existing output): only where it is is checked.

    Raises:
        RemoteStorageError: ``output_dir`` is a URL.
        OutputExistsError: ``output_dir`` is the checkpoint, its root or a directory above them, or on or inside its
            ``weights/`` or ``context/`` (symbolic links resolved); or something is there and ``overwrite`` is
            ``False``; or what is there is neither a previous output nor an empty directory. The message names the
            resolved paths and what is there.
    """
    refuse_remote(output_dir, "the output")
    checkpoint, target = _resolved(checkpoint_dir), _resolved(output_dir)
    shown = f"{output_dir}" if str(output_dir) == str(target) else f"{output_dir} (resolved: {target})"
    elsewhere = f"the default is {checkpoint / 'consolidated'}"
    if checkpoint == target or checkpoint.is_relative_to(target):
        what = "the checkpoint itself" if checkpoint == target else "a directory holding the checkpoint"
        raise OutputExistsError(
            f"Refusing to write the output to {shown}: it is {what} ({checkpoint}), which publishing would replace; "
            f"choose another output directory ({elsewhere})"
        )
    for name in PROTECTED_SUBDIRS:
        protected = checkpoint / name
        if target.is_relative_to(protected):
            raise OutputExistsError(
                f"Refusing to write the output to {shown}: it is on or inside the checkpoint's {name}/ ({protected}); "
                f"choose another output directory ({elsewhere})"
            )
    if read_only or not os.path.lexists(output_dir):
        return
    if not is_replaceable_output(output_dir):
        raise OutputExistsError(
            f"Refusing to replace {shown}: it is {describe_entry(output_dir)}; only a previous output of "
            "a consolidation or an empty directory is replaced (--force), so choose another output directory"
        )
    if not overwrite:
        raise OutputExistsError(f"{output_dir} exists (overwrite it with --force)")
