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

"""Consolidation speed, scaling and memory against PyTorch's stock converter and a plain copy, on one checkpoint.

1. Generates a synthetic GPT-shaped ``torch_dist`` checkpoint with megatron-core's ``dist_checkpointing.save``
   (single process, gloo): layer-stacked ``module.decoder.layers.*`` tensors saved per layer and split in TP=2-style
   shards along their TP axis, exactly as megatron-core lays out a TP=2 run; by default about 2.55 GB of fp32 model
   weights. ``--with-optimizer`` adds Adam ``exp_avg``/``exp_avg_sq`` for every weight, as NeMo's intermediate
   checkpoints carry.
2. Runs, each in a fresh process, on the same ``weights/`` directory:
   - ``nemo_patch, N workers``: :func:`nemo_patch.engine.consolidate.consolidate_checkpoint` (model weights ->
     safetensors) with ``workers=N`` writer processes on this node, for every N of ``--workers-list`` (default
     1, 2, 4) plus 1 and the CLI's default (:func:`nemo_patch.engine.parts.default_workers`), marked ``(default)``;
     the process reports its busy seconds per stage and the peak RSS of itself and of its largest writer process;
   - ``dcp_to_torch_save``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (what a user would reach
     for: the whole directory -> one ``torch.save`` file);
   - ``copy``: ``shutil.copytree`` of the ``weights/`` bytes (the I/O floor), and ``copy + fsync``, the same made
     durable (the durable copy floor), since the consolidation fsyncs its output before publishing it; ``copy +
     fsync, 2 processes``: the same split over 2 processes (every other file each), what the storage path alone
     gains from a second process;
   - ``start-up only``: a process that only imports the consolidation module (Python, torch,
     ``torch.distributed.checkpoint``): the part of a consolidation's time that is not consolidation.

   Each method runs ``--repeat`` times (default 3), round-robin, so that a slow spell of the machine hits every
   method alike.
3. Prints four tables:
   - every method: median wall seconds with the min-max, MB/s of model-weight bytes, and the peak RSS of the largest
     single process (for a consolidation, the larger of its own process and its largest writer process: "per
     worker"; the writers are forked, separate processes), also as a share of the model-weight bytes;
   - where 1 worker's time goes: busy seconds per stage (:mod:`nemo_patch.engine.stage_times`; median over the
     runs) and the start-up, each as a share of the 1-worker wall time. Stages overlap (a writer reads the next
     tensor while it writes the current one), so their sum can exceed the wall time;
   - scaling: throughput (model-weight bytes / wall time) with the start-up excluded (the start-up-only median taken
     off) and included, and the speed-up over 1 worker, for every number of workers, with the RSS of the
     consolidating process and of its largest writer;
   - targets, each a ratio measured in this run, with PASS or MISS: (a) 1 worker, start-up excluded, at most 1.5x
     the durable copy floor; (b) 2 workers at least 1.6x the throughput of 1, start-up excluded, next to what a
     second process gains on this machine without any of our code: for the durable copy, and for CPU-bound work
     against the cores 1 worker keeps busy (from its CPU seconds); (c) peak RSS per
     worker at most 25% of the model-weight bytes; (d) the default number of workers at least 3x faster than
     ``dcp_to_torch_save`` end to end (start-up included). Next to them: the CPU cores (``os.cpu_count()`` and the
     cores this process may use), how much more pure CPU work 2 processes do than 1 on this machine (the ceiling of
     (b) for work that is all CPU) and the durable copy floor's seconds and MB/s.

The files fit in this machine's page cache, so "I/O" here is mostly memory bandwidth and CPU, as on a node with a
warm cache.

Usage: .venv/bin/python scripts/bench_consolidation.py [--layers 12] [--hidden 2048] [--with-optimizer] [--repeat 3]
[--workers-list 1,2,4]
"""

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from nemo_patch.engine.stage_times import STAGES  # standard library only: this process must not import torch

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

#: Starts the line on which a consolidation process reports (JSON) what :func:`run_once` cannot see from outside.
REPORT_PREFIX = "BENCH_REPORT "

