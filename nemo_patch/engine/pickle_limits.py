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

"""Bounds on what a ``.metadata`` pickle may make the unpickler build: checked before anything is built, and counted
while it is built.

:mod:`.dcp_metadata` resolves only allowlisted names, but an allowlisted pickle can still cost
unbounded memory or crash the interpreter: a memo index near 2**32 makes CPython allocate a memo array of that size,
and a deeply nested tuple used as a dict key crashes it in C recursion. :func:`prescan_pickle` walks the opcodes with
``pickletools.genops`` (no object is made) and refuses such files. A few bytes can also build many elements: the
allowlisted ``torch.Size`` applied again and again to one memoised list of N items builds N elements per 3-byte
``BINGET, TUPLE1, REDUCE``, so memory grew with the square of the file's size. :func:`element_bounded` makes an
unpickler class that counts the elements it builds (each container's items, each object's state, not the opcodes)
and stops at :data:`MAX_ELEMENTS_PER_BYTE` per byte of the file: memory is then linear in the file's size.
:mod:`.metadata_checks` uses both.

Standard library only.
"""

import io
import pickle
import pickletools
from typing import Any, Callable, Collection, Dict, Sequence

__all__ = ["MAX_ELEMENTS_PER_BYTE", "MAX_NESTING", "element_bounded", "prescan_pickle"]

#: The deepest nesting of containers and objects a ``.metadata`` pickle may build (DCP's is about 8 deep).
MAX_NESTING = 64
_SETTERS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GETTERS = {"GET", "BINGET", "LONG_BINGET"}
_FILLERS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}


def prescan_pickle(data: bytes, max_nesting: int = MAX_NESTING) -> None:
    """Check a pickle's structure before anything is built from it, with ``pickletools.genops`` (no object is made).

    A stack of nesting depths is simulated from each opcode's declared stack effect, so that what the unpickler would
    build is bounded before it builds it:

    * memo indices (``PUT``/``GET`` and their binary forms) must be smaller than the number of opcodes read so far:
      a 9-byte pickle with a memo index near 2**32 makes CPython's unpickler allocate and zero a memo array of that
      size;
    * nesting (a container or object inside another) must stay within ``max_nesting``: hashing a deeply nested
      tuple used as a dict key crashes CPython in C recursion (a segfault, no message).

    Raises:
        pickle.UnpicklingError: naming the byte offset and what is wrong; also for opcodes ``pickletools`` cannot
            parse (a truncated or corrupt file).
    """
    depths: list = []  # nesting depth of each stack item; None marks a MARK
    memo: Dict[int, int] = {}
    count = 0
    try:
        for opcode, arg, position in pickletools.genops(data):
            count += 1
            name = opcode.name
            if name in _SETTERS or name == "MEMOIZE":
                index = len(memo) if name == "MEMOIZE" else arg
                if not isinstance(index, int) or index > count:
                    raise pickle.UnpicklingError(f"memo index {index} at byte {position} of a {len(data)}-byte pickle")
                memo[index] = depths[-1] if depths and depths[-1] is not None else 0
                continue
            if name in _GETTERS:
                if arg not in memo:
                    raise pickle.UnpicklingError(f"memo index {arg} at byte {position} was never stored")
                depths.append(memo[arg])
                continue
            popped: list = []
            for item in reversed(opcode.stack_before):
                if item is pickletools.stackslice:
                    while depths and depths[-1] is not None:
                        popped.append(depths.pop())
                elif item is pickletools.markobject:
                    if not depths or depths[-1] is not None:
                        raise pickle.UnpicklingError(f"{name} at byte {position} finds no MARK")
                    depths.pop()
                elif depths and depths[-1] is not None:
                    popped.append(depths.pop())
                else:
                    raise pickle.UnpicklingError(f"{name} at byte {position} pops an empty stack")
            if name == "MARK":
                depths.append(None)
            elif opcode.stack_after:
                inner = max(popped, default=-1) + 1
                if name in _FILLERS:  # the container stays below what was added to it
                    inner = max(popped[-1], max(popped[:-1], default=-1) + 1)
                if inner > max_nesting:
                    raise pickle.UnpicklingError(
                        f"nesting deeper than {max_nesting} at byte {position}: not DCP metadata"
                    )
                depths.extend([inner] * len(opcode.stack_after))
    except (ValueError, IndexError, KeyError) as error:
        raise pickle.UnpicklingError(f"not a well-formed pickle: {error}") from error


#: The most elements a pickle may build or walk per byte of its file, plus :data:`_SPARE_ELEMENTS`: DCP's metadata
#: counts fewer than one per byte (``torch.Size`` of an int: a few elements from 4 bytes at least).
MAX_ELEMENTS_PER_BYTE = 4
_SPARE_ELEMENTS = 1 << 16
_MADE = ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET")
_APPLIED = ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST")  # a callable applied to arguments it may iterate
_HASHED = ("DICT", "SETITEM", "SETITEMS", "FROZENSET", "ADDITEMS")  # keys hashed: a tuple's hash walks all of it
_CONTAINERS = (tuple, list, dict, set, frozenset)


