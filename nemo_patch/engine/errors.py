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

"""The errors a consolidation can raise, one class per cause, each with the process exit code the CLI uses.

Every class derives from :class:`ConsolidationError`, so a caller that does not care about the cause catches that one.
Exit code 2 is left to ``argparse`` (bad command line) and 1 to causes without a class of their own. Each class's
``exit_code`` and ``summary`` are the one list of exit codes: ``nemo-consolidate --help`` and the documentation's table
are made from them.

Standard library only (no torch); never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

__all__ = [
    "CheckpointNotFoundError",
    "ConsolidationError",
    "CorruptShardError",
    "DtypeOverflowError",
    "ExportError",
    "NoMonitoredMetricError",
    "NotACheckpointError",
    "OutputExistsError",
    "PeerError",
    "PostCommandError",
    "UnfinishedCheckpointError",
    "UnknownLayoutError",
    "AdapterCheckpointError",
    "AdapterMergeError",
    "UnsupportedFormatError",
    "UntrustedContextError",
    "VerificationError",
]


class ConsolidationError(RuntimeError):
    """A checkpoint could not be consolidated; the message names the checkpoint and the cause."""

    #: Exit code of ``nemo-consolidate`` for this cause.
    exit_code = 1
    #: A few words for ``nemo-consolidate --help``'s list of exit codes.
    summary = "other"


class CheckpointNotFoundError(ConsolidationError):
    """The given path does not exist."""

    exit_code = 3
    summary = "path missing"


class NotACheckpointError(ConsolidationError):
    """The path exists but holds no NeMo 2 distributed checkpoint."""

    exit_code = 4
    summary = "not a NeMo checkpoint"


class UnfinishedCheckpointError(ConsolidationError):
    """NeMo's ``<ckpt>-unfinished`` marker is present (or DCP's ``.metadata`` is missing): the save never finished."""

    exit_code = 5
    summary = "unfinished checkpoint"


class UnsupportedFormatError(ConsolidationError):
    """A checkpoint format that cannot be consolidated (``fsdp_dtensor``, another ``sharded_backend``) or a ``zarr``
    array whose layout cannot be read safely; the message names it."""

    exit_code = 6
    summary = "unsupported format"


class OutputExistsError(ConsolidationError):
    """The output directory exists and overwriting was not asked for (or ``--force`` was asked for an output that is
    not a previous output or an empty directory), or the output would be the checkpoint, its root or a directory above
    them, or lie on or inside its ``weights/`` or ``context/``; nothing is written."""

    exit_code = 7
    summary = "output exists or would overwrite the checkpoint"


class CorruptShardError(ConsolidationError):
    """A shard file (or the ``.metadata`` file) is truncated or corrupt; the message names the file."""

    exit_code = 8
    summary = "corrupt shard"


class VerificationError(ConsolidationError):
    """A consolidated tensor differs from its source; the message names the tensor and the output file."""

    exit_code = 9
    summary = "verification failed"


class UnknownLayoutError(ConsolidationError):
    """A checkpoint entry whose layout the output plan does not understand (an expert entry without its expert axis,
    a tensor its stored chunks cover only in part, two entries mapping to one name); the message names the key. The
    consolidation fails instead of writing a misnamed or partly filled tensor."""

    exit_code = 11
    summary = "a layout that cannot be named safely"


class AdapterCheckpointError(ConsolidationError):
    """A PEFT (e.g. LoRA) adapter checkpoint (NeMo's ``weights/adapter_metadata.json``: adapter weights only, not a
    model) cannot be exported as asked: in the Hugging Face format its model class has no ``"hf-peft"`` exporter, or
    its PEFT method cannot be read from the context; the message names the class or the context. Adapters are never
    written as a model."""

    exit_code = 12
    summary = "an adapter checkpoint whose model class has no hf-peft exporter"


class AdapterMergeError(ConsolidationError):
    """Adapters cannot be merged into their base model: the base checkpoint NeMo recorded is missing or unreadable, the
    PEFT method is not LoRA, its ``alpha``/``dim`` are unknown, or an adapter tensor does not pair with a base weight;
    the message names the path, method or tensor. Nothing is written."""

    exit_code = 13
    summary = "adapters that cannot be merged (e.g. base checkpoint missing)"


class NoMonitoredMetricError(ConsolidationError):
    """The best checkpoint of a run was asked for (``nemo-consolidate --best``), but the run recorded no monitored
    metric: no ``ModelCheckpoint(monitor=...)`` metric in its checkpoints' state and none in their names."""

    exit_code = 14
    summary = "--best for a run that recorded no monitored metric"


class PeerError(ConsolidationError):
    """A peer process of a multi-process run (``torchrun``/``srun``, :mod:`nemo_patch.cli.distributed`) left the run
    (killed, crashed), did not answer within ``--timeout`` (frozen, hung), or was launched with different arguments;
    the message names the rank(s). Rank 0 publishes nothing unless every rank reported its part written."""

    exit_code = 15
    summary = "a torchrun/srun peer process that failed, froze past --timeout or was launched with different arguments"


class UntrustedContextError(ConsolidationError):
    """The checkpoint's NeMo ``context/`` names code outside the packages a NeMo model comes from (NeMo, megatron-core,
    torch, transformers, Lightning), which loading it would import and run; the message names it. Refused unless the
    user trusts the checkpoint (``--trust-context``)."""

    exit_code = 16
    summary = "a context/ naming code outside NeMo's packages (see --trust-context)"


class PostCommandError(ConsolidationError):
    """The command run after an output was published (``--post-command``, ``ckpt_consolidation_post_command``) failed
    or timed out; the output itself is complete and stays published, and its ``metadata.json`` records the result."""

    exit_code = 17
    summary = "a --post-command that failed or timed out"


class DtypeOverflowError(ConsolidationError):
    """The output dtype asked for (``--dtype``, ``ckpt_consolidation_dtype``) cannot hold a finite value of the
    checkpoint, which the cast would turn into ``inf`` (e.g. a weight above 65504 in ``fp16``); the message names the
    tensor and its largest magnitude. Nothing is published; ``bf16`` has fp32's exponent range, and without a dtype the
    stored one is kept. A value too small for the dtype becoming 0 is ordinary precision loss and is not refused."""

    exit_code = 18
    summary = "a --dtype too narrow for the checkpoint's values (finite values would become inf)"


class ExportError(ConsolidationError):
    """A Hugging Face export is not possible, e.g. NeMo has no exporter for the checkpoint's model class."""

    exit_code = 10
    summary = "no HF exporter"
