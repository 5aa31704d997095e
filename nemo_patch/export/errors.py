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

"""The errors of a Hugging Face export (each with its ``nemo-consolidate`` exit code). Standard library only."""

from typing import Sequence

from nemo_patch.engine.errors import ConsolidationError

__all__ = ["AdapterCheckpointError", "ExportError", "UntrustedContextError", "unassigned_error"]


class ExportError(ConsolidationError):
    """A Hugging Face export is not possible, e.g. NeMo has no exporter for the checkpoint's model class."""

    exit_code, summary = 10, "no HF exporter"


class UntrustedContextError(ConsolidationError):
    """The checkpoint's NeMo ``context/`` names code outside NeMo, megatron-core, torch, transformers and Lightning,
    which loading it would import and run (the message names it); refused without ``--trust-context``."""

    exit_code, summary = 16, "a context/ naming code outside NeMo's packages (see --trust-context)"


class AdapterCheckpointError(ConsolidationError):
    """A PEFT (LoRA) adapter checkpoint, adapter weights only, cannot be consolidated as asked."""

    exit_code, summary = 12, "an adapter checkpoint that cannot be consolidated as asked"


def unassigned_error(exporter: str, names: Sequence[str]) -> ExportError:
    """The error for ``names``, tensors of the Hugging Face model that NeMo's ``exporter`` assigned nothing to."""
    listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return ExportError(
        f"NeMo's {exporter} left {len(names)} tensor(s) of the Hugging Face model unassigned (no source tensor maps "
        f"to them): {listed}"
    )
