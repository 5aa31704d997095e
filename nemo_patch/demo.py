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

A real NeMo 2 run (``llm.train``, ``nl.Trainer``, ``nl.MegatronStrategy(ckpt_consolidation_frequency=...)``, NeMo's
``ModelCheckpoint`` and ``NeMoLogger``, ``torch_dist`` checkpoints); only CUDA is stubbed out
(``nemo_patch.testing.cpu_harness``). Running it again on the same ``--out`` resumes the run. Runs as
``nemo-patch-demo`` and ``scripts/demo_consolidation_cadence.py`` (docs/cadences.md); refuses to run when the overlay
is not active.
"""

import argparse
import importlib
import json
import logging
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from nemo_patch.cli.check import OVERLAY_OFF_EXIT_CODE

#: What ``--post-command`` without a command runs: this script's ``--evaluate`` on each output, in the consolidation
#: process (``{output}`` and ``{format}`` are filled in, shell-quoted, by nemo-patch).
EVALUATE = "{python} -m nemo_patch.demo --evaluate {{output}} --format {{format}}"


def overlay_off_reason() -> Optional[str]:
    """Why the overlay is not in effect in this process, or ``None``: the demo would describe a run that consolidated
    nothing."""
    import nemo_patch  # noqa: F401 - importing the package applies the overlay (at once, or as NeMo is imported)
    from nemo_patch.overlay import hook

    importlib.import_module(hook.TARGET_MODULE)
    return hook.not_applied_reason()


def format_table(root: Path, report: dict) -> str:
    """The demo's closing table: ``nemo-consolidate ROOT --list`` (:mod:`nemo_patch.cli.listing`), one row per
    checkpoint and retained output; with validation (``report["val_loss"]``), each checkpoint's ``val_loss`` too."""
    from nemo_patch.cli.listing import format_listing, list_root

    listing = list_root(root)
    val_loss = {int(step): value for step, value in (report.get("val_loss") or {}).items()}
    extra = {}
    if val_loss:
        entries = listing["checkpoints"] + listing["retained"]
        extra["val_loss"] = {entry["name"]: f"{val_loss[entry['global_step']]:.4f}" for entry in entries
                             if entry["global_step"] in val_loss}  # fmt: skip
    return format_listing(listing, extra)


