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

"""Source transforms that turn nemo-patch modules into their NeMo form, stage by stage (used by
``scripts/make_upstream_patch.py``).

Four kinds of change, each tied to a stage of the series (``until``: the change applies while that stage has not
landed; ``None``: always, the upstream form):

* :class:`Edit`: exact text replaced (the text must be there exactly ``count`` times, else the script stops naming
  it: code that moved on is noticed, never silently mis-patched);
* :class:`Drop`: top-level definitions removed by name (functions, classes, assignments, with their ``#:`` comments
  and their ``__all__`` entries), found with :mod:`ast` so that edits elsewhere in the module do not disturb them;
* :class:`Replace`: a top-level definition, or the module docstring (``name=None``), replaced;
* the generic renames of :func:`upstream_text` (import paths, NeMo's logging, leftovers of the overlay).

Imports left unused by a change are removed (pyflakes finds them), and the result is formatted with NeMo's black and
isort settings (:data:`BLACK_MODE`, :data:`ISORT_SETTINGS`).
"""

import ast
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

PACKAGE = "nemo.lightning.io.consolidation"
CONVERTER = "consolidate_nemo2_checkpoint.py"

#: NeMo's black settings (its ``.pre-commit-config.yaml``: ``--skip-string-normalization --line-length=119``).
BLACK_ARGS = ["--skip-string-normalization", "--line-length=119"]
#: NeMo's isort settings (``[tool.isort]`` of its ``pyproject.toml``).
ISORT_SETTINGS = dict(
    profile="black",
    line_length=119,
    ignore_whitespace=True,
    known_first_party=["nemo"],
    known_third_party=["nemo_text_processing", "examples", "scripts"],
    sections=["FUTURE", "STDLIB", "THIRDPARTY", "FIRSTPARTY", "LOCALFOLDER"],
    default_section="THIRDPARTY",
)
#: NeMo's flake8 settings (its ``.flake8``).
FLAKE8_ARGS = ["--max-line-length=119", "--select=F541,F841,F401,E741,F821,E266"]


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in ``path`` (a module path relative to the package, e.g. ``engine/parts.py``)."""

    path: str
    old: str
    new: str
    until: Optional[str] = None
    count: int = 1


@dataclass(frozen=True)
class Drop:
    """Remove the top-level definitions ``names`` of ``path`` (those not there are ignored)."""

    path: str
    names: Tuple[str, ...]
    until: Optional[str] = None


@dataclass(frozen=True)
class Replace:
    """Replace the top-level definition ``name`` of ``path`` (``None``: the module docstring) by ``text``."""

    path: str
    name: Optional[str]
    text: str
    until: Optional[str] = None


Change = object  # Edit | Drop | Replace


class TransformError(SystemExit):
    """A change that does not fit the code it is written for (the code moved on)."""


def _lines_of_definition(tree: ast.Module, lines: List[str], name: str) -> Optional[Tuple[int, int]]:
    """0-based ``[start, end)`` line range of the top-level definition ``name``, with its decorators and the comment
    lines right above it."""
    for node in tree.body:
        names: List[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        if name not in names:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        return start, node.end_lineno or node.lineno
    return None


def _set_all(text: str, drop: Iterable[str]) -> str:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names = [n for n in ast.literal_eval(node.value) if n not in set(drop)]
            lines = text.splitlines(keepends=True)
            new = "__all__ = [" + ", ".join(f'"{n}"' for n in names) + "]\n"
            return "".join(lines[: node.lineno - 1] + [new] + lines[node.end_lineno or node.lineno :])
    return text


def drop_definitions(text: str, names: Sequence[str]) -> str:
    """``text`` without the top-level definitions ``names`` (and their ``__all__`` entries)."""
    for name in names:
        lines = text.splitlines(keepends=True)
        found = _lines_of_definition(ast.parse(text), lines, name)
        if found is not None:
            start, end = found
            text = "".join(lines[:start] + lines[end:])
    return _set_all(text, names)


def replace_definition(text: str, name: Optional[str], new: str, where: str) -> str:
    """``text`` with the top-level definition ``name`` (or the module docstring) replaced by ``new``."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    if name is None:
        first = tree.body[0] if tree.body else None
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
            raise TransformError(f"{where}: no module docstring to replace")
        start, end = first.lineno - 1, first.end_lineno or first.lineno
    else:
        found = _lines_of_definition(tree, lines, name)
        if found is None:
            raise TransformError(f"{where}: no top-level definition {name!r} to replace")
        start, end = found
    return "".join(lines[:start]) + new.rstrip("\n") + "\n" + "".join(lines[end:])


