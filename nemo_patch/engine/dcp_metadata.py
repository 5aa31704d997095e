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

"""Read a ``torch.distributed.checkpoint`` ``.metadata`` file without running code, and check what it declares.

The DCP ``.metadata`` file is a pickle: PyTorch's ``FileSystemReader.read_metadata`` unpickles it with no
restrictions (any callable named in the file runs), and megatron-core writes its own ``MCoreMetadata`` subclass into
it, so reading it that way also imports megatron-core. :func:`read_dcp_metadata` unpickles it with an exact allowlist:
a table from ``(module, name)`` to the one object that name may resolve to (:data:`_ALLOWED`): the DCP metadata
dataclasses and enums, ``torch.Size``, each ``torch.dtype`` and ``torch.layout`` by name, torch's layout helper, local
stand-ins for megatron-core's ``MCoreMetadata``/``MCoreSavePlan`` (plain dataclasses with the same fields), and four
builtin containers, and pure ``pathlib`` paths (``FileSystemWriter`` records the directory it saved to as a
``PosixPath``). Nothing is looked up by attribute: a name outside the table (a module object, ``__builtins__``,
a function of an allowed module) is refused with ``pickle.UnpicklingError``. The objects in the table are data
holders; calling one (``REDUCE``) or rebuilding one (``BUILD``) runs no code of the file's choosing.

Why not torch's own hardened unpickler (``torch._weights_only_unpickler``, behind ``torch.load(weights_only=True)``):
it implements pickle protocol 2 only, and DCP writes ``.metadata`` with ``pickle.dump``'s default protocol (4 or 5:
``FRAME``, ``STACK_GLOBAL``, ``MEMOIZE``), which it rejects (``Unsupported operand 149``). The stored tensors
themselves are read with ``torch.load(weights_only=True)`` (:mod:`nemo_patch.engine.dcp_reader`).

An unpickled file can still hold wrong values of the right classes (``size="abc"``, ``chunks=None``, an integer key);
:func:`validate_metadata` checks every field the engine reads, so such a file fails as corrupt metadata naming the
entry, not with a traceback later.

Imports the standard library and torch only; never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import io
import pickle
import pickletools
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from nemo_patch.engine.safe_files import read_regular_file

__all__ = ["InvalidMetadataError", "prescan_pickle", "read_dcp_metadata", "validate_metadata"]

_METADATA_FILE = ".metadata"
_MCORE_MODULE = "megatron.core.dist_checkpointing.strategies.torch"
#: The most bytes a ``.metadata`` file may have (a large MoE model's is tens of MB; the bound keeps a
#: crafted file from growing memory without end).
MAX_METADATA_BYTES = 512 << 20


class InvalidMetadataError(pickle.UnpicklingError):
    """The ``.metadata`` file unpickled, but what it declares is not valid DCP metadata; the message names the
    entry."""


@dataclass
class MCoreMetadata(Metadata):
    """Stand-in for megatron-core's ``MCoreMetadata`` (DCP ``Metadata`` plus ``mcore_data``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


@dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    """Stand-in for megatron-core's ``MCoreSavePlan`` (DCP ``SavePlan`` plus ``mcore_data``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


def _allowed() -> Dict[Tuple[str, str], Any]:
    table: Dict[Tuple[str, str], Any] = {}
    metadata_classes: Tuple[type, ...] = (Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                          TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                                          _MEM_FORMAT_ENCODING)  # fmt: skip
    for cls in metadata_classes:
        table[("torch.distributed.checkpoint.metadata", cls.__name__)] = cls
    table[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    table[("torch.distributed.checkpoint.filesystem", "_StoragePrefix")] = _StoragePrefix
    planner_classes: Tuple[type, ...] = (SavePlan, WriteItem, WriteItemType, TensorWriteData, BytesIOWriteData)
    for cls in planner_classes:
        table[("torch.distributed.checkpoint.planner", cls.__name__)] = cls
    table[(_MCORE_MODULE, "MCoreMetadata")] = MCoreMetadata
    table[(_MCORE_MODULE, "MCoreSavePlan")] = MCoreSavePlan
    table[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout)):
            table[("torch", name)] = value
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table[("collections", "OrderedDict")] = OrderedDict
    # torch's FileSystemWriter records the directory it saved to, a pathlib path, in storage_meta.checkpoint_id: as
    # pure paths (made from strings; they touch no file), under the modules the pathlib classes have had
    # (pathlib._local in Python 3.13).
    for module in ("pathlib", "pathlib._local"):
        for name, cls in (("PosixPath", PurePosixPath), ("PurePosixPath", PurePosixPath),
                          ("WindowsPath", PureWindowsPath), ("PureWindowsPath", PureWindowsPath)):  # fmt: skip
            table[(module, name)] = cls
    for builtin in (set, frozenset, slice, complex):
        table[("builtins", builtin.__name__)] = builtin
    return table


#: ``(module, name)`` -> the object a ``.metadata`` pickle may name: nothing else resolves.
_ALLOWED = _allowed()


#: The deepest nesting of containers and objects a ``.metadata`` pickle may build (DCP's is about 8 deep).
MAX_NESTING = 64
_BUILD_TARGETS = frozenset(
    cls
    for cls in _ALLOWED.values()
    if isinstance(cls, type) and not issubclass(cls, Enum) and cls.__module__.startswith(("torch.", __name__))
)
_SETTERS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GETTERS = {"GET", "BINGET", "LONG_BINGET"}
_FILLERS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}


def prescan_pickle(data: bytes, max_nesting: int = MAX_NESTING) -> None:
    """Check a pickle's structure before anything is built from it, with ``pickletools.genops`` (no object is made).

    A stack of nesting depths is simulated from each opcode's declared stack effect, so that what the unpickler would
    build is bounded before it builds it:

    * memo indices (``PUT``/``GET`` and their binary forms) must be smaller than the number of opcodes read so far:
      a 9-byte pickle with a memo index near 2**32 makes CPython's unpickler allocate and zero a memo array of that
      size;
    * nesting (a container or object inside another) must stay within ``max_nesting``: hashing a deeply nested
      tuple used as a dict key crashes CPython in C recursion (a segfault, no message).

    Raises:
        pickle.UnpicklingError: naming the byte offset and what is wrong; also for opcodes ``pickletools`` cannot
            parse (a truncated or corrupt file).
    """
    depths: list = []  # nesting depth of each stack item; None marks a MARK
    memo: Dict[int, int] = {}
    count = 0
    try:
        for opcode, arg, position in pickletools.genops(data):
            count += 1
            name = opcode.name
            if name in _SETTERS or name == "MEMOIZE":
                index = len(memo) if name == "MEMOIZE" else arg
                if not isinstance(index, int) or index > count:
                    raise pickle.UnpicklingError(f"memo index {index} at byte {position} of a {len(data)}-byte pickle")
                memo[index] = depths[-1] if depths and depths[-1] is not None else 0
                continue
            if name in _GETTERS:
                if arg not in memo:
                    raise pickle.UnpicklingError(f"memo index {arg} at byte {position} was never stored")
                depths.append(memo[arg])
                continue
            popped: list = []
            for item in reversed(opcode.stack_before):
                if item is pickletools.stackslice:
                    while depths and depths[-1] is not None:
                        popped.append(depths.pop())
                elif item is pickletools.markobject:
                    if not depths or depths[-1] is not None:
                        raise pickle.UnpicklingError(f"{name} at byte {position} finds no MARK")
                    depths.pop()
                elif depths and depths[-1] is not None:
                    popped.append(depths.pop())
                else:
                    raise pickle.UnpicklingError(f"{name} at byte {position} pops an empty stack")
            if name == "MARK":
                depths.append(None)
            elif opcode.stack_after:
                inner = max(popped, default=-1) + 1
                if name in _FILLERS:  # the container stays below what was added to it
                    inner = max(popped[-1], max(popped[:-1], default=-1) + 1)
                if inner > max_nesting:
                    raise pickle.UnpicklingError(
                        f"nesting deeper than {max_nesting} at byte {position}: not DCP metadata"
                    )
                depths.extend([inner] * len(opcode.stack_after))
    except (ValueError, IndexError, KeyError) as error:
        raise pickle.UnpicklingError(f"not a well-formed pickle: {error}") from error


_LOAD_BUILD: Callable[[Any], None] = pickle._Unpickler.dispatch[pickle.BUILD[0]]  # the standard BUILD


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its memo is a dict, and each opcode can be checked), resolving globals only through
    :data:`_ALLOWED` and rebuilding (``BUILD``) only instances of the metadata classes, never a class or function."""

    dispatch: ClassVar[Dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except (KeyError, TypeError):
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name} from DCP metadata: not a metadata type"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds a persistent id; refusing it")

    def _load_build(self) -> None:
        stack: List[Any] = getattr(self, "stack")  # the pure-Python unpickler's value stack
        target = stack[-2]
        if type(target) not in _BUILD_TARGETS:
            raise pickle.UnpicklingError(
                f"refusing to set the state of a {type(target).__name__}: not a metadata object"
            )
        _LOAD_BUILD(self)

    dispatch[pickle.BUILD[0]] = _load_build


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(value: Any, what: str, ndim: Optional[int] = None) -> None:
    if not isinstance(value, torch.Size) or not all(_is_int(n) and n >= 0 for n in value):
        raise InvalidMetadataError(f"{what} is {value!r}, not a torch.Size of non-negative integers")
    if ndim is not None and len(value) != ndim:
        raise InvalidMetadataError(f"{what} has {len(value)} dimensions, the tensor {ndim}")


