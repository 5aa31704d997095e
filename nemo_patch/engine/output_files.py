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

"""Find and read the weights files of a consolidated output: one file, or shards through their index.

Every reader of outputs goes through :func:`output_weight_map`, which checks the index against the files' headers
before anything is read. Never imports NeMo, Lightning or megatron-core.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import torch
from safetensors import safe_open

from nemo_patch.engine.output_layout import MODEL_STEM, index_filename, single_filename
from nemo_patch.engine.safe_files import MAX_JSON_BYTES, read_regular_file

__all__ = [
    "InvalidOutputError",
    "is_plain_filename",
    "output_weight_map",
    "read_index_weight_map",
    "read_output_tensors",
]


class InvalidOutputError(ValueError):
    """A consolidated output's files contradict each other or its index is malformed; the message names the file and,
    where one is involved, the tensor."""


def is_plain_filename(name: object) -> bool:
    """Whether ``name`` is a file name that stays inside its directory: a non-empty string without ``/``, ``\\`` or
    NUL that is not ``.`` or ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _refuse_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """``json.loads`` object hook: a dict, unless a key is repeated (JSON allows it; the last one would win)."""
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise InvalidOutputError(f"key {key!r} appears more than once")
        result[key] = value
    return result


def _check_files(output_dir: Path, weight_map: Mapping[str, str], source: Path) -> None:
    """Each file of ``weight_map`` exists and holds exactly the tensors ``weight_map`` maps to it."""
    by_file: Dict[str, set] = {}
    for name, filename in weight_map.items():
        by_file.setdefault(filename, set()).add(name)
    for filename, expected in sorted(by_file.items()):
        if not (output_dir / filename).is_file():
            raise FileNotFoundError(
                f"{source} maps tensor {min(expected)} to {filename}, which is not a file in {output_dir}"
            )
    for filename, expected in sorted(by_file.items()):
        path = output_dir / filename
        try:
            with safe_open(str(path), framework="pt") as handle:
                present = set(handle.keys())
        except Exception as error:  # safetensors' SafetensorError, OSError
            raise InvalidOutputError(f"Cannot read the safetensors header of {path}: {error}") from error
        for name in sorted(present - expected):
            if name in weight_map:
                raise InvalidOutputError(
                    f"Tensor {name} is in {path}, but {source} maps it to {weight_map[name]}: every tensor must be in "
                    "exactly the file the index names"
                )
            raise InvalidOutputError(f"Tensor {name} in {path} is not in the weight_map of {source}")
        for name in sorted(expected - present):
            raise InvalidOutputError(f"{source} maps tensor {name} to {filename}, but {path} does not hold it")


def read_index_weight_map(index_path: Union[str, Path]) -> Dict[str, str]:
    """The ``weight_map`` of a safetensors index, checked for its form and against the headers of the files it names.

    Args:
        index_path: a ``model.safetensors.index.json`` (or ``adapter_model.safetensors.index.json``) file.

    Returns:
        Tensor name -> weights file name (a plain name in the index's directory), in the index's order.

    Raises:
        OSError: the index cannot be read (not a regular file, too large), or it or a file it names does not exist.
        InvalidOutputError: the index is not JSON, has no ``weight_map`` object, names a tensor twice or none, or maps
            a tensor to something other than a plain file name; or a file holds a tensor the index does not map to it,
            or lacks one it does. The message names the index, the tensor and the files.
    """
    index_path = Path(index_path)
    data = read_regular_file(index_path, MAX_JSON_BYTES)
    try:
        index = json.loads(data.decode("utf-8"), object_pairs_hook=_refuse_duplicates)
    except InvalidOutputError as error:
        raise InvalidOutputError(f"Invalid safetensors index {index_path}: {error}") from None
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise InvalidOutputError(f"Invalid safetensors index {index_path}: not UTF-8 JSON ({error})") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InvalidOutputError(f"Invalid safetensors index {index_path}: no non-empty \"weight_map\" object")
    for name, filename in weight_map.items():
        if not is_plain_filename(filename):
            raise InvalidOutputError(
                f"Invalid safetensors index {index_path}: tensor {name} is mapped to {filename!r}, which is not a "
                "plain file name in the index's directory"
            )
    _check_files(index_path.parent, weight_map, index_path)
    return dict(weight_map)


def output_weight_map(output_dir: Union[str, Path], stems: Sequence[str] = (MODEL_STEM,)) -> Dict[str, str]:
    """Tensor name -> weights file name of a consolidated output, checked against the files' headers.

    Args:
        output_dir: a consolidated output directory (``consolidated/``, ``hf/``, ``retained/<name>/consolidated``).
        stems: the weights file stems to look for, in order (``"model"``, ``"adapter_model"``): the first with
            ``<stem>.safetensors`` or ``<stem>.safetensors.index.json`` is used.

    Returns:
        Tensor name -> file name in ``output_dir`` (every file name plain; each tensor in exactly that file).

    Raises:
        FileNotFoundError: ``output_dir`` holds neither a single weights file nor an index of any stem, or a file the
            index names is missing (the message names it).
        InvalidOutputError: the single file and the index of one stem both exist, the index is malformed
            (:func:`read_index_weight_map`), or a file's tensors differ from what the index maps to it (the message
            names the tensor and the files).
    """
    output_dir = Path(output_dir)
    for stem in stems:
        single, index = output_dir / single_filename(stem), output_dir / index_filename(stem)
        if single.is_file() and index.is_file():
            raise InvalidOutputError(
                f"{output_dir} holds both {single.name} and {index.name}: it is not clear which weights to read"
            )
        if index.is_file():
            return read_index_weight_map(index)
        if single.is_file():
            try:
                with safe_open(str(single), framework="pt") as handle:
                    return {name: single.name for name in handle.keys()}
            except Exception as error:  # safetensors' SafetensorError
                raise InvalidOutputError(f"Cannot read the safetensors header of {single}: {error}") from error
    wanted = " or ".join(f"{single_filename(stem)} / {index_filename(stem)}" for stem in stems)
    raise FileNotFoundError(f"No consolidated {wanted} in {output_dir}")


def read_output_tensors(output_dir: Union[str, Path], weight_map: Mapping[str, str]) -> Dict[str, torch.Tensor]:
    """Read every tensor of ``weight_map`` (from :func:`output_weight_map` or :func:`read_index_weight_map`) from its
    file in ``output_dir``, one file open at a time.

    Args:
        output_dir: the directory of the weights files.
        weight_map: tensor name -> file name.

    Returns:
        Tensor name -> CPU tensor with the shape and dtype stored in the file (a ``bfloat16`` output gives
        ``torch.bfloat16`` tensors), in ``weight_map``'s order.

    Raises:
        InvalidOutputError: a file name is not plain, or a file does not hold a tensor mapped to it.
        OSError: a file cannot be read.
    """
    output_dir = Path(output_dir)
    by_file: Dict[str, List[str]] = {}
    for name, filename in weight_map.items():
        if not is_plain_filename(filename):
            raise InvalidOutputError(f"Tensor {name} is mapped to {filename!r}, not a plain file name in {output_dir}")
        by_file.setdefault(filename, []).append(name)
    tensors: Dict[str, torch.Tensor] = {}
    for filename, names in by_file.items():
        with safe_open(str(output_dir / filename), framework="pt") as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise InvalidOutputError(f"Tensor {name} is not in {output_dir / filename}")
                tensors[name] = handle.get_tensor(name)
    return {name: tensors[name] for name in weight_map}
