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

"""The upstream series (``scripts/make_upstream_patch.py --series``) applies to the installed NeMo one patch at a
time, and after each patch that patch's own tests pass in the patched tree, with the overlay off.

The installed NeMo is 2.7.3 in ``.venv`` and 2.5.3 in CI's ``.venv-nemo-2.5`` (the ``matrix`` mark runs this file in
both). Each patch's tests are the test files it adds or changes under ``tests/``, run once, in the tree patched up to
it: real consolidations of real checkpoints, and for the strategy, retention and PEFT patches a CPU fit of the patched
NeMo each (see each stage's ``description.md`` under ``scripts/upstream/stages``). What is expensive to make is made
once and shared by the patches' tests (``NEMO_CONSOLIDATION_TEST_CACHE``): the megatron-core checkpoint of the first
patch's tests and the knob's fit, which the PEFT patch's LoRA fit starts from.
"""

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import make_upstream_patch  # noqa: E402
from upstream.transforms import BLACK_ARGS, FLAKE8_ARGS, ISORT_SETTINGS, LEFTOVERS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.matrix]

STAGES = make_upstream_patch.STAGES
GIT_ENV = dict(
    os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"
)


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=GIT_ENV)


class PatchedTree:
    """A git copy of the installed NeMo package, with the series applied up to some patch."""

    def __init__(self, root: Path, patches: List[Path]) -> None:
        self.root, self.patches, self.applied = root, patches, 0
        self.cache = root.parent / "test-cache"
        self.cache.mkdir(exist_ok=True)

    def apply_through(self, number: int) -> None:
        while self.applied < number:
            patch = self.patches[self.applied]
            proc = _git(self.root, "am", "--quiet", str(patch))
            assert proc.returncode == 0, f"{patch.name} does not apply:\n{proc.stdout}{proc.stderr}"
            self.applied += 1


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> List[Path]:
    out = tmp_path_factory.mktemp("series")
    # In this process (the tests below reuse its formatted modules); includes the check of the NeMo files it edits
    # against the installed wheel's RECORD hashes, and each stage's pyflakes and import checks.
    assert make_upstream_patch.main(["--series", str(out)]) == 0
    return [out / name for name in (out / "series").read_text().split()]


@pytest.fixture(scope="module")
def tree(series, tmp_path_factory) -> PatchedTree:
    installed = Path(list(importlib.util.find_spec("nemo").submodule_search_locations)[0])
    root = tmp_path_factory.mktemp("nemo-src")
    # The compiled files are copied too (their sources keep their times), so that the patched tree imports fast.
    shutil.copytree(installed, root / "nemo")
    (root / ".gitignore").write_text("__pycache__/\n")
    assert _git(root, "init", "-q").returncode == 0
    assert _git(root, "add", "-A").returncode == 0
    assert _git(root, "commit", "-qm", "nemo_toolkit as installed").returncode == 0
    return PatchedTree(root, series)


def test_every_setting_of_the_overlay_is_an_argument_of_nemos_strategy_or_named_as_a_follow_up(series):
    """The patched ``MegatronStrategy.__init__`` (the whole series) takes every setting the overlay declares, with its
    declared default, except the ones named as follow-ups."""
    from upstream import nemo_edits

    from nemo_patch.training.settings import SETTINGS

    state = make_upstream_patch.tree_state(make_upstream_patch.installed_nemo_src(), STAGES[-1].key)
    tree = ast.parse(state[nemo_edits.STRATEGY])
    strategy = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MegatronStrategy")
    init = next(f for f in strategy.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    defaults = dict(zip([a.arg for a in init.args.args][-len(init.args.defaults) :], init.args.defaults))
    upstream = {name: ast.literal_eval(default) for name, default in defaults.items()}
    for spec in SETTINGS:
        if spec.strategy_argument in nemo_edits.NOT_UPSTREAMED_ARGUMENTS:
            assert spec.strategy_argument not in upstream
        else:
            assert upstream[spec.strategy_argument] == spec.default, spec.strategy_argument
    assert set(nemo_edits.NOT_UPSTREAMED_ARGUMENTS) <= {spec.strategy_argument for spec in SETTINGS}


def _added_files(patch: Path) -> List[str]:
    return re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), flags=re.M)


def test_series_is_one_described_patch_per_stage(series):
    assert [p.name.split("-", 1)[1] for p in series] == [f"{s.directory.split('-', 1)[1]}.patch" for s in STAGES]
    for patch, stage in zip(series, STAGES):
        text = patch.read_text()
        assert f"Subject: [PATCH {series.index(patch) + 1}/{len(series)}] {stage.subject}" in text
        description = patch.with_suffix(".md").read_text()
        for heading in ("## What", "## Why", "## How it is tested", "## Follow-ups"):
            assert heading in description, f"{patch.name}: no {heading!r} section"
        assert "docs/source/checkpoints/consolidation.rst" in _added_files(patch), "each patch documents its part"
        assert any(re.match(r"tests/.*test_.*\.py$", path) for path in _added_files(patch)), "each patch is tested"


