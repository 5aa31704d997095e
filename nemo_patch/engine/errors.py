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

"""The errors of a consolidation, one class per cause, each with a command-line tool's exit code for it (2 is left to
``argparse``, 1 to causes without a class of their own)."""


class ConsolidationError(RuntimeError):
    """A checkpoint could not be consolidated; the message names the checkpoint and the cause."""

    exit_code, summary = 1, "other"


class CheckpointNotFoundError(ConsolidationError):
    """The given path does not exist."""

    exit_code, summary = 3, "path missing"


class NotACheckpointError(ConsolidationError):
    """The path exists but holds no NeMo 2 distributed checkpoint."""

    exit_code, summary = 4, "not a NeMo checkpoint"


class UnfinishedCheckpointError(ConsolidationError):
    """NeMo's ``<ckpt>-unfinished`` marker is there, or DCP's ``.metadata`` is missing: the save never finished."""

    exit_code, summary = 5, "unfinished checkpoint"


class UnsupportedFormatError(ConsolidationError):
    """A checkpoint format that cannot be consolidated (``fsdp_dtensor``, ``zarr``, another ``sharded_backend``)."""

    exit_code, summary = 6, "unsupported format"


class OutputExistsError(ConsolidationError):
    """The output exists and may not be replaced, or it would overwrite the checkpoint; nothing is written."""

    exit_code, summary = 7, "output exists or would overwrite the checkpoint"


class CorruptShardError(ConsolidationError):
    """A shard file or ``.metadata`` is truncated, corrupt or leaves a part out; the message names it."""

    exit_code, summary = 8, "corrupt shard"


class UnknownLayoutError(ConsolidationError):
    """A checkpoint entry whose layout cannot be named safely (e.g. chunks that cover it in part), naming the key."""

    exit_code, summary = 11, "a layout that cannot be named safely"