# The writer processes' peak RSS comes from wait4 as multiprocessing reaps each (os.waitpid is wrapped, from just
# before the consolidation): RUSAGE_CHILDREN's ru_maxrss would also count the helper processes that importing torch
# starts (``ldconfig -p``), which report the RSS of the process they were started from as their own. ru_maxrss is in
# KiB on Linux.
CONSOLIDATE = r"""
import json, os, resource, sys
from nemo_patch.engine.huge_pages import prefer_huge_pages

prefer_huge_pages()  # as nemo-consolidate and the run's consolidation process do, before torch is imported
from nemo_patch.engine.consolidate import consolidate_checkpoint

writers = []

def waitpid(pid, options):
    pid, status, usage = os.wait4(pid, options)
    if pid:
        writers.append(usage.ru_maxrss * 1024)
    return pid, status

os.waitpid = waitpid
result = consolidate_checkpoint(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]))
report = {
    "stage_seconds": result.stage_seconds,
    "total_bytes": result.total_bytes,
    "tensor_count": result.tensor_count,
    "rss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_largest_writer": max(writers, default=0),
    "writers": len(writers),
}
print(sys.argv[4] + json.dumps(report), flush=True)
"""
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
# The same in 2 processes, each copying every other file (the shard files of one save are about the same size).
COPY_FSYNC_PAIR = (
    "import os, shutil, sys\nfrom multiprocessing import Process\n"
    "src, dst = sys.argv[1], sys.argv[2] + '/weights'; os.makedirs(dst); names = sorted(os.listdir(src))\n"
    "def copy(share):\n"
    "    for name in share:\n"
    "        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))\n"
    "        fd = os.open(os.path.join(dst, name), os.O_RDONLY); os.fsync(fd); os.close(fd)\n"
    "pair = [Process(target=copy, args=(names[i::2],)) for i in range(2)]\n"
    "[p.start() for p in pair]; [p.join() for p in pair]\n"
    "sys.exit(max(p.exitcode for p in pair))"
)
DEFAULT_WORKERS = "from nemo_patch.engine.parts import default_workers; print(default_workers())"

# Row names the tables and targets look up.
DCP_NAME, COPY_NAME, DURABLE_NAME, STARTUP_NAME = "dcp_to_torch_save", "copy", "copy + fsync", "start-up only"
DURABLE_PAIR_NAME = "copy + fsync, 2 processes"

# Targets, as measured ratios.
TARGET_VS_DURABLE_COPY = 1.5  # (a) 1 worker, start-up excluded, / durable copy floor: at most
TARGET_TWO_WORKER_SPEEDUP = 1.6  # (b) 2 workers' / 1 worker's throughput, start-up excluded: at least
TARGET_RSS_SHARE = 0.25  # (c) peak RSS per worker / model-weight bytes: at most
TARGET_VS_DCP = 3.0  # (d) dcp_to_torch_save's / the default workers' wall time, start-up included: at least


@dataclass(frozen=True)
class Method:
    """One row: Python code timed in a fresh interpreter.

    Attributes:
        name: the row's label.
        code: the source, run with ``python -c``; a consolidation prints a :data:`REPORT_PREFIX` line.
        argv: the command-line arguments, from the checkpoint directory and an empty directory for the output.
        workers: writer processes, for a consolidation; ``None`` for the other methods.
    """

    name: str
    code: str
    argv: Callable[[Path, Path], Sequence[object]]
    workers: Optional[int] = None


@dataclass(frozen=True)
class Run:
    """One run of a :class:`Method`.

    Attributes:
        wall: wall seconds, from starting the interpreter to its exit.
        rss: peak RSS in bytes of the largest single process: ``wait4``'s (the process and the children it waited
            for), or for a consolidation the larger of ``rss_self`` and ``rss_largest_writer``.
        rss_self: a consolidation's own process's peak RSS in bytes.
        rss_largest_writer: a consolidation's largest writer process's peak RSS in bytes (0 with 1 worker: the
            consolidating process writes).
        writers: the writer processes a consolidation started.
        stage_seconds: a consolidation's busy seconds per stage, summed over its writers.
        total_bytes: the model-weight bytes a consolidation wrote.
        tensor_count: the tensors a consolidation wrote.
        cpu: user + system CPU seconds of the process and the children it waited for (``wait4``).
    """

    wall: float
    rss: int
    rss_self: int = 0
    rss_largest_writer: int = 0
    writers: int = 0
    stage_seconds: Dict[str, float] = field(default_factory=dict)
    total_bytes: int = 0
    cpu: float = 0.0
    tensor_count: int = 0


