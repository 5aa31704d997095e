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


"""Decide whether a checkpoint's NeMo ``context/`` may be loaded: what it names must come from NeMo's own world.

NeMo's ``io.load_context`` rebuilds the objects of ``context/io.json`` with fiddle: every ``{"type": "pyref",
"module": M, "name": N}`` in the file is imported (``import M``, then ``getattr``) and may be called while the objects
are built. A checkpoint from elsewhere can name any importable callable there (``subprocess.getoutput`` with a command
as its argument), so loading the context of a checkpoint one did not write runs the writer's choice of code.

:func:`check_context_trusted` reads ``io.json`` as plain JSON (bounded, a regular file) before NeMo sees it and lists
every reference. A reference is trusted when its module lies in a package a NeMo model legitimately comes from
(:data:`TRUSTED_PACKAGES`: NeMo, NeMo-Run, megatron-core, torch, transformers, Lightning, fiddle) or, in ``builtins``,
names a plain container or scalar type (:data:`TRUSTED_BUILTINS`). Anything else is refused
(:class:`~nemo_patch.engine.errors.UntrustedContextError`) unless the user opts in, as with Hugging Face's
``trust_remote_code``: ``nemo-consolidate --trust-context``. The training path passes ``trust=True``: the context it
reads is the one the run itself just wrote.

This is a check of the names, not a sandbox: a trusted package's own functions run with the arguments the file gives
them (as they do whenever NeMo loads a checkpoint).

Imports the standard library and the engine's errors and file access only; never NeMo.
"""

from pathlib import Path
from typing import Any, List, Set, Tuple, Union

from nemo_patch.engine.errors import UntrustedContextError
from nemo_patch.engine.safe_files import read_json_file

__all__ = ["TRUSTED_BUILTINS", "TRUSTED_PACKAGES", "check_context_trusted", "context_references"]

#: Top-level packages whose names a trusted context may reference.
TRUSTED_PACKAGES = frozenset(
    {"nemo", "nemo_run", "megatron", "torch", "transformers", "lightning", "pytorch_lightning", "fiddle"}
)
#: The ``builtins`` a trusted context may reference: types that build plain data, nothing that runs code.
TRUSTED_BUILTINS = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bool", "slice"}
)
_IO_JSON = "io.json"


def context_references(context_dir: Union[str, Path]) -> List[Tuple[str, str]]:
    """Every ``(module, name)`` that ``<context_dir>/io.json`` asks fiddle to import, sorted, without duplicates.

    Raises:
        UntrustedContextError: ``io.json`` cannot be read as JSON (missing, not a regular file, too large, invalid),
            or a reference is not a pair of strings.
    """
    path = Path(context_dir) / _IO_JSON
    try:
        data = read_json_file(path)
    except (OSError, ValueError) as error:
        raise UntrustedContextError(f"Cannot read {path} as JSON: {error}") from error
    found: Set[Tuple[str, str]] = set()
    stack: List[Any] = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if value.get("type") == "pyref":
                module, name = value.get("module"), value.get("name")
                if not isinstance(module, str) or not isinstance(name, str):
                    raise UntrustedContextError(f"{path}: a reference {value!r} that is not a module and a name")
                found.add((module, name))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return sorted(found)


def _trusted(module: str, name: str) -> bool:
    if module == "builtins":
        return name in TRUSTED_BUILTINS
    return module.split(".")[0] in TRUSTED_PACKAGES


def check_context_trusted(context_dir: Union[str, Path], trust: bool = False) -> None:
    """Refuse a ``context/`` that references code outside :data:`TRUSTED_PACKAGES` (module docstring).

    Args:
        context_dir: a checkpoint's ``context/`` directory.
        trust: load whatever it names (``--trust-context``; the training path's own context).

    Raises:
        UntrustedContextError: naming the first untrusted references and the option that allows them.
    """
    if trust:
        return
    untrusted = [f"{module}.{name}" for module, name in context_references(context_dir) if not _trusted(module, name)]
    if untrusted:
        raise UntrustedContextError(
            f"{Path(context_dir) / _IO_JSON} references code outside NeMo, megatron-core, torch, transformers and "
            f"Lightning: {', '.join(untrusted[:5])}{' ...' if len(untrusted) > 5 else ''}; loading it would import "
            "and run that code. Pass --trust-context if you trust whoever wrote this checkpoint."
        )
