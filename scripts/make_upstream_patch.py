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

"""Write nemo-patch's upstream pull requests: the product's own files placed under NeMo's tree, plus NeMo's edits.

Usage::

    python scripts/make_upstream_patch.py --series OUTDIR [--nemo-src DIR]   # one git format-patch file per PR
    python scripts/make_upstream_patch.py --sizes [--nemo-src DIR]           # added lines per pull request

Each pull request of :data:`SERIES` is a set of the product's files, moved (:data:`PLACES`) with their import paths
renamed (:data:`RENAMES`) and then formatted with NeMo's isort and black settings: a mechanical step, so the code that
goes upstream is the code the overlay's users run and its tests run. NeMo's own files are changed only by the unified
diffs in ``nemo_patch/overlay/nemo_edits/<key>.diff`` (the hunks the overlay applies when NeMo is imported), renamed
likewise. The NeMo docs page grows by one section per pull request (``docs/upstream/consolidation.rst``: each section
starts with a ``.. pull-request: <key>`` line) and each pull request's description is ``docs/upstream/<key>.md``.

``--nemo-src`` is the directory holding NeMo's ``nemo/`` package (a checkout or an unpacked wheel; default: the
installed one). The series is built in a temporary git repository holding that tree, one commit per pull request, and
written with ``git format-patch``; ``OUTDIR/series`` lists the patches in order. Checks before anything is written:
no ``nemo_patch`` name left, no line over 119 columns and no ``# fmt: skip``, every module a file imports present in
the tree by then (in an optional-import block: added by a later pull request of the series), and no import of a module
the series never adds. The series' ``config.py`` leaves out the ``ConsolidationConfig`` fields of later additions
(:data:`LATER_FIELDS`, :func:`without_later_fields`). ``tests/test_upstream_patch.py`` applies the series to the
installed NeMo and runs each pull request's tests there: the same test files the product's suite runs
against the overlay.
"""

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "nemo.lightning.io.consolidation"
#: Product name prefix -> NeMo's (dotted names in code and text).
RENAMES = (
    ("nemo_patch.engine", PACKAGE),
    ("nemo_patch.training", f"{PACKAGE}.training"),
    ("nemo_patch.export", f"{PACKAGE}.export"),
    ("nemo_patch.runs", f"{PACKAGE}.runs"),
    ("NEMO_PATCH_WORKER_NICENESS", "NEMO_CONSOLIDATION_WORKER_NICENESS"),  # an environment variable's name
)
#: Product path prefix -> NeMo path prefix.
PLACES = (
    ("nemo_patch/engine/", "nemo/lightning/io/consolidation/"),
    ("nemo_patch/training/", "nemo/lightning/io/consolidation/training/"),
    ("nemo_patch/export/", "nemo/lightning/io/consolidation/export/"),
    ("nemo_patch/runs/", "nemo/lightning/io/consolidation/runs/"),
    ("tests/nemo/", "tests/"),
)
DOCS_PAGE, NEMO_DOCS_PAGE = "docs/upstream/consolidation.rst", "docs/source/checkpoints/consolidation.rst"
EDITS = "nemo_patch/overlay/nemo_edits"
#: NeMo's formatting (its ``pyproject.toml``): black with these arguments, isort with these settings.
BLACK_ARGS = ["--skip-string-normalization", "--line-length=119"]
ISORT_SETTINGS = dict(
    profile="black",
    line_length=119,
    known_first_party=["nemo"],
    known_third_party=["nemo_text_processing", "examples", "scripts"],
    default_section="THIRDPARTY",
)
#: ``ConsolidationConfig`` fields of the later additions -> the product module that uses them: a series without that
#: module leaves the field out (:func:`without_later_fields`), with its ``Attributes:`` entry and what only it used.
LATER_FIELDS = {
    "format": "nemo_patch.export.hf",
    "keep": "nemo_patch.training.retention",
    "merge_adapters": "nemo_patch.engine.adapter_merge",
    "post_command": "nemo_patch.training.post_results",
    "post_command_timeout": "nemo_patch.training.post_results",
}
CONFIG = "nemo_patch/training/config.py"
LEFTOVERS = re.compile(r"nemo_patch|nemo-patch|NEMO_PATCH|nemo-consolidate")