@dataclass(frozen=True)
class Summary:
    """A method's runs, summarised.

    Attributes:
        wall: median wall seconds.
        low: the fastest run's wall seconds.
        high: the slowest run's wall seconds.
        rss: the largest peak RSS of any run, in bytes (that of the largest single process).
        rss_self: a consolidation's largest own peak RSS, in bytes.
        rss_largest_writer: a consolidation's largest writer's peak RSS, in bytes.
        writers: the most writer processes a run of a consolidation started.
        stage_seconds: a consolidation's median busy seconds per stage.
        cpu: median CPU seconds (user + system).
    """

    wall: float
    low: float
    high: float
    rss: int
    rss_self: int
    rss_largest_writer: int
    writers: int
    stage_seconds: Dict[str, float]
    cpu: float

    @classmethod
    def of(cls, runs: Sequence[Run]) -> "Summary":
        """The median wall time and stage seconds, and the largest RSS, of ``runs``."""
        walls = [run.wall for run in runs]
        stages: Dict[str, List[float]] = {}
        for run in runs:
            for stage, seconds in run.stage_seconds.items():
                stages.setdefault(stage, []).append(seconds)
        return cls(
            statistics.median(walls),
            min(walls),
            max(walls),
            max(run.rss for run in runs),
            max(run.rss_self for run in runs),
            max(run.rss_largest_writer for run in runs),
            max(run.writers for run in runs),
            {stage: statistics.median(seconds) for stage, seconds in stages.items()},
            statistics.median(run.cpu for run in runs),
        )


def consolidation_label(workers: int, default: bool = False) -> str:
    """A consolidation row's name, e.g. ``nemo_patch, 2 workers (default)``."""
    label = f"nemo_patch, {workers} worker{'s' if workers != 1 else ''}"
    return label + (" (default)" if default else "")


def consolidation_args(ckpt: Path, target: Path, workers: int) -> Tuple[Path, Path, int, str]:
    """:data:`CONSOLIDATE`'s arguments: checkpoint, output directory, writer processes, :data:`REPORT_PREFIX`."""
    return ckpt, target / "consolidated", workers, REPORT_PREFIX


def weights_args(ckpt: Path, target: Path) -> Tuple[Path, Path]:
    """The other methods' arguments: the checkpoint's ``weights/`` directory and the output directory."""
    return ckpt / "weights", target


def consolidation_methods(workers_list: Sequence[int], default_workers: int) -> List[Method]:
    """The ``nemo_patch`` rows: one consolidating process on this node with each number of writer processes. The
    method table, the scaling table and target (c) take every such row; the speed-ups are over 1 worker."""
    return [
        Method(
            consolidation_label(n, default=n == default_workers),
            CONSOLIDATE,
            functools.partial(consolidation_args, workers=n),
            workers=n,
        )
        for n in workers_list
    ]


def build_methods(workers_list: Sequence[int], default_workers: int) -> List[Method]:
    """Every row, in the order each round runs them."""
    return [
        *consolidation_methods(workers_list, default_workers),
        Method(DCP_NAME, DCP, weights_args),
        Method(COPY_NAME, COPY, weights_args),
        Method(DURABLE_NAME, COPY_FSYNC, weights_args),
        Method(DURABLE_PAIR_NAME, COPY_FSYNC_PAIR, weights_args),
        Method(STARTUP_NAME, STARTUP, weights_args),
    ]


def one_node(methods: Sequence[Method], results: Mapping[str, Summary]) -> Dict[int, Summary]:
    """The consolidation rows on one node, by their number of writer processes."""
    return {m.workers: results[m.name] for m in methods if m.workers is not None}


#: Pure-Python CPU work with no I/O and no memory traffic, for :func:`cpu_scaling`.
SPIN = "total = 0\nfor i in range(20_000_000):\n    total += i"


