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

"""Check a consolidated output tensor by tensor against the distributed checkpoint it was made from.

Never imports NeMo, Lightning or megatron-core.
"""

from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from nemo_patch.engine.casting import cast_overflow
from nemo_patch.engine.checkpoint_reader import open_weights
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError, UnfinishedCheckpointError
from nemo_patch.engine.output_files import output_weight_map
from nemo_patch.engine.output_layout import ADAPTER_STEM, MODEL_STEM
from nemo_patch.engine.plan import OutputTensor, plan_outputs
from nemo_patch.engine.safe_files import read_json_file
from nemo_patch.engine.save_identity import SaveIdentity, save_identity

__all__ = [
    "VerificationError",
    "output_shapes",
    "tensors_bitwise_equal",
    "verify_consolidated",
    "verify_names_and_shapes",
]


class VerificationError(ConsolidationError):
    """A consolidated tensor differs from its source; the message names the tensor and the output file."""

    exit_code, summary = 9, "verification failed"


def _where(output: OutputTensor) -> str:
    """``key[i, j]`` of an output tensor's source (for messages)."""
    return output.key + (f"[{', '.join(map(str, output.index))}]" if output.index else "")


def output_shapes(output_dir: Union[str, Path]) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of every tensor in a consolidated output, from the safetensors headers (no tensor data read).

    Raises:
        VerificationError: an output file cannot be read, or the output's index is malformed or contradicts its files
            (:func:`.output_files.output_weight_map`).
    """
    output_dir = Path(output_dir)
    shapes: Dict[str, Tuple[int, ...]] = {}
    try:
        for filename in sorted(set(output_weight_map(output_dir, stems=(MODEL_STEM, ADAPTER_STEM)).values())):
            with safe_open(str(output_dir / filename), framework="pt") as handle:
                shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
    except Exception as error:  # OSError, ValueError, safetensors' SafetensorError
        raise VerificationError(f"Cannot read the consolidated output in {output_dir}: {error}") from error
    return shapes


def verify_names_and_shapes(output_dir: Union[str, Path], expected: Mapping[str, Tuple[int, ...]], source: str) -> int:
    """Check that a consolidated output holds exactly the names and shapes of ``expected``.

    Args:
        output_dir: a consolidated output directory.
        expected: name -> shape.
        source: what ``expected`` describes, for the message.

    Returns:
        The number of tensors checked.

    Raises:
        VerificationError: naming the first differing key (in sorted order) with both sides' shapes.
    """
    actual = output_shapes(output_dir)
    for name in sorted(set(actual) | set(expected)):
        if actual.get(name) != expected.get(name):
            have = "absent" if name not in actual else f"shape {list(actual[name])}"
            want = "absent" if name not in expected else f"shape {list(expected[name])}"
            raise VerificationError(
                f"{output_dir} does not match {source}: first differing key {name} is {have} in the output and "
                f"{want} in the model"
            )
    return len(actual)


def tensors_bitwise_equal(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Bitwise equality (so NaNs compare equal to themselves and -0.0 differs from 0.0)."""
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        return False
    return torch.equal(expected.contiguous().view(torch.uint8), actual.contiguous().view(torch.uint8))


