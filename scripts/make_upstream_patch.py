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

"""Write nemo-patch in NeMo's own form: a series of pull requests against NeMo's source tree (NeMo 2.7.3 and 2.5.3).

Usage::

    python scripts/make_upstream_patch.py --series OUTDIR [--nemo-src DIR]   # the series, one patch per PR
    python scripts/make_upstream_patch.py --out FILE [--nemo-src DIR]        # all of it as one diff

``--nemo-src`` is the directory that holds NeMo's ``nemo/`` package: a NeMo checkout, an unpacked ``nemo_toolkit``
wheel, or by default the installed package of this interpreter (checked file by file against the wheel's ``RECORD``
hashes, so that a locally modified NeMo is not taken for NeMo).

The series (``OUTDIR/series`` lists it in order; each ``OUTDIR/000N-<name>.patch`` is in ``git format-patch`` form,
its message the pull request's description, and applies with ``git am`` or ``git apply`` on top of the previous
ones; ``OUTDIR/000N-<name>.md`` is the same description alone). The stages are listed in :data:`STAGES`; what each
one adds is declared here:

* the overlay's modules move into ``nemo/lightning/io/consolidation/`` (``engine/``, ``export/``, ``training/``,
  ``cli/``; imports renamed, NeMo's logging, no overlay leftovers), each at the stage :func:`module_stage` gives it;
  modules that stay in the overlay as follow-ups are listed in :data:`FOLLOW_UPS`;
* the changes of :mod:`upstream.transforms` (``scripts/upstream/changes.py``, with ``changes_retention.py`` and
  ``changes_peft.py``) hold back, until its stage, what a later stage adds inside a module (or a test, or a docs
  section) that an earlier stage already has, and make the permanent upstream differences;
* the knob stage edits NeMo's ``megatron_strategy.py`` (its new arguments made from the settings module's
  declarations at each stage), ``strategies/utils.py`` and ``io/pl.py``, the retention stage adds
  ``consolidate_best_checkpoint``, the PEFT stage edits ``callbacks/peft.py``, and from a NeMo source checkout the
  first stage lists the docs page in ``docs/source/checkpoints/intro.rst`` (:mod:`upstream.nemo_edits`);
* each stage's directory ``scripts/upstream/stages/<nn>-<name>/`` holds its pull request description
  (``description.md``), its section of the NeMo docs page ``docs/source/checkpoints/consolidation.rst``
  (``docs.rst``), and the new files it adds to NeMo's tree (``tree/``: tests, the converter script), which replace
  those of earlier stages at the same path.

Every stage is checked before it is written: no overlay name left, no pyflakes complaint (an undefined name or an
unused import a held-back feature left behind), no import of a module the tree does not have yet; and every change
must have applied to some stage. ``tests/test_upstream_patch.py`` applies the series to a git copy of the installed
NeMo one patch at a time and runs each patch's own tests in the patched tree, with the overlay off.
"""

import argparse
import base64
import csv
import difflib
import functools
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from upstream import changes, nemo_edits  # noqa: E402
from upstream.transforms import (  # noqa: E402
    APPLIED,
    LEFTOVERS,
    PACKAGE,
    apply_changes,
    format_nemo,
    remove_unused_imports,
    upstream_text,
)

PACKAGE_DIR = PACKAGE.replace(".", "/")
STAGES_DIR = REPO / "scripts" / "upstream" / "stages"
DOCS_PAGE = "docs/source/checkpoints/consolidation.rst"


@dataclass(frozen=True)
class Stage:
    """One pull request of the series."""

    key: str
    directory: str
    subject: str


