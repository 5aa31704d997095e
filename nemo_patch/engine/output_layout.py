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

"""The names of everything a consolidation writes, and the default shard size (standard library only).

Kept free of torch so that settings and the CLI can name outputs without importing it.
"""

from pathlib import Path
from typing import Dict, Union

__all__ = [
    "ADAPTER_STEM",
    "CONSOLIDATED_DIRNAME",
    "DTYPE_NAMES",
    "DEFAULT_MAX_SHARD_SIZE",
    "FORMAT_VERSION",
    "HF_DIRNAME",
    "INDEX_FILENAME",
    "METADATA_FILENAME",
    "MODEL_STEM",
    "OUTPUT_DIRNAMES",
    "RETAINED_DIRNAME",
    "SINGLE_FILENAME",
    "dtype_name",
    "index_filename",
    "post_command_log_path",
    "single_filename",
]

#: Name of the ``safetensors``-format output directory inside a checkpoint directory.
CONSOLIDATED_DIRNAME = "consolidated"
#: Name of the Hugging Face output directory inside a checkpoint directory.
HF_DIRNAME = "hf"
#: Output format -> output directory name.
OUTPUT_DIRNAMES: Dict[str, str] = {"safetensors": CONSOLIDATED_DIRNAME, "hf": HF_DIRNAME}
#: Directory in a checkpoint root holding outputs kept after NeMo's top-k removed their checkpoints
#: (``retained/<checkpoint name>/consolidated/``; see ``training.retention``).
RETAINED_DIRNAME = "retained"
#: Hugging Face's default ``max_shard_size`` ("5GB", decimal): 5 * 10**9 bytes of tensor data per file.
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
#: Stem of the weights files of a model output (``model.safetensors``, ``model-00001-of-00002.safetensors``).
MODEL_STEM = "model"
#: Stem of the weights files of a PEFT adapter output (``adapter_model.safetensors``, the name Hugging Face PEFT uses).
ADAPTER_STEM = "adapter_model"
#: Weights file name when everything fits in one shard.
SINGLE_FILENAME = "model.safetensors"
#: Index file name when there are several shards.
INDEX_FILENAME = "model.safetensors.index.json"
#: This package's description of an output (global step, source, tensor count, bytes, per-file digests).
METADATA_FILENAME = "metadata.json"
#: Version of the ``metadata.json`` layout.
FORMAT_VERSION = 2


#: Output dtypes a user may ask for (``ckpt_consolidation_dtype``, the CLI's ``--dtype``) -> the ``torch`` dtype's
#: attribute name.
DTYPE_NAMES: Dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def dtype_name(value: object) -> str:
    """The short name (``"bf16"``, ``"fp16"`` or ``"fp32"``) of an output dtype given as a short name, a torch name
    (``"bfloat16"``, ``"float16"``/``"half"``, ``"float32"``/``"float"``, case-insensitive) or a ``torch.dtype``.

    Raises:
        ValueError: anything else; the message names the accepted values.
    """
    text = str(value).removeprefix("torch.").lower() if not isinstance(value, bool) else ""
    name = _DTYPE_ALIASES.get(text, text)
    if name not in DTYPE_NAMES:
        raise ValueError(
            f"invalid dtype {value!r}: expected one of {', '.join(DTYPE_NAMES)} (or bfloat16, float16, float32)"
        )
    return name


def single_filename(stem: str = MODEL_STEM) -> str:
    """``model.safetensors`` (or ``adapter_model.safetensors``): the weights file when everything fits in one."""
    return f"{stem}.safetensors"


def index_filename(stem: str = MODEL_STEM) -> str:
    """``model.safetensors.index.json`` (or ``adapter_model.safetensors.index.json``) when there are several shards."""
    return f"{stem}.safetensors.index.json"


def post_command_log_path(output_dir: Union[str, Path]) -> Path:
    """Where the post command of the output ``output_dir`` writes its stdout and stderr: ``<output>.post-command.log``
    beside it (kept beside the output when the output is retained)."""
    output_dir = Path(output_dir)
    return output_dir.parent / f"{output_dir.name}.post-command.log"
