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

* ``nemo-patch-strategy-arguments``: one entry per ``MegatronStrategy`` consolidation argument (type, default,
  meaning), from the edited class's own signature and docstring (the ``nemo_edits`` that go upstream).
* ``nemo-patch-consolidation-config``: one entry per ``ConsolidationConfig`` field (type, default, ``nemo-consolidate``
  option, the deprecated flat keyword it replaces, meaning), from the fields' declarations
  (:data:`nemo_patch.training.config.SETTINGS`), the same ones the class's documentation and the CLI's options are made
  from.
* ``nemo-patch-exit-codes``: one row per exit code of ``nemo-consolidate``: those of its ``CLI_EXIT_CODES`` (0, 2,
  130), and every ``ConsolidationError`` class of :mod:`nemo_patch.engine.errors` with its ``exit_code`` and docstring.

The two references are definition lists, one entry per argument or field, so that no column runs off a narrow screen.
A declaration they cannot be made from (a setting without help, two error classes with one exit code) fails the build,
naming it.

Class signatures: autodoc looks for a class's ``__new__`` before its ``__init__``, and NeMo's ``IOMixin.__new__``
takes ``(*args, **kwargs)``, so the strategy and the checkpoint IO would read ``(*args, **kwargs)``. Python itself
(``inspect.signature``, which NeMo-Run and fiddle use) takes the ``__init__`` a class defines; that one is shown.
"""

import importlib.util
import inspect
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

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


def format_default(value: Any) -> str:
    """A default as Python source: large integers with ``_`` separators, floats that are whole numbers as ints."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**6:
        return f"{value:_}"
    return repr(value)


def strategy_argument_entries() -> List[Tuple[str, str, str, str]]:
    """``(argument, type, default, meaning)`` for every consolidation argument of ``MegatronStrategy``: the signature
    and the ``Args:`` entry (``name (type): meaning``) of NeMo's edited class."""
    import nemo_patch
    from nemo_patch.training.config import annotation_text
    from nemo_patch.training.integration import ARGUMENTS

    strategy = nemo_patch.MegatronStrategy  # NeMo's class, edited as NeMo's module is imported
    parameters = inspect.signature(strategy.__init__).parameters
    doc = inspect.getdoc(strategy) or ""
    entries = []
    for name in ARGUMENTS:
        match = re.search(rf"^    {name} \([^)]*\): (.*?)(?=^    \S|^\S|\Z)", doc, re.S | re.M)
        if name not in parameters or match is None:
            raise ExtensionError(f"MegatronStrategy has no argument {name!r} documented (is the overlay applied?)")
        parameter = parameters[name]
        meaning = " ".join(match.group(1).split())
        entries.append((name, annotation_text(parameter.annotation), format_default(parameter.default), meaning))
    return entries


def config_field_entries() -> List[Tuple[str, str, str, str, str, str]]:
    """``(field, type, default, CLI option or "", deprecated flat keyword or "", meaning)`` for every
    ``ConsolidationConfig`` field."""
    from nemo_patch.overlay.deprecated import deprecated_keywords
    from nemo_patch.training.config import SETTINGS, annotation_text

    flat = {field: keyword for keyword, field in deprecated_keywords("strategy").items()}
    entries = []
    for spec in SETTINGS:
        if not spec.help.strip():
            raise ExtensionError(f"ConsolidationConfig.{spec.field} declares no help text")
        cli = spec.cli.flag if spec.cli is not None else ""
        annotation, default = annotation_text(spec.annotation), format_default(spec.default)
        entries.append((spec.field, annotation, default, cli, flat.get(spec.field, ""), spec.help))
    return entries


def exit_code_rows() -> List[Tuple[int, str, str]]:
    """``(exit code, error class, meaning)`` for every exit code of ``nemo-consolidate``, by code."""
    from nemo_patch.cli.exit_codes import error_classes
    from nemo_patch.cli.nemo_consolidate import CLI_EXIT_CODES
    from nemo_patch.engine.errors import ConsolidationError

    rows = [(code, "", text) for code, (_, text) in CLI_EXIT_CODES.items()]
    seen = {code: "(fixed)" for code in CLI_EXIT_CODES}
    for name, cls in sorted(error_classes().items()):
        code = cls.__dict__.get("exit_code", None)
        if not isinstance(code, int):
            raise ExtensionError(f"{name} declares no exit_code of its own")
        if code in seen:
            raise ExtensionError(f"exit code {code} belongs to both {seen[code]} and {name}")
        seen[code] = name
        text = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
        if cls is ConsolidationError:
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


def _facts(*facts: Tuple[str, Optional[str]]) -> nodes.paragraph:
    """``label: literal · label: literal ...``: an entry's type, default and the like, on one line; a fact whose value
    is ``None`` is left out, one whose value is empty reads "none"."""
    paragraph = nodes.paragraph()
    for label, value in facts:
        if value is None:
            continue
        if len(paragraph):
            paragraph += nodes.Text(" · ")
        paragraph += nodes.Text(f"{label}: ")
        paragraph += nodes.literal(text=value) if value else nodes.Text("none")
    return paragraph


