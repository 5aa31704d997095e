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

"""Sphinx extension: reference tables generated from nemo_patch's own declarations, so the docs cannot drift.

Directives (usable from MyST Markdown as ```` ```{nemo-patch-strategy-arguments} ````):

* ``nemo-patch-strategy-arguments``: one row per ``MegatronStrategy`` consolidation argument, read from
  :mod:`nemo_patch.training.settings`: the arguments are the parameters of ``ConsolidationSettings.from_arguments``
  (their defaults are the table's), named for the strategy by ``STRATEGY_ARGUMENTS`` (plus ``save_consolidated`` and
  ``ckpt_consolidation_frequency``) and for the checkpoint IO by ``CHECKPOINT_IO_ARGUMENTS``; the meaning is the
  argument's entry in the ``Args:`` section of ``nemo_patch.training.strategy.MegatronStrategy``'s docstring, read
  from the module's source (without importing NeMo).
* ``nemo-patch-exit-codes``: one row per exit code of ``nemo-consolidate``: 0 and 2 (argparse), and every
  ``ConsolidationError`` class of :mod:`nemo_patch.engine.errors` with its ``exit_code`` and docstring.

A declaration the table cannot be made from (a setting without an argument name or without an ``Args:`` entry,
two error classes with one exit code) fails the build, naming it.
"""

import ast
import dataclasses
import importlib.util
import inspect
import re
import sys
from typing import Any, Dict, List, Sequence, Tuple

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective

#: The two arguments of the strategy that are not in ``STRATEGY_ARGUMENTS`` (they choose the cadence; the checkpoint IO
#: takes them under the same names).
CADENCE_ARGUMENTS = {"save_consolidated": "save_consolidated", "frequency": "ckpt_consolidation_frequency"}

#: Exit codes that no error class carries: success, and argparse's bad command line.
FIXED_EXIT_CODES = {
    0: (
        "",
        "Success: the output was written and published (or, with ``--verify`` of an existing output, it matched).",
    ),
    2: ("", "Bad command line: ``argparse`` prints the usage and the reason."),
}

_INLINE = re.compile(r"``(?P<literal>.+?)``|:[\w:]+:`~?(?P<role>[^`]+?)`|`(?P<plain>[^`]+)`")


def inline_nodes(text: str) -> List[nodes.Node]:
    """``text`` (reStructuredText inline markup as docstrings use it) as docutils nodes: literals and roles become
    literals (a role's target shown by its last component when written with ``~``), the rest plain text."""
    result: List[nodes.Node] = []
    position = 0
    for match in _INLINE.finditer(text):
        if match.start() > position:
            result.append(nodes.Text(text[position : match.start()]))
        if match.group("literal") is not None:
            result.append(nodes.literal(text=match.group("literal")))
        elif match.group("role") is not None:
            target = match.group("role")
            target = re.sub(r"^.*<(.+)>$", r"\1", target)
            shown = target.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else target
            result.append(nodes.literal(text=shown))
        else:
            result.append(nodes.literal(text=match.group("plain")))
        position = match.end()
    if position < len(text):
        result.append(nodes.Text(text[position:]))
    return result


def docstring_sections(doc: str, section: str) -> Dict[str, str]:
    """The entries of a Google-style docstring section (``Attributes:``, ``Args:``): name -> its text, continuation
    lines joined."""
    lines = inspect.cleandoc(doc).splitlines()
    entries: Dict[str, str] = {}
    inside, name = False, ""
    for line in lines:
        if line.strip() == f"{section}:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^    (\*{0,2}\w+)(?: \([^)]*\))?: ?(.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2).strip()
        elif line.strip() and name:
            entries[name] += " " + line.strip()
    return entries