@dataclass(frozen=True)
class PullRequest:
    """One pull request: its key (``docs/upstream/<key>.md`` is its description), subject and product files."""

    key: str
    subject: str
    files: Tuple[str, ...]


SERIES = (
    PullRequest(
        "converter",
        "Checkpoint consolidation: NeMo 2 torch_dist checkpoints to safetensors, offline",
        (
            "nemo_patch/engine/__init__.py",
            "nemo_patch/engine/errors.py",
            "nemo_patch/engine/checkpoint_layout.py",
            "nemo_patch/engine/dcp_metadata.py",
            "nemo_patch/engine/plan.py",
            "nemo_patch/engine/converter.py",
            "tests/nemo/lightning/_io/test_consolidation_converter.py",
        ),
    ),
    PullRequest(
        "reader",
        "Checkpoint consolidation: checkpoints from elsewhere, read one layer at a time",
        tuple(f"nemo_patch/engine/{name}.py" for name in (
            "safe_files", "pickle_limits", "metadata_checks", "layout_checks", "record_checks", "dcp_reader",
            "moe_names", "stage_times", "checkpoint_reader", "tensor_sources"))  # fmt: skip
        + ("tests/nemo/lightning/conftest.py", "tests/nemo/lightning/_io/test_consolidation_reader.py"),
    ),
    PullRequest(
        "identity",
        "Checkpoint consolidation: which save an output was made from",
        ("nemo_patch/engine/save_identity.py", "tests/nemo/lightning/_io/test_consolidation_identity.py"),
    ),
    PullRequest(
        "outputs",
        "Checkpoint consolidation: streamed writes, per-tensor digests and verification",
        tuple(f"nemo_patch/engine/{name}.py" for name in (
            "casting", "output_layout", "safetensors_writer", "output_target", "output_files", "verify", "digests",
            "vocabulary", "consolidate"))  # fmt: skip
        + ("tests/nemo/lightning/_io/test_consolidation_outputs.py",),
    ),
    PullRequest(
        "writers",
        "Checkpoint consolidation: writer processes and publishing that survives a killed process",
        tuple(f"nemo_patch/engine/{name}.py" for name in ("publish", "process_limits", "part_writer", "parts"))
        + ("tests/nemo/lightning/_io/test_consolidation_writers.py",),
    ),
    PullRequest(
        "process",
        "Checkpoint consolidation: ConsolidationConfig and a background process that consolidates checkpoints",
        tuple(f"nemo_patch/training/{name}.py" for name in (
            "__init__", "config", "policy", "settings", "schedule", "queue", "worker"))  # fmt: skip
        + ("tests/nemo/lightning/_io/test_consolidation_process.py",),
    ),
    PullRequest(
        "latest",
        "Checkpoint consolidation: LATEST, outputs kept past top-k removal, and on_consolidation_end",
        tuple(f"nemo_patch/training/{name}.py" for name in ("latest", "retention", "hooks"))
        + (
            "nemo_patch/runs/__init__.py",
            "nemo_patch/runs/checkpoint_root.py",
            "tests/nemo/lightning/_io/test_consolidation_latest.py",
        ),
    ),
    PullRequest(
        "knob",
        "MegatronStrategy(ckpt_consolidation_frequency=...): consolidate checkpoints as training saves them",
        tuple(
            f"nemo_patch/training/{name}.py"
            for name in ("callback", "background", "coordinator", "fit_end", "integration")
        )
        + ("tests/nemo/lightning/pytorch/strategies/test_megatron_strategy_consolidation.py",),
    ),
)


def nemo_path(path: str) -> str:
    """Where a product file goes in NeMo's tree.

    Raises:
        ValueError: ``path`` is under none of :data:`PLACES`.
    """
    for product, nemo in PLACES:
        if path.startswith(product):
            return nemo + path[len(product) :]
    raise ValueError(f"{path} has no place in NeMo's tree")


