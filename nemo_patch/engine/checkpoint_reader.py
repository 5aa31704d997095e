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

"""Open a checkpoint's weights for reading, whatever distributed-checkpoint format wrote them.

``torch_dist`` is read (:mod:`.dcp_reader`), and megatron-core's ``zarr`` where a reader is registered
(:data:`zarr_reader`). Both are described by DCP ``Metadata``, so planning the output (:mod:`.plan`) is one code path,
and both readers read a key, or one index of it, into a given tensor. Imports the standard library, torch and the
engine only.
"""

from pathlib import Path
from typing import Any, List, Optional, Protocol, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata

from nemo_patch.engine import moe_names, plan
from nemo_patch.engine.checkpoint_layout import inspect_checkpoint
from nemo_patch.engine.dcp_reader import DCPRegionReader
from nemo_patch.engine.errors import CorruptShardError, UnsupportedFormatError
from nemo_patch.engine.layout_checks import check_dcp_layout, check_no_missing_layer
from nemo_patch.engine.metadata_checks import read_dcp_metadata

#: The reader of megatron-core's deprecated ``zarr`` format (``read_zarr_metadata``, ``ZarrRegionReader``), where an
#: extension registers one; ``None``: ``torch_dist`` only.
zarr_reader: Any = None

__all__ = ["RegionReader", "open_weights"]
plan.moe_names = moe_names  # mixture-of-experts entries: one output tensor per expert


class RegionReader(Protocol):
    """What the engine needs of a reader (:class:`DCPRegionReader`, :class:`ZarrRegionReader`)."""

    path: Path

    def files_of(self, key: str) -> List[str]:
        """The files (relative to :attr:`path`) that hold ``key``, for error messages."""

    def read(
        self, key: str, index: Union[None, int, Tuple[int, ...]] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``key`` (or ``key[index]``, indices into the leading dimensions) in its stored dtype, into ``out``."""


def open_weights(
    weights_dir: Path, backend: Optional[str] = None, metadata: Optional[Metadata] = None
) -> Tuple[Metadata, RegionReader]:
    """The metadata and a reader of a checkpoint's ``weights/`` directory.

    Args:
        weights_dir: the directory with the distributed checkpoint's files.
        backend: ``"torch_dist"`` or ``"zarr"``; read from megatron-core's ``metadata.json`` when ``None``.
        metadata: the checkpoint's metadata when the caller has read it already (it is not read again).

    Returns:
        ``(metadata, reader)``.

    Raises:
        CorruptShardError: the metadata cannot be read (``.metadata`` truncated, corrupt or of the wrong types, a
            ``.zarray`` unreadable), or the chunks do not tile their tensors or name shard files that are missing,
            outside ``weights/``, not regular files or too short (:func:`.layout_checks.check_dcp_layout`).
        UnsupportedFormatError: a zarr array this package cannot read safely, or zarr/ml_dtypes not installed.
        ConsolidationError: any other backend.
    """
    weights_dir = Path(weights_dir)
    backend = inspect_checkpoint(weights_dir, allow_unfinished=True).backend if backend is None else backend
    if backend == "zarr" and zarr_reader is not None:
        metadata = zarr_reader.read_zarr_metadata(weights_dir) if metadata is None else metadata
        check_no_missing_layer(metadata, plan.model_tensor_keys(metadata))
        return metadata, zarr_reader.ZarrRegionReader(weights_dir, metadata)
    if backend != "torch_dist":
        raise UnsupportedFormatError(f"{weights_dir}: cannot read a '{backend}' checkpoint")
    if metadata is None:
        try:
            metadata = read_dcp_metadata(weights_dir)
        except Exception as error:  # OSError, pickle.UnpicklingError, EOFError
            raise CorruptShardError(
                f"Cannot read the checkpoint metadata file {weights_dir / '.metadata'}: {type(error).__name__}: "
                f"{error}"
            ) from error
    keys = plan.model_tensor_keys(metadata)
    files = check_dcp_layout(weights_dir, metadata, keys)
    check_no_missing_layer(metadata, keys)
    return metadata, DCPRegionReader(weights_dir, metadata, files=files, checked=keys)
