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

"""Check nemo-patch on your GPU node: real NeMo training on CUDA, no CPU harness, one PASS/FAIL line per check.

Usage: ``python scripts/gpu_check.py [--out DIR] [--steps N] [--json FILE]``; ``--cpu`` runs the same flow on the CPU
through the test harness (no distributed optimizer), to check this script itself where there is no GPU.

It trains the tiny NeMo GPT (``nemo_patch.testing.fit_run``: ``llm.train``, ``nl.MegatronStrategy``, NeMo's
``ModelCheckpoint``) with bf16 mixed precision, megatron-core's distributed optimizer and async save, consolidating at
``"every_n:2"``, then resumes it with ``"latest"``, and checks:

* ``cadence``: exactly the due checkpoints were consolidated (the 2nd and 4th of the first run, the newest at the end
  of the resumed one);
* ``tensors``: every consolidated tensor equals megatron-core's own reading of its distributed checkpoint
  (``dist_checkpointing.load_plain_tensors``) bit for bit, and the output holds nothing else;
* ``logits``: a fresh model loaded with ``nemo_patch.load_consolidated_into`` gives the trained model's logits on the
  GPU, exactly;
* ``optimizer``: the checkpoint holds the distributed optimizer's state and the output none of it;
* ``blocked``: the training loop's time in the consolidation hooks per consolidation, against the consolidation's own
  time (it must be under 10% of it).

With Transformer Engine installed it also runs NeMo's TE layer spec (``te``); with more than one GPU, TP=2 (``tp2``);
otherwise it says why they are skipped. It ends with a table of the runs and exits 1 on any FAIL, 0 otherwise.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
#: Most training-loop time per consolidation, as a share of the consolidation's own time.
BLOCKED_SHARE = 0.10


class Checks:
    """Collects and prints ``PASS``/``FAIL``/``SKIP`` lines."""

    def __init__(self) -> None:
        self.results: List[Tuple[str, str, str]] = []

    def record(self, name: str, ok: Optional[bool], detail: str) -> None:
        """One line: ``ok`` ``True`` PASS, ``False`` FAIL, ``None`` SKIP."""
        status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        self.results.append((status, name, detail))
        print(f"{status} {name}: {detail}", flush=True)

    @property
    def failed(self) -> bool:
        """Whether any check failed."""
        return any(status == "FAIL" for status, _, _ in self.results)


def fit(out: Path, device: str, **options: Any) -> Dict[str, Any]:
    """One ``nemo_patch.testing.fit_run`` in a fresh interpreter; returns its JSON report.

    Raises:
        RuntimeError: the run failed (the last lines of its output are in the message).
    """
    args = [sys.executable, "-m", "nemo_patch.testing.fit_run", "--out", str(out), "--device", device]
    args += ["--json", str(out / "report.json")]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value not in (None, False):
            args += [flag, str(value)]
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    (out / f"fit-{int(time.time())}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"fit failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    report["wall_seconds"] = time.perf_counter() - started
    return report


def compare_with_megatron_core(checkpoint: Path, output: Path) -> Tuple[bool, str]:
    """``nemo_patch.testing.mcore_compare`` in a fresh interpreter: ``(ok, detail)``."""
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch.testing.mcore_compare", str(checkpoint / "weights"), str(output)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {"error": proc.stderr[-500:]}
    if proc.returncode == 0 and "compared" in result:
        return True, f"{checkpoint.name}: {result['compared']} tensors bitwise equal"
    return False, f"{checkpoint.name}: {result.get('error', 'no result')}"


def optimizer_keys(checkpoint: Path) -> int:
    """How many optimizer entries the checkpoint's DCP metadata holds."""
    from nemo_patch.engine.metadata_checks import read_dcp_metadata

    return sum(key.startswith("optimizer.") for key in read_dcp_metadata(checkpoint / "weights").state_dict_metadata)


def output_names(output: Path) -> List[str]:
    """The tensor names of a consolidated output."""
    from safetensors import safe_open

    names: List[str] = []
    for path in sorted(output.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names += list(handle.keys())
    return names


def consolidated_steps(report: Dict[str, Any]) -> List[int]:
    """Global steps consolidated during one run (its queue's completed requests)."""
    return sorted(report["completed_steps"])


def check_tensors(checks: Checks, name: str, root: Path, reports: List[Dict[str, Any]]) -> None:
    """``tensors``: every checkpoint of the run that holds an output, against megatron-core's load."""
    done = [root / entry["name"] for entry in reports[-1]["checkpoints"] if entry["consolidated"]]
    results = [compare_with_megatron_core(path, path / "consolidated") for path in done]
    ok = bool(results) and all(ok for ok, _ in results)
    checks.record(name, ok, "; ".join(detail for _, detail in results) or "no consolidated checkpoint")


def environment() -> Dict[str, str]:
    """Versions and the device, for the report."""
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__}
    for package in ("nemo", "megatron.core", "transformer_engine", "lightning"):
        try:
            module = importlib.import_module(package)
            info[package] = str(getattr(module, "__version__", "installed"))
        except ImportError:
            info[package] = "absent"
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    info["gpus"] = str(torch.cuda.device_count())
    return info


