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

"""Output dtypes: every checkpoint dtype (fp32, bf16, fp16) x every requested dtype (none, bf16, fp16, fp32), in both
formats, offline and during training, on the tiny Llama.

The fp32 checkpoint is the NeMo import of a random ``transformers`` Llama; the bf16 and fp16 ones are 2-step
fine-tunes of it with ``nl.MegatronMixedPrecision("bf16-mixed")`` and ``("16-mixed")`` (megatron-core's
mixed-precision optimizer; the CPU harness names CPU tensors' types as CUDA ones for it, stub 7), so their
``module.*`` weights are stored in bf16 and fp16 as on a GPU cluster.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import dcp_reference_tensors, run_fit
from safetensors.torch import load_file

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.export.hf import cast_floating, checkpoint_dtype

pytestmark = pytest.mark.slow

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: trainer precision -> (output format, ConsolidationConfig.dtype) of the consolidation during that fine-tune.
FINE_TUNES = {"bf16-mixed": ("hf", "fp16"), "16-mixed": ("safetensors", "bf16")}
OUTPUT_DIRS = {"hf": "hf", "safetensors": "consolidated"}


@pytest.fixture(scope="module")
def checkpoints(imported_llama, tmp_path_factory):
    """Checkpoint dtype name -> (checkpoint dir, fit report or None)."""
    found = {"fp32": (imported_llama / "nemo", None)}
    for precision, (output_format, cast) in FINE_TUNES.items():
        out = tmp_path_factory.mktemp(precision)
        report = run_fit(
            out,
            model_from=imported_llama / "nemo",
            frequency="latest",
            format=output_format,
            max_steps=2,
            save_every=2,
            precision=precision,
            config_arg=[f"dtype={cast}"],
        )
        found["bf16" if precision == "bf16-mixed" else "fp16"] = (
            out / "tiny_gpt" / "checkpoints" / report["latest"],
            report,
        )
    return found


def _tensors(directory: Path):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def references(checkpoints, imported_llama, tmp_path_factory):
    """(checkpoint dtype, format) -> the expected tensors in the checkpoint's own dtype, from oracles that are not
    the product: for ``safetensors``, PyTorch's DCP converter's reading of the checkpoint (``dcp_to_torch_save``);
    for ``hf``, the original Hugging Face weights NeMo imported (the fp32 checkpoint is that import, bit for bit).
    The fine-tuned checkpoints' ``hf`` references are the export with no dtype asked, once it is checked to be in the
    checkpoint's dtype (its values are checked against ``transformers`` in test_hf_families and test_hf_export)."""
    found = {}
    for name, (checkpoint, _) in checkpoints.items():
        scratch = tmp_path_factory.mktemp(f"{name}-dcp")
        found[name, "safetensors"] = dcp_reference_tensors(checkpoint / "weights", scratch)
        if name == "fp32":
            found[name, "hf"] = _tensors(imported_llama / "hf")
            continue
        out = tmp_path_factory.mktemp(f"{name}-hf")
        assert main([str(checkpoint), "--format", "hf", "--trust-context", "--out", str(out / "o"), "--quiet"]) == 0
        found[name, "hf"] = _tensors(out / "o")
    return found


@pytest.mark.parametrize("output_format", sorted(OUTPUT_DIRS))
@pytest.mark.parametrize("requested", [None, "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("stored", ["fp32", "bf16", "fp16"])
def test_every_checkpoint_dtype_exports_in_every_requested_dtype(
    checkpoints, references, stored, requested, output_format, tmp_path, capsys
):
    checkpoint, _ = checkpoints[stored]
    reference = references[stored, output_format]
    assert {tensor.dtype for tensor in reference.values()} == {DTYPES[stored]}  # default: the checkpoint's dtype
    args = [
        str(checkpoint),
        "--format",
        output_format,
        "--trust-context",
        "--out",
        str(tmp_path / "o"),
        "--quiet",
        "--verify",
    ]
    code = main(args + ([] if requested is None else ["--dtype", requested]))
    assert code == 0, capsys.readouterr().err
    want = DTYPES[requested or stored]
    exported = _tensors(tmp_path / "o")
    assert sorted(exported) == sorted(reference)
    for name, tensor in exported.items():
        assert tensor.dtype == want and torch.equal(tensor, reference[name].to(want)), name
    meta = json.loads((tmp_path / "o" / "metadata.json").read_text())
    if output_format == "hf":
        assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")
    # Both formats record the cast asked for, null when none was.
    assert meta["dtype"] == (None if requested is None else str(want).removeprefix("torch."))


@pytest.mark.parametrize("precision", sorted(FINE_TUNES))
def test_consolidation_during_training_casts_as_asked(checkpoints, references, precision):
    output_format, cast = FINE_TUNES[precision]
    stored = "bf16" if precision == "bf16-mixed" else "fp16"
    checkpoint, report = checkpoints[stored]
    assert report["consolidations"] == 1 and report["consolidation_errors"] == []
    written = _tensors(checkpoint / OUTPUT_DIRS[output_format])
    reference = references[stored, output_format]
    assert sorted(written) == sorted(reference)
    for name, tensor in written.items():
        assert tensor.dtype == DTYPES[cast] and torch.equal(tensor, reference[name].to(DTYPES[cast])), name


def test_integer_tensors_are_never_cast_and_the_checkpoint_dtype_is_the_largest_share():
    state = {
        "w": torch.ones(4, 4, dtype=torch.bfloat16),
        "b": torch.ones(2, dtype=torch.float32),
        "steps": torch.arange(3, dtype=torch.int64),
        "mask": torch.ones(2, dtype=torch.bool),
    }
    assert checkpoint_dtype(state) == torch.bfloat16  # 32 bytes of bf16 against 8 of fp32
    cast = cast_floating(state, torch.float16)
    assert {name: tensor.dtype for name, tensor in cast.items()} == {
        "w": torch.float16,
        "b": torch.float16,
        "steps": torch.int64,
        "mask": torch.bool,
    }
    assert cast["steps"] is state["steps"] and cast["mask"] is state["mask"]
