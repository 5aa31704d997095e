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

"""The upstream series (``scripts/make_upstream_patch.py``) is the product's own files: it applies to the installed
NeMo one pull request at a time, and after each, that pull request's tests pass in the patched tree, overlay off.
Those tests are the product's own (``tests/nemo/``), which the product's suite also runs against the overlay: the
same files, against both. The series' sizes are checked here too (the first pull request at most 800 added lines,
tests and docs included; every other at most 2,000), and its files follow NeMo's formatting and lint.
"""

import ast
import dataclasses
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

from nemo_patch.training.config import ConsolidationConfig  # noqa: E402

pytestmark = pytest.mark.slow
SERIES = make_upstream_patch.SERIES
UPSTREAM_DOC = (REPO / "docs" / "UPSTREAM.md").read_text()


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"
    )
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> List[Path]:
    out = tmp_path_factory.mktemp("series")
    assert make_upstream_patch.main(["--series", str(out)]) == 0
    return [out / name for name in (out / "series").read_text().split()]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A git copy of the installed NeMo package (compiled files included: the patched tree imports fast)."""
    root = tmp_path_factory.mktemp("nemo-src")
    shutil.copytree(make_upstream_patch.installed_nemo_src() / "nemo", root / "nemo")
    (root / ".gitignore").write_text("__pycache__/\n")
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-qm", "NeMo as installed")):
        assert _git(root, *args).returncode == 0
    return root


def _added(patch: Path) -> List[str]:
    return re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), flags=re.M)


def _created(patch: Path) -> List[str]:
    return re.findall(r"^--- /dev/null\n\+\+\+ b/(\S+)$", patch.read_text(), flags=re.M)


def _added_lines(patch: Path) -> int:
    return sum(
        1
        for line in patch.read_text().split("\n-- \n")[0].splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )


def test_one_described_patch_per_pull_request_within_its_size(series):
    assert len(series) == len(SERIES)
    for number, (patch, pr) in enumerate(zip(series, SERIES), 1):
        text = patch.read_text().replace("\n ", " ")  # unfold the headers
        assert f"Subject: [PATCH {number}/{len(SERIES)}] {pr.subject}" in text
        for heading in ("## What", "## Why", "## How it is tested", "## Follow-ups"):
            assert heading in text, f"{patch.name}: no {heading!r}"
        assert "\nSigned-off-by: " in text.split("\n---\n")[0], f"{patch.name}: not signed off (DCO)"
        assert make_upstream_patch.NEMO_DOCS_PAGE in _added(patch), "each pull request documents its part"
        assert any(re.match(r"tests/.*test_[^/]*\.py$", path) for path in _added(patch)), "each is tested"
        assert _added_lines(patch) <= (800 if number == 1 else 2000), f"{patch.name}: +{_added_lines(patch)}"
        documented = re.search(rf"^\| {number} \| `{pr.key}` \|.*\| \+(\d+) \|$", UPSTREAM_DOC, flags=re.M)
        assert documented and int(documented.group(1)) == _added_lines(patch), f"docs/UPSTREAM.md's size of {pr.key}"


def _created_texts(patch: Path) -> Dict[str, str]:
    """The text of each file ``patch`` creates (``new file``: one hunk of ``+`` lines), by its path in NeMo's tree."""
    texts: Dict[str, str] = {}
    for block in re.split(r"^diff --git ", patch.read_text().split("\n-- \n")[0] + "\n", flags=re.M)[1:]:
        match = re.search(r"^--- /dev/null\n\+\+\+ b/(\S+)\n@@[^\n]*@@[^\n]*\n", block, flags=re.M)
        if match:
            lines = block[match.end() :].splitlines(keepends=True)
            texts[match.group(1)] = "".join(line[1:] for line in lines if line.startswith("+"))
    return texts


def test_the_series_is_the_products_files_renamed(series):
    """Every file a pull request adds is, byte for byte, a product file with its import paths renamed and formatted
    as NeMo formats its code (nothing else edited on the way), but for ``config.py``, which leaves out the fields of
    later additions (each accepts only its default without its module) and what only they used."""
    later = make_upstream_patch.later_fields()
    assert set(later) == {"format", "merge_adapters", "post_command", "post_command_timeout"}
    for patch, pr in zip(series, SERIES):
        created = _created_texts(patch)
        for source in pr.files:
            text = (REPO / source).read_text()
            in_patch = created[make_upstream_patch.nemo_path(source)]
            if source == make_upstream_patch.CONFIG:
                tree = ast.parse(in_patch)
                config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ConsolidationConfig")
                fields = [n.target.id for n in config.body if isinstance(n, ast.AnnAssign)]
                assert fields == [
                    field.name for field in dataclasses.fields(ConsolidationConfig) if field.name not in later
                ]
                names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                names |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
                for name in ("validate_format", "validate_post_command", "DEFAULT_FORMAT"):
                    assert name not in names and f'"{name}"' not in in_patch, name
                assert "validate_keep" in names  # keep comes with retention, in the series
                attributes = (ast.get_docstring(config, clean=False) or "").split("Attributes:")[1].split("Raises:")[0]
                documented = re.findall(r"^ {8}(\w+): ", attributes, re.MULTILINE)
                assert documented == fields
                text = make_upstream_patch.without_later_fields(
                    text, later, make_upstream_patch._other_series_text(source)
                )
            expected = (
                make_upstream_patch.formatted(text) if source.endswith(".py") else make_upstream_patch.renamed(text)
            )
            assert in_patch == expected, source
            assert "nemo_patch" not in in_patch, source


