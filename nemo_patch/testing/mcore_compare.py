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

"""Compare a consolidated output with megatron-core's own reading of the checkpoint it came from.

``python -m nemo_patch.testing.mcore_compare <weights dir> <output dir>`` loads every tensor of the distributed
checkpoint with megatron-core's ``dist_checkpointing.load_plain_tensors`` (its own reader, for ``torch_dist`` and
``zarr`` alike; a one-process gloo group, as megatron-core's loaders need one), and checks that each model tensor
(``module.*``, no ``_extra_state``), split per layer where it is layer-stacked, equals the consolidated tensor of that
name bit for bit, and that the output holds nothing else. Prints one JSON line: ``{"compared": n}`` or
``{"error": "..."}`` (exit code 1).

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import json
import os
import pathlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:
    import torch


def compare(weights_dir: Path, output_dir: Path) -> int:
    """The number of tensors compared.

    Raises:
        AssertionError: a tensor differs, or one is missing on either side (the message names it).
    """
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    with socket.socket() as probe:  # a free port for the one-process group
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    created = not dist.is_initialized()  # the one-process group is ended again: the caller's process is left as it was
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        # megatron-core loads common.pt with torch.load's default (weights_only): NeMo's holds pathlib paths, which
        # NeMo allows when its own modules are imported; this aid must not depend on what an earlier test imported
        with torch.serialization.safe_globals([pathlib.PosixPath, pathlib.Path]):
            plain = dist_checkpointing.load_plain_tensors(str(weights_dir))
    finally:
        if created:
            dist.destroy_process_group()
    # The expected names are written here from megatron-core's own model naming (``decoder.layers.<i>.<rest>``, what
    # ``GPTModel.state_dict()`` calls a layer's tensor), never with the product's key mapping: this is the oracle.
    expected: Dict[str, torch.Tensor] = {}
    for key, tensor in plain.items():
        if not key.startswith("module.") or "_extra_state" in key or not isinstance(tensor, torch.Tensor):
            continue
        name = key[len("module.") :]
        head, sep, tail = name.partition(".layers.")
        if not sep or tail[:1].isdigit():
            expected[name] = tensor
        else:  # layer-stacked: one output tensor per layer, the layer index after ``layers``
            for layer in range(tensor.shape[0]):
                expected[f"{head}.layers.{layer}.{tail}"] = tensor[layer]
    files = sorted(output_dir.glob("*.safetensors"))
    actual: Dict[str, torch.Tensor] = {}
    for file in files:
        actual.update(load_file(str(file)))
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    assert not missing and not extra, f"missing {missing[:5]}, unexpected {extra[:5]}"
    for name, tensor in expected.items():
        assert _bitwise_equal(tensor.contiguous(), actual[name]), f"{name} differs from megatron-core's load"
    return len(expected)


def _bitwise_equal(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Same dtype, shape and bytes (NaNs and signed zeros included), by torch alone."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; see the module docstring."""
    args = sys.argv[1:] if argv is None else argv
    try:
        print(json.dumps({"compared": compare(Path(args[0]), Path(args[1]))}))
    except AssertionError as error:
        print(json.dumps({"error": str(error)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
