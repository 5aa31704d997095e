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

Inside a checkpoint directory ``<ckpt>/``, the output directory is ``consolidated/`` for this package's
``safetensors`` format and ``hf/`` for a Hugging Face directory (:data:`OUTPUT_DIRNAMES`). In it, the weights are
``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json`` when they
exceed the shard size (``transformers``' ``save_pretrained`` naming), and this package's ``metadata.json``
(version :data:`FORMAT_VERSION`). Kept free of torch so that settings and the CLI can name outputs without importing
it.
"""

import re
from fractions import Fraction
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
    "parse_size",
    "shard_filename",
    "single_filename",
]

#: Name of the ``safetensors``-format output directory inside a checkpoint directory.
CONSOLIDATED_DIRNAME = "consolidated"
#: Name of the Hugging Face output directory inside a checkpoint directory.
HF_DIRNAME = "hf"
#: Output format (``ckpt_consolidation_format``, the CLI's ``--format``) -> output directory name.
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


def shard_filename(index: int, count: int, stem: str = MODEL_STEM) -> str:
    """``model-00001-of-00003.safetensors`` for ``index=0, count=3`` (Hugging Face's naming); ``stem`` is
    :data:`MODEL_STEM` or :data:`ADAPTER_STEM`."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}.safetensors"


def single_filename(stem: str = MODEL_STEM) -> str:
    """``model.safetensors`` (or ``adapter_model.safetensors``): the weights file when everything fits in one."""
    return f"{stem}.safetensors"


def index_filename(stem: str = MODEL_STEM) -> str:
    """``model.safetensors.index.json`` (or ``adapter_model.safetensors.index.json``) when there are several shards."""
    return f"{stem}.safetensors.index.json"


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(value: Union[int, str]) -> int:
    """Bytes (>= 1) of a shard size given as ``transformers``' ``save_pretrained(max_shard_size=...)`` takes it.

    Args:
        value: an ``int``, or a number with an optional unit: ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000),
            ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024); e.g. ``"5GB"``, ``"500MiB"``. Units are
            case-insensitive except a final lowercase ``b`` after a power of 1000 (or alone), which counts bits as
            ``transformers.utils.hub.convert_file_size_to_int`` reads it (``"5Gb"`` is 625,000,000 bytes).

    Raises:
        ValueError: anything else, or less than one byte.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    match = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match and isinstance(value, str):
        unit = match.group(2) or ""
        try:
            size = Fraction(match.group(1)) * _UNITS[unit.upper()]  # exact, any size
        except ValueError:  # more digits than int() converts
            size = Fraction(0)
        if value.strip().endswith("b") and not unit.lower().endswith("ib"):
            size /= 8
        if int(size) >= 1:
            return int(size)
    raise ValueError(f"invalid size {value!r}: expected a number of bytes >= 1 or a size such as '5GB' or '500MiB'")
