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

"""Shared fixtures: real NeMo fits of the tiny GPT on the CPU, each in a fresh interpreter.

Every fit runs ``python -m nemo_patch.testing.fit_run`` in a subprocess: a real ``llm.train`` with ``nl.Trainer``,
``nl.MegatronStrategy`` (the overlay's, or NeMo's own with ``NEMO_PATCH_DISABLE=1``), NeMo's ``ModelCheckpoint`` and
``NeMoLogger``, saving real ``torch_dist`` checkpoints. Only CUDA is stubbed (``nemo_patch.testing.cpu_harness``).
A fresh interpreter per fit keeps NeMo's and megatron-core's process-global state (parallel state, async writer,
callback group) from leaking between runs.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]

#: This module. NeMo's tree under tests/nemo/ has a conftest.py of its own in a directory without ``__init__.py``,
#: which pytest imports under the same name, ``conftest``, replacing this one in ``sys.modules``; the suite's modules
#: import their helpers with ``from conftest import ...`` (see :func:`pytest_collectstart`).
_SUITE_CONFTEST = sys.modules[__name__]


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Before a test module of the suite (not one of tests/nemo/) is imported, make ``conftest`` this module again."""
    if isinstance(collector, pytest.Module) and "nemo" not in collector.path.relative_to(REPO / "tests").parts[:1]:
        sys.modules["conftest"] = _SUITE_CONFTEST


def run_python(code: str, env: Optional[Dict[str, str]] = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this venv; returns the completed process (text output)."""
    full_env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO
    )


def run_fit(out: Path, *, stock: bool = False, **options: Any) -> Dict[str, Any]:
    """Run one tiny-GPT fit into ``out`` and return its JSON report (see ``nemo_patch.testing.fit_run``)."""
    proc = run_fit_process(out, stock=stock, **options)
    if proc.returncode != 0:
        pytest.fail(f"fit failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads((out / "report.json").read_text())


def run_fit_process(out: Path, *, stock: bool = False, **options: Any) -> subprocess.CompletedProcess:
    """Run one tiny-GPT fit into ``out``; returns the completed process (its output also in ``out/fit.log``)."""
    args = [sys.executable, "-m", "nemo_patch.testing.fit_run", "--out", str(out), "--json", str(out / "report.json")]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                args += [flag, str(item)]
        elif value is not None and value is not False:
            args += [flag, str(value)]
    env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
    if stock:
        args.append("--stock")
        env["NEMO_PATCH_DISABLE"] = "1"
    out.mkdir(parents=True, exist_ok=True)
    # its own process group, output to files: the fit's end is its process's exit, not the end of every pipe a
    # process it started may hold; what of the group outlives it is named and killed (a die: fault kills the group)
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(args, stdout=stdout, stderr=stderr, env=env, cwd=REPO, start_new_session=True)
        try:
            returncode = process.wait(timeout=900)
        except subprocess.TimeoutExpired:
            _stop_group(process.pid, grace=0.0)
            process.wait()
            raise
        left = _stop_group(process.pid, grace=30.0)
        stdout.seek(0)
        stderr.seek(0)
        proc = subprocess.CompletedProcess(
            args, returncode, stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
        )
    (out / "fit.log").write_text(proc.stdout + proc.stderr)
    if left:
        pytest.fail(f"processes of the fit outlived it (killed now): {left}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def _stop_group(group: int, grace: float) -> List[str]:
    """Wait up to ``grace`` seconds for the processes of process group ``group`` to end, then SIGKILL what is left;
    returns the command lines of those killed (a process group's members from ``/proc``, as ps(1) reads them)."""
    deadline = time.monotonic() + grace
    while True:
        members = {}
        for entry in Path("/proc").iterdir():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if entry.name.isdigit() and fields[0] != "Z" and int(fields[2]) == group:
                    members[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            except (OSError, IndexError, ValueError):
                continue
        if not members or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if members:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [f"{pid}: {cmdline}" for pid, cmdline in sorted(members.items())]


def consolidated_names(report: Dict[str, Any]) -> list:
    """Names of the checkpoints in a report that hold ``consolidated/``."""
    return [entry["name"] for entry in report["checkpoints"] if entry["consolidated"]]


def make_tiny_llama(out: Path, *flags: str) -> Path:
    """``out/hf``: a random tiny ``LlamaForCausalLM`` (``nemo_patch.testing.tiny_llama`` with ``flags``); ``out/nemo``:
    its import with NeMo's own importer."""
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch.testing.tiny_llama", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def imported_llama(tmp_path_factory) -> Path:
    """``hf/``: a random LlamaForCausalLM (2 layers, GQA, fp32) with a word-level tokenizer; ``nemo/``: its import."""
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def each_run(tmp_path_factory) -> Dict[str, Any]:
    """A 6-step run saving every 2 steps with ``ckpt_consolidation_frequency="each"`` (sync save), 2 writers."""
    out = tmp_path_factory.mktemp("each")
    # The queue bound is raised so that every save of this fast tiny run is consolidated (none skipped).
    # Two writer processes per consolidation: every test of this run checks a multi-writer output.
    report = run_fit(out, frequency="each", max_steps=6, save_every=2, max_pending=8, config_arg=["workers=2"])
    report["root"] = out / "tiny_gpt" / "checkpoints"
    return report


@pytest.fixture()
def checkpoint_copy(each_run, tmp_path) -> Path:
    """A private copy of a finished checkpoint of ``each_run`` (global step 6) without its consolidated output."""
    copy = tmp_path / "ckpt"
    shutil.copytree(each_run["root"] / "LATEST", copy, ignore=shutil.ignore_patterns("consolidated"))
    return copy


@pytest.fixture(scope="session")
def tp2_checkpoint(tmp_path_factory) -> Path:
    """A finished checkpoint of a 2-step TP=2 fit (2 processes: each attention and MLP weight stored as several
    chunks), and its reference tensors in ``<run>/reference/model.safetensors``: PyTorch's own DCP converter's
    reading of it (:func:`dcp_reference_tensors`), never the product's output."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("tp2")
    report = run_fit(out, tp=2, devices=2, max_steps=2, save_every=2)
    root = Path(report.get("root") or out / "tiny_gpt" / "checkpoints")
    checkpoint = next(path for path in sorted(root.iterdir()) if (path / "weights").is_dir())
    (out / "reference").mkdir()
    tensors = dcp_reference_tensors(checkpoint / "weights", out / "reference")
    save_file(
        {name: tensor.contiguous() for name, tensor in tensors.items()}, str(out / "reference" / "model.safetensors")
    )
    (out / "reference" / "reference.pt").unlink()
    return checkpoint


def dcp_reference_tensors(weights_dir: Path, scratch: Path) -> Dict[str, Any]:
    """The model tensors of a NeMo checkpoint according to PyTorch's own DCP converter (``dcp_to_torch_save``), named
    as megatron-core's model names them (``module.`` dropped, layer-stacked entries split per layer, the layer index
    after ``layers``) by hand here, not by the product. ``scratch`` receives ``reference.pt``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(weights_dir), str(scratch / "reference.pt"))
    full = torch.load(scratch / "reference.pt", weights_only=False)
    reference = {}
    for key, value in full.items():
        if not key.startswith("module.") or "_extra_state" in key or not isinstance(value, torch.Tensor):
            continue
        name = key[len("module.") :]
        head, sep, tail = name.partition(".layers.")
        if sep and not tail[:1].isdigit():
            for layer in range(value.shape[0]):
                reference[f"{head}.layers.{layer}.{tail}"] = value[layer]
        else:
            reference[name] = value
    return reference
