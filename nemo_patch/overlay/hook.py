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

"""The overlay's import hook: NeMo's modules are executed with the edits of ``nemo_edits/`` applied to their source.

``nemo_patch.pth`` calls :func:`install` at interpreter start-up. Every hunk of the diffs ``nemo_edits/series`` lists
applies strictly (its old lines found exactly once), or NeMo runs unedited, with one warning, and its
``MegatronStrategy`` refuses the consolidation arguments (:func:`guard_unedited`). Standard library only.
``NEMO_PATCH_DISABLE=1`` (or ``true``/``yes``) leaves NeMo unedited.
"""

import functools
import inspect
import linecache
import os
import re
import sys
import warnings
from importlib.machinery import ModuleSpec
from importlib.util import find_spec
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["EDITS_DIR", "OverlayNotAppliedError", "TARGET_MODULE", "edit_loaded_modules", "guard_unedited", "install"]
__all__ += ["not_applied_reason", "overlay_applied", "overlay_disabled"]

#: The diffs and their ``series`` file.
EDITS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nemo_edits")
#: The NeMo module whose edit means the overlay is active (``MegatronStrategy``'s).
TARGET_MODULE = "nemo.lightning.pytorch.strategies.megatron_strategy"

#: Called once before the first edit (imports ``nemo_patch``, whose version gate may refuse this NeMo).
Prepare = Callable[[], None]
#: Called after an edited module was executed.
AfterExec = Callable[[ModuleType], None]
_Hunk = Tuple[List[str], List[str]]
_HUNK_HEADER = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


class OverlayNotAppliedError(RuntimeError):
    """``MegatronStrategy`` was given a consolidation argument while NeMo's module runs unedited (the overlay's edits
    do not apply to this NeMo, NeMo is not supported, or ``NEMO_PATCH_DISABLE`` is set); the message names the file,
    the NeMo version and the reason."""


class _State:
    """What this process knows: the edited sources by module (``None`` until computed; empty when refused), and why."""

    sources: Optional[Dict[str, str]] = None
    reason: Optional[str] = None
    edited: Set[str] = set()
    prepare: Optional[Prepare] = None
    after_exec: Optional[AfterExec] = None


def overlay_disabled() -> bool:
    """Whether ``NEMO_PATCH_DISABLE`` is set to ``1``, ``true`` or ``yes`` (case-insensitive)."""
    return os.environ.get("NEMO_PATCH_DISABLE", "").strip().lower() in ("1", "true", "yes")


def overlay_applied() -> bool:
    """Whether NeMo's ``MegatronStrategy`` module was executed with the edits."""
    return TARGET_MODULE in _State.edited and TARGET_MODULE in sys.modules


def not_applied_reason() -> Optional[str]:
    """Why NeMo's ``MegatronStrategy`` module is not edited in this process, or ``None`` when it is."""
    if overlay_applied():
        return None
    if overlay_disabled():
        return f"NEMO_PATCH_DISABLE={os.environ.get('NEMO_PATCH_DISABLE', '')} is set"
    if _State.reason is not None:
        return _State.reason
    if TARGET_MODULE in sys.modules:
        return "NeMo's MegatronStrategy module was imported before the overlay was installed, and not edited since"
    return "NeMo's MegatronStrategy module is not imported yet"


def guard_unedited(module: ModuleType) -> None:
    """Make the unedited ``MegatronStrategy`` of NeMo's ``module`` refuse ``save_consolidated`` and the
    ``ckpt_consolidation*`` keywords with :class:`OverlayNotAppliedError`; other modules, a class already guarded, and
    one whose ``__init__`` takes ``ckpt_consolidation_frequency`` itself (a NeMo with the series merged) are left
    alone. The class keeps its signature (``functools.wraps``) and NeMo's ``IOMixin`` wrapping."""
    strategy = vars(module).get("MegatronStrategy")
    if module.__name__ != TARGET_MODULE or not isinstance(strategy, type):
        return
    original = strategy.__dict__.get("__init__")
    if original is None or getattr(original, "nemo_patch_guard", False) or _takes_the_knob(original):
        return
    filename = str(module.__spec__.origin if module.__spec__ is not None else module.__file__)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        asked = sorted(name for name in kwargs if name == "save_consolidated" or name.startswith("ckpt_consolidation"))
        if asked:
            raise OverlayNotAppliedError(
                f"MegatronStrategy({', '.join(asked)}=...) needs the nemo_patch overlay, which is not applied to "
                f"{filename} of nemo_toolkit {_nemo_version()}: {not_applied_reason()}. Unedited, NeMo would pass "
                "the argument on to Lightning and consolidate nothing (`nemo-consolidate --check` tells whether the "
                "overlay is active; docs/installation.md)"
            )
        original(self, *args, **kwargs)

    __init__.nemo_patch_guard = True  # type: ignore[attr-defined]
    strategy.__init__ = __init__  # type: ignore[misc]


