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

"""Every argument that a message of ours names exists (the whole kind of "re-save with ckpt_save_format=...").

The messages are the string constants inside the calls that make them: exceptions raised, ``logger.*`` and
``warnings.warn`` calls, ``print`` and ``parser.error``, and ``argparse`` ``help=`` texts, in every product module
(``nemo_patch.testing`` excluded). Two kinds of names are collected from them: identifiers shaped like the arguments
users pass (``ckpt_*``, ``save_*``, ``consolidation_*``, or any ``name=`` inside a call such as
``ModelCheckpoint(save_top_k=...)``) and command-line options (``--name``). Each must be a parameter of
``MegatronStrategy`` (ours and NeMo's, and the deprecated flat keywords it still takes),
``nemo_patch.MegatronCheckpointIO``, NeMo's or Lightning's ``ModelCheckpoint``, an option of ``nemo-consolidate`` or
of the consolidation process, or a parameter of one of this package's functions.
"""

import ast
import dataclasses
import inspect
import re
from typing import Iterator, Set, Tuple

from conftest import REPO

PACKAGE = REPO / "nemo_patch"
_SHAPED = re.compile(r"(?<![\w.])((?:ckpt|save|consolidation)_[a-z0-9_]+)\b(?!\()")
_KEYWORD = re.compile(r"\b[A-Z]\w*\((?:[^()]*?,\s*)?([a-z_][a-z0-9_]*)=")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]+)")
_MESSAGE_CALLS = {"warning", "error", "info", "debug", "exception", "critical", "warn", "print", "fail"}


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def message_strings() -> Iterator[Tuple[str, str]]:
    """``(where, text)`` of every string constant inside a message-making call or a ``help=`` keyword."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            parts = []
            if name in _MESSAGE_CALLS or name.endswith(("Error", "Exception", "Warning")):
                parts = [node]
            parts += [keyword.value for keyword in node.keywords if keyword.arg == "help"]
            for part in parts:
                for sub in ast.walk(part):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        yield f"{path.relative_to(REPO)}:{sub.lineno}", sub.value


def named_arguments(text: str) -> Set[str]:
    """The argument names and ``--options`` a message text mentions."""
    return set(_SHAPED.findall(text)) | set(_KEYWORD.findall(text)) | set(_OPTION.findall(text))


def known_arguments() -> Set[str]:
    import lightning.pytorch.callbacks as lightning_callbacks
    from nemo import lightning as nl

    from nemo_patch import ConsolidationConfig, MegatronCheckpointIO, MegatronStrategy
    from nemo_patch.cli.nemo_consolidate import build_parser
    from nemo_patch.demo import build_parser as build_demo_parser
    from nemo_patch.overlay.deprecated import deprecated_keywords
    from nemo_patch.training.worker import build_parser as build_worker_parser

    known: Set[str] = set()
    for function in (
        MegatronStrategy.__init__,  # NeMo's own arguments and the consolidation ones (the overlay edits NeMo's class)
        MegatronCheckpointIO.__init__,
        nl.ModelCheckpoint.__init__,
        lightning_callbacks.ModelCheckpoint.__init__,
    ):
        known |= set(inspect.signature(function).parameters)
    known |= {field.name for field in dataclasses.fields(ConsolidationConfig)}
    # The flat keywords of earlier versions are still accepted (with a DeprecationWarning) until the next minor
    # release.
    known |= {*deprecated_keywords("strategy"), *deprecated_keywords("io")}
    # nemo-consolidate's, the consolidation process's and nemo-patch-demo's
    for parser in (build_parser(), build_worker_parser(), build_demo_parser()):
        for action in parser._actions:
            known |= set(action.option_strings)
    for path in PACKAGE.rglob("*.py"):  # and the parameters of this package's own functions (its Python API)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                known |= {arg.arg for arg in node.args.args + node.args.kwonlyargs}
    return known


def test_the_checker_catches_the_kind_it_is_for():
    assert named_arguments("re-save with ckpt_save_format='torch_dist'") == {"ckpt_save_format"}
    assert named_arguments("use ModelCheckpoint(save_top_k=2) or --max-shard-size") == {
        "save_top_k",
        "--max-shard-size",
    }
    assert "ckpt_save_format" not in known_arguments() and "save_ckpt_format" in known_arguments()


def test_every_argument_our_messages_name_exists():
    known = known_arguments()
    unknown = sorted(
        f"{where}: {name}" for where, text in message_strings() for name in named_arguments(text) if name not in known
    )
    seen = {name for _, text in message_strings() for name in named_arguments(text)}
    assert {"save_top_k", "ckpt_consolidation_frequency", "--force"} <= seen  # it looks
    assert unknown == []
