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

* :class:`Edit`: exact text replaced (the text must be there exactly ``count`` times);
* :class:`Drop`: definitions removed by name (functions, classes, assignments, with their ``#:`` comments and their
  ``__all__`` entries; ``"Class.member"`` for a method, a class attribute or a dataclass field), found with
  :mod:`ast` so that edits elsewhere in the module do not disturb them;
* :class:`Replace`: a definition (dotted names too), or the module docstring (``name=None``), replaced;
* :class:`DropArgument`: a parameter removed from a function's signature, with its entry in the docstring's
  ``Args:`` section;
* :class:`DropKeyword`: a keyword argument removed from every call of a function (e.g. ``cli=`` of each setting's
  declaration);
* the generic renames of :func:`upstream_text` (import paths, NeMo's logging, leftovers of the overlay).

Every change must find what it names: an :class:`Edit` whose text is not there ``count`` times, a :class:`Drop`,
:class:`Replace` or :class:`DropArgument` whose definition or parameter is not there stops the script with a
:class:`TransformError` naming the module, the stage and the anchor (code that moved on is noticed, never silently
mis-patched).

Imports left unused by a change are removed (pyflakes finds them), and the result is formatted with NeMo's black and
isort settings (:data:`BLACK_MODE`, :data:`ISORT_SETTINGS`).
"""

import ast
import re
import textwrap
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

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
    """Remove the definitions ``names`` of ``path`` (top-level, or ``"Class.member"``); each must be there."""

    path: str
    names: Tuple[str, ...]
    until: Optional[str] = None


@dataclass(frozen=True)
class Replace:
    """Replace the definition ``name`` of ``path`` (top-level or ``"Class.member"``; ``None``: the module docstring)
    by ``text``."""

    path: str
    name: Optional[str]
    text: str
    until: Optional[str] = None


@dataclass(frozen=True)
class DropArgument:
    """Remove the parameter ``argument`` of the function ``function`` of ``path`` (``"Class.method"`` for a method):
    its line(s) in the signature and its entry in the docstring's ``Args:`` section (if it has one). The parameter
    must be there; uses of it in the body need changes of their own."""

    path: str
    function: str
    argument: str
    until: Optional[str] = None


@dataclass(frozen=True)
class DropKeyword:
    """Remove the keyword argument ``keyword=...`` from every call of the function named ``function`` in ``path``
    (e.g. one declaration's part from each ``setting(...)`` call); at least one call must have it."""

    path: str
    function: str
    keyword: str
    until: Optional[str] = None


Change = Union[Edit, Drop, Replace, DropArgument, DropKeyword]


class TransformError(SystemExit):
    """A change that does not fit the code it is written for (the code moved on)."""


def _defined_names(node: ast.stmt) -> List[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [target.id for target in node.targets if isinstance(target, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _find_definition(tree: ast.Module, name: str) -> Optional[ast.stmt]:
    """The definition ``name`` (``"outer.inner"``: ``inner`` in the body of the class ``outer``), or ``None``."""
    body: List[ast.stmt] = tree.body
    node: Optional[ast.stmt] = None
    for part in name.split("."):
        node = next((candidate for candidate in body if part in _defined_names(candidate)), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def _lines_of_definition(tree: ast.Module, lines: List[str], name: str) -> Optional[Tuple[int, int]]:
    """0-based ``[start, end)`` line range of the definition ``name`` (top-level, or ``"Class.member"``), with its
    decorators and the comment lines right above it."""
    node = _find_definition(tree, name)
    if node is None:
        return None
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return start, node.end_lineno or node.lineno


def _set_all(text: str, drop: Iterable[str]) -> str:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names = [n for n in ast.literal_eval(node.value) if n not in set(drop)]
            lines = text.splitlines(keepends=True)
            new = "__all__ = [" + ", ".join(f'"{n}"' for n in names) + "]\n"
            return "".join(lines[: node.lineno - 1] + [new] + lines[node.end_lineno or node.lineno :])
    return text


def drop_definitions(text: str, names: Sequence[str], where: str = "<module>") -> str:
    """``text`` without the definitions ``names`` (and their ``__all__`` entries).

    Raises:
        TransformError: a name is not defined in ``text`` (``where`` names the module and the stage).
    """
    for name in names:
        lines = text.splitlines(keepends=True)
        found = _lines_of_definition(ast.parse(text), lines, name)
        if found is None:
            raise TransformError(f"{where}: no definition {name!r} to drop")
        start, end = found
        text = "".join(lines[:start] + lines[end:])
    return _set_all(text, names)


def drop_argument(text: str, function: str, argument: str, where: str = "<module>") -> str:
    """``text`` without the parameter ``argument`` of ``function`` (signature and docstring ``Args:`` entry).

    Raises:
        TransformError: ``function`` is not defined, or has no such parameter, or the parameter shares its line with
            another (only one parameter per line, as black writes long signatures, can be removed).
    """
    tree = ast.parse(text)
    node = _find_definition(tree, function)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TransformError(f"{where}: no function {function!r} to drop the argument {argument!r} of")
    arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    found = next((a for a in arguments if a.arg == argument), None)
    if found is None:
        raise TransformError(f"{where}: {function}() has no argument {argument!r} to drop")
    lines = text.splitlines(keepends=True)
    first, last = found.lineno - 1, (found.end_lineno or found.lineno) - 1
    # the default value ends the parameter: it runs to the line before the next parameter (or the closing paren)
    later = [a for a in arguments + [node.args.vararg, node.args.kwarg] if a is not None and a.lineno > found.lineno]
    defaults = dict(zip([a.arg for a in (node.args.posonlyargs + node.args.args)][::-1], node.args.defaults[::-1]))
    defaults.update({a.arg: d for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None})
    if argument in defaults:
        last = max(last, (defaults[argument].end_lineno or defaults[argument].lineno) - 1)
    while last + 1 < len(lines) and re.fullmatch(r"\s*[)\]}]+,\s*", lines[last + 1]):  # a default's closing
        last += 1
    remove: Set[int] = set()
    shared = (later and min(a.lineno for a in later) - 1 <= last) or not lines[first].lstrip().startswith(argument)
    if shared:  # on a line with others (a short signature): cut it out of the line, with one of its commas
        end = defaults.get(argument, found)
        if (end.end_lineno or end.lineno) != found.lineno:
            raise TransformError(f"{where}: {function}()'s argument {argument!r} spans lines shared with others")
        line = lines[first]
        before, after = line[: found.col_offset], line[end.end_col_offset or 0 :]
        if before.rstrip().endswith(","):
            before = before.rstrip()[:-1]
        elif after.lstrip().startswith(","):
            after = after.lstrip()[1:].lstrip()
        else:
            raise TransformError(f"{where}: {function}()'s argument {argument!r}: no comma next to it")
        lines[first] = before + after
    else:
        remove.update(range(first, last + 1))
    docstring = ast.get_docstring(node, clean=False)
    if docstring is not None:
        body0 = node.body[0]
        doc_start, doc_end = body0.lineno - 1, body0.end_lineno or body0.lineno
        head = re.compile(rf"^(\s+){re.escape(argument)}( \([^)]*\))?: ")
        for number in range(doc_start, doc_end):
            match = head.match(lines[number])
            if match:
                indent, stop = len(match.group(1)), number + 1
                while stop < doc_end and lines[stop].strip() and len(lines[stop]) - len(lines[stop].lstrip()) > indent:
                    stop += 1
                remove.update(range(number, stop))
                break
    return "".join(line for number, line in enumerate(lines) if number not in remove)


def drop_keyword(text: str, function: str, keyword: str, where: str = "<module>") -> str:
    """``text`` without the ``keyword=...`` arguments of the calls of ``function`` (see :class:`DropKeyword`).

    Raises:
        TransformError: no call of ``function`` passes ``keyword``.
    """
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(line: int, column: int) -> int:  # ast columns count UTF-8 bytes
        return starts[line - 1] + len(lines[line - 1].encode()[:column].decode())

    spans = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function:
            for argument in node.keywords:
                if argument.arg == keyword:
                    end = offset(argument.end_lineno or argument.lineno, argument.end_col_offset or 0)
                    spans.append((offset(argument.lineno, argument.col_offset), end))
    if not spans:
        raise TransformError(f"{where}: no call of {function}() passes {keyword}= to drop")
    for start, end in sorted(spans, reverse=True):
        after = re.match(r"\s*,?[ \t]*\n?", text[end:])
        end += after.end() if after else 0
        line_start = text.rfind("\n", 0, start) + 1
        if not text[line_start:start].strip() and text[end - 1 : end] == "\n":
            start = line_start  # the argument had lines of its own
        text = text[:start] + text[end:]
    return text


def replace_definition(text: str, name: Optional[str], new: str, where: str) -> str:
    """``text`` with the definition ``name`` (top-level or ``"Class.member"``; ``None``: the module docstring)
    replaced by ``new`` (written with the definition's own indentation)."""
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
            raise TransformError(f"{where}: no definition {name!r} to replace")
        start, end = found
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        if indent and not new.startswith(indent):
            new = textwrap.indent(new, indent)
    return "".join(lines[:start]) + new.rstrip("\n") + "\n" + "".join(lines[end:])


#: Every change :func:`apply_changes` has applied in this process (``scripts/make_upstream_patch.py`` checks that
#: none is left that applies nowhere: a change whose module moved, or was renamed, would otherwise do nothing).
APPLIED: set = set()


def apply_changes(text: str, path: str, changes: Sequence[Change], landed: Callable[[Optional[str]], bool]) -> str:
    """Apply the changes of ``path`` that are in force (``landed(until)`` is false for them) in order.

    Raises:
        TransformError: a change does not find what it names (see the module docstring).
    """
    for change in changes:
        if change.path != path or landed(change.until):
            continue
        APPLIED.add(id(change))
        where = f"{path} (a change until {change.until!r})" if change.until else f"{path} (an upstream change)"
        if isinstance(change, Edit):
            found = text.count(change.old)
            if found != change.count:
                raise TransformError(
                    f"{where}: expected this text {change.count} time(s), found it {found} time(s):\n{change.old}"
                )
            text = text.replace(change.old, change.new)
        elif isinstance(change, Drop):
            text = drop_definitions(text, change.names, where)
        elif isinstance(change, Replace):
            text = replace_definition(text, change.name, change.text, where)
        elif isinstance(change, DropArgument):
            text = drop_argument(text, change.function, change.argument, where)
        elif isinstance(change, DropKeyword):
            text = drop_keyword(text, change.function, change.keyword, where)
        else:
            raise TypeError(f"not a change: {change!r}")
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
    lines = text.split("\n")
    wrapped = []
    for number, line in enumerate(lines, 1):
        pushed = False
        while len(line) > width and (number in docstring_lines or number in comments):
            indent = len(line) - len(line.lstrip())
            start = comments.get(number, indent)
            cut = line.rfind(" ", start + 2, width + 1)
            if cut <= start or "fmt: skip" in line or "noqa" in line:
                break
            rest = line[cut + 1 :].lstrip()
            if number in comments:
                prefix = " " * start + ("#: " if line[start:].startswith("#:") else "# ")
            else:
                continuation = indent + 4 if _ARGS_ENTRY.match(line) else indent
                prefix = " " * continuation
                if number < len(lines) and number + 1 in docstring_lines and _continues(lines[number], continuation):
                    # the paragraph goes on: the words that do not fit move to its next line (wrapped in its turn)
                    lines[number] = prefix + rest + " " + lines[number].lstrip()
                    wrapped.append(line[:cut].rstrip())
                    pushed = True
                    break
            wrapped.append(line[:cut].rstrip())
            line = prefix + rest
        current = _STRING_LINE.match(line) if len(line) > width and not pushed else None
        following = _STRING_LINE.match(lines[number]) if current and number < len(lines) else None
        same_quote = following is not None and (following.group(3) is None) == (current.group(3) is None)
        mergeable = same_quote and following.group(1) == current.group(1) and not current.group(5)
        next_body = (
            (following.group(3) if following.group(3) is not None else following.group(4)) if same_quote else ""
        )
        if mergeable and (following.group(2) == current.group(2) or "{" not in next_body):
            pieces = _split_string_line(line, width)
            last = _STRING_LINE.match(pieces[-1])
            if len(pieces) > 1 and last is not None:  # the next literal goes on: the rest moves into it
                rest = last.group(3) if last.group(3) is not None else last.group(4)
                quote = '"' if last.group(3) is not None else "'"
                prefix = following.group(2) or (current.group(2) if "{" in rest else "")
                lines[number] = f"{following.group(1)}{prefix}{quote}{rest}{next_body}{quote}{following.group(5)}"
                wrapped.extend(pieces[:-1])
                continue
        if not pushed:
            wrapped.extend(_split_string_line(line, width))
    return "\n".join(wrapped)


_STRING_LINE = re.compile(r"""^(\s*)(f?)(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')(\s*[,)]*)$""")


def _split_string_line(line: str, width: int) -> List[str]:
    """A line that is one ``"..."`` (or ``'...'``) literal of an implicit concatenation (inside brackets), longer
    than ``width``, as two or more literals on lines of their own, cut at spaces (never inside an f-string's
    ``{...}``)."""
    match = _STRING_LINE.match(line)
    if len(line) <= width or match is None:
        return [line]
    indent, prefix, suffix = match.group(1), match.group(2), match.group(5)
    quote = '"' if match.group(3) is not None else "'"
    body = match.group(3) if match.group(3) is not None else match.group(4)
    room = width - len(indent) - len(prefix) - 2
    cut = -1
    for position in range(min(room, len(body) - 1), 0, -1):
        if body[position - 1] == " " and body[:position].count("{") == body[:position].count("}"):
            cut = position
            break
    if cut <= 0:
        return [line]
    first = f'{indent}{prefix if "{" in body[:cut] else ""}{quote}{body[:cut]}{quote}'
    second = f'{indent}{prefix if "{" in body[cut:] else ""}{quote}{body[cut:]}{quote}{suffix}'
    return [first] + _split_string_line(second, width)


#: A Google-style ``Args:``/``Attributes:`` entry: ``name: text`` or ``name (type): text``.
_ARGS_ENTRY = re.compile(r"^\s+[*\w.]+( \([^)]*\))?: \S")


def _continues(line: str, indent: int) -> bool:
    """Whether a docstring ``line`` continues the paragraph of a line whose continuation indent is ``indent``."""
    stripped = line.lstrip()
    return (
        bool(stripped)
        and len(line) - len(stripped) == indent
        and not stripped.startswith(("* ", "- ", ".. ", ">>>", '"""', "'''"))
        and not stripped.endswith("::")
        and not re.fullmatch(r"\w+( \w+)?:", stripped)
    )


def format_nemo(text: str) -> str:
    """``text`` formatted as NeMo formats its code (isort, then black, with NeMo's settings; long docstring and
    comment lines broken)."""
    import black
    import isort

    mode = black.Mode(line_length=119, string_normalization=False)
    text = isort.code(text, config=isort.Config(**ISORT_SETTINGS))
    return black.format_str(wrap_long_lines(black.format_str(text, mode=mode)), mode=mode)