def _apply_through(tree: Path, series: List[Path], number: int) -> None:
    """Apply the series to ``tree`` up to and including pull request ``number``."""
    applied = int(_git(tree, "rev-list", "--count", "HEAD").stdout) - 1
    for patch in series[applied:number]:
        proc = _git(tree, "am", "--quiet", str(patch))
        assert proc.returncode == 0, f"{patch.name} does not apply:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("number", range(1, len(SERIES) + 1), ids=[pr.key for pr in SERIES])
def test_each_pull_request_applies_and_its_tests_pass_in_the_patched_tree(series, tree, number):
    """The same test files as the product's suite runs against the overlay (``tests/nemo/``), in NeMo's tree."""
    _apply_through(tree, series, number)
    tests = [path for path in _added(series[number - 1]) if re.match(r"tests/.*test_[^/]*\.py$", path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(NEMO_PATCH_DISABLE="1", PYTHONPATH=str(tree))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-W", "ignore"]
    command += ["--basetemp", str(tree.parent / f"basetemp-{number}"), *tests]
    proc = subprocess.run(command, cwd=tree, capture_output=True, text=True, env=env, timeout=1200)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in last and "failed" not in last and "skipped" not in last, last


def test_added_python_follows_nemos_lint(series, tree):
    """flake8 with NeMo's selection and line length on every Python file the series creates (black and isort
    formatting is made by the packager), NeMo's line length on the lines it adds to NeMo's files; no ``assert`` in
    library code."""
    _apply_through(tree, series, len(series))
    added = sorted({path for patch in series for path in _created(patch) if path.endswith(".py")})
    for patch in series:
        long = [line for line in patch.read_text().splitlines() if line.startswith("+") and len(line) > 120]
        assert not long, f"{patch.name}: {long}"
    select = "--select=F541,F841,F401,E741,F821,E266,E501"
    proc = subprocess.run([sys.executable, "-m", "flake8", "--max-line-length=119", select, *added], cwd=tree,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.stdout == "", proc.stdout
    for path in added:
        tree_ = ast.parse((tree / path).read_text())
        if path.startswith("nemo/"):
            assert not any(isinstance(node, ast.Assert) for node in ast.walk(tree_)), f"{path}: assert in library code"


def test_the_packager_refuses_an_import_of_a_module_the_series_never_adds(tmp_path):
    """An optional import of a later addition of the product (which NeMo's tree never gets from the series) is refused
    like any other; one of a module a later pull request of the series adds is let through at its stage."""
    (tmp_path / "nemo" / "lightning" / "io" / "consolidation").mkdir(parents=True)
    package = make_upstream_patch.PACKAGE

    def optional(module: str) -> str:
        return f"try:\n    import {module} as extension\nexcept ModuleNotFoundError:\n    extension = None\n"

    check = make_upstream_patch.check_file
    never = f"{package}.zarr_reader"  # the engine sets it as an attribute now: no exception left
    assert check("nemo/a.py", optional(never), tmp_path) == [
        f"nemo/a.py:2: imports {never}, a module the series never adds"
    ]
    assert check("nemo/a.py", optional(f"{package}.publish"), tmp_path) == []  # the writers pull request adds it
    assert check("nemo/a.py", "x = [1,\n  2]  # fmt: skip\n", tmp_path) == ["nemo/a.py:2: '# fmt: skip'"]
    assert check("nemo/a.py", f"from {package}.publish import publish_dir\n", tmp_path) == [
        f"nemo/a.py:1: imports {package}.publish, not in the tree yet"
    ]
    assert (
        never not in make_upstream_patch.series_modules()
        and f"{package}.publish" in make_upstream_patch.series_modules()
    )


def test_links_planted_where_the_series_is_written_are_replaced_not_written_through(tmp_path):
    """A second run into the same directory, where ``series`` and a description are links to files elsewhere: the
    links are replaced by the new files, the files they pointed at are untouched, stale patches go."""
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not the packager's\n")
    first_md = "0001-Checkpoint-consolidation-NeMo-2-torch_dist-checkpoin.md"
    for name in ("series", first_md):
        (out / name).symlink_to(elsewhere)
    (out / "0009-stale.patch").write_text("from an earlier run\n")

    assert make_upstream_patch.main(["--series", str(out)]) == 0

    assert elsewhere.read_text() == "not the packager's\n"
    assert not (out / "series").is_symlink() and not (out / first_md).is_symlink()
    patches = (out / "series").read_text().split()
    assert len(patches) == len(SERIES) and sorted(p.name for p in out.glob("*.patch")) == sorted(patches)
    assert (out / first_md).read_text() == (REPO / "docs" / "upstream" / "converter.md").read_text()