def validate_metadata(metadata: Any) -> Metadata:
    """Check that unpickled DCP metadata holds what the engine reads, with the right types.

    Checked: ``state_dict_metadata`` is a dict from ``str`` keys to ``TensorStorageMetadata`` (``properties`` with a
    ``torch.dtype``; ``size`` a ``torch.Size`` of non-negative ints; ``chunks`` a list of ``ChunkStorageMetadata``
    whose ``offsets`` and ``sizes`` are ``torch.Size`` of the tensor's rank) or ``BytesStorageMetadata``; and
    ``storage_data`` (when present) a dict from ``MetadataIndex`` (``fqn`` a ``str``, ``offset`` a ``torch.Size`` or
    ``None``) to ``_StorageInfo`` (``relative_path`` a ``str``, ``offset`` and ``length`` non-negative ints). Whether
    the chunks tile their tensor and where the files are is checked later (:mod:`nemo_patch.engine.layout_checks`).

    Args:
        metadata: what the ``.metadata`` file unpickled to.

    Returns:
        ``metadata``, unchanged.

    Raises:
        InvalidMetadataError: naming the first entry and field that is wrong.
    """
    if not isinstance(metadata, Metadata):
        raise InvalidMetadataError(f"DCP metadata holds a {type(metadata).__name__}, not a Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise InvalidMetadataError(f"state_dict_metadata is a {type(entries).__name__}, not a dict")
    for key, item in entries.items():
        if not isinstance(key, str):
            raise InvalidMetadataError(f"state_dict_metadata has a key {key!r} that is not a string")
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise InvalidMetadataError(f"entry {key}: a {type(item).__name__}, not tensor or bytes metadata")
        if not isinstance(item.properties, TensorProperties) or not isinstance(item.properties.dtype, torch.dtype):
            raise InvalidMetadataError(f"entry {key}: properties {item.properties!r} name no torch dtype")
        _check_size(item.size, f"entry {key}: size")
        if not isinstance(item.chunks, list):
            raise InvalidMetadataError(f"entry {key}: chunks is {type(item.chunks).__name__}, not a list")
        for number, chunk in enumerate(item.chunks):
            if not isinstance(chunk, ChunkStorageMetadata):
                raise InvalidMetadataError(f"entry {key}: chunk {number} is a {type(chunk).__name__}")
            _check_size(chunk.offsets, f"entry {key}: chunk {number} offsets", len(item.size))
            _check_size(chunk.sizes, f"entry {key}: chunk {number} sizes", len(item.size))
    storage = metadata.storage_data
    if storage is None:
        return metadata
    if not isinstance(storage, dict):
        raise InvalidMetadataError(f"storage_data is a {type(storage).__name__}, not a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise InvalidMetadataError(f"storage_data has a key {index!r} that is not a MetadataIndex")
        if index.offset is not None:
            _check_size(index.offset, f"storage_data[{index.fqn}]: offset")
        if not isinstance(info, _StorageInfo):
            raise InvalidMetadataError(f"storage_data[{index.fqn}] is a {type(info).__name__}, not a _StorageInfo")
        if not isinstance(info.relative_path, str) or not all(
            _is_int(n) and n >= 0 for n in (info.offset, info.length)
        ):
            raise InvalidMetadataError(
                f"storage_data[{index.fqn}]: relative_path {info.relative_path!r}, offset {info.offset!r}, length "
                f"{info.length!r}: expected a file name and non-negative byte counts"
            )
    return metadata


def read_dcp_metadata(dcp_dir: Path) -> Metadata:
    """Read ``<dcp_dir>/.metadata`` with torch's hardened unpickler (module docstring) and check it.

    Args:
        dcp_dir: a ``torch.distributed.checkpoint`` directory (NeMo's ``<ckpt>/weights``).

    Returns:
        The DCP ``Metadata`` (megatron-core's ``MCoreMetadata`` comes back as this module's stand-in subclass).

    Raises:
        OSError: if the file cannot be read, is not a regular file, or is larger than :data:`MAX_METADATA_BYTES`.
        pickle.UnpicklingError: if the file names a global outside the allowlist, or is truncated or corrupt;
            :class:`InvalidMetadataError` (a subclass) if it unpickles to values of the wrong types.
    """
    data = read_regular_file(Path(dcp_dir) / _METADATA_FILE, MAX_METADATA_BYTES)
    prescan_pickle(data)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as error:  # EOFError, ValueError, TypeError, RuntimeError, ... from a damaged file
        raise pickle.UnpicklingError(f"corrupt DCP metadata: {type(error).__name__}: {error}") from error
    return validate_metadata(metadata)