#: The series, in order. The keys are what ``until`` of a change in ``scripts/upstream/changes.py`` names. Why this
#: order: each stage needs only the ones before it. Retention/``best`` and PEFT come right after the knob because
#: both extend the training side it adds (the coordinator's removals and pointers; NeMo's PEFT callback, which
#: rebuilds the knob's checkpoint IO), and the CLI comes last because its options use all of them (``--best``, a
#: run's root resolved through ``LATEST``, ``--merge-adapters``), so that no stage holds back a part of the CLI.
STAGES = [
    Stage("engine", "01-engine", "Checkpoint consolidation: torch_dist checkpoints to safetensors, offline"),
    Stage("writers", "02-writers", "Checkpoint consolidation: parallel writer processes"),
    Stage("hf", "03-hf", "Checkpoint consolidation: Hugging Face format through the registered exporters"),
    Stage("knob", "04-knob", "MegatronStrategy: ckpt_consolidation_frequency, off the training path"),
    Stage(
        "retention",
        "05-retention",
        'Checkpoint consolidation: outputs kept past top-k removal, LATEST/BEST and the "best" cadence',
    ),
    Stage("peft", "06-peft", "Checkpoint consolidation: PEFT adapter checkpoints and merged LoRA adapters"),
    Stage("cli", "07-cli", "Checkpoint converter CLI: verify, best checkpoint, post-command, loading the weights"),
]
STAGE_KEYS = [stage.key for stage in STAGES]

#: Subpackage of nemo-patch -> the stage its modules land in unless :data:`MODULE_STAGES` says otherwise.
PACKAGE_STAGES = {"engine": "engine", "export": "hf", "training": "knob", "cli": "cli"}
#: Modules that land in another stage than their subpackage's.
MODULE_STAGES = {
    "engine/best_checkpoint.py": "retention",  # the "best" cadence; the CLI's --best
    "training/latest.py": "retention",  # LATEST and BEST
    "training/retention.py": "retention",  # outputs kept under retained/ when top-k removes their checkpoints
    "engine/adapter_merge.py": "peft",  # LoRA adapters merged into the base model
    "engine/adapter_settings.py": "peft",  # the PEFT method and settings an adapter checkpoint's context records
    "engine/post_command.py": "knob",  # a command after each consolidation: the training side and the CLI use it
    "engine/load.py": "cli",  # loading a consolidated output back
    "export/context_model.py": "cli",  # --verify against the checkpoint's context
}
#: Modules that stay in the overlay (follow-ups a maintainer would not take in a first round), and why.
FOLLOW_UPS = {
    "engine/zarr_reader.py": "the zarr reader (megatron-core's deprecated zarr backend; a zarr checkpoint is refused)",
    "cli/distributed.py": "multi-node consolidation (torchrun/srun ranks splitting one consolidation's writes)",
    "training/strategy.py": "becomes edits of NeMo's own MegatronStrategy (the overlay's subclass is not needed)",
}
#: The package ``__init__`` files are written here, not moved: the overlay's describe its import contracts.
INITS = {
    "": (
        "engine",
        "Checkpoint consolidation: finished NeMo 2 distributed checkpoints to unsharded safetensors, offline or\n"
        "at the cadence ``MegatronStrategy(ckpt_consolidation_frequency=...)`` asks for, off the training path.\n\n"
        "``engine`` reads a ``torch_dist`` checkpoint's files and writes the consolidated output; ``export`` writes\n"
        "the Hugging Face format through the model's registered exporter; ``training`` holds the settings, cadence,\n"
        "consolidation process and checkpoint IO of a training run; ``cli`` the converter command\n"
        "(``scripts/checkpoint_converters/consolidate_nemo2_checkpoint.py``).",
    ),
    "engine": (
        "engine",
        "The consolidation engine: a finished ``torch_dist`` checkpoint in, unsharded safetensors out (see\n"
        ":mod:`.consolidate`). It reads files only: no process group, no NeMo model. This ``__init__`` imports\n"
        "nothing.",
    ),
    "export": ("hf", "Exports of a distributed checkpoint to other formats: Hugging Face (:mod:`.hf`)."),
    "training": (
        "knob",
        "A training run's checkpoint consolidation: settings, cadence, the consolidation process and its queue,\n"
        "the consolidating checkpoint IO and the Lightning callback. This ``__init__`` imports nothing.",
    ),
    "cli": ("cli", "The checkpoint converter command (:mod:`.nemo_consolidate`)."),
}

HEADER = (REPO / "nemo_patch" / "engine" / "consolidate.py").read_text().split('"""', 1)[0]