def run_checks(
    out: Path, device: str, steps: int, distributed_optimizer: bool = True
) -> Tuple[Checks, List[Dict[str, Any]]]:
    """The main flow (see the module docstring); returns the checks and one table row per run
    (``distributed_optimizer``: megatron-core's on CUDA, else the plain optimizer)."""
    import torch

    checks = Checks()
    rows: List[Dict[str, Any]] = []
    cuda = device == "cuda"
    common = dict(
        save_every=steps // 4,
        async_save=True,
        precision="bf16-mixed",
        distributed_optimizer=cuda and distributed_optimizer,
        wait_for_consolidation=True,
    )
    main = out / "main"
    root = main / "tiny_gpt" / "checkpoints"
    first = fit(main, device, frequency="every_n:2", max_steps=steps, **common)
    second = fit(main, device, frequency="latest", max_steps=steps + steps // 2, probe_logits=True, **common)
    for label, report in (("every_n:2", first), ("latest (resumed)", second)):
        rows.append({"run": label, **{k: report[k] for k in ("global_step", "consolidations", "fit_seconds")}})
        rows[-1].update(
            blocked_seconds=report["blocked_seconds"], consolidation_seconds=report["consolidation_seconds"]
        )
    interval = steps // 4
    expected = ([2 * interval, 4 * interval], [steps + steps // 2])
    got = (consolidated_steps(first), consolidated_steps(second))
    checks.record("cadence", got == expected, f"consolidated global steps {got[0]} then {got[1]}, expected {expected}")
    check_tensors(checks, "tensors", root, [first, second])
    diff = second.get("max_abs_logit_diff")
    checks.record("logits", diff == 0.0, f"max |logit difference| on {device}: {diff}")
    latest = root / "LATEST"
    held, leaked = optimizer_keys(latest), [n for n in output_names(latest / "consolidated") if "optimizer" in n]
    if cuda and distributed_optimizer:
        checks.record(
            "optimizer",
            held > 0 and not leaked,
            f"{held} optimizer entries in the checkpoint, {len(leaked)} in the output",
        )
    else:
        checks.record(
            "optimizer", None, "the distributed optimizer needs CUDA" if not cuda else "off (--plain-optimizer)"
        )
    blocked = sum(r["blocked_seconds"] for r in (first, second))
    count = max(1, sum(r["consolidations"] for r in (first, second)))
    spent = sum(r["consolidation_seconds"] for r in (first, second))
    per, share = blocked / count, (blocked / spent if spent else 0.0)
    checks.record(
        "blocked",
        share < BLOCKED_SHARE,
        f"{per * 1000:.1f} ms of training per consolidation ({share:.2%} of {spent / count:.1f} s)",
    )
    if cuda and importlib.util.find_spec("transformer_engine") is not None:
        te = fit(
            out / "te", device, frequency="each", max_steps=steps // 2, layer_spec="te", probe_logits=True, **common
        )
        rows.append({"run": "te each", **{k: te[k] for k in ("global_step", "consolidations", "fit_seconds")}})
        check_tensors(checks, "te", out / "te" / "tiny_gpt" / "checkpoints", [te])
        checks.record(
            "te-logits", te.get("max_abs_logit_diff") == 0.0, f"max |logit difference|: {te.get('max_abs_logit_diff')}"
        )
    else:
        checks.record("te", None, "Transformer Engine is not installed" if cuda else "Transformer Engine needs CUDA")
    if cuda and torch.cuda.device_count() > 1:
        tp2 = fit(out / "tp2", device, frequency="each", max_steps=steps // 2, tp=2, **common)
        rows.append({"run": "tp2 each", **{k: tp2[k] for k in ("global_step", "consolidations", "fit_seconds")}})
        check_tensors(checks, "tp2", out / "tp2" / "tiny_gpt" / "checkpoints", [tp2])
    else:
        checks.record("tp2", None, f"{torch.cuda.device_count()} GPU(s): TP=2 needs 2")
    return checks, rows


def main(argv: Optional[List[str]] = None) -> int:
    """Run the checks; returns the exit code (1 on any FAIL)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="work directory (emptied)")
    parser.add_argument("--steps", type=int, default=8, help="global steps of the first run (a multiple of 4 >= 4)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU through the test harness (no GPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--plain-optimizer",
        action="store_true",
        help="train without megatron-core's distributed optimizer (its save fails in stock NeMo 2.7.3 with "
        "megatron-core 0.15.3 under torch 2.11: AssertionError (torch.Size([]), 0, 64))",
    )
    args = parser.parse_args(argv)
    if args.steps < 4 or args.steps % 4:
        parser.error(f"--steps must be a multiple of 4 and at least 4, got {args.steps}")
    import shutil

    import torch

    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU node, or pass --cpu to check this script on the CPU")
    shutil.rmtree(args.out, ignore_errors=True)
    info = environment()
    print("gpu_check: " + ", ".join(f"{key} {value}" for key, value in info.items()), flush=True)
    started = time.perf_counter()
    try:
        checks, rows = run_checks(args.out, "cpu" if args.cpu else "cuda", args.steps, not args.plain_optimizer)
    except RuntimeError as error:
        print(f"FAIL run: {error}", flush=True)
        return 1
    print(f"\n{'run':<18}{'global step':>12}{'consolidations':>16}{'fit s':>8}")
    for row in rows:
        print(f"{row['run']:<18}{row['global_step']:>12}{row['consolidations']:>16}{row['fit_seconds']:>8.1f}")
    print(f"gpu_check: {'FAIL' if checks.failed else 'PASS'} in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"environment": info, "checks": checks.results, "runs": rows}, indent=2))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