def renamed(text: str) -> str:
    """``text`` with the product's module names NeMo's (:data:`RENAMES`)."""
    for product, nemo in RENAMES:
        text = re.sub(rf"\b{re.escape(product)}\b", nemo, text)
    return text


def formatted(text: str) -> str:
    """A Python file renamed and formatted as NeMo formats its code."""
    import black
    import isort

    text = isort.code(renamed(text), config=isort.Config(**ISORT_SETTINGS))
    return black.format_str(text, mode=black.Mode(line_length=119, string_normalization=False))


def _optional_imports(tree: ast.Module) -> set:
    """The ``import`` nodes inside ``try: ... except ModuleNotFoundError`` blocks."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id == "ModuleNotFoundError" for h in node.handlers
        ):
            found.update(id(child) for child in ast.walk(node) if isinstance(child, (ast.Import, ast.ImportFrom)))
    return found


def _top_level_names(node: ast.stmt) -> List[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [target.id for target in targets if isinstance(target, ast.Name)]
    return []


def _cut(lines: List[str], spans: Iterable[Tuple[int, int]]) -> List[str]:
    """``lines`` without the 1-based inclusive ``spans``."""
    dropped = {n for start, end in spans for n in range(start, end + 1)}
    return [line for n, line in enumerate(lines, 1) if n not in dropped]


def without_later_fields(text: str, fields: Iterable[str], kept_elsewhere: str = "") -> str:
    """The product's ``config.py`` (``text``) without the ``ConsolidationConfig`` ``fields``: their declarations, their
    ``Attributes:`` entries, then every top-level name of the file that only they used (their validators, defaults,
    option parsers; with the ``#:`` comment above each and its ``__all__`` entry), until none is left. A name that
    ``kept_elsewhere`` (the series' other files) mentions is kept.

    Raises:
        ValueError: a field is not declared in ``ConsolidationConfig``.
    """
    fields = set(fields)
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ConsolidationConfig")
    declared = {n.target.id: n for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    if fields - set(declared):
        raise ValueError(f"ConsolidationConfig declares no field {sorted(fields - set(declared))}")
    used = {n.id for field in fields for n in ast.walk(declared[field]) if isinstance(n, ast.Name)}
    spans = [(declared[field].lineno, declared[field].end_lineno or declared[field].lineno) for field in fields]
    entry = re.compile(r" {8}(\w+): ")
    inside = None
    for n, line in enumerate(lines, 1):
        match = entry.match(line)
        if match or not line.startswith(" " * 12):
            inside = match.group(1) if match else None
        if inside in fields:
            spans.append((n, n))
    text = "".join(_cut(lines, spans))
    while True:
        tree = ast.parse(text)
        lines = text.splitlines(keepends=True)
        unused = []
        for node in tree.body:
            for name in _top_level_names(node):
                mentions = len(re.findall(rf"\b{re.escape(name)}\b", text)) - len(re.findall(rf'"{name}"', text))
                if name in used and mentions <= 1 and not re.search(rf"\b{re.escape(name)}\b", kept_elsewhere):
                    start = node.lineno - len(getattr(node, "decorator_list", []))
                    while start > 1 and lines[start - 2].startswith("#:"):
                        start -= 1
                    unused.append((name, (start, node.end_lineno or node.lineno)))
        if not unused:
            return _without_unused_imports(text)
        text = "".join(_cut(lines, [span for _, span in unused]))
        for name, _ in unused:
            text = re.sub(rf'"{name}", ?|, "{name}"(?=\])', "", text)


def _without_unused_imports(text: str) -> str:
    """``text`` without the names of its top-level ``from ... import`` statements that it no longer uses."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in reversed(tree.body):
        if not isinstance(node, ast.ImportFrom) or node.end_lineno is None:
            continue
        kept = [a for a in node.names if len(re.findall(rf"\b{re.escape(a.asname or a.name)}\b", text)) > 1]
        if len(kept) == len(node.names):
            continue
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in kept)
        replacement = [f"from {node.module} import {names}\n"] if kept else []
        lines[node.lineno - 1 : node.end_lineno] = replacement
    return "".join(lines)


def later_fields() -> List[str]:
    """The :data:`LATER_FIELDS` whose module the series does not add."""
    added = {path[: -len(".py")].replace("/", ".") for pr in SERIES for path in pr.files}
    return [field for field, module in LATER_FIELDS.items() if module not in added]


def _other_series_text(but: str) -> str:
    """The series' product files but ``but``, concatenated."""
    return "".join((REPO / path).read_text() for pr in SERIES for path in pr.files if path != but)


def series_modules() -> set:
    """The dotted names of the modules the whole series adds (in NeMo's tree)."""
    paths = [nemo_path(path) for pr in SERIES for path in pr.files if path.endswith(".py")]
    return {path[: -len(".py")].replace("/", ".").removesuffix(".__init__") for path in paths}


def check_file(path: str, text: str, tree_root: Path) -> List[str]:
    """Problems of one file as it lands in NeMo's tree (``tree_root`` holds the tree so far, this file included).

    An import of a module of :data:`PACKAGE` must find it in the tree by then; in an optional-import block it may
    name a module a later pull request of the series adds. An import of a module the series never adds is refused,
    optional or not.
    """
    problems = [
        f"{path}:{n}: {line.strip()[:80]}" for n, line in enumerate(text.splitlines(), 1) if LEFTOVERS.search(line)
    ]
    problems += [
        f"{path}:{n}: {len(line)} columns: {line.strip()[:60]}"
        for n, line in enumerate(text.splitlines(), 1)
        if len(line) > 119
    ]
    problems += [f"{path}:{n}: '# fmt: skip'" for n, line in enumerate(text.splitlines(), 1) if "# fmt: skip" in line]
    if path.endswith(".py"):
        tree = ast.parse(text)
        optional, later = _optional_imports(tree), series_modules()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names if alias.name.startswith(PACKAGE)]
            else:
                continue
            if not modules:
                continue
            target = tree_root / modules[0].replace(".", "/")
            names = [target.with_suffix(".py"), target / "__init__.py"]
            names += [tree_root / f"{module.replace('.', '/')}.py" for module in modules[1:]]
            if not any(name.exists() for name in names):
                if id(node) in optional and any(module in later for module in modules):
                    continue
                what = "a module the series never adds" if id(node) in optional else "not in the tree yet"
                problems.append(f"{path}:{node.lineno}: imports {modules[0]}, {what}")
    return problems