def landed(stage: str) -> "callable":
    """``until -> bool``: whether the stage ``until`` names has landed by ``stage`` (``None``: never lands)."""
    index = STAGE_KEYS.index(stage)

    def has(until: Optional[str]) -> bool:
        if until is None:
            return False
        if until not in STAGE_KEYS:
            raise SystemExit(f"a change names the unknown stage {until!r}")
        return STAGE_KEYS.index(until) <= index

    return has


def module_stage(relative: str) -> Optional[str]:
    """The stage a nemo-patch module (``engine/parts.py``) lands in, or ``None`` when it stays in the overlay."""
    if relative in FOLLOW_UPS:
        return None
    return MODULE_STAGES.get(relative, PACKAGE_STAGES[relative.split("/", 1)[0]])


def _init_text(doc: str) -> str:
    return HEADER + '"""' + doc + '\n"""\n'


@functools.lru_cache(maxsize=None)
def _nemo_form(text: str, relative: str) -> str:
    """A module's text (its changes applied) in NeMo's form: renamed, unused imports removed, formatted. The same
    text recurs from stage to stage, so it is formatted once."""
    return format_nemo(remove_unused_imports(upstream_text(text), relative))


@functools.lru_cache(maxsize=None)
def _formatted(text: str) -> str:
    return format_nemo(text)


def module_files(stage: str) -> Dict[str, str]:
    """NeMo tree path -> content of every moved module present at ``stage``."""
    has = landed(stage)
    files: Dict[str, str] = {}
    for sub, (since, doc) in INITS.items():
        if since in STAGE_KEYS and has(since):
            files[f"{PACKAGE_DIR}/{sub}/__init__.py".replace("//", "/")] = _formatted(_init_text(doc))
    for package in PACKAGE_STAGES:
        for source in sorted((REPO / "nemo_patch" / package).glob("*.py")):
            relative = f"{package}/{source.name}"
            if source.name == "__init__.py":
                continue
            since = module_stage(relative)
            if since is None or since not in STAGE_KEYS or not has(since):
                continue
            text = apply_changes(source.read_text(), relative, changes.CHANGES, has)
            files[f"{PACKAGE_DIR}/{relative}"] = _nemo_form(text, relative)
    return files


#: Files of a stage's ``tree/`` that a later stage removes (NeMo tree path -> that stage): a test of what the later
#: stage changes.
TREE_REMOVED = {
    # until the PEFT stage, which consolidates adapters:
    "tests/lightning/consolidation/test_consolidation_adapters_refused.py": "peft",
}


def stage_dir(stage: Stage) -> Path:
    return STAGES_DIR / stage.directory


