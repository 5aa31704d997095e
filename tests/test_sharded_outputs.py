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

"""Sharded consolidated outputs load back (#28, first part).

The final checkpoint of a real NeMo fit (``each_run``) is consolidated with a small ``max_shard_size`` into several
``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``, in fp32 and in bf16, each into the
layout the README's loading example names (``runs/demo/tiny_gpt/checkpoints/LATEST/consolidated``). The loaders must
give every tensor exactly as two oracles that share no code with them give it:

* the unsharded output of the same checkpoint (``model.safetensors``, read with ``safetensors.torch.load_file``);
* megatron-core's own loader (``dist_checkpointing.load`` of the distributed checkpoint into a TP=1 model), against
  which a fresh model loaded by the README's example, as written, is compared tensor by tensor.
"""

import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.digests import verify_digests
from nemo_patch.engine.load import load_consolidated_state_dict
from nemo_patch.engine.verify import verify_consolidated

pytestmark = pytest.mark.slow

#: Bytes of tensor data per shard: the tiny GPT's ~300 KB of fp32 weights (~150 KB in bf16) give several files.
MAX_SHARD_SIZE = 50_000
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: Run in a fresh interpreter: a one-process gloo group and megatron-core's parallel state, which would leak into the
#: other tests of this process. argv: the checkpoint's weights dir, the README snippet, [[working dir, dtype], ...].
LOAD_INTO_MODEL = textwrap.dedent(
    """
    import json, os, socket, sys, torch, torch.distributed as dist

    def tensors(model):
        return {k: v.clone() for k, v in model.state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def main():
        weights_dir, snippet, cases = sys.argv[1], open(sys.argv[2]).read(), json.loads(sys.argv[3])
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from nemo_patch.testing.cpu_harness import megatron_on_cpu
        from nemo_patch.testing.tiny_gpt import tiny_gpt_config

        parallel_state.initialize_model_parallel(1, 1)
        report = {}
        with megatron_on_cpu():
            # The oracle: megatron-core's own loader reads the distributed checkpoint into a TP=1 model.
            model_parallel_cuda_manual_seed(1)
            reference = tiny_gpt_config().configure_model(tokenizer=None)
            initial = tensors(reference)
            sharded = {k: v for k, v in reference.sharded_state_dict(prefix="module.").items()
                       if "_extra_state" not in k}
            loaded = dist_checkpointing.load(sharded, weights_dir)
            state = {k[len("module."):]: v for k, v in loaded.items() if k.startswith("module.")}
            missing, unexpected = reference.load_state_dict(state, strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
            expected = tensors(reference)
            report["reference_changed"] = sum(not torch.equal(initial[k], v) for k, v in expected.items())
            for cwd, dtype_name in cases:
                dtype = getattr(torch, dtype_name)
                model_parallel_cuda_manual_seed(2)
                mcore_gpt_model = tiny_gpt_config().configure_model(tokenizer=None).to(dtype)
                before = tensors(mcore_gpt_model)
                os.chdir(cwd)
                exec(snippet, {"mcore_gpt_model": mcore_gpt_model})  # the README's example, as written
                after = tensors(mcore_gpt_model)
                assert after.keys() == expected.keys(), sorted(set(after) ^ set(expected))
                for key, value in expected.items():
                    assert after[key].dtype == dtype, (key, after[key].dtype)
                    assert torch.equal(after[key], value.to(dtype)), f"{key} differs from megatron-core's load"
                changed = sum(not torch.equal(before[k], v) for k, v in after.items())
                report[dtype_name] = {"compared": len(after), "changed": changed}
        print(json.dumps(report))

    if __name__ == "__main__":
        main()
    """
)


def _readme_loading_example():
    """The README's Python block that calls ``load_consolidated_into``, and the output path it names."""
    text = (REPO / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "load_consolidated_into(" in b]
    assert len(blocks) == 1, blocks
    paths = re.findall(r"load_consolidated_into\(\s*\w+,\s*\"([^\"]+)\"\s*\)", blocks[0])
    assert len(paths) == 1 and paths[0].endswith("/LATEST/consolidated"), blocks[0]
    return blocks[0], paths[0]