def _definition_list(classes: str, entries: Sequence[Tuple[str, nodes.paragraph, str]]) -> nodes.definition_list:
    """One entry per ``(name, facts, meaning)``: the name as a literal term, then the facts and the meaning."""
    result = nodes.definition_list(classes=[classes])
    for name, facts, meaning in entries:
        item = nodes.definition_list_item()
        term = nodes.term()
        term += nodes.literal(text=name)
        definition = nodes.definition()
        definition += facts
        paragraph = nodes.paragraph()
        paragraph.extend(inline_nodes(meaning))
        definition += paragraph
        item += term
        item += definition
        result += item
    return result


class _Reference(SphinxDirective):
    """Rebuilt when the declaring modules change."""

    modules = ("nemo_patch.training.settings", "nemo_patch.training.config")

    def note_dependencies(self) -> None:
        for module in self.modules:
            spec = importlib.util.find_spec(module)
            if spec is not None and spec.origin is not None:
                self.env.note_dependency(spec.origin)


class StrategyArguments(_Reference):
    """The reference of ``MegatronStrategy``'s consolidation arguments (see the module docstring)."""

    def run(self) -> List[nodes.Node]:
        self.note_dependencies()
        entries = [
            (name, _facts(("type", annotation), ("default", default)), meaning)
            for name, annotation, default, meaning in strategy_argument_entries()
        ]
        return [_definition_list("nemo-patch-strategy-arguments", entries)]


class ConsolidationConfigFields(_Reference):
    """The reference of ``ConsolidationConfig``'s fields (see the module docstring)."""

    def run(self) -> List[nodes.Node]:
        self.note_dependencies()
        entries = [
            (
                name,
                _facts(
                    ("type", annotation),
                    ("default", default),
                    ("nemo-consolidate", cli),
                    ("replaces the deprecated", f"{flat}=" if flat else None),
                ),
                meaning,
            )
            for name, annotation, default, cli, flat, meaning in config_field_entries()
        ]
        return [_definition_list("nemo-patch-consolidation-config", entries)]


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


def cli_parser() -> Any:
    """``nemo-consolidate``'s parser (:func:`nemo_patch.cli.nemo_consolidate.build_parser`) for the
    ``sphinx_argparse_cli`` directive, with ``<`` and ``>`` in its help texts written as HTML entities: the directive
    parses help texts as Markdown, in which ``<ckpt>`` is an HTML tag and would vanish from the page."""
    from nemo_patch.cli.nemo_consolidate import build_parser

    parser = build_parser()
    parser.format_help()  # makes its exit-code epilog
    for action in parser._actions:
        if action.help:
            action.help = action.help.replace("<", "&lt;").replace(">", "&gt;")
    return parser


def class_signature(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: Any, return_annotation: Any
) -> Any:
    """``autodoc-process-signature``: a class whose signature autodoc read from a ``(*args, **kwargs)`` ``__new__``
    gets the one Python gives it (its ``__init__``'s), without annotations (they are in the description)."""
    if what not in ("class", "exception") or signature != "(*args, **kwargs)":
        return None
    try:
        python = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    bare = python.replace(
        parameters=[param.replace(annotation=inspect.Parameter.empty) for param in python.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return (None, return_annotation) if str(bare) == signature else (str(bare), return_annotation)


def edited_class_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: List[str]) -> None:
    """``autodoc-process-docstring``: NeMo's edited classes are documented by what the overlay adds to them (their own
    docstrings are NeMo's, documented in NeMo's reference, and not written for this site's checks)."""
    if what != "class":
        return
    if name == "nemo_patch.MegatronStrategy":
        lines[:] = [
            "NeMo's ``MegatronStrategy`` (``nemo.lightning.MegatronStrategy``), edited by the overlay: NeMo's own",
            "arguments are documented in NeMo's reference; the consolidation arguments, keyword-only, are:",
            "",
        ]
        for argument, _, _, meaning in strategy_argument_entries():
            lines.append(f":param {argument}: {meaning}")
    elif name == "nemo_patch.MegatronCheckpointIO":
        lines[:] = [
            "NeMo's ``MegatronCheckpointIO`` (``nemo.lightning.io.pl.MegatronCheckpointIO``), edited by the",
            "overlay: it takes ``consolidation_settings`` (a :class:`~nemo_patch.ConsolidationSettings`; ``None``: no",
            "consolidation) and holds the run's coordinator as ``consolidation`` (``None`` when it consolidates",
            "nothing).",
        ]


def setup(app: Sphinx) -> Dict[str, Any]:
    app.connect("autodoc-process-signature", class_signature)
    app.connect("autodoc-process-docstring", edited_class_docstring)
    app.add_directive("nemo-patch-strategy-arguments", StrategyArguments)
    app.add_directive("nemo-patch-consolidation-config", ConsolidationConfigFields)
    app.add_directive("nemo-patch-exit-codes", ExitCodes)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
