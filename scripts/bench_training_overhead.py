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

"""How much a training run pays for consolidation, per ckpt_consolidation_frequency.

Trains the tiny NeMo GPT on the CPU (same steps, same save interval) with consolidation off, "each" (with
``ConsolidationConfig(workers=...)`` 1 and 2), "every_n:4" and "latest", each in a fresh interpreter, and prints one
table:

- fit s: wall time of ``llm.train`` (the end-of-fit wait for consolidations included);
- blocked s: time the training loop spent inside the consolidation callback's per-step hooks (handing the step's pass
  to the coordinator's stepper thread, which hands requests to the run's consolidation process and polls its result
  pipe; reporting metrics and hooks), plus the time its saves waited for a pass still in progress (the consolidation
  itself runs in that separate process);
- end wait s: time the end of ``fit`` waited for running and queued consolidations;
- consol. s: wall time of the consolidations, summed (from hand-out to reaped result); n: how many ran.

Targets: blocked time under 0.5% of the consolidation time for "each" (one consolidation process serves the run; the
loop hands each step's bookkeeping to a thread and logs what ended); "latest" within noise of "off" until the end of
fit (fit minus end wait). The number of writers changes the consolidation's time, not the loop's. The blocked time per
save is printed too: the ratio's denominator (the tiny model's consolidations) varies from run to run.

Usage: .venv/bin/python scripts/bench_training_overhead.py [--max-steps 40] [--save-every 4]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: (row name, frequency, ConsolidationConfig.workers)
MODES = [
    ("off", None, None),
    ("each, 1 worker", "each", 1),
    ("each, 2 workers", "each", 2),
    ("every_n:4", "every_n:4", None),
    ("latest", "latest", None),
]


def run(mode, frequency, workers, max_steps, save_every, workdir):
    out = Path(workdir) / mode.replace(":", "_").replace(", ", "_").replace(" ", "_")
    args = [sys.executable, "-m", "nemo_patch.testing.fit_run", "--out", str(out), "--json", str(out / "r.json")]
    args += ["--max-steps", str(max_steps), "--save-every", str(save_every), "--max-pending", "1000"]
    if frequency:
        args += ["--frequency", frequency]
    if workers:
        args += ["--config-arg", f"workers={workers}"]
    out.mkdir(parents=True)
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "r.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for mode, frequency, workers in MODES:
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            rows.append((mode, run(mode, frequency, workers, args.max_steps, args.save_every, workdir)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"tiny GPT, {args.max_steps} steps, checkpoint every {args.save_every} steps (sync save), {cores} CPU cores")
    header = f"{'frequency':<17}{'fit s':>8}{'fit - end wait s':>18}{'blocked s':>11}{'end wait s':>12}"
    print(header + f"{'consol. s':>11}{'n':>4}{'blocked/consol.':>17}")
    off = rows[0][1]["fit_seconds"]
    for mode, r in rows:
        ratio = r["blocked_seconds"] / r["consolidation_seconds"] if r["consolidation_seconds"] else float("nan")
        print(
            f"{mode:<17}{r['fit_seconds']:>8.2f}{r['fit_seconds'] - r['end_wait_seconds']:>18.2f}"
            f"{r['blocked_seconds']:>11.4f}{r['end_wait_seconds']:>12.2f}{r['consolidation_seconds']:>11.2f}"
            f"{r['consolidations']:>4}{ratio:>16.2%}"
        )
    print(f"(off = {off:.2f} s; 'latest' consolidates only after training, inside the end wait)")
    for mode, r in rows:
        if mode.startswith("each") and r["consolidation_seconds"]:
            ratio = r["blocked_seconds"] / r["consolidation_seconds"]
            verdict = "PASS" if ratio < 0.005 else "MISS"
            per_save = r["blocked_seconds"] / r["consolidations"] * 1e3
            print(
                f"target {mode}: blocked / consolidation = {ratio:.2%} (< 0.5%) {verdict}; {per_save:.2f} ms per save"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