def apply_changes(text: str, path: str, changes: Sequence[Change], landed: Callable[[Optional[str]], bool]) -> str:
    """Apply the changes of ``path`` that are in force (``landed(until)`` is false for them) in order."""
    for change in changes:
        if getattr(change, "path") != path or landed(getattr(change, "until")):
            continue
        where = f"{path} (until {getattr(change, 'until')})"
        if isinstance(change, Edit):
            found = text.count(change.old)
            if found != change.count:
                raise TransformError(
                    f"{where}: expected this text {change.count} time(s), found it {found} time(s):\n{change.old}"
                )
            text = text.replace(change.old, change.new)
        elif isinstance(change, Drop):
            text = drop_definitions(text, change.names)
        elif isinstance(change, Replace):
            text = replace_definition(text, change.name, change.text, where)
    return text


#: Names of the overlay that have another name in NeMo (applied before the import paths are renamed).
RENAMES = [
    ("``nemo_patch.MegatronStrategy``", "``nemo.lightning.MegatronStrategy``"),
    (":class:`nemo_patch.MegatronStrategy`", ":class:`nemo.lightning.MegatronStrategy`"),
    ("nemo_patch.MegatronStrategy", "nemo.lightning.MegatronStrategy"),
    ("``nemo_patch.MegatronCheckpointIO``", "``nemo.lightning.io.pl.ConsolidatingMegatronCheckpointIO``"),
    (":class:`nemo_patch.MegatronCheckpointIO`", ":class:`nemo.lightning.io.pl.ConsolidatingMegatronCheckpointIO`"),
    ("nemo_patch.MegatronCheckpointIO", "nemo.lightning.io.pl.ConsolidatingMegatronCheckpointIO"),
    ("not nemo_patch consolidation settings", "not consolidation settings"),
    ("not a nemo_patch part job", "not a consolidation part job"),
    ("not an output of nemo_patch", "not a consolidated output"),
    ("(nemo_patch worker)", "(consolidation process)"),
    ("nemo_patch's metadata.json", "the consolidation's metadata.json"),
    (".nemo-patch.lock", ".consolidation.lock"),
    ("_nemo_patch_", "_consolidation_"),
    ("nemo_patch_", "consolidation_"),
    ("nemo_patch/", "nemo_consolidation/"),
    ("python -m nemo_patch", f"python scripts/checkpoint_converters/{CONVERTER}"),
    ("``nemo-consolidate``", f"``{CONVERTER}``"),
    ("nemo-consolidate", CONVERTER),
    ("nemo_patch.", f"{PACKAGE}."),
]

#: Words of the overlay that must not be left in NeMo's tree.
LEFTOVERS = re.compile(r"nemo_patch|nemo-patch|NEMO_PATCH|nemo-consolidate|-m nemo_patch")

_CLAIM = re.compile(r"^(Imports |Standard library only|Must not import |May import |NeMo and Lightning are imported)")


def _drop_layering_paragraphs(text: str) -> str:
    """Remove the module docstring's paragraphs about what the module may import: the overlay's import-linter
    contracts, which do not hold inside NeMo's package tree (any module under ``nemo.lightning`` imports it)."""
    tree = ast.parse(text)
    first = tree.body[0] if tree.body else None
    if not (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    ):
        return text
    lines = text.splitlines(keepends=True)
    start, end = first.lineno - 1, first.end_lineno or first.lineno
    raw = "".join(lines[start:end]).rstrip("\n")
    quote = raw[:3]
    if quote not in ('"""', "'''") or not raw.endswith(quote):
        return text
    body = raw[3:-3]
    paragraphs = body.rstrip("\n").split("\n\n")
    kept = [p for p in paragraphs if not _CLAIM.match(p.strip())] or paragraphs[:1]
    new = quote + "\n\n".join(kept) + ("\n" if body.endswith("\n") else "") + quote + "\n"
    return "".join(lines[:start]) + new + "".join(lines[end:])


def _nemo_logging(text: str) -> str:
    """stdlib ``logging.getLogger(__name__)`` -> NeMo's ``from nemo.utils import logging``; ``logger.exception``
    (which NeMo's logger does not have) -> ``logging.error(..., exc_info=True)``."""
    if "logger = logging.getLogger(__name__)\n" not in text:
        return text
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    inserts: List[Tuple[int, int]] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "exception"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "logger"
        ):
            inserts.append((node.end_lineno or node.lineno, node.end_col_offset or 0))
    for line, col in sorted(inserts, reverse=True):
        source = lines[line - 1]
        # the call's closing parenthesis is at col - 1 (utf-8 offsets: the code lines are ASCII)
        lines[line - 1] = source[: col - 1].rstrip().rstrip(",") + ", exc_info=True" + source[col - 1 :]
    text = "".join(lines)
    text = text.replace("logger = logging.getLogger(__name__)\n", "")
    text = re.sub(r"^import logging\n", "from nemo.utils import logging\n", text, count=1, flags=re.M)
    text = text.replace("logger.exception(", "logger.error(")
    return re.sub(r"\blogger\.", "logging.", text)


