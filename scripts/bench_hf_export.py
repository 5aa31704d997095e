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

"""Benchmark: the streamed Hugging Face export against NeMo's exporter on the whole model and the safetensors format.

The checkpoint: a many-layer Llama (``--layers`` x hidden ``--hidden-size``, fp32; the default 46 x 1024 is about
2.2 GB of weights) made with ``transformers`` and imported with NeMo's own importer on the CPU
(``python -m nemo_patch.testing.tiny_llama``), with its NeMo ``context/``. Measured side by side, each in a fresh
process, one after the other:

- ``hf streamed``: ``nemo-consolidate --format hf --trust-context`` (:mod:`nemo_patch.export.hf_stream`);
- ``hf in-memory``: NeMo's exporter on the whole model, which is what ``llm.export_ckpt`` does once it has loaded the
  model (``export_hf_checkpoint(..., stream=False)``);
- ``safetensors``: ``nemo-consolidate --format safetensors --workers 1``;
- ``imports only``: a process importing NeMo's Llama exporter and ``transformers`` (the fixed start-up of the first
  two rows).

The in-memory row needs about twice the weights in memory; it is skipped (and says so) when the machine has less than
2.5 times the weights available.

Each row: peak resident memory of the whole process tree (sampled every 20 ms with ``psutil``; and of the row's own
process, the kernel's high-water mark), over the model's weight bytes (the ``.distcp`` files); wall time with start-up;
and the time of the work alone, measured by the row's process after its imports (torch and the engine; NeMo's exporter
and ``transformers`` for the ``hf`` rows), which is what the training-time consolidation process and ``--watch``, that
import once, pay per checkpoint. Then the lines::

    hf streamed peak RSS / model bytes: X%
    hf in-memory peak RSS / model bytes: Y%
    hf streamed time with start-up / safetensors time with start-up: W.WWx
    hf streamed time / safetensors time: Z.ZZx

(``Z``: the work alone; ``W``: the one-shot command, NeMo's imports included).

Before each row, earlier rows' writes are synced and the checkpoint's files are read once (the page cache holds them
for every row alike). The times still vary from one round to the next (the write-back of the outputs most; on a shared
machine by up to 2x); ``--repeat`` runs all rows that many times, in turn.

Usage: ``python scripts/bench_hf_export.py [--work DIR] [--layers 46] [--hidden-size 1024]``. The entry point is
guarded: NeMo's importer spawns processes that import the main module again.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
#: The start-up every ``--format hf`` process pays before it reads a tensor (NeMo's exporter and ``transformers``).
IMPORTS = (
    "from nemo.lightning import io; from nemo.collections.llm.gpt.model import llama; "
    "from transformers import LlamaForCausalLM"
)
#: What every row imports before its clock for the work starts: torch and the engine (the ``safetensors`` row's
#: start-up); the ``hf`` rows add :data:`IMPORTS`.
ENGINE_IMPORTS = "import torch; import nemo_patch.cli.nemo_consolidate; import nemo_patch.engine.consolidate"
#: A row's process: its imports, then ``WORK`` timed by the process itself and printed as ``work seconds: S`` (the
#: row's time without its start-up, which the training-time consolidation process and ``--watch`` pay once).
ROW = (
    "import sys, time; {imports}; started = time.perf_counter(); {work}; "
    "print(f'work seconds: {{time.perf_counter() - started:.3f}}', flush=True)"
)
CLI_WORK = "code = nemo_patch.cli.nemo_consolidate.main(sys.argv[1:]); code and sys.exit(code)"
IN_MEMORY_WORK = (
    "from nemo_patch.export.hf import export_hf_checkpoint; "
    "export_hf_checkpoint(sys.argv[1], sys.argv[2], stream=False)"
)


def settle(checkpoint: Path) -> None:
    """The same start for every row: earlier rows' written data made durable (``sync``), and the checkpoint's files
    read once, so that each row reads them from the page cache (an earlier row's outputs, or the in-memory row's
    memory, may have evicted them)."""
    os.sync()
    for path in sorted(checkpoint.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(1 << 24):
                    pass


def row(imports: str, work: str, *args: str) -> List[str]:
    """A row's command line: a Python process that imports ``imports``, then runs ``work`` (with ``args`` as
    ``sys.argv[1:]``) and prints its seconds (:data:`ROW`)."""
    return [sys.executable, "-c", ROW.format(imports=imports, work=work), *args]


def measure(command: List[str]) -> Tuple[int, float, int, float]:
    """Run ``command``; return the peak RSS of its process tree (bytes, sampled), its wall seconds, the peak RSS
    of its own process (bytes: the kernel's high-water mark, ``ru_maxrss``, not sampled), and the seconds of its work
    (its ``work seconds:`` line; the wall seconds where it prints none). A child sampled between
    ``vfork`` and ``exec`` (a library running ``ninja --version`` or ``lscpu``) shares its parent's memory but shows
    its RSS, so the sampled tree peak can count the parent twice; the high-water mark cannot.

    Raises:
        RuntimeError: it failed (its last output).
    """
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    root, peak = psutil.Process(proc.pid), 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            tree = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed ({proc.returncode}): {output[-3000:]}")
    found = re.findall(r"^work seconds: ([0-9.]+)$", output, re.MULTILINE)
    return peak, wall, usage.ru_maxrss * 1024, float(found[-1]) if found else wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoint and outputs go (default: tmp)")
    parser.add_argument("--layers", type=int, default=46)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=2816)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all rows, one after the other (the times: "
                        "each row's median; the peaks: each row's largest)")  # fmt: skip
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-hf-"))
    model = work / "model"
    if not (model / "nemo").exists():
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "nemo_patch.testing.tiny_llama", "--out", str(model), "--layers", str(args.layers),
             "--hidden-size", str(args.hidden_size), "--intermediate-size", str(args.intermediate_size)],
            cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        print(f"checkpoint made with NeMo's importer in {time.perf_counter() - started:.0f} s")
    checkpoint = model / "nemo"
    weights = sum(path.stat().st_size for path in (checkpoint / "weights").glob("*.distcp"))
    cli = [str(checkpoint), "--quiet", "--force"]
    import psutil

    hf_imports = f"{ENGINE_IMPORTS}; {IMPORTS}"
    runs = {
        "hf streamed": row(
            hf_imports, CLI_WORK, *cli, "--format", "hf", "--trust-context", "--out", str(work / "hf-streamed")
        ),
        "hf in-memory": row(hf_imports, IN_MEMORY_WORK, str(checkpoint), str(work / "hf-in-memory")),
        "safetensors": row(ENGINE_IMPORTS, CLI_WORK, *cli, "--workers", "1", "--out", str(work / "safetensors")),
        "imports only": row(hf_imports, "pass"),
    }
    available = psutil.virtual_memory().available
    if available < 2.5 * weights:
        del runs["hf in-memory"]
        print(f"hf in-memory: skipped, {available / 1e9:.1f} GB available < 2.5 x the weights")
    print(f"model bytes: {weights / 1e9:.2f} GB ({args.layers} layers, hidden {args.hidden_size}); "
          f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")  # fmt: skip
    rounds: Dict[str, List[Tuple[int, float, int, float]]] = {name: [] for name in runs}
    for round_ in range(args.repeat):
        for name, command in runs.items():
            shutil.rmtree(work / name.replace(" ", "-"), ignore_errors=True)
            settle(checkpoint)
            rounds[name].append(measure(command))
            peak, wall, own, busy = rounds[name][-1]
            print(f"{name:>13}: peak RSS {peak / 1e6:8.0f} MB ({100 * peak / weights:5.1f}% of the weights; its own "
                  f"process {own / 1e6:.0f} MB), {wall:6.1f} s, {busy:6.1f} s without start-up"
                  + (f" (round {round_ + 1})" if args.repeat > 1 else ""))  # fmt: skip
    results = {
        name: (
            max(g[0] for g in got),
            statistics.median(g[1] for g in got),
            max(g[2] for g in got),
            statistics.median(g[3] for g in got),
        )
        for name, got in rounds.items()
    }
    if args.repeat > 1:
        for name, (peak, wall, own, busy) in results.items():
            print(f"{name:>13}: largest peak RSS {peak / 1e6:8.0f} MB (own process {own / 1e6:.0f} MB), "
                  f"median time {wall:6.1f} s, {busy:6.1f} s without start-up")  # fmt: skip
    above = (results["hf streamed"][0] - results["imports only"][0]) / weights
    print(f"hf streamed peak RSS above the imports' baseline / model bytes: {100 * above:.0f}%")
    if "hf in-memory" in results:
        streamed, in_memory = sorted((work / "hf-streamed").glob("*.safetensors")), work / "hf-in-memory"
        same = all(path.read_bytes() == (in_memory / path.name).read_bytes() for path in streamed)
        print(f"hf streamed and in-memory safetensors files byte-identical: {same}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    own = results["hf streamed"][2] / weights
    print(f"hf streamed peak RSS of its own process (kernel high-water mark) / model bytes: {100 * own:.0f}%")
    print(f"hf streamed peak RSS / model bytes: {100 * results['hf streamed'][0] / weights:.0f}%")
    if "hf in-memory" in results:
        print(f"hf in-memory peak RSS / model bytes: {100 * results['hf in-memory'][0] / weights:.0f}%")
    print(
        f"hf streamed time with start-up / safetensors time with start-up: "
        f"{results['hf streamed'][1] / results['safetensors'][1]:.2f}x"
    )
    print(f"hf streamed time / safetensors time: {results['hf streamed'][3] / results['safetensors'][3]:.2f}x")
    if args.work is None:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