def cpu_scaling(repeat: int) -> float:
    """How much more CPU-bound work this machine does with 2 processes than with 1: twice the fastest of ``repeat``
    single runs over the fastest of ``repeat`` paired runs. 2.0 on 2 idle physical cores; less where the "cores" are
    hyperthreads or the hypervisor shares them."""
    ones, twos = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", SPIN], check=True)
        ones.append(time.perf_counter() - start)
        start = time.perf_counter()
        pair = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2)]
        if any(process.wait() != 0 for process in pair):
            sys.exit("the CPU-scaling probe failed")
        twos.append(time.perf_counter() - start)
    return 2 * min(ones) / min(twos)


def run_once(code: str, args: Sequence[object]) -> Run:
    """Run ``code`` in a fresh interpreter with ``args``; its stdout and stderr go to files, not to the tables.

    Raises:
        SystemExit: the process failed (with the end of its output).
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"failed (exit code {proc.returncode}): {code.strip()[:80]}...\n{(stdout + stderr)[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    for line in stdout.splitlines():
        if line.startswith(REPORT_PREFIX):
            report = json.loads(line[len(REPORT_PREFIX) :])
            own, writer = report["rss_self"], report["rss_largest_writer"]
            return Run(
                wall,
                rss=max(own, writer),
                rss_self=own,
                rss_largest_writer=writer,
                writers=report["writers"],
                stage_seconds=report["stage_seconds"],
                total_bytes=report["total_bytes"],
                tensor_count=report["tensor_count"],
                cpu=cpu,
            )
    return Run(wall, usage.ru_maxrss * 1024, cpu=cpu)


def query_default_workers() -> int:
    """:func:`nemo_patch.engine.parts.default_workers`, asked of a child process.

    Not imported here: it imports torch, and a process started from one holding torch reports that process's RSS as
    its own peak.
    """
    result = subprocess.run([sys.executable, "-c", DEFAULT_WORKERS], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


def parse_workers_list(text: str) -> List[int]:
    """``--workers-list``: whole numbers >= 1, separated by commas."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1 separated by commas, got {text!r}")
    return values


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN unless both are positive (a start-up-excluded time that noise made <= 0)."""
    return numerator / denominator if numerator > 0 and denominator > 0 else math.nan


def per_second(nbytes: int, seconds: float) -> float:
    """MB/s, NaN for a time that is not positive."""
    return ratio(nbytes / 1e6, seconds)


def shown(value: float, spec: str, width: int = 0, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``, or ``n/a`` if it is NaN, right-aligned in ``width``."""
    text = f"{value:{spec}}{suffix}" if math.isfinite(value) else "n/a"
    return f"{text:>{width}}"


def target_line(label: str, value: float, target: float, at_least: bool, percent: bool = False, note: str = "") -> str:
    """One target's line: the measured value, the target and PASS or MISS."""
    measured = shown(value, ".1%", 8) if percent else shown(value, ".2f", 8, "x")
    wanted = f"{'>=' if at_least else '<='} " + (f"{target:.0%}" if percent else f"{target:.1f}x")
    passed = value >= target if at_least else value <= target  # False for NaN
    return f"{label:<58}{measured}   target {wanted:<8}{'PASS' if passed else 'MISS':>6}{note}"


def print_methods(methods: Sequence[Method], results: Mapping[str, Summary], model_bytes: int, repeat: int) -> None:
    """The table of every method."""
    print(f"median of {repeat} run(s) per method, round-robin, min-max in brackets")
    columns = f"{'wall s':>9}{'(min-max)':>15}{'MB/s (model)':>14}{'peak RSS MB':>13}{'RSS / weights':>15}"
    print(f"{'method':<34}{columns}")
    for method in methods:
        result = results[method.name]
        spread = f"({result.low:.2f}-{result.high:.2f})"
        rate = "-" if method.name == STARTUP_NAME else f"{per_second(model_bytes, result.wall):.0f}"
        print(
            f"{method.name:<34}{result.wall:>9.2f}{spread:>15}{rate:>14}{result.rss / 1e6:>13.0f}"
            f"{result.rss / model_bytes:>15.1%}"
        )
    print(
        "peak RSS: of the largest single process; for nemo_patch, the larger of the consolidating process's and its "
        "largest writer process's"
    )