def remove_unused_imports(text: str, filename: str = "<module>") -> str:
    """``text`` without the imports pyflakes reports unused (an import with a ``noqa`` comment is kept)."""
    from pyflakes import checker, messages

    for _ in range(3):
        tree = ast.parse(text)
        found = checker.Checker(tree, filename=filename)
        unused: Dict[int, set] = {}
        for message in found.messages:
            if isinstance(message, messages.UnusedImport):
                unused.setdefault(message.lineno, set()).add(message.message_args[0])
        if not unused:
            return text
        lines = text.splitlines(keepends=True)
        for node in sorted(tree.body + [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))],
                           key=lambda n: -n.lineno):  # fmt: skip
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno not in unused:
                continue
            if "noqa" in "".join(lines[node.lineno - 1 : node.end_lineno]):
                continue
            gone = unused.pop(node.lineno)
            module = node.module if isinstance(node, ast.ImportFrom) else None
            keep = []
            for alias in node.names:
                full = f"{module}.{alias.name}" if module else alias.name
                shown = f"{full} as {alias.asname}" if alias.asname else full
                if shown not in gone and full not in gone:
                    keep.append(alias)
            indent = lines[node.lineno - 1][: len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
            names = ", ".join(f"{a.name} as {a.asname}" if a.asname else a.name for a in keep)
            if not keep:
                new = [] if indent == "" or _has_sibling(tree, node) else [f"{indent}pass\n"]
            elif module is not None:
                new = [f"{indent}from {'.' * node.level}{module} import {names}\n"]
            else:
                new = [f"{indent}import {names}\n"]
            lines[node.lineno - 1 : node.end_lineno] = new
        text = "".join(lines)
    return text


def _has_sibling(tree: ast.Module, target: ast.stmt) -> bool:
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and target in block:
                return len(block) > 1
    return True


def _no_asserts(text: str) -> str:
    """``assert`` statements (library code must not depend on ``-O``) become ``if ...: raise RuntimeError(...)``."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Assert)), key=lambda n: -n.lineno):
        indent = lines[node.lineno - 1][: node.col_offset]
        test = node.test
        if (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None
        ):
            condition = f"{ast.unparse(test.left)} is None"
        else:
            condition = f"not ({ast.unparse(test)})"
        message = (
            ast.unparse(node.msg) if node.msg is not None else repr(f"internal error: expected {ast.unparse(test)}")
        )
        lines[node.lineno - 1 : node.end_lineno] = [
            f"{indent}if {condition}:\n",
            f"{indent}    raise RuntimeError({message})\n",
        ]
    return "".join(lines)


def upstream_text(text: str) -> str:
    """The generic part of the NeMo form of a module: NeMo's logging, no layering paragraphs, no ``assert``,
    renamed names."""
    text = _no_asserts(_nemo_logging(text))
    text = _drop_layering_paragraphs(text)
    for old, new in RENAMES:
        text = text.replace(old, new)
    return text


def wrap_long_lines(text: str, width: int = 119) -> str:
    """Break docstring and comment lines longer than ``width`` (the longer import paths of NeMo's tree make some of
    the overlay's lines too long) at their last space that fits; code and other strings are left as they are."""
    import io
    import tokenize

    docstring_lines = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstring_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    comments = {
        token.start[0]: token.start[1]
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
    }
    wrapped = []
    for number, line in enumerate(text.split("\n"), 1):
        while len(line) > width and (number in docstring_lines or number in comments):
            indent = len(line) - len(line.lstrip())
            start = comments.get(number, indent)
            cut = line.rfind(" ", start + 2, width + 1)
            if cut <= start or "fmt: skip" in line or "noqa" in line:
                break
            if number in comments:
                prefix = " " * start + ("#: " if line[start:].startswith("#:") else "# ")
            else:
                prefix = line[:indent]
            wrapped.append(line[:cut].rstrip())
            line = prefix + line[cut + 1 :].lstrip()
        wrapped.append(line)
    return "\n".join(wrapped)


def format_nemo(text: str) -> str:
    """``text`` formatted as NeMo formats its code (isort, then black, with NeMo's settings; long docstring and
    comment lines broken)."""
    import black
    import isort

    mode = black.Mode(line_length=119, string_normalization=False)
    text = isort.code(text, config=isort.Config(**ISORT_SETTINGS))
    return black.format_str(wrap_long_lines(black.format_str(text, mode=mode)), mode=mode)
