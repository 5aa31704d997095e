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

"""Train a tiny NeMo GPT on the CPU and show which checkpoints were consolidated.

A real NeMo 2 run: ``llm.train`` with ``nl.Trainer``, ``nl.MegatronStrategy(ckpt_consolidation_frequency=...,
ckpt_consolidation=ConsolidationConfig(...))`` (the overlay's, reached through NeMo's own name), NeMo's
``ModelCheckpoint`` and ``NeMoLogger``, saving ``torch_dist`` distributed checkpoints. Only CUDA is stubbed out
(``nemo_patch.testing.cpu_harness``). Running it again on the same ``--out`` resumes the run from its last checkpoint.

Example:
    python scripts/demo_consolidation_cadence.py --frequency every_n:2 --max-steps 10 --save-every 2 --out runs/demo
"""

import argparse
import logging
import re
import sys
import time
from pathlib import Path

from nemo_patch.engine.checkpoint_root import global_step_in_name


def _size(num_bytes: float) -> str:
    """Decimal units, as ``nemo-consolidate`` prints them."""
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return ""


def format_table(report: dict) -> str:
    """The demo's closing table: one row per checkpoint directory."""
    rows = [("checkpoint", "global step", "consolidated", "consolidated/ on disk")]
    natural = lambda entry: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", entry["name"])]  # noqa: E731
    for entry in sorted(report["checkpoints"], key=natural):
        step = entry["global_step"]
        if step is None and not report.get("resumed_from"):  # saved by this run, which consolidated none of it
            step = global_step_in_name(entry["name"])
        rows.append(
            (
                entry["name"] + ("   <- LATEST" if entry["name"] == report["latest"] else ""),
                "-" if step is None else str(step),
                "yes" if entry["consolidated"] else "no",
                _size(entry["consolidated_bytes"]) if entry["consolidated"] else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--frequency",
        default="every_n:2",
        help='ckpt_consolidation_frequency: "each", "latest", "every_n:<k>", or "off" (default: every_n:2)',
    )
    parser.add_argument("--max-steps", type=int, default=10, help="global steps to train (default: 10)")
    parser.add_argument(
        "--save-every", type=int, default=2, help="save a checkpoint every N global steps (default: 2)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="NeMoLogger log_dir (default: runs/demo)")
    parser.add_argument("--async-save", action="store_true", help="use NeMo's asynchronous checkpoint save")
    parser.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="ConsolidationConfig.max_pending: consolidations that may wait behind the running one (default: 2)",
    )
    parser.add_argument(
        "--save-top-k",
        type=int,
        default=-1,
        help="ModelCheckpoint(save_top_k=...): checkpoints NeMo keeps, newest first (default: -1, all)",
    )
    parser.add_argument(
        "--keep",
        type=int,
        default=None,
        help="ConsolidationConfig.keep: consolidated outputs kept when top-k removes their checkpoints (default: all)",
    )
    args = parser.parse_args()
    # nemo_patch's own INFO lines (a consolidation started, one published), on stderr in logging's default format.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    package_logger = logging.getLogger("nemo_patch")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False

    from nemo_patch.testing.fit_run import run_tiny_fit
    from nemo_patch.training.policy import parse_consolidation_frequency

    frequency = None if args.frequency == "off" else args.frequency
    demo_takes = 'the demo takes "each", "latest", "every_n:<k>", phases of those (e.g. "every_n:4; each@6"), or "off"'
    if frequency is not None:
        try:
            policy = parse_consolidation_frequency(frequency)
        except ValueError as error:
            parser.error(f"{str(error).split('; expected ')[0]}; {demo_takes}")
        if any(phase.cadence == "best" for phase in policy.phases):
            parser.error(
                f"--frequency {frequency!r}: \"best\" needs ModelCheckpoint(monitor=...) on a validation metric, "
                f"which this demo does not compute; {demo_takes}"
            )
    start = time.perf_counter()
    report = run_tiny_fit(
        args.out,
        frequency=frequency,
        max_steps=args.max_steps,
        save_every=args.save_every,
        async_save=args.async_save,
        max_pending=args.max_pending,
        save_top_k=args.save_top_k,
        monitor="step" if args.save_top_k >= 0 else None,  # newest first, and resumable (see docs/retention.md)
        keep=args.keep,
    )
    wall = time.perf_counter() - start
    print()
    print(
        f"ckpt_consolidation_frequency={args.frequency!r}: trained to global step {report['global_step']}, "
        f"checkpoint every {args.save_every} steps, {'async' if args.async_save else 'sync'} save; "
        f"fit {report['fit_seconds']:.1f} s, of which {report['end_wait_seconds']:.1f} s waiting for consolidation at "
        f"the end ({wall:.1f} s with NeMo's set-up)"
    )
    print(f"checkpoints in {args.out / 'tiny_gpt' / 'checkpoints'}:")
    print(format_table(report))
    if report.get("resumed_from") and any(entry["global_step"] is None for entry in report["checkpoints"]):
        print("global step '-': saved before this run (resumed); the every_n count carried on from the checkpoint.")
    if report["retained"]:
        print("consolidated outputs kept after NeMo's top-k removed their checkpoints (retained/):")
        for entry in report["retained"]:
            marker = "   <- LATEST" if f"retained/{entry['name']}" == report["latest_target"] else ""
            print(f"  {entry['name']}{marker}  (global step {entry['global_step']}, {_size(entry['bytes'])})")
    if report["skipped"]:
        print(
            f"Skipped because the consolidation queue was full (checkpoints came faster than they could be "
            f"consolidated; raise --max-pending to keep more waiting): {', '.join(report['skipped'])}"
        )
    if report["dropped_by_removal"]:
        print(
            f"Dropped because NeMo's top-k removed the checkpoint while its consolidation was waiting (raise "
            f"--save-top-k to keep checkpoints longer): {', '.join(report['dropped_by_removal'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
