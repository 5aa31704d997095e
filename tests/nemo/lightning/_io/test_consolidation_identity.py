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

"""Which save a checkpoint holds, on checkpoints megatron-core saves: two saves under one name differ, a shard
rewritten in place (a Megatron-LM rollback writes ``.metadata`` last) is a save in progress, and a save that changes
while it is read is caught."""

import os
import shutil
import subprocess
import sys

import pytest

from nemo_patch.engine.errors import CorruptShardError, UnfinishedCheckpointError
from nemo_patch.engine.save_identity import SaveIdentity, check_unchanged, is_save_changed, save_identity

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]

#: Saves two tensors with megatron-core's dist_checkpointing (seeded by argv[3]) into argv[1].
SAVE = """
import os, sys, torch, torch.distributed as dist
def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.synchronize, torch.cuda.current_device = (lambda: None), (lambda: "cpu")  # no GPU on this runner
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    g = torch.Generator().manual_seed(int(sys.argv[3]))
    state = {name: ShardedTensor.from_rank_offsets("module." + name, torch.randn(8, 4, generator=g), replica_id=0)
             for name in ("embedding.word_embeddings.weight", "output_layer.weight")}
    dist_checkpointing.save(state, sys.argv[1])
if __name__ == "__main__":
    main()
"""


def _save(weights, seed):
    if weights.exists():
        shutil.rmtree(weights)
    weights.mkdir(parents=True)
    port = str(29500 + (hash(str(weights)) + seed) % 1000)
    subprocess.run([sys.executable, "-c", SAVE, str(weights), port, str(seed)], check=True, capture_output=True)


@pytest.fixture
def checkpoint(tmp_path):
    directory = tmp_path / "model--step=9"
    _save(directory / "weights", 0)
    return directory


def test_two_saves_under_one_name_have_two_identities(checkpoint):
    first = save_identity(checkpoint)
    assert first.layout == "torch_dist" and first.global_step == 10  # NeMo's step=<N> is the global step - 1
    assert save_identity(checkpoint).same_save(first)  # read again, unchanged
    _save(checkpoint / "weights", 0)  # the same tensors saved again under the same name
    assert not save_identity(checkpoint).same_save(first)
    assert SaveIdentity.from_json(first.as_json()) == first


def test_a_shard_rewritten_after_the_metadata_is_a_save_in_progress(checkpoint):
    shard = next((checkpoint / "weights").glob("*.distcp"))
    metadata = os.stat(checkpoint / "weights" / ".metadata")
    os.utime(shard, ns=(metadata.st_atime_ns, metadata.st_mtime_ns + 10**9))  # written after .metadata
    with pytest.raises(UnfinishedCheckpointError):
        save_identity(checkpoint)


def test_a_save_changed_while_read_is_refused(checkpoint):
    before = save_identity(checkpoint, allow_unfinished=True)
    _save(checkpoint / "weights", 1)  # saved again meanwhile, other tensors
    with pytest.raises(CorruptShardError) as raised:
        check_unchanged(checkpoint, before)
    assert is_save_changed(raised.value)