def format_default(value: Any) -> str:
    """A default as Python source: large integers with ``_`` separators, floats that are whole numbers as ints."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**6:
        return f"{value:_}"
    return repr(value)


def strategy_docstring() -> str:
    """``MegatronStrategy``'s docstring, read from :mod:`nemo_patch.training.strategy`'s source (importing the module
    would import NeMo)."""
    spec = importlib.util.find_spec("nemo_patch.training.strategy")
    if spec is None or spec.origin is None:
        raise ExtensionError("nemo_patch.training.strategy not found")
    tree = ast.parse(open(spec.origin).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "MegatronStrategy":
            return ast.get_docstring(node) or ""
    raise ExtensionError(f"no class MegatronStrategy in {spec.origin}")


def strategy_argument_rows() -> List[Tuple[str, str, str, str]]:
    """``(strategy argument, checkpoint IO argument, default, meaning)`` for every consolidation argument."""
    from nemo_patch.training import settings

    cls = settings.ConsolidationSettings
    field_names = [field.name for field in dataclasses.fields(cls)]
    parameters = inspect.signature(cls.from_arguments).parameters
    meanings = docstring_sections(strategy_docstring(), "Args")
    strategy_names = {**CADENCE_ARGUMENTS, **settings.STRATEGY_ARGUMENTS}
    io_names = {**CADENCE_ARGUMENTS, **settings.CHECKPOINT_IO_ARGUMENTS}
    unknown = set(settings.STRATEGY_ARGUMENTS) - set(field_names)
    if unknown:
        raise ExtensionError(f"STRATEGY_ARGUMENTS names settings ConsolidationSettings lacks: {sorted(unknown)}")
    rows = []
    for name in field_names:
        if name not in parameters:
            continue  # derived from the arguments (the cadence policy), not given by the user
        if name not in strategy_names:
            raise ExtensionError(f"setting {name!r} has no strategy argument name in STRATEGY_ARGUMENTS")
        if strategy_names[name] not in meanings:
            raise ExtensionError(f"{strategy_names[name]!r} has no entry in MegatronStrategy's Args: section")
        default = parameters[name].default
        rows.append(
            (
                strategy_names[name],
                io_names.get(name, "(none: the strategy's teardown waits)"),
                format_default(default),
                meanings[strategy_names[name]],
            )
        )
    return rows


def exit_code_rows() -> List[Tuple[int, str, str]]:
    """``(exit code, error class, meaning)`` for every exit code of ``nemo-consolidate``, by code."""
    from nemo_patch.engine import errors

    rows = [(code, name, text) for code, (name, text) in FIXED_EXIT_CODES.items()]
    seen = {code: "(fixed)" for code in FIXED_EXIT_CODES}
    for name in sorted(errors.__all__):
        cls = getattr(errors, name)
        if not (isinstance(cls, type) and issubclass(cls, errors.ConsolidationError)):
            continue
        code = cls.__dict__.get("exit_code", None)
        if not isinstance(code, int):
            raise ExtensionError(f"{name} declares no exit_code of its own")
        if code in seen:
            raise ExtensionError(f"exit code {code} belongs to both {seen[code]} and {name}")
        seen[code] = name
        text = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
        if cls is errors.ConsolidationError:
            text += " Also any cause without a class of its own, and an unexpected error (one line on stderr)."
        rows.append((code, name, text))
    return sorted(rows)


def _table(
    classes: str, header: Sequence[str], widths: Sequence[int], rows: Sequence[Sequence[List[nodes.Node]]]
) -> nodes.table:
    table = nodes.table(classes=[classes])
    group = nodes.tgroup(cols=len(header))
    table += group
    group.extend(nodes.colspec(colwidth=width) for width in widths)

    def row(cells: Sequence[List[nodes.Node]]) -> nodes.row:
        result = nodes.row()
        for content in cells:
            entry = nodes.entry()
            paragraph = nodes.paragraph()
            paragraph.extend(content)
            entry += paragraph
            result += entry
        return result

    head = nodes.thead()
    head += row([[nodes.Text(text)] for text in header])
    body = nodes.tbody()
    body.extend(row(cells) for cells in rows)
    group += head
    group += body
    return table


class StrategyArguments(SphinxDirective):
    """The table of ``MegatronStrategy``'s consolidation arguments (see the module docstring)."""

    def run(self) -> List[nodes.Node]:
        for module in ("nemo_patch.training.settings", "nemo_patch.training.strategy"):
            spec = importlib.util.find_spec(module)
            if spec is not None and spec.origin is not None:
                self.env.note_dependency(spec.origin)
        rows = [
            [
                [nodes.literal(text=strategy)],
                [nodes.literal(text=io)],
                [nodes.literal(text=default)],
                inline_nodes(meaning),
            ]
            for strategy, io, default, meaning in strategy_argument_rows()
        ]
        header = ["MegatronStrategy argument", "MegatronCheckpointIO argument", "default", "meaning"]
        return [_table("nemo-patch-strategy-arguments", header, [22, 20, 10, 48], rows)]


class ExitCodes(SphinxDirective):
    """The table of ``nemo-consolidate``'s exit codes (see the module docstring)."""

    def run(self) -> List[nodes.Node]:
        spec = importlib.util.find_spec("nemo_patch.engine.errors")
        if spec is not None and spec.origin is not None:
            self.env.note_dependency(spec.origin)
        rows = [
            [[nodes.Text(str(code))], [nodes.literal(text=name)] if name else [], inline_nodes(text)]
            for code, name, text in exit_code_rows()
        ]
        return [_table("nemo-patch-exit-codes", ["exit code", "error class", "cause"], [8, 22, 70], rows)]


def data_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: List[str]) -> None:
    """A constant re-exported by ``nemo_patch`` (``nemo_patch.ACCEPTED_FREQUENCIES``) gets the ``#:`` comment of the
    module that defines it instead of its type's docstring (``str(object='') -> str ...``)."""
    if what != "data" or not name.startswith("nemo_patch.") or lines[:1] != (type(obj).__doc__ or "").splitlines()[:1]:
        return
    short = name.rsplit(".", 1)[-1]
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("nemo_patch.") and getattr(module, short, None) is obj:
            docs = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", short))
            if docs:
                lines[:] = list(docs)
                return


def setup(app: Sphinx) -> Dict[str, Any]:
    app.connect("autodoc-process-docstring", data_docstring)
    app.add_directive("nemo-patch-strategy-arguments", StrategyArguments)
    app.add_directive("nemo-patch-exit-codes", ExitCodes)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
