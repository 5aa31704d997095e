#!/usr/bin/env python
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

"""Consolidation speed and memory against PyTorch's stock converter and a plain copy, on one synthetic checkpoint.

1. Generates a synthetic GPT-shaped ``torch_dist`` checkpoint with megatron-core's ``dist_checkpointing.save``
   (single process, gloo): layer-stacked ``module.decoder.layers.*`` tensors saved per layer and split in TP=2-style
   shards along their TP axis, exactly as megatron-core lays out a TP=2 run; by default about 2.4 GB of fp32 model
   weights. ``--with-optimizer`` adds Adam ``exp_avg``/``exp_avg_sq`` for every weight, as NeMo's intermediate
   checkpoints carry.
2. Runs, each in a fresh process, on the same ``weights/`` directory:
   - ``nemo_patch``: :func:`nemo_patch.consolidate_checkpoint` (model weights -> safetensors);
   - ``dcp_to_torch_save``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (what a user would reach
     for: the whole directory -> one ``torch.save`` file);
   - ``copy``: ``shutil.copytree`` of the ``weights/`` bytes (the I/O floor), and ``copy + fsync``, the same made
     durable, since the consolidation fsyncs its output before publishing it.
3. Prints wall seconds, MB/s of model-weight bytes, peak RSS (from ``wait4``), and the ratios.

The files fit in this machine's page cache, so "I/O" here is mostly memory bandwidth and CPU, as on a node with a
warm cache. Each method runs ``--repeat`` times (default 3), round-robin; the table shows the median wall time and
the spread. A last row, ``start-up only``, times a process that only imports the consolidation module (Python, torch,
``torch.distributed.checkpoint``): the part of ``nemo_patch``'s time that is not consolidation.
Usage: .venv/bin/python scripts/bench_consolidation.py [--layers 12] [--hidden 2048] [--with-optimizer] [--repeat 3]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

GENERATE = r"""
import os, sys, torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

out, layers, hidden, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tp, with_optim = 2, sys.argv[5] == "1"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29517")
dist.init_process_group("gloo", rank=0, world_size=1)
ffn = 4 * hidden
# name: (per-layer shape, TP axis or None)
layer_params = {
    "self_attention.linear_qkv.weight": ((3 * hidden, hidden), 0),
    "self_attention.linear_qkv.layer_norm_weight": ((hidden,), None),
    "self_attention.linear_proj.weight": ((hidden, hidden), 1),
    "mlp.linear_fc1.weight": ((ffn, hidden), 0),
    "mlp.linear_fc1.layer_norm_weight": ((hidden,), None),
    "mlp.linear_fc2.weight": ((hidden, ffn), 1),
}
gen = torch.Generator().manual_seed(0)
def filled(shape):
    return torch.empty(shape, dtype=torch.float32).uniform_(-1, 1, generator=gen)
sd = {}
def add(prefix, key, shape, tp_axis, layer=None):
    full = filled(shape)
    pieces = full.chunk(tp, dim=tp_axis) if tp_axis is not None else [full]
    for rank, piece in enumerate(pieces):
        offsets = []
        if layer is not None:
            offsets.append((0, layer, layers))
        if tp_axis is not None:
            offsets.append(((1 if layer is not None else 0) + tp_axis, rank, tp))
        sd[f"{prefix}{key}/{layer}/{rank}"] = ShardedTensor.from_rank_offsets(
            prefix + key, piece.contiguous(), *offsets, replica_id=0, prepend_axis_num=1 if layer is not None else 0
        )
prefixes = ["module."]
if with_optim:
    prefixes += ["optimizer.state.exp_avg.module.", "optimizer.state.exp_avg_sq.module."]
for prefix in prefixes:
    add(prefix, "embedding.word_embeddings.weight", (vocab, hidden), 0)
    for layer in range(layers):
        for key, (shape, axis) in layer_params.items():
            add(prefix, "decoder.layers." + key, shape, axis, layer)
    add(prefix, "decoder.final_layernorm.weight", (hidden,), None)
os.makedirs(out, exist_ok=True)
from nemo_patch.testing.cpu_harness import megatron_on_cpu  # megatron-core's writer touches CUDA; none here

with megatron_on_cpu():
    dist_checkpointing.save(sd, out)