@pytest.fixture(scope="module")
def sharded_outputs(each_run, tmp_path_factory):
    """dtype name -> (working dir, sharded output, unsharded output of the same dtype): the run's final checkpoint,
    copied to ``<working dir>/<the README's path>`` (``LATEST`` a relative symlink, as the strategy makes it) and
    consolidated there in shards; the unsharded output is the run's own for fp32, a default consolidation for bf16."""
    _, readme_path = _readme_loading_example()
    checkpoint = (each_run["root"] / "LATEST").resolve()
    base = tmp_path_factory.mktemp("sharded")
    outputs = {}
    for name, dtype in DTYPES.items():
        root = base / name / readme_path[: -len("/LATEST/consolidated")]
        copy = root / checkpoint.name
        shutil.copytree(checkpoint, copy, ignore=shutil.ignore_patterns("consolidated"))
        (root / "LATEST").symlink_to(checkpoint.name)
        cast = None if dtype == torch.float32 else dtype
        sharded = consolidate_checkpoint(copy, global_step=6, max_shard_size=MAX_SHARD_SIZE, dtype=cast, verify=True)
        if cast is None:
            single = checkpoint / "consolidated"
        else:
            single = consolidate_checkpoint(copy, output_dir=base / f"single-{name}", dtype=cast).output_dir
        outputs[name] = (base / name, sharded.output_dir, single)
    return outputs


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_a_sharded_output_loads_as_its_unsharded_output(sharded_outputs, dtype_name):
    _, sharded, single = sharded_outputs[dtype_name]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert sorted(p.name for p in single.iterdir()) == ["metadata.json", "model.safetensors"]
    expected = load_file(str(single / "model.safetensors"))
    fp32 = load_file(str(sharded_outputs["fp32"][2] / "model.safetensors"))
    assert expected.keys() == fp32.keys() and all(
        torch.equal(expected[n], t.to(DTYPES[dtype_name])) for n, t in fp32.items()
    )
    for path in (sharded, sharded / "model.safetensors.index.json", str(sharded)):
        loaded = load_consolidated_state_dict(path)
        assert sorted(loaded) == sorted(expected) == sorted(index["weight_map"])
        for name, tensor in expected.items():
            assert loaded[name].dtype == DTYPES[dtype_name] and loaded[name].shape == tensor.shape, name
            assert torch.equal(loaded[name], tensor), name
    weights = sharded.parent / "weights"
    assert verify_consolidated(weights, sharded) == len(expected) == verify_digests(sharded)


def test_the_readmes_loading_example_loads_sharded_outputs_into_a_real_model(sharded_outputs, tmp_path):
    """The README's example, as written, loads each sharded output into a fresh TP=1 megatron-core GPT (fp32 and bf16
    parameters): every weight equals what megatron-core's own loader reads from the distributed checkpoint (cast to
    the output's dtype)."""
    snippet, _ = _readme_loading_example()
    weights = sharded_outputs["fp32"][1].parent / "weights"
    cases = [[str(cwd), str(DTYPES[name]).removeprefix("torch.")] for name, (cwd, _, _) in sharded_outputs.items()]
    script, example = tmp_path / "load_into_model.py", tmp_path / "readme_example.py"
    script.write_text(LOAD_INTO_MODEL)
    example.write_text(snippet)
    command = [sys.executable, str(script), str(weights), str(example), json.dumps(cases)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    tensor_count = len(load_consolidated_state_dict(sharded_outputs["fp32"][1]))
    assert report["reference_changed"] == tensor_count  # megatron-core's load replaced every initial weight
    for dtype_name in ("float32", "bfloat16"):
        # every weight compared, and every one differed from the fresh model's before the example loaded it
        assert report[dtype_name] == {"compared": tensor_count, "changed": tensor_count}, report