def added_files(stage: str) -> Dict[str, Optional[str]]:
    """NeMo tree path -> content of the files the stages up to ``stage`` add besides the modules: tests, the
    converter script and the docs page. A later stage's file replaces an earlier one at the same path; a file that
    grows with later stages is kept once, in full, in the stage that adds it, and the changes of
    ``scripts/upstream/changes.py`` for ``tree/<path>`` hold back what later stages add to it (``docs/<nn>-<name>.rst``
    for a stage's docs section); a file :data:`TREE_REMOVED` names is ``None`` from that stage on (the stage removes
    it)."""
    has = landed(stage)
    files: Dict[str, str] = {}
    sections = []
    for item in STAGES[: STAGE_KEYS.index(stage) + 1]:
        tree = stage_dir(item) / "tree"
        for path in sorted(p for p in tree.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            relative = str(path.relative_to(tree))
            if relative in TREE_REMOVED and has(TREE_REMOVED[relative]):
                files[relative] = None
                continue
            text = apply_changes(path.read_text(), f"tree/{relative}", changes.CHANGES, has)
            files[relative] = _formatted(text) if relative.endswith(".py") else text
        section = (stage_dir(item) / "docs.rst").read_text()
        sections.append(apply_changes(section, f"docs/{item.directory}.rst", changes.CHANGES, has).strip("\n"))
    files[DOCS_PAGE] = "\n\n".join(sections) + "\n"
    return files


@functools.lru_cache(maxsize=None)
def _pyflakes_messages(text: str, path: str) -> Tuple[str, ...]:
    """pyflakes' complaints about ``text`` (line numbers left out, so that they compare across edits)."""
    import ast as ast_module

    from pyflakes import checker

    found = checker.Checker(ast_module.parse(text), filename=path)
    return tuple(sorted(f"{path}: {type(m).__name__}: {m.message % m.message_args}" for m in found.messages))


_IMPORT = re.compile(r"^\s*(?:from|import) (nemo\.lightning\.io\.consolidation(?:\.\w+)*)", re.M)


def check_imports(state: Dict[str, Optional[str]], stage: str) -> None:
    """Every module of the package that a file of the patched tree imports is in the tree at this stage (a change
    that holds back a later stage's module must hold back its imports too)."""
    missing = []
    for path, text in sorted(state.items()):
        if text is None or not path.endswith(".py"):
            continue
        for module in _IMPORT.findall(text):
            base = module.replace(".", "/")
            if state.get(f"{base}.py") is None and state.get(f"{base}/__init__.py") is None:
                missing.append(f"{path} imports {module}")
    if missing:
        raise SystemExit(f"after the {stage!r} stage, modules not in the tree are imported:\n" + "\n".join(missing))


def check_pyflakes(state: Dict[str, Optional[str]], original: Dict[str, Optional[str]], stage: str) -> None:
    """Every Python file a stage adds or changes is clean for pyflakes (no undefined name, no unused import or
    variable: what a change holding back a later stage's feature can leave behind); for NeMo's own files, no new
    complaint."""
    found = []
    for path, text in sorted(state.items()):
        if text is None or not path.endswith(".py") or text == original.get(path):
            continue
        before = set(_pyflakes_messages(original[path], path)) if original.get(path) else set()
        found += [message for message in _pyflakes_messages(text, path) if message not in before]
    if found:
        raise SystemExit(f"after the {stage!r} stage, pyflakes finds:\n" + "\n".join(found))


def tree_state(nemo_src: Path, stage: Optional[str]) -> Dict[str, Optional[str]]:
    """NeMo tree path -> content after the stages up to ``stage`` (``None``: NeMo as it is); ``None`` content is
    a file NeMo does not have."""
    state: Dict[str, Optional[str]] = {}
    for path in nemo_edits.EDITED:
        state[path] = (nemo_src / path).read_text()
    index = nemo_src / nemo_edits.DOCS_INDEX  # a source checkout's; the wheel has no docs/
    state[nemo_edits.DOCS_INDEX] = index.read_text() if index.is_file() else None
    if stage is None:
        return state
    modules = module_files(stage)
    for path, edit in nemo_edits.edits(landed(stage), modules.get(nemo_edits.SETTINGS_MODULE)).items():
        if state[path] is not None:
            state[path] = edit(state[path])
    state.update(modules)
    state.update(added_files(stage))
    return state


def check_leftovers(state: Dict[str, Optional[str]], original: Dict[str, Optional[str]]) -> None:
    """No overlay name is left in what the series writes."""
    found = []
    for path, text in sorted(state.items()):
        if text is None or text == original.get(path):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if LEFTOVERS.search(line) and not (original.get(path) and line in original[path]):
                found.append(f"{path}:{number}: {line.strip()}")
    if found:
        raise SystemExit("overlay names left in NeMo's form:\n" + "\n".join(found))


def _check_against_record(nemo_src: Path, paths: List[str]) -> None:
    """The files to patch must be the installed wheel's (``RECORD`` sha256), not a locally modified copy."""
    records = list(nemo_src.glob("nemo_toolkit-*.dist-info/RECORD"))
    if not records:
        return  # an unpacked wheel without its dist-info, or a source checkout: nothing to compare against
    hashes = {row[0]: row[1] for row in csv.reader(records[0].read_text().splitlines()) if len(row) >= 2}
    for path in paths:
        digest = hashlib.sha256((nemo_src / path).read_bytes()).digest()
        expected = f"sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()}"
        if hashes.get(path) != expected:
            raise SystemExit(f"{nemo_src / path} differs from the installed wheel's RECORD: not pristine NeMo source")


def _diff(path: str, old: Optional[str], new: Optional[str]) -> str:
    if old == new:
        return ""
    old_lines = [] if old is None else old.splitlines(keepends=True)
    new_lines = [] if new is None else new.splitlines(keepends=True)
    body = "".join(
        difflib.unified_diff(
            old_lines,
            new_lines,
            "/dev/null" if old is None else f"a/{path}",
            "/dev/null" if new is None else f"b/{path}",
        )
    )
    header = f"diff --git a/{path} b/{path}\n"
    if old is None:
        header += "new file mode 100755\n" if path.startswith("scripts/") else "new file mode 100644\n"
    elif new is None:
        header += "deleted file mode 100644\n"
    return header + body


def diff_states(before: Dict[str, Optional[str]], after: Dict[str, Optional[str]]) -> Tuple[str, List[str]]:
    """The unified diff from ``before`` to ``after`` and the paths it touches."""
    parts, paths = [], []
    for path in sorted(set(before) | set(after)):
        text = _diff(path, before.get(path), after.get(path))
        if text:
            parts.append(text)
            paths.append(path)
    return "".join(parts), paths


def description(stage: Stage) -> str:
    """The stage's pull request description (markdown)."""
    return (stage_dir(stage) / "description.md").read_text().strip("\n") + "\n"


def write_series(nemo_src: Path, out: Path) -> List[Path]:
    """Write the series into ``out``; returns the patch files in order."""
    original = tree_state(nemo_src, None)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("[0-9][0-9][0-9][0-9]-*.patch"), *out.glob("[0-9][0-9][0-9][0-9]-*.md")]:
        stale.unlink()  # an earlier series' (``git am OUTDIR/*.patch`` must find this one's only)
    previous, written, names = original, [], []
    for number, stage in enumerate(STAGES, 1):
        state = tree_state(nemo_src, stage.key)
        check_leftovers(state, original)
        check_pyflakes(state, original, stage.key)
        check_imports(state, stage.key)
        patch, paths = diff_states(previous, state)
        name = f"{number:04d}-{stage.directory.split('-', 1)[1]}"
        text = description(stage)
        message = (
            f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            f"From: nemo-patch developers <nemo-patch@users.noreply.github.com>\n"
            f"Subject: [PATCH {number}/{len(STAGES)}] {stage.subject}\n\n"
            f"{text}\n---\n" + "".join(f" {path}\n" for path in paths) + f" {len(paths)} files changed\n\n"
        )
        (out / f"{name}.patch").write_text(message + patch + "--\n2.43.0\n")
        (out / f"{name}.md").write_text(f"# {stage.subject}\n\n{text}")
        written.append(out / f"{name}.patch")
        names.append(f"{name}.patch")
        previous = state
    (out / "series").write_text("".join(f"{name}\n" for name in names))
    check_every_change_applied()
    return written


