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

"""Read a ``torch.distributed.checkpoint`` ``.metadata`` file without running arbitrary code.

The DCP ``.metadata`` file is a pickle: PyTorch's ``FileSystemReader.read_metadata`` unpickles it with no
restrictions, and megatron-core writes its own ``MCoreMetadata`` subclass into it, so reading it that way imports (and
runs) megatron-core. :func:`read_dcp_metadata` unpickles it with an allowlist: PyTorch's DCP metadata classes,
``torch.Size``, dtypes and layouts, and local stand-ins for megatron-core's ``MCoreMetadata``/``MCoreSavePlan`` (plain
dataclasses with the same fields). Any other global in the file is refused with ``pickle.UnpicklingError``.

Imports the standard library and torch only; never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["read_dcp_metadata"]

_METADATA_FILE = ".metadata"
_MCORE_MODULE = "megatron.core.dist_checkpointing.strategies.torch"


@dataclass
class MCoreMetadata(Metadata):
    """Stand-in for megatron-core's ``MCoreMetadata`` (DCP ``Metadata`` plus ``mcore_data``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


@dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    """Stand-in for megatron-core's ``MCoreSavePlan`` (DCP ``SavePlan`` plus ``mcore_data``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": dcp_metadata,
    "torch.distributed.checkpoint.filesystem": dcp_filesystem,
    "torch.distributed.checkpoint.planner": dcp_planner,
}
_STANDINS = {(_MCORE_MODULE, "MCoreMetadata"): MCoreMetadata, (_MCORE_MODULE, "MCoreSavePlan"): MCoreSavePlan}
_BUILTINS = {"set", "frozenset", "slice", "complex"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STANDINS:
            return _STANDINS[(module, name)]
        if module in _ALLOWED and hasattr(_ALLOWED[module], name):
            return getattr(_ALLOWED[module], name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        ):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "collections" and name == "OrderedDict" or module == "builtins" and name in _BUILTINS:
            return pickle.Unpickler.find_class(self, module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata: not a metadata type")


def read_dcp_metadata(dcp_dir: Path) -> Metadata:
    """Read ``<dcp_dir>/.metadata`` with the allowlist described in the module docstring.

    Args:
        dcp_dir: a ``torch.distributed.checkpoint`` directory (NeMo's ``<ckpt>/weights``).

    Returns:
        The DCP ``Metadata`` (megatron-core's ``MCoreMetadata`` comes back as this module's stand-in subclass).

    Raises:
        OSError: if the file cannot be read.
        pickle.UnpicklingError: if the file names a global outside the allowlist, or is truncated or corrupt.
    """
    with open(Path(dcp_dir) / _METADATA_FILE, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
        except (EOFError, ValueError, TypeError, AttributeError) as error:
            raise pickle.UnpicklingError(f"corrupt DCP metadata: {type(error).__name__}: {error}") from error
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"DCP metadata holds a {type(metadata).__name__}, not a Metadata")
    return metadata
