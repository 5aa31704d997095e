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

NeMo's ``io.load_context`` imports and calls every ``{"module": M, "name": N}`` of ``context/io.json``: its names
(:func:`check_context_trusted`, against the allowlists below) and files (:func:`check_context_files`) are checked
first, and NeMo loads it :func:`offline`; else :class:`~nemo_patch.export.errors.UntrustedContextError`, unless
``--trust-context`` (docs/security.md). A check of names, not a sandbox. Imports the standard library and the engine
at module level; the modules a context names only when checking them.
"""

import contextlib
import errno
import importlib
import os
import stat
import sys
import types
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Set, Tuple, Union

from nemo_patch.engine.safe_files import read_json_file
from nemo_patch.export.errors import UntrustedContextError

__all__ = ["DENIED_MODULES", "DENIED_NAMES", "TRUSTED_BUILTINS", "TRUSTED_CLASS_MODULES", "TRUSTED_FUNCTION_MODULES"]
__all__ += ["TRUSTED_SETTINGS_CLASSES", "TRUSTED_OBJECTS", "TRUSTED_PACKAGES", "HUB_ARTIFACTS", "MAX_CONTEXT_ENTRIES"]
__all__ += ["MAX_CONTEXT_FILE_BYTES", "check_context_files", "check_context_trusted", "context_loading", "offline"]

#: Top-level packages whose names a trusted context may reference.
TRUSTED_PACKAGES = frozenset({"nemo", "megatron", "torch", "transformers", "lightning", "pytorch_lightning", "fiddle"})
#: Parts of the trusted packages that load or run code, processes or whole jobs by design: never named by a context.
DENIED_MODULES = (
    "torch.hub",
    "torch.package",
    "torch.jit",
    "torch.utils.cpp_extension",
    "torch._dynamo",
    "torch._inductor",
    "torch.compiler",
    "torch.multiprocessing",
    "torch.distributed.run",
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.serialization",
    "torch.testing",
    "transformers.dynamic_module_utils",
    "transformers.utils.hub",
    "transformers.commands",
    "nemo.collections.llm.api",
    "nemo.core.connectors",
    "nemo.utils.exp_manager",
    "lightning.pytorch.cli",
    "lightning.fabric.cli",
    "fiddle._src.experimental.serialization",
    # classes whose construction loads a pickle or builds or loads datasets, checkpoints and engines
    "nemo.collections.common.tokenizers.tabular_tokenizer",
    "megatron.core.datasets",
    "megatron.core.dist_checkpointing",
    "megatron.core.export",
    "megatron.core.inference",
    "transformers.models.deprecated",
)
#: Functions of trusted modules that load files or compile code.
DENIED_NAMES = frozenset({"load", "save", "compile", "hub", "jit", "exec", "eval", "system", "popen"})
#: Where a class a trusted context names may be defined (this module or one below it): what NeMo's contexts build.
TRUSTED_CLASS_MODULES = (
    "fiddle._src.config",
    "fiddle._src.partial",
    "nemo.collections.llm",
    "nemo.collections.vlm",
    "nemo.collections.common.tokenizers",
    "nemo.lightning",
    "megatron.core",
    "lightning.pytorch",
    "lightning.fabric",
    "pytorch_lightning",
    "lightning_fabric",
    "transformers.configuration_utils",
    "transformers.generation.configuration_utils",
    "transformers.tokenization_utils",
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_fast",
    "torch.nn.modules",
    "torch.optim",
)
#: Where a function (or other callable that is not a class) a trusted context names may be defined: activations,
#: initialisers, layer specs and tokenizer factories, which a model's config holds and its build or forward calls.
TRUSTED_FUNCTION_MODULES = (
    "torch.nn.functional",
    "torch._C._nn",
    "torch.nn.init",
    "megatron.core.activations",
    "megatron.core.fusions",
    "megatron.core.models",
    "megatron.core.transformer",
    "nemo.collections.llm.fn",
    "nemo.collections.llm.gpt.model",
    "nemo.collections.common.tokenizers",
    "nemo.lightning.io.artifact",
)
#: Single objects a trusted context may name beyond those modules, as ``<defining module>.<name>``.
TRUSTED_OBJECTS = frozenset(
    {
        "torch.dtype",
        "torch.device",
        "torch.Size",
        "torch.tanh",
        "torch.sigmoid",
        "torch.relu",
        "torch.erf",
        "torch.exp",
        "torch.abs",
        "torch.square",
        "torch.softmax",
        "torch.log_softmax",
        "megatron.core.utils.init_method_normal",
        "megatron.core.utils.scaled_init_method_normal",
    }
)
#: This package's classes a context may name, as ``(module, name)``: the settings values the strategy and the
#: checkpoint IO record (:class:`nemo_patch.ConsolidationConfig`, :class:`nemo_patch.ConsolidationSettings`), whose
#: construction only validates them.
TRUSTED_SETTINGS_CLASSES = frozenset(
    {("nemo_patch.training.config", "ConsolidationConfig"), ("nemo_patch.training.settings", "ConsolidationSettings")}
)
#: The ``builtins`` a trusted context may reference: types that build plain data, nothing that runs code.
TRUSTED_BUILTINS = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bool", "slice"}
)
_IO_JSON = "io.json"
#: The most bytes one file under ``context/`` may have (tokenizer files are a few MB), and the most entries in it.
MAX_CONTEXT_FILE_BYTES = 1 << 30
MAX_CONTEXT_ENTRIES = 100_000
#: Artifacts that hold a name NeMo resolves on the Hugging Face hub when it is not a directory of the context.
HUB_ARTIFACTS = frozenset(
    {("nemo.lightning.io.artifact.file", "DirOrStringArtifact"), ("nemo.lightning.io.artifact", "DirOrStringArtifact")}
)


def _io_json(context_dir: Union[str, Path]) -> Any:
    path = Path(context_dir) / _IO_JSON
    try:
        return read_json_file(path)
    except (OSError, ValueError) as error:
        raise UntrustedContextError(f"Cannot read {path} as JSON: {error}") from error


def _values(data: Any) -> Iterator[Any]:
    """Every value of a JSON document, depth first, its objects' keys included."""
    stack: List[Any] = [data]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _under(module: str, prefixes: Tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _why_untrusted(module: str, name: str) -> Optional[str]:
    """Why a reference is not trusted, or ``None`` when it is (imports the trusted module it names)."""
    if module == "builtins":
        return None if name in TRUSTED_BUILTINS else "not a plain builtin type"
    if (module, name) in TRUSTED_SETTINGS_CLASSES:
        return None
    if module.split(".")[0] not in TRUSTED_PACKAGES:
        return "outside NeMo, megatron-core, torch, transformers, Lightning and fiddle"
    if not name.isidentifier():
        return "a dotted name, reached through attributes out of its module"
    if _under(module, DENIED_MODULES) or name in DENIED_NAMES:
        return "a part of a trusted package that loads or runs code"
    try:
        value = getattr(importlib.import_module(module), name)
    except Exception as error:  # noqa: BLE001 - a trusted module that does not import here: not loadable
        return f"cannot be imported here ({type(error).__name__})"
    if isinstance(value, types.ModuleType):
        return "a module object"
    owner = getattr(value, "__module__", None) or type(value).__module__
    if not isinstance(owner, str) or owner.split(".")[0] not in TRUSTED_PACKAGES or _under(owner, DENIED_MODULES):
        return f"defined in {owner}, only re-exported by {module}"
    own_name = getattr(value, "__name__", name)
    if f"{owner}.{own_name}" in TRUSTED_OBJECTS:
        return None
    if isinstance(value, type):
        parts = owner.split(".")  # transformers.models.<family>.configuration_* or tokenization_*, not the models
        hf_ok = parts[:2] == ["transformers", "models"] and parts[-1].startswith(("configuration_", "tokenization_"))
        if not (_under(owner, TRUSTED_CLASS_MODULES) or hf_ok):
            return f"a class defined in {owner}, not where the classes a NeMo model's context builds come from"
    elif callable(value):
        if not _under(owner, TRUSTED_FUNCTION_MODULES) or own_name in DENIED_NAMES:
            return f"a function defined in {owner}, not where a NeMo model's activations, specs and factories live"
    return None


def check_context_trusted(context_dir: Union[str, Path], trust: bool = False) -> None:
    """Refuse a ``context/`` whose ``io.json`` references code that is not trusted (module docstring).

    Args:
        context_dir: a checkpoint's ``context/`` directory.
        trust: load whatever it names (``--trust-context``).

    Raises:
        UntrustedContextError: naming the first untrusted references, why, and the option that allows them.
    """
    if trust:
        return
    path = Path(context_dir) / _IO_JSON
    found: Set[Tuple[str, str]] = set()
    remote_code = False
    for value in _values(_io_json(context_dir)):
        if isinstance(value, dict) and "module" in value and "name" in value:
            module, name = value["module"], value["name"]
            if not isinstance(module, str) or not isinstance(name, str):
                raise UntrustedContextError(f"{path}: a reference {value!r:.200} that is not a module and a name")
            found.add((module, name))
        elif isinstance(value, str) and "trust_remote_code" in value:
            remote_code = True
    untrusted = []
    for module, name in sorted(found):
        why = _why_untrusted(module, name)
        if why is not None:
            untrusted.append(f"{module}.{name} ({why})")
    if remote_code:
        untrusted.append("trust_remote_code (Hugging Face code shipped with the checkpoint would run)")
    if untrusted:
        raise UntrustedContextError(
            f"{path} references code that a NeMo model's context has no need of: "
            f"{', '.join(untrusted[:3])}{' ...' if len(untrusted) > 3 else ''}; loading it would import "
            "and run that code. Pass --trust-context if you trust whoever wrote this checkpoint."
        )


def _bounded_or_directory(path: Path, status: os.stat_result) -> Optional[str]:
    """Why ``path`` may not be opened by NeMo, or ``None`` for a directory or a regular file of bounded size."""
    if stat.S_ISDIR(status.st_mode):
        return None
    if not stat.S_ISREG(status.st_mode):
        return "not a regular file or a directory (a FIFO, device or socket would block or never end a read)"
    if status.st_size > MAX_CONTEXT_FILE_BYTES:
        return f"a file of {status.st_size} bytes, more than the {MAX_CONTEXT_FILE_BYTES} a context file may have"
    return None


def _hub_artifacts(data: Any) -> List[str]:
    """The names the hub artifacts of ``io.json`` hold: fiddle configs of a :data:`HUB_ARTIFACTS` class (NeMo saves one
    for a name that was no path when the context was written), by their ``attr``."""
    found = []
    for value in _values(data):
        if isinstance(value, dict) and _referenced_callable(data, value.get("metadata")) in HUB_ARTIFACTS:
            attr = next((item[1] for item in value.get("items") or [] if isinstance(item, list) and len(item) == 2
                         and item[0] == "Attr(name='attr')"), None)  # fmt: skip
            found.append(str(attr.get("value") if isinstance(attr, dict) else attr))
    return found


def _referenced_callable(data: Any, metadata: Any) -> Optional[Tuple[Any, Any]]:
    """The ``(module, name)`` a fiddle config's metadata names as its callable (through a ``ref`` to an object of
    ``data["objects"]``, as fiddle's serialization writes it)."""
    objects = data.get("objects") if isinstance(data, dict) else None
    for _ in range(2):  # the metadata, or a reference to it
        if isinstance(metadata, dict) and metadata.get("type") == "ref" and isinstance(objects, dict):
            metadata = objects.get(metadata.get("key"))
    if not isinstance(metadata, dict):
        return None
    for item in metadata.get("items") or []:
        if isinstance(item, list) and len(item) == 2 and item[0] == "Attr(name='fn_or_cls')":
            ref = item[1]
            if isinstance(ref, dict):
                return ref.get("module"), ref.get("name")
    return None


def check_context_files(context_dir: Union[str, Path]) -> None:
    """Prove what NeMo opens when it loads ``context_dir`` safe to open: every entry under it (at most
    :data:`MAX_CONTEXT_ENTRIES`, no symbolic link) and every existing path a string of ``io.json`` names a directory or
    a regular file of at most :data:`MAX_CONTEXT_FILE_BYTES`, and no hub artifact.

    Raises:
        UntrustedContextError: naming the entry, the string or the artifact.
    """
    context_dir = Path(context_dir)
    pending, seen = [context_dir], 0
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    seen += 1
                    path = Path(entry.path)
                    if seen > MAX_CONTEXT_ENTRIES:
                        raise UntrustedContextError(f"{context_dir} holds more than {MAX_CONTEXT_ENTRIES} entries")
                    if entry.is_symlink():
                        raise UntrustedContextError(
                            f"{path} is a symbolic link (to {os.readlink(path)}); a context holds its own files"
                        )
                    why = _bounded_or_directory(path, entry.stat(follow_symlinks=False))
                    if why is not None:
                        raise UntrustedContextError(f"{path} is {why}; NeMo would open it loading the context")
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(path)
        except OSError as error:
            raise UntrustedContextError(f"Cannot list {directory}: {error}") from error
    data = _io_json(context_dir)
    for text in _values(data):
        if not isinstance(text, str) or not text or "\0" in text or len(text) > 4096:
            continue
        path = Path(text) if os.path.isabs(text) else context_dir / text
        try:
            status = path.stat()
        except (OSError, ValueError):
            continue  # no such path: a plain string
        why = _bounded_or_directory(path, status)
        if why is not None:
            raise UntrustedContextError(
                f"{context_dir / _IO_JSON} names {text!r}, which is {why}; NeMo would open it loading the context"
            )
    hub = _hub_artifacts(data)
    if hub:
        raise UntrustedContextError(
            f"{context_dir / _IO_JSON} names {hub[0]!r} as a hub artifact (a DirOrStringArtifact that is no directory "
            "of the context): NeMo would fetch it from the Hugging Face hub. Pass --trust-context if you trust "
            "whoever wrote this checkpoint and want it fetched"
        )


_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_NETWORK_EVENTS = ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto", "socket.sendmsg")
_offline_depth = [0]
_hook_installed = [False]


def _refuse_network(event: str, args: Tuple[Any, ...]) -> None:
    if _offline_depth[0] and event in _NETWORK_EVENTS:
        raise OSError(
            errno.ENETUNREACH, f"network access ({event}) refused while a checkpoint's context is loaded untrusted"
        )


def _hub_constants(offline: Optional[bool]) -> None:
    """Set the offline flags ``huggingface_hub`` and ``transformers`` read at import time, where they are imported
    (``None``: as the environment now says)."""
    if offline is None:
        offline = any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in _OFFLINE_VARIABLES)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        setattr(constants, "HF_HUB_OFFLINE", offline)
    hub = sys.modules.get("transformers.utils.hub")
    if hub is not None and hasattr(hub, "_is_offline_mode"):
        setattr(hub, "_is_offline_mode", offline)


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """While the block runs: the Hugging Face hub in offline mode (environment and module constants) and every
    connection or name lookup through Python's ``socket`` module refused (``OSError``); restored after."""
    if not _hook_installed[0]:
        sys.addaudithook(_refuse_network)  # stays installed: it acts only inside this block
        _hook_installed[0] = True
    saved = {name: os.environ.get(name) for name in _OFFLINE_VARIABLES}
    os.environ.update({name: "1" for name in _OFFLINE_VARIABLES})
    _hub_constants(True)
    _offline_depth[0] += 1
    try:
        yield
    finally:
        _offline_depth[0] -= 1
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if not _offline_depth[0]:
            _hub_constants(None)


def context_loading(context_dir: Union[str, Path], trust: bool = False) -> Callable[[], ContextManager[None]]:
    """What to run NeMo's loading of ``context_dir`` in (each ``with context_loading(...)()`` block): unless ``trust``,
    its names and files are checked now and :func:`offline` is returned; else a block that does nothing.

    Raises:
        UntrustedContextError: from the checks.
    """
    if trust:
        return contextlib.nullcontext
    check_context_trusted(context_dir)
    check_context_files(context_dir)
    return offline