def check_every_change_applied() -> None:
    """Every change of ``scripts/upstream/changes.py`` applied to some stage: one that applies nowhere (its module or
    tree file renamed, moved to another stage, or its ``until`` a stage at or before its module's) is an error."""
    unused = [change for change in changes.CHANGES if id(change) not in APPLIED]
    if unused:
        raise SystemExit(
            "changes that apply to no stage (their module or stage moved?):\n"
            + "\n".join(f"{change.path} (until {change.until!r}): {change!r}"[:300] for change in unused)
        )


def installed_nemo_src() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("nemo")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("NeMo is not installed here; pass --nemo-src")
    return Path(list(spec.submodule_search_locations)[0]).parent


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nemo-src", type=Path, default=None, help="directory holding nemo/ (default: installed)")
    parser.add_argument("--series", type=Path, default=None, help="write the series of patches into this directory")
    parser.add_argument("--out", type=Path, default=None, help="write everything as one diff (default: stdout)")
    args = parser.parse_args(argv)
    nemo_src = args.nemo_src or installed_nemo_src()
    _check_against_record(nemo_src, list(nemo_edits.EDITED))
    if args.series is not None:
        written = write_series(nemo_src, args.series)
        print(f"wrote {len(written)} patches and {args.series / 'series'}", file=sys.stderr)
        return 0
    original = tree_state(nemo_src, None)
    final = tree_state(nemo_src, STAGE_KEYS[-1])
    check_leftovers(final, original)
    patch, paths = diff_states(original, final)
    if args.out is None:
        sys.stdout.write(patch)
    else:
        args.out.write_text(patch)
        print(f"wrote {args.out}: {len(paths)} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