def print_stages(result: Summary, startup: float, repeat: int) -> None:
    """Where 1 worker's time goes: the start-up and the busy seconds per stage, as shares of the wall time."""
    print()
    print(f"nemo_patch, 1 worker: busy seconds per stage, median of {repeat} run(s); stages overlap")
    print(f"{'stage':<26}{'busy s':>9}{'share of wall':>15}")
    print(f"{'start-up (' + STARTUP_NAME + ')':<26}{startup:>9.2f}{startup / result.wall:>15.1%}")
    for stage in [*STAGES, *sorted(set(result.stage_seconds) - set(STAGES))]:
        seconds = result.stage_seconds.get(stage, 0.0)
        print(f"{stage:<26}{seconds:>9.2f}{seconds / result.wall:>15.1%}")
    total = sum(result.stage_seconds.values())
    print(f"{'sum of stages':<26}{total:>9.2f}{total / result.wall:>15.1%}")
    print(f"{'wall':<26}{result.wall:>9.2f}{1:>15.1%}")


def print_scaling(methods: Sequence[Method], results: Mapping[str, Summary], model_bytes: int, startup: float) -> None:
    """Throughput with the start-up excluded and included, and the speed-up over 1 worker, per consolidation row."""
    base = one_node(methods, results)[1]
    print()
    print(
        f"scaling: model-weight bytes / wall time; start-up excluded: minus the start-up-only median, {startup:.2f} s"
    )
    print(
        f"{'method':<34}{'MB/s excl.':>11}{'MB/s incl.':>11}{'speed-up excl.':>16}{'speed-up incl.':>16}"
        f"{'writers':>9}{'own RSS MB':>12}{'writer RSS MB':>15}"
    )
    for method in methods:
        if method.workers is None:
            continue
        result = results[method.name]
        rates = shown(per_second(model_bytes, result.wall - startup), ".0f", 11) + shown(
            per_second(model_bytes, result.wall), ".0f", 11
        )
        speedups = shown(ratio(base.wall - startup, result.wall - startup), ".2f", 16, "x") + shown(
            ratio(base.wall, result.wall), ".2f", 16, "x"
        )
        writer = f"{result.rss_largest_writer / 1e6:.0f}" if result.writers else "-"
        print(f"{method.name:<34}{rates}{speedups}{result.writers:>9}{result.rss_self / 1e6:>12.0f}{writer:>15}")
    print("writer RSS: the peak RSS of the largest writer process; own RSS: the consolidating process's")


