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

"""The NeMo-native patch (``scripts/make_upstream_patch.py``) applies to the pinned NeMo source and its ported tests
pass there, with the overlay disabled."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"
    )
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)


def test_patch_applies_to_pinned_nemo_and_ported_tests_pass(tmp_path):
    installed = Path(list(importlib.util.find_spec("nemo").submodule_search_locations)[0])
    patch = tmp_path / "nemo-consolidation.patch"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_upstream_patch.py"), "--out", str(patch)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr  # includes the check against the wheel's RECORD hashes
    # A git tree of the pinned wheel's nemo/ package (as pip unpacked it), then the patch on top.
    source = tmp_path / "nemo-src"
    shutil.copytree(installed, source / "nemo", ignore=shutil.ignore_patterns("__pycache__"))
    assert _git(source, "init", "-q").returncode == 0
    assert _git(source, "add", "-A").returncode == 0
    assert _git(source, "commit", "-qm", "nemo_toolkit 2.7.3").returncode == 0
    check = _git(source, "apply", "--check", str(patch))
    assert check.returncode == 0, check.stderr
    assert _git(source, "apply", str(patch)).returncode == 0
    changed = _git(source, "status", "--porcelain").stdout
    assert " M nemo/lightning/pytorch/strategies/megatron_strategy.py" in changed
    assert " M nemo/lightning/io/pl.py" in changed and "?? nemo/lightning/io/consolidation/" in changed
    # The ported tests, run against the patched tree (first on the path), without the overlay.
    env = dict(os.environ, NEMO_PATCH_DISABLE="1", PYTHONPATH=str(source))
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/lightning/consolidation"],
        cwd=source,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout.strip().splitlines()[-1]