def _takes_the_knob(init: Any) -> bool:
    try:
        return "ckpt_consolidation_frequency" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        return False


def read_series(directory: Optional[str] = None) -> List[Tuple[str, str, List[_Hunk]]]:
    """The hunks of every diff ``series`` lists, in order, as ``(diff name, file path, [(old lines, new lines)])``.

    Raises:
        ValueError: a diff that is not a unified diff.
    """
    directory = directory or EDITS_DIR
    with open(os.path.join(directory, "series")) as series:
        names = [line.strip() for line in series if line.strip() and not line.startswith("#")]
    result: List[Tuple[str, str, List[_Hunk]]] = []
    for name in names:
        with open(os.path.join(directory, name)) as diff:
            lines = diff.read().split("\n")
        path: Optional[str] = None
        for number, line in enumerate(lines):
            if line.startswith("+++ "):
                path = line[4:].strip().removeprefix("b/")
                result.append((name, path, []))
            elif _HUNK_HEADER.match(line):
                if path is None:
                    raise ValueError(f"{name}:{number + 1}: a hunk before its file's header")
                result[-1][2].append(([], []))
            elif result and result[-1][2] and line[:1] in (" ", "-", "+") and not line.startswith(("--- ", "+++ ")):
                old, new = result[-1][2][-1]
                if line[0] != "+":
                    old.append(line[1:])
                if line[0] != "-":
                    new.append(line[1:])
            elif result and result[-1][2] and line == "" and number < len(lines) - 1:
                raise ValueError(f"{name}:{number + 1}: an empty line inside a hunk (context lines start with ' ')")
    return result


def apply_hunks(text: str, hunks: Sequence[_Hunk]) -> Tuple[str, Optional[str]]:
    """``text`` with ``hunks`` applied in order, or ``(text, reason)`` for the first hunk whose old lines are not
    found exactly once (line numbers do not matter)."""
    lines = text.split("\n")
    for index, (old, new) in enumerate(hunks, 1):
        found = [i for i in range(len(lines) - len(old) + 1) if lines[i : i + len(old)] == old]
        if len(found) != 1:
            return text, f"hunk {index}'s context is found {len(found)} times"
        lines[found[0] : found[0] + len(old)] = new
    return "\n".join(lines), None


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _nemo_version() -> str:
    try:
        from importlib import metadata

        return metadata.version("nemo_toolkit")
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"


def _refuse(message: str) -> Dict[str, str]:
    _State.reason = message
    warnings.warn(f"nemo_patch overlay not applied: {message}; NeMo runs unedited", RuntimeWarning, stacklevel=3)
    _State.sources = {}
    return _State.sources


def edited_sources() -> Dict[str, str]:
    """The edited source of each NeMo module the series edits, by module name; ``{}`` when the overlay is disabled,
    ``prepare`` refused this NeMo, or a hunk does not apply (each warned once). Computed once per process."""
    if _State.sources is not None:
        return _State.sources
    _State.sources = {}
    if overlay_disabled():
        return _State.sources
    try:
        if _State.prepare is not None:
            _State.prepare()
        series = read_series()
    except Exception as error:  # never break `import nemo` because of the overlay
        return _refuse(str(error))
    spec = find_spec("nemo")
    root = os.path.dirname(list(spec.submodule_search_locations or [""])[0]) if spec is not None else ""
    sources: Dict[str, str] = {}
    for name, path, hunks in series:
        module = _module_name(path)
        if module not in sources:
            try:
                with open(os.path.join(root, path)) as file:
                    sources[module] = file.read()
            except OSError as error:
                return _refuse(f"{path} of nemo_toolkit {_nemo_version()} cannot be read ({error})")
        sources[module], reason = apply_hunks(sources[module], hunks)
        if reason is not None:
            return _refuse(f"{path} of nemo_toolkit {_nemo_version()} does not match {name} ({reason})")
    _State.sources = sources
    return sources


def _execute(module: ModuleType, source: str) -> None:
    """Execute ``source`` as ``module`` (in its namespace), under its file name, its text in :mod:`linecache`."""
    filename = str(module.__spec__.origin if module.__spec__ is not None else module.__file__)
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)  # no mtime: checkcache() keeps it
    code = compile(source, filename, "exec", dont_inherit=True)
    _State.edited.add(module.__name__)
    exec(code, module.__dict__)
    if _State.after_exec is not None:
        _State.after_exec(module)