def print_targets(
    methods: Sequence[Method],
    results: Mapping[str, Summary],
    model_bytes: int,
    dir_bytes: int,
    default_workers: int,
    scaling: float,
) -> None:
    """The four targets, each a ratio measured in this run, with the CPU cores and the durable copy floor."""
    startup, durable, dcp = results[STARTUP_NAME].wall, results[DURABLE_NAME].wall, results[DCP_NAME].wall
    by_workers = one_node(methods, results)
    one, two, default = by_workers[1], by_workers.get(2), by_workers[default_workers]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print()
    print("targets, each a ratio measured in this run")
    print(
        f"CPU cores: os.cpu_count() {os.cpu_count()}, usable by this process (sched_getaffinity) {usable}; "
        f"default_workers() {default_workers}"
    )
    print(f"CPU-bound work (pure Python, no I/O) in 2 processes: {scaling:.2f}x the throughput of 1 on this machine")
    print(
        f"durable copy floor (copy + fsync): {durable:.2f} s, {per_second(dir_bytes, durable):.0f} MB/s of weights/ "
        f"bytes copied ({per_second(model_bytes, durable):.0f} MB/s of model-weight bytes)"
    )
    label = "(a) 1 worker, start-up excluded / durable copy floor"
    note = f"   ({one.wall - startup:.2f} s vs {durable:.2f} s)"
    print(target_line(label, ratio(one.wall - startup, durable), TARGET_VS_DURABLE_COPY, at_least=False, note=note))
    label = "(b) 2 workers / 1 worker throughput, start-up excluded"
    if two is not None:
        note = f"   ({one.wall - startup:.2f} s vs {two.wall - startup:.2f} s)"
        speedup = ratio(one.wall - startup, two.wall - startup)
        print(target_line(label, speedup, TARGET_TWO_WORKER_SPEEDUP, at_least=True, note=note))
        busy = (one.cpu - results[STARTUP_NAME].cpu) / (one.wall - startup)
        copies = ratio(durable, results[DURABLE_PAIR_NAME].wall)
        print(
            f"    what 2 processes gain here without our code: the durable copy {copies:.2f}x; CPU-bound work "
            f"{scaling:.2f}x, and 1 worker keeps {busy:.2f} cores busy (start-up excluded), so at most "
            f"{ratio(scaling, busy):.2f}x from CPU"
        )
    else:
        print(f"{label:<58}{'n/a':>8}   (2 is not in --workers-list)")
    largest = max((m for m in methods if m.workers is not None), key=lambda m: results[m.name].rss)
    rss = results[largest.name].rss
    label, note = "(c) peak RSS per worker / model-weight bytes", f"   ({rss / 1e6:.0f} MB: {largest.name})"
    print(target_line(label, rss / model_bytes, TARGET_RSS_SHARE, at_least=False, percent=True, note=note))
    label = f"(d) dcp_to_torch_save / default workers ({default_workers}), end to end"
    note = f"   ({dcp:.2f} s vs {default.wall:.2f} s)"
    print(target_line(label, ratio(dcp, default.wall), TARGET_VS_DCP, at_least=True, note=note))


def main() -> int:
    """Generate the checkpoint, time every method round-robin, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--with-optimizer", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; the tables show the median")
    parser.add_argument(
        "--workers-list",
        type=parse_workers_list,
        default=[1, 2, 4],
        help="writer processes per nemo_patch row, comma-separated (default 1,2,4); 1 and default_workers() are "
        "always added",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where to put the ~GB of files (default: a tempdir)"
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be a whole number >= 1, got {args.repeat}")
    default_workers = query_default_workers()
    workers_list = sorted({1, default_workers, *args.workers_list})
    methods = build_methods(workers_list, default_workers)
    workdir = Path(tempfile.mkdtemp(prefix="bench-consolidation-", dir=args.workdir))
    try:
        ckpt = workdir / "ckpt"
        start = time.perf_counter()
        run_once(GENERATE, (ckpt / "weights", args.layers, args.hidden, args.vocab, int(args.with_optimizer)))
        generate_s = time.perf_counter() - start
        runs: Dict[str, List[Run]] = {method.name: [] for method in methods}
        for _ in range(args.repeat):  # round-robin, so a slow spell of the machine hits every method alike
            for method in methods:
                target = Path(tempfile.mkdtemp(prefix="out-", dir=workdir))
                os.sync()  # every method starts with no dirty pages left over from the previous one
                runs[method.name].append(run_once(method.code, method.argv(ckpt, target)))
                shutil.rmtree(target)
        results = {name: Summary.of(method_runs) for name, method_runs in runs.items()}
        scaling = cpu_scaling(args.repeat)  # after the runs, with no file of the checkpoint being written
        first = runs[methods[0].name][0]  # a consolidation's: what it wrote
        model_bytes, tensor_count = first.total_bytes, first.tensor_count
        dir_bytes = sum(f.stat().st_size for f in (ckpt / "weights").iterdir())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"synthetic torch_dist checkpoint: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, "
        f"TP=2-style shards{', with Adam state' if args.with_optimizer else ''}; generated in {generate_s:.1f} s"
    )
    print(
        f"model weights {model_bytes / 1e9:.2f} GB ({tensor_count} output tensors); "
        f"weights/ dir {dir_bytes / 1e9:.2f} GB"
    )
    startup = results[STARTUP_NAME].wall
    print_methods(methods, results, model_bytes, args.repeat)
    print_stages(one_node(methods, results)[1], startup, args.repeat)
    print_scaling(methods, results, model_bytes, startup)
    print_targets(methods, results, model_bytes, dir_bytes, default_workers, scaling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