def _size(value: Any) -> int:
    return 1 + (len(value) if isinstance(value, _CONTAINERS) else 0)


def _walked(values: Collection[Any], limit: int) -> int:
    """The elements reachable from ``values`` through built-in containers, each container counted as often as it is
    reached (hashing a tuple or iterating an argument walks it each time), counting stopped once past ``limit``."""
    count = len(values)
    pending = list(values) if count <= limit else []
    while pending and count <= limit:
        value = pending.pop()
        if isinstance(value, _CONTAINERS) and value:
            count += len(value) * (2 if isinstance(value, dict) else 1)
            if count <= limit:
                pending.extend(value.keys() if isinstance(value, dict) else value)
                pending.extend(value.values() if isinstance(value, dict) else ())
    return count


def _dict_items(items: Sequence[Any], limit: int) -> int:
    """Key-value pairs laid out flat (as above a MARK): the keys walked (hashed), the values one each."""
    keys = items[0::2]
    return len(items) - len(keys) + _walked(keys, limit)


def _state(state: Any, limit: int) -> int:
    """What ``BUILD`` walks: the state dict's keys (hashed) and values, and the slot state's."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    count = 1
    for part in parts:
        count += len(part) + _walked(part.keys(), limit) if isinstance(part, dict) else _size(part)
    return count


def _cost_before(self: Any, name: str) -> int:
    """The elements an opcode walks in what is on the stack before it runs (its arguments and the items it adds)."""
    stack, limit = self.stack, self.elements_left
    if name in ("APPEND", "APPENDS"):  # a reference each
        return 1 if name == "APPEND" else len(stack)
    if name == "SETITEM":
        return _dict_items(stack[-2:], limit)
    if name in ("SETITEMS", "DICT"):  # above the MARK: key, value, key, value, ...
        return _dict_items(stack, limit)
    if name in ("FROZENSET", "ADDITEMS"):
        return _walked(stack, limit)
    if name in ("REDUCE", "NEWOBJ"):
        return _walked(stack[-1:], limit)
    if name == "NEWOBJ_EX":
        return _walked(stack[-2:], limit)
    if name in ("OBJ", "INST"):  # the class (OBJ) and the arguments, above the MARK
        return _walked(stack, limit)
    if name == "BUILD":
        return _state(stack[-1], limit)
    return 0


def _counted(load: Callable[[Any], None], name: str) -> Callable[[Any], None]:
    def run(self: Any) -> None:
        count = _cost_before(self, name)
        if count <= self.elements_left:
            load(self)
            if name in _MADE or name in _APPLIED or name in ("DICT", "FROZENSET"):
                count += _size(self.stack[-1])  # what it built
        self.elements_left -= count
        if self.elements_left < 0:
            raise pickle.UnpicklingError(
                f"the pickle builds more than {self.element_budget} elements (items and fields) from its "
                f"{self.file_bytes} bytes: not DCP metadata"
            )

    return run


def element_bounded(unpickler: type) -> type:
    """A subclass of ``unpickler`` (a ``pickle._Unpickler``, the pure-Python one) that counts the elements it builds
    and walks, and raises ``pickle.UnpicklingError`` beyond ``MAX_ELEMENTS_PER_BYTE`` per byte of its file (a
    seekable stream), plus a constant, before the opcode that would pass the bound runs.

    Counted: the items of each container it makes (``TUPLE``, ``LIST``, ``DICT``, ...), each item added to one
    (``APPEND(S)``, ``SETITEM(S)``, ``ADDITEMS``), each object's state (``BUILD``), and for an allowlisted callable
    applied to arguments (``REDUCE``, ``NEWOBJ``, ...: ``torch.Size``, ``set``, ``frozenset``) every element of its
    arguments, nested containers included, and what it returns; keys that are hashed are walked the same way (a
    tuple's hash is not cached). So ``set`` applied again and again to one memoised list costs the list's length each
    time, though each result holds one element.
    """
    dispatch = dict(unpickler.dispatch)  # type: ignore[attr-defined]
    for name in (*_MADE, *_APPLIED, *_HASHED, "APPEND", "APPENDS", "BUILD"):
        code = getattr(pickle, name)[0]
        if code in dispatch:
            dispatch[code] = _counted(dispatch[code], name)

    def __init__(self: Any, file: io.BufferedIOBase, *args: Any, **kwargs: Any) -> None:
        base: Any = unpickler
        base.__init__(self, file, *args, **kwargs)
        start = file.tell()
        size = file.seek(0, io.SEEK_END) - start
        file.seek(start)
        self.file_bytes, self.element_budget = size, MAX_ELEMENTS_PER_BYTE * size + _SPARE_ELEMENTS
        self.elements_left = self.element_budget

    return type(f"ElementBounded{unpickler.__name__}", (unpickler,), {"dispatch": dispatch, "__init__": __init__})