def evaluate(output: Path, output_format: str) -> Dict[str, float]:
    """``--evaluate``, the default post command: one output's metrics (``safetensors``: its tensors' global L2 norm;
    ``hf``: the loss of ``AutoModelForCausalLM`` on a fixed sequence)."""
    import torch

    if output_format == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(output)).eval()  # fp32, as saved
        tokens = (torch.arange(64) * 7 % (model.config.vocab_size - 3) + 3).unsqueeze(0)
        with torch.no_grad():
            loss = model(input_ids=tokens, labels=tokens).loss
        parameters = sum(parameter.numel() for parameter in model.parameters())
        return {"eval/loss": round(float(loss), 4), "eval/parameters": parameters}
    from safetensors import safe_open

    count, squares = 0, 0.0
    for path in sorted(output.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            for name in tensors.keys():
                count += 1
                squares += float(tensors.get_tensor(name).double().pow(2).sum())
    return {"eval/tensors": count, "eval/weight_norm": round(squares**0.5, 4)}


def make_tiny_llama(out: Path) -> Path:
    """The NeMo checkpoint to fine-tune: ``out/nemo``, NeMo's ``HFLlamaImporter``'s import of ``out/hf``, a random
    2-layer ``LlamaForCausalLM`` made locally with ``transformers``; made once (a resumed run reuses them)."""
    if not (out / "nemo" / "context").is_dir():
        print(f"making a tiny Llama with transformers and importing it with NeMo's importer into {out} ...")
        command = [sys.executable, "-m", "nemo_patch.testing.tiny_llama", "--out", str(out)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"importing the tiny Llama failed:\n{proc.stderr[-3000:]}")
    return out / "nemo"


def print_post_commands(root: Path) -> None:
    """Each output's post-command result, from its ``metadata.json``."""
    outputs = [path for path in root.glob("*/*/metadata.json") if not path.parents[1].is_symlink()]
    for metadata in sorted(outputs) + sorted(root.glob("retained/*/*/metadata.json")):
        result = json.loads(metadata.read_text()).get("post_command")
        if result is None:
            continue
        status = f"exit {result['returncode']}" if result.get("returncode") is not None else "not run"
        if result.get("timed_out"):
            status = "timed out"
        metrics = json.dumps(result.get("metrics") or {})
        print(
            f"  {metadata.parent.relative_to(root)}: {status} after {result.get('seconds', 0):.1f} s, "
            f"metrics {metrics} (log: {Path(result.get('log') or '-').name})"
        )


def print_transformers_load(root: Path) -> None:
    """Load ``LATEST/hf`` with ``transformers``, as a user of the output would, and say what it is."""
    from transformers import AutoModelForCausalLM

    hf_dir = root / "LATEST" / "hf"
    if not hf_dir.is_dir():
        print("no hf output yet (nothing was consolidated), so nothing for transformers to load")
        return
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()  # fp32, as saved
    parameters = sum(parameter.numel() for parameter in model.parameters())
    files = sorted(path.name for path in hf_dir.iterdir())
    print(
        f"transformers.AutoModelForCausalLM.from_pretrained({str(hf_dir)!r}): {type(model).__name__}, "
        f"{parameters:,} parameters; {', '.join(files)}"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``nemo-patch-demo``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--frequency",
        help='ckpt_consolidation_frequency: "each", "latest", "every_n:<k>", "best", phases of those, or "off" '
        '(default: every_n:2; "best" with --best)',
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
        help="ConsolidationConfig.keep: consolidated outputs kept when top-k removes their checkpoints (default: all)",
    )
    parser.add_argument(
        "--best",
        action="store_true",
        help='validate every --save-every steps and rank checkpoints by NeMo\'s val_loss (ModelCheckpoint(monitor='
        '"val_loss", mode="min")); the data makes val_loss fall, then rise; --frequency defaults to "best"',
    )
    parser.add_argument(
        "--hf",
        action="store_true",
        help="fine-tune a tiny Llama (made with transformers, imported with NeMo's HFLlamaImporter) instead of the "
        'tiny GPT, with ConsolidationConfig(format="hf"); then load LATEST/hf with transformers',
    )
    parser.add_argument(
        "--post-command",
        nargs="?",
        const="",
        metavar="COMMAND",
        help="ConsolidationConfig.post_command, run after each output is published ({output}, {format}, "
        "{global_step}, {checkpoint}); without COMMAND, this script's --evaluate, which loads the output and prints "
        "metrics",
    )
    parser.add_argument(
        "--evaluate",
        type=Path,
        metavar="OUTPUT",
        help="(what --post-command runs) load one output and print its metrics as a JSON line, then exit",
    )
    parser.add_argument("--format", default="safetensors", help="with --evaluate: the output's format")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the demo (``nemo-patch-demo``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.evaluate is not None:
        print(json.dumps(evaluate(args.evaluate, args.format)))
        return 0
    logging.getLogger("nemo_patch").setLevel(logging.INFO)  # a consolidation started, one published (NeMo's format)

    reason = overlay_off_reason()
    if reason is not None:
        parser.exit(OVERLAY_OFF_EXIT_CODE, f"{parser.prog}: error: the nemo_patch overlay is not active: {reason}\n")
    from nemo_patch.testing.fit_run import run_tiny_fit
    from nemo_patch.training.policy import parse_consolidation_frequency

    if args.frequency is None:
        args.frequency = "best" if args.best else "every_n:2"
    frequency = None if args.frequency == "off" else args.frequency
    demo_takes = 'the demo takes "each", "latest", "every_n:<k>", "best", phases of those (e.g. "every_n:4; each@6"), '
    demo_takes += 'or "off"'
    if frequency is not None:
        try:
            policy = parse_consolidation_frequency(frequency)
        except ValueError as error:
            parser.error(f"{str(error).split('; expected ')[0]}; {demo_takes}")
        if any(phase.cadence == "best" for phase in policy.phases):
            args.best = True  # "best" ranks checkpoints by a validation metric: validate
    post_command = args.post_command
    if post_command == "":
        post_command = EVALUATE.format(python=shlex.quote(sys.executable))
    options: Dict[str, Any] = {}
    if args.best:
        # Validation (2 batches) every --save-every steps; ModelCheckpoint saves after each, ranked by val_loss.
        minimum = max(args.save_every, args.max_steps * 3 // 5 // args.save_every * args.save_every)
        options.update(monitor="val_loss", validate_every=args.save_every, val_minimum_at=minimum, lr=5e-3)
    else:
        options["monitor"] = "step" if args.save_top_k >= 0 else None  # newest first, resumable (docs/retention.md)
    if args.hf:
        options.update(model_from=make_tiny_llama(args.out / "tiny-llama"), output_format="hf")
    start = time.perf_counter()
    report = run_tiny_fit(
        args.out.resolve(),  # absolute, as the run's paths in the report and the table are
        frequency=frequency,
        max_steps=args.max_steps,
        save_every=args.save_every,
        async_save=args.async_save,
        max_pending=args.max_pending,
        save_top_k=args.save_top_k,
        keep=args.keep,
        post_command=post_command,
        **options,
    )
    wall = time.perf_counter() - start
    root = args.out / "tiny_gpt" / "checkpoints"
    model = "a tiny Llama (hf outputs)" if args.hf else "the tiny GPT"
    validation = f", validated every {args.save_every} steps" if args.best else ""
    print()
    print(
        f"ckpt_consolidation_frequency={args.frequency!r}: trained {model} to global step {report['global_step']}, "
        f"checkpoint every {args.save_every} steps{validation}, {'async' if args.async_save else 'sync'} save; "
        f"fit {report['fit_seconds']:.1f} s, of which {report['end_wait_seconds']:.1f} s waiting for consolidation at "
        f"the end ({wall:.1f} s with NeMo's set-up)"
    )
    print(f"checkpoints in {root} (nemo-consolidate {root} --list):")
    print(format_table(root, report))
    if args.best:
        best = report.get("best_target")
        print(f"BEST -> {best}: the lowest val_loss so far when it was saved" if best else "BEST: none yet")
    if report["retained"]:
        print("retained/...: consolidated outputs kept after NeMo's top-k removed their checkpoints")
    if post_command is not None:
        print(f"post command after each output: {post_command}")
        print_post_commands(root)
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
    if args.hf:
        print_transformers_load(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
