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

"""Installing into an existing NeMo environment as the README and ``docs/installation.md`` say, and their two checks.

The wheel is built with ``pip wheel --no-deps`` and installed with the documented ``pip install --no-deps <wheel>
"blake3>=1.0" "zlib-ng>=0.5"`` into a fresh virtual environment. That environment then sees this one's site-packages
(NeMo, torch, megatron-core) through a path entry, as a NeMo container's environment would hold them: a path entry's
own ``.pth`` files are not run, so this checkout's editable nemo-patch and its start-up hook stay invisible there, and
what edits NeMo's ``MegatronStrategy`` is the wheel's ``nemo_patch.pth`` alone. Then the documented checks
run there, with the overlay on and off, and ``pip uninstall`` removes what the wheel put in.
"""

import os
import re
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

CHECK = (
    "import inspect, nemo.lightning as nl; "
    "print('ckpt_consolidation_frequency' in inspect.signature(nl.MegatronStrategy).parameters)"
)


def _run(args, cwd, env=None, timeout=900):
    base = {k: v for k, v in os.environ.items() if k not in ("NEMO_PATCH_DISABLE", "PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=cwd, env={**base, **(env or {})}, timeout=timeout)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _readme_install_line():
    line = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("pip install"))
    return line.split("#")[0].split()


def test_no_deps_install_into_an_existing_nemo_environment_and_its_checks(tmp_path):
    import nemo_patch

    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)], cwd=tmp_path)
    wheel = dist / f"nemo_patch-{nemo_patch.__version__}-py3-none-any.whl"
    assert wheel.is_file(), sorted(p.name for p in dist.iterdir())
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "nemo_patch/engine/consolidate.py" in names
    assert {"nemo_patch/overlay/nemo_edits/series", "nemo_patch/overlay/nemo_edits/knob.diff"} <= set(names)
    # the demo, and what it trains with (before, the wheel left nemo_patch.testing out: the demo exited 2)
    assert {"nemo_patch/demo.py", "nemo_patch/testing/fit_run.py", "nemo_patch/testing/tiny_llama.py"} <= set(names)

    env_dir = tmp_path / "nemo-env"
    _run([sys.executable, "-m", "venv", str(env_dir)], cwd=tmp_path)
    python = env_dir / "bin" / "python"
    # The README's command, with the wheel for the path.
    args = _readme_install_line()
    assert args[:3] == ["pip", "install", "--no-deps"] and args[3] == "/path/to/nemo-patch", args
    requirements = [arg.strip('"') for arg in args[4:]]
    assert requirements == ["blake3>=1.0", "zlib-ng>=0.5"]
    _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel), *requirements], cwd=tmp_path)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    installed = os.listdir(purelib)
    assert {"nemo_patch", "nemo_patch.pth", "_nemo_patch_autoload.py"} <= set(installed)
    # The existing NeMo environment: this venv's packages, by path entry only.
    ours = site.getsitepackages()[0] if site.getsitepackages() else sysconfig.get_paths()["purelib"]
    with open(os.path.join(purelib, "zz_existing_nemo.pth"), "w") as pth:
        pth.write(ours + "\n")

    version = _run([str(env_dir / "bin" / "nemo-consolidate"), "--version"], cwd=tmp_path).stdout.strip()
    assert version == f"nemo-consolidate (nemo-patch {nemo_patch.__version__})"
    where = _run([str(python), "-c", CHECK + "; import nemo_patch; print(nemo_patch.__file__)"], cwd=tmp_path)
    active, package_file = where.stdout.strip().splitlines()[-2:]
    assert active == "True"
    assert package_file.startswith(purelib), package_file  # the wheel's copy, not this checkout
    off = _run([str(python), "-c", CHECK], cwd=tmp_path, env={"NEMO_PATCH_DISABLE": "1"})
    assert off.stdout.strip().splitlines()[-1] == "False"
    check = _run([str(env_dir / "bin" / "nemo-consolidate"), "--check"], cwd=tmp_path).stdout
    assert check.startswith("nemo_patch overlay active: ") and check.endswith("(start-up hook installed)\n"), check
    _the_demo_runs_from_the_wheel(env_dir, tmp_path)

    docs = (REPO / "docs" / "installation.md").read_text()
    assert CHECK in docs and CHECK in (REPO / "README.md").read_text()
    assert re.search(r"prints `True` when the overlay is active", docs)

    os.remove(os.path.join(purelib, "zz_existing_nemo.pth"))
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", "nemo-patch"], cwd=tmp_path)
    left = set(os.listdir(purelib)) & {"nemo_patch", "nemo_patch.pth", "_nemo_patch_autoload.py"}
    assert not left


def _the_demo_runs_from_the_wheel(env_dir, tmp_path):
    """The demo from the wheel, as a user of a NeMo environment runs it (``nemo-patch-demo``, outside any checkout):
    the tiny Llama with ``hf`` outputs, which ``transformers`` loads; then ``nemo-consolidate --format hf`` on its
    checkpoint (whose context names the wheel's ``nemo_patch.testing.tiny_llama``; before, it exited 10: "No module
    named 'nemo_patch.testing'") writes the same tensors as the run's own consolidation."""
    from safetensors.torch import load_file

    demo = [str(env_dir / "bin" / "nemo-patch-demo"), "--hf", "--frequency", "each", "--max-steps", "2"]
    proc = _run(demo + ["--save-every", "2", "--out", str(tmp_path / "demo")], cwd=tmp_path)
    assert "transformers.AutoModelForCausalLM.from_pretrained(" in proc.stdout, proc.stdout[-3000:]
    root = tmp_path / "demo" / "tiny_gpt" / "checkpoints"
    cli = [str(env_dir / "bin" / "nemo-consolidate"), str(root), "--format", "hf", "--trust-context"]
    _run(cli + ["--out", str(tmp_path / "hf")], cwd=tmp_path)
    ours, runs = load_file(tmp_path / "hf" / "model.safetensors"), load_file(
        root / "LATEST" / "hf" / "model.safetensors"
    )
    assert sorted(ours) == sorted(runs) and len(ours) > 5
    assert all(ours[name].equal(runs[name]) for name in ours)