dist.destroy_process_group()
"""

NEMO_PATCH = (
    "import sys; from nemo_patch.engine.consolidate import consolidate_checkpoint; "
    "consolidate_checkpoint(sys.argv[1], sys.argv[2])"
)
DCP = (
    "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
    "dcp_to_torch_save(sys.argv[1], sys.argv[2] + '/full.pt')"
)
STARTUP = "import nemo_patch.engine.consolidate"
COPY = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2] + '/weights')"
COPY_FSYNC = (
    "import os, shutil, sys; dst = sys.argv[2] + '/weights'; shutil.copytree(sys.argv[1], dst)\n"
    "for name in os.listdir(dst):\n"
    "    fd = os.open(os.path.join(dst, name), os.O_RDONLY); os.fsync(fd); os.close(fd)"
)


def timed(code, *args):
    """Run ``code`` in a fresh interpreter; return (wall seconds, peak RSS bytes)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {code[:60]}...\n{proc.stderr.read().decode()[-3000:]}")
    proc.stderr.close()
    return wall, usage.ru_maxrss * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--with-optimizer", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; the table shows the median")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where to put the ~GB of files (default: a tempdir)"
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be a whole number >= 1, got {args.repeat}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-consolidation-", dir=args.workdir))
    try:
        ckpt = workdir / "ckpt"
        start = time.perf_counter()
        gen_args = (ckpt / "weights", args.layers, args.hidden, args.vocab, int(args.with_optimizer))
        timed(GENERATE, *gen_args)
        generate_s = time.perf_counter() - start
        methods = (
            ("nemo_patch", NEMO_PATCH),
            ("dcp_to_torch_save", DCP),
            ("copy", COPY),
            ("copy + fsync", COPY_FSYNC),
            ("start-up only", STARTUP),
        )
        runs: Dict[str, List[Tuple[float, int]]] = {name: [] for name, _ in methods}
        for _ in range(args.repeat):  # round-robin, so a slow spell of the machine hits every method alike
            for name, code in methods:
                target = workdir / name.replace(" + ", "_")
                target.mkdir()
                os.sync()  # every method starts with no dirty pages left over from the previous one
                arg = ckpt if name == "nemo_patch" else ckpt / "weights"
                runs[name].append(timed(code, arg, target / "consolidated" if name == "nemo_patch" else target))
                shutil.rmtree(target)
        # Median wall time of the runs; the largest peak RSS of any run.
        results = {name: (statistics.median(w for w, _ in r), max(m for _, m in r)) for name, r in runs.items()}
        # Imported only now: a child forked from a parent that holds torch reports the parent's RSS as its own peak.
        from nemo_patch.engine.dcp_metadata import read_dcp_metadata
        from nemo_patch.engine.plan import plan_outputs

        outputs = plan_outputs(read_dcp_metadata(ckpt / "weights"))
        model_bytes = sum(o.spec.nbytes for o in outputs)
        dir_bytes = sum(f.stat().st_size for f in (ckpt / "weights").iterdir())
        print(
            f"synthetic torch_dist checkpoint: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, "
            f"TP=2-style shards{', with Adam state' if args.with_optimizer else ''}; generated in {generate_s:.1f} s"
        )
        print(
            f"model weights {model_bytes / 1e9:.2f} GB ({len(outputs)} output tensors); "
            f"weights/ dir {dir_bytes / 1e9:.2f} GB"
        )
        print(f"median of {args.repeat} run(s) per method, min-max in brackets")
        columns = f"{'wall s':>9}{'(min-max)':>15}{'MB/s (model)':>14}{'peak RSS MB':>13}{'RSS / weights':>15}"
        print(f"{'method':<20}{columns}")
        for name, (wall, rss) in results.items():
            walls = [w for w, _ in runs[name]]
            spread = f"({min(walls):.2f}-{max(walls):.2f})"
            rate = "-" if name == "start-up only" else f"{model_bytes / wall / 1e6:.0f}"
            print(f"{name:<20}{wall:>9.2f}{spread:>15}{rate:>14}{rss / 1e6:>13.0f}{rss / model_bytes:>15.1%}")
        ours, dcp = results["nemo_patch"][0], results["dcp_to_torch_save"][0]
        copy, durable = results["copy"][0], results["copy + fsync"][0]
        print(f"speed-up vs dcp_to_torch_save:         {dcp / ours:.2f}x (target >= 1.5x)")
        print(
            f"time vs copy floor:                    {ours / copy:.2f}x "
            "(target <= 1.3x; page-cache copy, nothing on disk yet)"
        )
        print(
            f"time vs durable copy floor:            {ours / durable:.2f}x "
            "(copy + fsync; nemo_patch fsyncs before publishing)"
        )
        startup = results["start-up only"][0]
        print(
            f"time vs copy floor, start-up excluded: {(ours - startup) / copy:.2f}x "
            f"({startup:.2f} s of interpreter and torch import)"
        )
        print(f"peak RSS vs weight bytes:              {results['nemo_patch'][1] / model_bytes:.1%} (target < 25%)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