class _EditingLoader:
    """Executes NeMo's module with the edits applied to its source; NeMo's own loader otherwise."""

    nemo_patch_editing = True  # another copy of this hook leaves a spec with this loader alone

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        _State.edited.add(module.__name__)  # being edited: not to be edited again meanwhile (edit_loaded_modules)
        source = edited_sources().get(module.__name__)
        if source is None:
            _State.edited.discard(module.__name__)
            self._loader.exec_module(module)
            guard_unedited(module)
        else:
            _execute(module, source)

    def get_source(self, name: str) -> Optional[str]:
        source = edited_sources().get(name)
        return source if source is not None else self._loader.get_source(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def watched_modules() -> List[str]:
    """The NeMo modules the series edits, in the order it first names them."""
    try:
        names = [_module_name(path) for _, path, _ in read_series()]
    except (OSError, ValueError):
        return []
    return list(dict.fromkeys(names))


class _OverlayFinder:
    """Meta-path finder that wraps the loaders of the modules the series edits, and of no other."""

    # Set while this finder asks the others (another copy of this hook would ask us back): answer nothing then.
    _searching = False
    _watched: Optional[Set[str]] = None

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        if not fullname.startswith("nemo.lightning.") or _OverlayFinder._searching:
            return None
        if self._watched is None:
            self._watched = set(watched_modules())
        if fullname not in self._watched:
            return None
        _OverlayFinder._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and not getattr(spec.loader, "nemo_patch_editing", False):
                        spec.loader = _EditingLoader(spec.loader)  # type: ignore[assignment]
                    return spec
            return None
        finally:
            _OverlayFinder._searching = False


def install(prepare: Prepare, after_exec: Optional[AfterExec] = None) -> None:
    """Register the finder once. With the overlay disabled it edits nothing: it only guards NeMo's unedited
    ``MegatronStrategy`` (:func:`guard_unedited`).

    Args:
        prepare: called once, before the first edit; an exception leaves NeMo unedited (and is warned). It may call
            this function again, with both arguments.
        after_exec: called with each module once it was executed edited.
    """
    _State.prepare = prepare
    _State.after_exec = after_exec if after_exec is not None else _State.after_exec
    if not any(isinstance(finder, _OverlayFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OverlayFinder())


def edit_loaded_modules() -> List[str]:
    """Execute again, edited, the NeMo modules that were imported unedited (before :func:`install`), and make every
    loaded ``nemo`` module use their classes (names rebound, subclasses rebased). When the edits do not apply (or the
    overlay is disabled), guards NeMo's unedited ``MegatronStrategy`` instead (:func:`guard_unedited`).

    Returns:
        The modules edited now.
    """
    done: List[str] = []
    for name in watched_modules():
        module = sys.modules.get(name)
        if module is None or name in _State.edited:
            continue
        source = edited_sources().get(name)
        if source is None:
            target = sys.modules.get(TARGET_MODULE)
            if target is not None and TARGET_MODULE not in _State.edited:
                guard_unedited(target)
            return done
        before = {key: value for key, value in vars(module).items() if getattr(value, "__module__", None) == name}
        _execute(module, source)
        if module.__spec__ is not None and module.__spec__.loader is not None:
            module.__spec__.loader = _EditingLoader(module.__spec__.loader)  # type: ignore[assignment]
        _rebind({id(old): (old, vars(module)[key]) for key, old in before.items() if vars(module).get(key) is not old})
        done.append(name)
    return done


def _rebind(replaced: Dict[int, Tuple[Any, Any]]) -> None:
    """Rebind every ``nemo`` module's names of the ``replaced`` objects (``id(old) -> (old, new)``), and rebase the
    subclasses of replaced classes defined elsewhere."""
    for loaded_name, loaded in list(sys.modules.items()):
        if loaded is not None and (loaded_name == "nemo" or loaded_name.startswith("nemo.")):
            for key, value in list(vars(loaded).items()):
                if id(value) in replaced and replaced[id(value)][0] is value:
                    setattr(loaded, key, replaced[id(value)][1])
    for old, new in replaced.values():
        subclasses: List[type] = old.__subclasses__() if isinstance(old, type) else []
        for subclass in subclasses:
            if id(subclass) not in replaced:
                subclass.__bases__ = tuple(new if base is old else base for base in subclass.__bases__)
