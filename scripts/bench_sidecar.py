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

"""What a ``nemo-consolidate --watch`` sidecar costs a stock NeMo training run beside it.

Trains the tiny NeMo GPT on the CPU with stock NeMo (the overlay disabled: ``NEMO_PATCH_DISABLE=1``), async save,
the same steps and save interval, alone and then with a watcher consolidating every checkpoint (``--frequency each``,
one writer) from a process of its own, alternating the two ``--repeat`` times, and prints the fit's wall time side by
side: the ratio is what the sidecar's reads and writes cost the training process on this machine's cores (on a cluster
the sidecar runs on other cores, or other nodes). It also prints how long after the fit the last output was published
(the sidecar's lag).

Usage: .venv/bin/python scripts/bench_sidecar.py [--max-steps 40] [--save-every 4] [--repeat 2]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]


def fit(out: Path, max_steps: int, save_every: int, watch: bool) -> Tuple[float, Optional[float], int]:
    """One stock fit into ``out``: (fit seconds, seconds from the fit's end to the last output, outputs)."""
    from nemo_patch.cli.watch import output_is_complete
    from nemo_patch.runs.run_checkpoints import list_run_checkpoints

    root = out / "tiny_gpt" / "checkpoints"
    env = {**os.environ, "NEMO_PATCH_DISABLE": "1"}
    watcher = None
    if watch:
        command = [
            sys.executable,
            "-m",
            "nemo_patch",
            str(root),
            "--watch",
            "--poll-interval",
            "0.5",
            "--workers",
            "1",
        ]
        watcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    args = [sys.executable, "-m", "nemo_patch.testing.fit_run", "--out", str(out), "--json", str(out / "r.json")]
    args += ["--max-steps", str(max_steps), "--save-every", str(save_every), "--async-save", "--stock"]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode != 0:
            sys.exit(f"the fit failed:\n{proc.stderr[-4000:]}")
        ended = time.monotonic()
        report: Dict = json.loads((out / "r.json").read_text())
        lag, outputs = None, 0
        if watcher is not None:
            while time.monotonic() < ended + 600:
                finished = list_run_checkpoints(root).finished
                done = [c for c in finished if output_is_complete(c.path, c.path / "consolidated")]
                if finished and len(done) == len(finished):
                    lag, outputs = time.monotonic() - ended, len(done)
                    break
                time.sleep(0.2)
        return report["fit_seconds"], lag, outputs
    finally:
        if watcher is not None:
            watcher.send_signal(signal.SIGTERM)
            watcher.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    alone, beside, lags, outputs = [], [], [], 0
    with tempfile.TemporaryDirectory() as workdir:
        for attempt in range(args.repeat):
            for watch in (False, True):
                print(f"fit {attempt + 1}/{args.repeat} {'with' if watch else 'without'} a watcher ...",
                      file=sys.stderr, flush=True)  # fmt: skip
                out = Path(workdir) / f"{attempt}-{int(watch)}"
                seconds, lag, count = fit(out, args.max_steps, args.save_every, watch)
                (beside if watch else alone).append(seconds)
                if watch:
                    lags.append(lag if lag is not None else float("nan"))
                    outputs = count
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"tiny GPT, stock NeMo, {args.max_steps} steps, async checkpoint every {args.save_every} steps, "
          f"{cores} CPU cores shared by the fit and the watcher, median of {args.repeat}")  # fmt: skip
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"fit alone:                 {a:8.2f} s")
    print(f"fit beside a watcher:      {b:8.2f} s   ({b / a:.3f}x)")
    print(f"last output after the fit: {statistics.median(lags):8.2f} s   ({outputs} outputs, --frequency each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
