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

"""The integrity data ``metadata.json`` records for a consolidated output, and its check.

Each writer hashes the tensors it writes while their bytes are in its cache: per safetensors file, ``metadata.json``
records its ``size``, ``header_blake3``, ``tensors_blake3`` (name -> digest) and ``blake3_tree`` (the digest of the
header's digest then each tensor's, 32 raw bytes each, in file order), and ``{"size", "blake3"}`` per JSON file.
Without the ``blake3`` package, outputs record sha256 under the same keys, ``sha256`` in place of ``blake3``.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from nemo_patch.engine.errors import CorruptShardError
from nemo_patch.engine.output_files import is_plain_filename, output_weight_map
from nemo_patch.engine.output_layout import (
    ADAPTER_STEM,
    METADATA_FILENAME,
    MODEL_STEM,
    index_filename,
    single_filename,
)
from nemo_patch.engine.safe_files import open_regular, read_json_file, read_regular_file
from nemo_patch.engine.safetensors_writer import MAX_HEADER_BYTES, OutputFile
from nemo_patch.engine.verify import VerificationError

_blake3: Optional[Any]
try:
    from blake3 import blake3 as _blake3
except ImportError:  # pragma: no cover - optional: sha256 digests then
    _blake3 = None

__all__ = [
    "blake3_tree",
    "digest_algorithm",
    "file_entry",
    "json_file_entry",
    "new_digest",
    "source_fingerprint",
    "verify_digests",
]

_BLOCK = 1 << 20
#: The digests an output may record (the keys of ``metadata.json`` name them).
_ALGORITHMS = ("blake3", "sha256")


def digest_algorithm() -> str:
    """The digest new outputs record: ``"blake3"`` where the ``blake3`` package is installed, else ``"sha256"``."""
    return "blake3" if _blake3 is not None else "sha256"


def new_digest(algorithm: Optional[str] = None, data: Union[bytes, memoryview] = b"") -> Any:
    """A hash object of ``algorithm`` (default: :func:`digest_algorithm`) that has been fed ``data``.

    Raises:
        VerificationError: ``algorithm`` is ``"blake3"`` without the ``blake3`` package, or neither of the two.
    """
    algorithm = algorithm or digest_algorithm()
    if algorithm == "sha256":
        return hashlib.sha256(data)
    if algorithm == "blake3" and _blake3 is not None:
        return _blake3(data)
    if algorithm == "blake3":
        raise VerificationError("The output records BLAKE3 digests: install the blake3 package to check them")
    raise VerificationError(f"Unknown digest algorithm {algorithm!r}")


def blake3_tree(header_blake3: str, tensor_blake3: Sequence[str], algorithm: str = "blake3") -> str:
    """The ``algorithm`` digest (BLAKE3 by default) of ``header_blake3`` then every tensor's digest (raw 32 bytes
    each, in file order), hex."""
    digest = new_digest(algorithm, bytes.fromhex(header_blake3))
    for value in tensor_blake3:
        digest.update(bytes.fromhex(value))
    return digest.hexdigest()


def file_entry(file: OutputFile, tensor_blake3: Mapping[str, str]) -> Dict[str, Any]:
    """``metadata.json``'s entry for a safetensors file, from its layout and its writers' tensor digests (of
    :func:`digest_algorithm`, which names the keys).

    Raises:
        KeyError: a tensor of the file has no digest (a writer did not report it).
    """
    algorithm = digest_algorithm()
    header = new_digest(algorithm, file.header).hexdigest()
    tensors = {spec.name: tensor_blake3[spec.name] for spec in file.specs}
    return {
        "size": file.size,
        f"header_{algorithm}": header,
        f"tensors_{algorithm}": tensors,
        f"{algorithm}_tree": blake3_tree(header, [tensors[spec.name] for spec in file.specs], algorithm),
    }


def json_file_entry(path: Path, algorithm: Optional[str] = None) -> Dict[str, Any]:
    """``metadata.json``'s entry for a small file written whole (``model.safetensors.index.json``): its size and
    digest, read as a regular file in blocks (whatever size it has, memory stays one block).

    Raises:
        OSError: it cannot be read, or is not a regular file (:class:`~.safe_files.UnsafeFileError`).
    """
    algorithm = algorithm or digest_algorithm()
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        return {"size": size, algorithm: _blake3_of(handle, 0, size, algorithm)}


def _blake3_of(handle: Any, offset: int, size: int, algorithm: str = "blake3") -> str:
    digest = new_digest(algorithm)
    handle.seek(offset)
    while size > 0:
        block = handle.read(min(_BLOCK, size))
        if not block:
            break
        digest.update(block)
        size -= len(block)
    return digest.hexdigest()


def verify_digests(output_dir: Union[str, Path]) -> int:
    """Check every file ``metadata.json`` lists against its recorded size and digests, and that every weights file of
    the output is among them. Files are opened as regular files (never a FIFO) and read in blocks of 1 MiB.

    Args:
        output_dir: a consolidated output directory (``safetensors`` format, format version 2).

    Returns:
        The number of tensors whose digests were checked.

    Raises:
        VerificationError: ``metadata.json`` is missing or records no digests of this kind, it names a file outside
            ``output_dir`` (not a plain file name), a weights file of the output or its index is not among the files
            it records, the output's index is malformed or contradicts its files, a file is missing or has another
            size, or a header or tensor differs; the message names the file and the tensor.
    """
    output_dir = Path(output_dir)
    try:
        files = read_json_file(output_dir / METADATA_FILENAME)["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise VerificationError(
            f"{output_dir} has no readable {METADATA_FILENAME} with file digests: {error}"
        ) from error
    if not isinstance(files, dict):
        raise VerificationError(f"{output_dir / METADATA_FILENAME}: \"files\" is not an object")
    for name in files:
        if not is_plain_filename(name):
            raise VerificationError(
                f"{output_dir / METADATA_FILENAME} records {name!r}, which is not a plain file name in {output_dir}"
            )
    stems = (MODEL_STEM, ADAPTER_STEM)
    entry_points = [
        n for stem in stems for n in (single_filename(stem), index_filename(stem)) if (output_dir / n).is_file()
    ]
    unreadable: Optional[VerificationError] = None  # raised after the digests, which name a changed file better
    if entry_points:  # else every weights file metadata.json records is missing, which the loop below reports
        try:
            weights = set(output_weight_map(output_dir, stems=stems).values())
        except (OSError, ValueError) as error:  # FileNotFoundError, InvalidOutputError
            unreadable = VerificationError(f"Cannot read the weights files of {output_dir}: {error}")
            unreadable.__cause__ = error
            weights = set()
        for name in sorted((weights | set(entry_points)) - set(files)):
            raise VerificationError(
                f"{output_dir / name} is part of the output, but {METADATA_FILENAME} records no digest of it"
            )
    checked = 0
    try:
        for name, entry in sorted(files.items()):
            path = output_dir / name
            try:
                with open_regular(path) as handle:  # never a FIFO or a device: no blocking, no endless read
                    size: Optional[int] = os.fstat(handle.fileno()).st_size
                have = f"{size} bytes"
            except OSError as error:
                size, have = None, "missing" if isinstance(error, FileNotFoundError) else f"unreadable ({error})"
            if size != entry.get("size"):
                raise VerificationError(f"{path}: {have}, {METADATA_FILENAME} records {entry.get('size')} bytes")
            # The checks below name BLAKE3's keys; an output written without blake3 records sha256 under sha256's.
            algorithm = next((a for a in _ALGORITHMS if a in entry or f"tensors_{a}" in entry), "blake3")
            entry = {key.replace(algorithm, "blake3"): value for key, value in entry.items()}
            if "blake3" in entry:
                if json_file_entry(path, algorithm)[algorithm] != entry["blake3"]:
                    raise VerificationError(f"{path} differs from the BLAKE3 digest {METADATA_FILENAME} records")
                continue
            if "tensors_blake3" not in entry:
                raise VerificationError(f"{path}: {METADATA_FILENAME} records no digests this version can check")
            with open_regular(path) as handle:
                header_size = 8 + int.from_bytes(handle.read(8), "little")
                if header_size > min(os.fstat(handle.fileno()).st_size, MAX_HEADER_BYTES + 8):
                    raise VerificationError(
                        f"{path}: a header of {header_size - 8} bytes, longer than the file allows"
                    )
                if _blake3_of(handle, 0, header_size, algorithm) != entry["header_blake3"]:
                    raise VerificationError(f"{path}: the header differs from the one {METADATA_FILENAME} records")
                handle.seek(8)
                header = json.loads(handle.read(header_size - 8))
                if set(entry["tensors_blake3"]) != set(header) - {"__metadata__"}:
                    raise VerificationError(f"{path}: its tensors are not the ones {METADATA_FILENAME} records")
                for tensor, recorded in entry["tensors_blake3"].items():
                    begin, end = header[tensor]["data_offsets"]
                    if _blake3_of(handle, header_size + begin, end - begin, algorithm) != recorded:
                        raise VerificationError(
                            f"{path}: tensor {tensor} differs from the BLAKE3 digest {METADATA_FILENAME} records"
                        )
                    checked += 1
                in_file_order = sorted(entry["tensors_blake3"], key=lambda tensor: header[tensor]["data_offsets"][0])
            tensor_digests = [entry["tensors_blake3"][tensor] for tensor in in_file_order]
            if blake3_tree(entry["header_blake3"], tensor_digests, algorithm) != entry["blake3_tree"]:
                raise VerificationError(f"{path}: {METADATA_FILENAME}'s blake3_tree does not match its tensor digests")
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise VerificationError(
            f"{output_dir / METADATA_FILENAME} is malformed ({type(error).__name__}: {error}); it cannot vouch for "
            "this output"
        ) from error
    if unreadable is not None:
        raise unreadable
    return checked


def source_fingerprint(weights_dir: Union[str, Path]) -> Dict[str, Any]:
    """The name, size and sha256 of the file the checkpoint's format writes last (DCP's ``.metadata``;
    ``metadata.json`` for ``zarr``), recorded in the output's ``metadata.json`` as ``"source_metadata"``.

    Raises:
        CorruptShardError: the file cannot be read, or is not a regular file of at most 1 GiB.
    """
    path = Path(weights_dir) / ".metadata"
    path = path if os.path.lexists(path) else path.with_name("metadata.json")  # zarr has no DCP metadata
    try:
        data = read_regular_file(path, 1 << 30)
    except OSError as error:
        raise CorruptShardError(f"Cannot read {path}: {error}") from error
    return {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