def docs_section(key: str) -> str:
    """The NeMo docs page up to and including ``key``'s section (the marker lines dropped)."""
    keys = [pr.key for pr in SERIES]
    text, kept = (REPO / DOCS_PAGE).read_text(), []
    current: Optional[str] = None
    for line in text.splitlines(keepends=True):
        match = re.match(r"\.\. pull-request: (\S+)", line)
        if match:
            current = match.group(1)
            continue
        if current is None or keys.index(current) <= keys.index(key):
            kept.append(line)
    return renamed("".join(kept)).rstrip() + "\n"


def _git(root: Path, *args: str, stdin: Optional[str] = None) -> str:
    env = {"GIT_AUTHOR_NAME": "nemo-consolidation", "GIT_AUTHOR_EMAIL": "consolidation@users.noreply.github.com",
           "GIT_COMMITTER_NAME": "nemo-consolidation", "GIT_COMMITTER_EMAIL": "consolidation@users.noreply.github.com",
           "PATH": "/usr/bin:/bin", "HOME": str(root)}  # fmt: skip
    proc = subprocess.run(["git", *args], cwd=root, input=stdin, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def build(nemo_src: Path, work: Path) -> List[str]:
    """Commit the series onto a git copy of ``nemo_src``'s ``nemo/`` in ``work``; returns the commits' hashes.

    Raises:
        SystemExit: a check of :func:`check_file` fails, or a NeMo edit does not apply; the message names it.
    """
    shutil.copytree(nemo_src / "nemo", work / "nemo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _git(work, "init", "-q")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "NeMo as given")
    commits = []
    for pr in SERIES:
        written: Dict[str, str] = {}
        for source in pr.files:
            text = (REPO / source).read_text()
            if source == CONFIG:
                text = without_later_fields(text, later_fields(), _other_series_text(CONFIG))
            written[nemo_path(source)] = formatted(text) if source.endswith(".py") else renamed(text)
        written[NEMO_DOCS_PAGE] = docs_section(pr.key)
        for path, text in written.items():
            (work / path).parent.mkdir(parents=True, exist_ok=True)
            (work / path).write_text(text)
        for package in {Path(path).parent for path in written if path.startswith("nemo/")}:
            if not (work / package / "__init__.py").exists():
                raise SystemExit(f"{pr.key}: {package} has no __init__.py in the series")
        problems = [p for path, text in written.items() for p in check_file(path, text, work)]
        if problems:
            raise SystemExit(f"{pr.key}: not in NeMo's form:\n" + "\n".join(problems))
        edit = REPO / EDITS / f"{pr.key}.diff"
        if edit.exists():
            _git(work, "apply", "--whitespace=nowarn", "-", stdin=renamed(edit.read_text()))
        _git(work, "add", "-A")
        message = f"{pr.subject}\n\n{renamed((REPO / 'docs' / 'upstream' / f'{pr.key}.md').read_text())}"
        _git(work, "commit", "-q", "--signoff", "-F", "-", stdin=message)  # DCO: NeMo requires a Signed-off-by
        commits.append(_git(work, "rev-parse", "HEAD").strip())
    return commits


def added_lines(work: Path, commits: Iterable[str]) -> List[int]:
    """Lines each commit adds (``git diff --numstat``)."""
    sizes = []
    for commit in commits:
        numstat = _git(work, "diff", "--numstat", f"{commit}~1", commit)
        sizes.append(sum(int(row.split()[0]) for row in numstat.splitlines() if row.split()[0].isdigit()))
    return sizes


def installed_nemo_src() -> Path:
    """The directory holding the installed ``nemo`` package."""
    import importlib.util

    spec = importlib.util.find_spec("nemo")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("NeMo is not installed here; pass --nemo-src")
    return Path(list(spec.submodule_search_locations)[0]).parent


def _replace(path: Path, text: str) -> None:
    """Write ``text`` as a new file renamed over ``path``: a link planted there is replaced, never written through."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        file.write(text)
    os.chmod(file.name, 0o644)
    os.replace(file.name, path)


def main(argv: Optional[List[str]] = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nemo-src", type=Path, help="the directory holding nemo/ (default: the installed one)")
    parser.add_argument("--series", type=Path, help="write the series of patches into this directory")
    parser.add_argument("--sizes", action="store_true", help="print the lines each pull request adds")
    args = parser.parse_args(argv)
    nemo_src = args.nemo_src or installed_nemo_src()
    with tempfile.TemporaryDirectory(prefix="nemo-series-") as work:
        commits = build(nemo_src, Path(work))
        if args.sizes:
            for pr, size in zip(SERIES, added_lines(Path(work), commits)):
                print(f"{pr.key}: +{size}")
        if args.series is not None:
            args.series.mkdir(parents=True, exist_ok=True)
            for stale in args.series.glob("*.patch"):
                stale.unlink()
            names = _git(Path(work), "format-patch", "-o", str(args.series.resolve()), f"{commits[0]}~1")
            patches = [Path(name).name for name in names.split()]
            _replace(args.series / "series", "\n".join(patches) + "\n")
            for pr, patch in zip(SERIES, patches):
                _replace(
                    (args.series / patch).with_suffix(".md"), (REPO / "docs" / "upstream" / f"{pr.key}.md").read_text()
                )
            print(f"wrote {len(patches)} patches and {args.series / 'series'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