def verify_consolidated(
    weights_dir: Union[str, Path], output_dir: Union[str, Path], metadata: Optional[Metadata] = None
) -> int:
    """Re-read every tensor of a consolidated output and compare it bitwise with its source in the checkpoint.

    Floating-point sources are cast to the output's dtype first, with the consolidation's cast, so the comparison is
    exact; an output value that is not finite where its source is fails first (:func:`.casting.cast_overflow`). Reads
    one tensor at a time, once its shape in the output's header is its source's.

    Args:
        weights_dir: the checkpoint's DCP directory (``<ckpt>/weights``).
        output_dir: a consolidated output (``model.safetensors`` or shards plus ``model.safetensors.index.json``).
        metadata: the already-read DCP metadata of ``weights_dir``, if the caller has it.

    Returns:
        The number of tensors compared.

    Raises:
        CorruptShardError: a shard file of the checkpoint cannot be read (the message names it).
        VerificationError: a tensor differs (or holds inf where its source is finite), is missing from the output or
            from the checkpoint, an output file cannot be read, or the output's index is malformed or contradicts its
            files; the message names the tensor and the output file.
    """
    weights_dir, output_dir = Path(weights_dir), Path(output_dir)
    metadata, reader = open_weights(weights_dir, metadata=metadata)
    sources = {output.spec.name: output for output in plan_outputs(metadata)}
    try:
        weight_map = output_weight_map(output_dir, stems=(MODEL_STEM, ADAPTER_STEM))
    except Exception as error:  # OSError, ValueError, safetensors' SafetensorError
        raise VerificationError(f"Cannot read the consolidated output in {output_dir}: {error}") from error
    missing = sorted(set(sources) - set(weight_map))
    extra = sorted(set(weight_map) - set(sources))
    if missing or extra:
        raise VerificationError(
            f"{output_dir} does not hold the checkpoint's tensors: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    by_file: Dict[str, list] = {}
    for name, filename in weight_map.items():
        by_file.setdefault(filename, []).append(name)
    for filename, names in sorted(by_file.items()):
        try:
            with safe_open(str(output_dir / filename), framework="pt") as handle:
                for name in names:
                    source = sources[name]
                    shape = tuple(handle.get_slice(name).get_shape())
                    if shape != tuple(source.spec.shape):  # before reading it: its size is then the checkpoint's
                        raise VerificationError(
                            f"Tensor {name} in {output_dir / filename} has shape {list(shape)}; {_where(source)} of "
                            f"{weights_dir} has {list(source.spec.shape)}"
                        )
                    actual = handle.get_tensor(name)
                    try:
                        expected = reader.read(source.key, source.index)
                    except (Exception, CheckpointException) as error:
                        raise CorruptShardError(
                            f"Cannot read shard file(s) {', '.join(reader.files_of(source.key))} of {weights_dir} "
                            f"(tensor {source.key}): {error}"
                        ) from error
                    if expected.dtype != actual.dtype and expected.is_floating_point():
                        overflow = cast_overflow(expected, actual) if expected.shape == actual.shape else None
                        if overflow is not None:
                            raise VerificationError(
                                f"Tensor {name} in {output_dir / filename} holds inf where {_where(source)} of "
                                f"{weights_dir} is finite: {overflow}"
                            )
                        expected = expected.to(actual.dtype)
                    if not tensors_bitwise_equal(expected, actual):
                        raise VerificationError(
                            f"Tensor {name} in {output_dir / filename} differs from {_where(source)} of {weights_dir}"
                        )
        except ConsolidationError:
            raise
        except Exception as error:
            raise VerificationError(f"Cannot read {output_dir / filename}: {type(error).__name__}: {error}") from error
    return len(weight_map)


def verify_identity(checkpoint_dir: Union[str, Path], output_dir: Union[str, Path]) -> Optional[SaveIdentity]:
    """The output was made from the save the checkpoint holds now.

    Args:
        checkpoint_dir: the checkpoint (``<ckpt>/``, its ``weights/`` or an ``iter_<N>``).
        output_dir: its output, whose ``metadata.json`` records ``"save"`` (outputs written before identities were
            recorded record none: nothing is compared then).

    Returns:
        The identity the output records, or ``None`` when it records none.

    Raises:
        VerificationError: the checkpoint holds another save (saved again, or copied, after the output was made),
            or a save is in progress in it; the message says which.
    """
    try:
        manifest = read_json_file(Path(output_dir) / "metadata.json")
    except (OSError, ValueError):
        return None  # the digest check reports an unreadable metadata.json
    if not isinstance(manifest, dict) or "save" not in manifest:
        return None
    try:
        recorded = SaveIdentity.from_json(manifest["save"])
    except ValueError as error:
        raise VerificationError(f"{output_dir}/metadata.json records a malformed \"save\": {error}") from error
    try:
        now = save_identity(checkpoint_dir, read_run=False)
    except UnfinishedCheckpointError as error:
        raise VerificationError(f"{checkpoint_dir} is being saved again: {error}") from error
    if not now.same_save(recorded):
        raise VerificationError(
            f"{output_dir} was made from another save of {checkpoint_dir}: the checkpoint was saved again (or "
            "copied) after the output was made; consolidate it again"
        )
    return recorded