@pytest.mark.parametrize("number", range(1, len(STAGES) + 1), ids=[stage.key for stage in STAGES])
def test_patch_applies_and_its_tests_pass_in_the_patched_tree(tree, number):
    """Each patch's own tests (the test files it adds or changes), once, in the tree patched up to it."""
    tree.apply_through(number)
    tests = [p for p in _added_files(tree.patches[number - 1]) if re.match(r"tests/.*/test_[^/]*\.py$", p)]
    assert tests
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    # The patches' tests share what is expensive to make (NEMO_CONSOLIDATION_TEST_CACHE): one megatron-core checkpoint
    # (written by the first patch's tests) and the knob's CPU fit (which the PEFT patch's LoRA fit starts from).
    env.update(NEMO_PATCH_DISABLE="1", PYTHONPATH=str(tree.root), NEMO_CONSOLIDATION_TEST_CACHE=str(tree.cache))
    # A basetemp of its own: under the default one, each inner pytest run would number a new
    # /tmp/pytest-of-<user>/pytest-N and delete all but the newest three, the outer run's (still in use) among them.
    basetemp = tree.root.parent / f"basetemp-{number}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "-W",
            "ignore",
            "--basetemp",
            str(basetemp),
            *tests,
        ],  # fmt: skip
        cwd=tree.root,
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in last and "failed" not in last and "skipped" not in last, last


def _python_files(tree: PatchedTree) -> Dict[str, str]:
    """Path -> text of every Python file the series adds or changes (the whole series applied)."""
    tree.apply_through(len(STAGES))
    changed = _git(tree.root, "diff", "--name-only", "HEAD~" + str(len(STAGES)), "HEAD").stdout.split()
    return {path: (tree.root / path).read_text() for path in changed if path.endswith(".py")}


def test_patched_files_follow_nemos_formatting_and_lint(tree):
    import black
    import isort

    files = _python_files(tree)
    original = {path: _git(tree.root, "show", f"HEAD~{len(STAGES)}:{path}").stdout for path in files}
    mode = black.Mode(line_length=int(BLACK_ARGS[1].split("=")[1]), string_normalization=False)
    for path, text in files.items():
        was = original[path]
        if not was or black.format_str(was, mode=mode) == was:  # NeMo's own files are held to what they were
            assert black.format_str(text, mode=mode) == text, f"{path} is not formatted as black {BLACK_ARGS}"
        if not was or isort.check_code(was, config=isort.Config(**ISORT_SETTINGS)):
            assert isort.check_code(text, config=isort.Config(**ISORT_SETTINGS)), f"{path}: imports not sorted"
        ast.parse(text)
    flake8 = [sys.executable, "-m", "flake8", *FLAKE8_ARGS]
    complaints = subprocess.run(flake8 + sorted(files), cwd=tree.root, capture_output=True, text=True).stdout
    base = tree.root.parent / "nemo-as-installed"  # NeMo's own files as they were: only new complaints count
    for path, text in original.items():
        if text:
            (base / path).parent.mkdir(parents=True, exist_ok=True)
            (base / path).write_text(text)
    old = subprocess.run(flake8 + [p for p in sorted(files) if original[p]], cwd=base, capture_output=True, text=True)
    position = re.compile(r":\d+:\d+:")
    known = {position.sub(":", line) for line in old.stdout.splitlines()}
    new = [line for line in complaints.splitlines() if line.strip() and position.sub(":", line) not in known]
    assert not new, "\n".join(new)
    # NeMo's line length: every line the series writes (NeMo's own longer lines are left as they are)
    long_lines = [
        f"{path}:{number}: {len(line)} characters"
        for path, text in files.items()
        for number, line in enumerate(text.splitlines(), 1)
        if len(line) > 119 and line not in original[path].splitlines()
    ]
    assert not long_lines, "\n".join(long_lines)


def test_no_overlay_leftovers_and_no_assert_in_library_code(tree):
    files = _python_files(tree)
    for path, text in files.items():
        for number, line in enumerate(text.splitlines(), 1):
            assert not LEFTOVERS.search(line), f"{path}:{number}: {line.strip()}"
        if path.startswith("nemo/lightning/io/consolidation/"):
            asserts = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Assert)]
            assert not asserts, f"{path}:{asserts[0].lineno}: assert in library code" if asserts else ""
            assert "getLogger(" not in text, f"{path}: NeMo code logs through nemo.utils.logging"
    callback = files["nemo/lightning/io/consolidation/training/callback.py"]
    assert "ckpt_consolidation_timeout" not in callback  # NeMo's own strategy has no such attribute
    worker = files["nemo/lightning/io/consolidation/training/worker.py"]
    assert "prefer_huge_pages" not in worker and "WORKER_NICENESS" in worker  # its environment brings huge pages
