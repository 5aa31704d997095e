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

"""Load a ``torch.distributed.checkpoint`` ``.metadata`` file without running code from it.

``FileSystemReader.read_metadata`` (and NeMo's ``load_sharded_metadata_torch_dist``) unpickle it unrestricted: a
crafted checkpoint runs any callable it names. :func:`load_dcp_metadata` unpickles it with the C ``pickle.Unpickler``
whose ``find_class`` resolves only an allowlist of names (the DCP metadata classes, ``torch.Size``, dtypes, stand-ins
for megatron-core's ``MCoreMetadata``, ...). ``torch.load(weights_only=True)`` cannot: it reads pickle protocol 2;
DCP writes 4 or 5.
"""

import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner
from torch.distributed.checkpoint.metadata import Metadata

_MCORE = "megatron.core.dist_checkpointing.strategies.torch"


@dataclass
class MCoreMetadata(Metadata):
    """Stand-in for megatron-core's ``MCoreMetadata`` (DCP ``Metadata`` plus ``mcore_data``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


@dataclass(frozen=True)
class MCoreSavePlan(planner.SavePlan):
    """Stand-in for megatron-core's ``MCoreSavePlan`` (DCP ``SavePlan`` plus ``mcore_data``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


def _allowlist() -> Dict[Tuple[str, str], Any]:
    table: Dict[Tuple[str, str], Any] = {("torch", "Size"): torch.Size, ("collections", "OrderedDict"): OrderedDict}
    for source, names in (
        (metadata, "Metadata MetadataIndex StorageMeta TensorProperties TensorStorageMetadata BytesStorageMetadata"),
        (metadata, "ChunkStorageMetadata _MEM_FORMAT_ENCODING"),
        (filesystem, "_StorageInfo _StoragePrefix"),
        (planner, "SavePlan WriteItem WriteItemType TensorWriteData BytesIOWriteData"),
    ):
        table.update({(source.__name__, name): getattr(source, name) for name in names.split()})
    table.update({(_MCORE, "MCoreMetadata"): MCoreMetadata, (_MCORE, "MCoreSavePlan"): MCoreSavePlan})
    table.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, (torch.dtype, torch.layout))})
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for module in ("pathlib", "pathlib._local"):  # FileSystemWriter records its directory as a pathlib path
        for name, pure in (("PosixPath", PurePosixPath), ("WindowsPath", PureWindowsPath)):
            table.update({(module, name): pure, (module, "Pure" + name): pure})
    table.update({("builtins", kind.__name__): kind for kind in (set, frozenset, slice, complex)})
    return table


#: ``(module, name)`` -> the one object a ``.metadata`` pickle may name. An enum is named as the lookup of its members
#: by value (they are pickled with ``REDUCE``): ``NEWOBJ``, which takes a type only, would return a shared member.
_ALLOWED = {
    k: v._value2member_map_.__getitem__ if isinstance(v, type) and issubclass(v, Enum) else v
    for k, v in _allowlist().items()
}


class _MetadataUnpickler(pickle.Unpickler):
    """The C unpickler, resolving names through :data:`_ALLOWED` only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata: not a metadata type")
        return _ALLOWED[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds a persistent id; refusing it")


def load_dcp_metadata(data: bytes) -> Metadata:
    """The DCP metadata in ``data`` (a ``.metadata`` file's bytes), unpickled with the allowlist.

    Raises:
        pickle.UnpicklingError: a name outside the allowlist, corrupt data, or something else than a ``Metadata``.
    """
    try:
        loaded = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as error:  # EOFError, ValueError, TypeError, ... from damaged data
        raise pickle.UnpicklingError(f"corrupt DCP metadata: {type(error).__name__}: {error}") from error
    if not isinstance(loaded, Metadata) or not isinstance(loaded.state_dict_metadata, dict):
        raise pickle.UnpicklingError(f"DCP metadata holds a {type(loaded).__name__}, not a Metadata")
    return loaded
