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

"""The opcodes of a ``.metadata`` pickle, checked before anything is built from them (:func:`prescan`).

An allowlisted pickle (:mod:`.dcp_metadata`) can still cost unbounded memory or time or harm the interpreter. One
pass over the opcodes, making no object, refuses: a memo index past the memo's end (``LONG_BINPUT`` 2**30 allocates
a memo array of that size); nesting deeper than :data:`MAX_NESTING` (hashing it crashes CPython in C recursion);
walking more than :data:`MAX_ELEMENTS_PER_BYTE` elements per byte of the file (``torch.Size`` applied again and again
to one memoised list copies it each time: what a callable is given, a hashed key and an object's state count as
walked); ``BUILD`` on anything but an object ``NEWOBJ`` just made (on a class it changes it process-wide); and
changing a container or object once the memo referenced it (its count would be stale; so no cycle can be made).
"""

import pickle
from typing import List, NoReturn, Tuple

__all__ = ["MAX_ELEMENTS_PER_BYTE", "MAX_NESTING", "prescan"]

#: The deepest nesting of containers and objects a ``.metadata`` pickle may build (DCP's is about 8 deep).
MAX_NESTING = 64
#: The most elements a pickle may walk per byte of its file, plus 65,536 (DCP's metadata: fewer than one).
MAX_ELEMENTS_PER_BYTE = 4
_ATOMS = {op: size for ops, size in ((b"N\x88\x89)", 0), (b"K", 1), (b"M", 2), (b"J", 4), (b"G", 8)) for op in ops}
_PREFIXED = {op: size for ops, size in ((b"\x8cUC\x8a", 1), (b"XTB\x8b", 4), (b"\x8d\x8e\x96", 8)) for op in ops}
_MEMO = {op: size for ops, size in ((b"q", 1), (b"r", 4), (b"gp", 0)) for op in ops}  # 0: a text line
_LINES = {op: lines for ops, lines in ((b"ILFSV", 1), (b"c", 2)) for op in ops}  # text arguments, one per line
_ATOM = 1 << 7  # an item's code: (elements << 7) | depth


def _refuse(message: str) -> NoReturn:
    raise pickle.UnpicklingError(message)


def prescan(data: bytes) -> int:  # noqa: C901 - one loop over the opcodes, for speed
    """Check a pickle's opcodes before anything is built from them (see the module docstring), in one pass.

    Each stack item is an int: its code, ``(elements << 7) | depth``, for what cannot change, or ``~n`` for the n-th
    container or new object: ``cells[n]`` its code, ``sizes[n]`` its items at most, ``states[n]`` 0 when new from
    ``NEWOBJ``, 1 for a container, 2 once referenced from the memo (it may no longer change).

    Returns:
        The elements the pickle makes the unpickler walk (at most :data:`MAX_ELEMENTS_PER_BYTE` per byte, plus 65,536).

    Raises:
        pickle.UnpicklingError: naming the byte offset and what is wrong; also for a truncated or corrupt file and
            opcodes DCP does not write (persistent ids, extensions, ``DUP``, ``INST``, ``OBJ``, ``NEWOBJ_EX``,
            ``POP_MARK``, out-of-band buffers).
    """
    budget = MAX_ELEMENTS_PER_BYTE * len(data) + (1 << 16)
    too_many = f"the pickle builds more than {budget} elements (items and fields) from its {len(data)} bytes"
    limit = budget << 7 | MAX_NESTING  # a code above it holds too many elements
    stack: List[int] = []
    marks: List[int] = []
    memo: List[int] = []
    cells: List[int] = []
    sizes: List[int] = []
    states = bytearray()
    push, pop, walked, i = stack.append, stack.pop, 0, 0

    def made(elements: int, depth: int) -> int:
        if depth > MAX_NESTING:
            _refuse(f"nesting deeper than {MAX_NESTING} at byte {i}: not DCP metadata")
        if elements > budget:
            _refuse(too_many)
        return elements << 7 | depth

    def count(items: List[int]) -> Tuple[int, int]:
        elements = depth = 0
        for item in items:
            code = item if item >= 0 else cells[~item]
            elements, depth = elements + (code >> 7), max(depth, code & 127)
        return elements, depth

    def changed(target: int, items: List[int]) -> int:
        if target >= 0 or states[~target] == 2:
            _refuse(f"refusing to change an immutable or shared object at byte {i}: not DCP metadata")
        elements, depth = count(items)
        code, sizes[~target] = cells[~target], sizes[~target] + len(items)
        cells[~target] = made((code >> 7) + elements, max(code & 127, depth + 1))
        return elements

    try:
        while True:
            op = data[i]
            i += 1
            if op == 0x94:  # MEMOIZE
                memo.append(stack[-1])
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                item = memo[data[i] if op == 0x68 else int.from_bytes(data[i : i + 4], "little")]
                i += 1 if op == 0x68 else 4
                if item < 0:
                    states[~item] = 2
                push(item)
            elif op == 0x4B:  # BININT1
                push(_ATOM)
                i += 1
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op in _ATOMS:
                push(_ATOM)
                i += _ATOMS[op]
            elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE: a callable applied to its arguments
                item = pop()
                code = item if item >= 0 else cells[~item]
                stack[-1], walked = ~len(cells), walked + (code >> 7)
                cells.append(code + _ATOM)
                sizes.append(code >> 7)
                states.append(op == 0x52)
            elif op == 0x62:  # BUILD: a state used once has its items copied, a shared one is walked whole
                item, target = pop(), stack[-1]
                if target >= 0 or states[~target]:
                    _refuse(f"refusing to set the state of a type, a global or a shared object (BUILD at byte {i})")
                code, old = item if item >= 0 else cells[~item], cells[~target]
                cells[~target] = made((old >> 7) + (code >> 7), max(old & 127, (code & 127) + 1))
                walked += sizes[~item] if item < 0 and states[~item] != 2 else code >> 7
            elif op == 0x75:  # SETITEMS: the keys hashed
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                changed(stack[-1], items)
                walked += sum(key if key >= 0 else cells[~key] for key in items[0::2]) >> 7  # at least their elements
            elif op == 0x85 or op == 0x86:  # TUPLE1, TUPLE2
                item = stack[-1]
                code = (item if item >= 0 else cells[~item]) + _ATOM + 1
                if op == 0x86:
                    item = pop()
                    other = stack[-1] if stack[-1] >= 0 else cells[~stack[-1]]
                    code = (code + (other & ~127)) & ~127 | max(code & 127, (other & 127) + 1)
                if code & 127 > MAX_NESTING or code > limit:
                    made(code >> 7, code & 127)
                stack[-1] = code
            elif op in b"}]\x8f":  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
                push(~len(cells))
                cells.append(_ATOM)
                sizes.append(0)
                states.append(1)
            elif op in _PREFIXED:
                size = _PREFIXED[op]
                i += size + int.from_bytes(data[i : i + size], "little")
                push(_ATOM)
            elif op == 0x87:  # TUPLE3
                elements, depth = count(stack[-3:])
                del stack[-3:]
                push(made(elements + 1, depth + 1))
            elif op in b"tld\x91e\x90":  # from the items above the last MARK
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                if op in b"e\x90":  # APPENDS, ADDITEMS (all hashed)
                    elements = changed(stack[-1], items)
                    walked += elements if op == 0x90 else 0
                else:  # TUPLE, LIST, DICT (the keys hashed), FROZENSET (all hashed)
                    elements, depth = count(items)
                    walked += count(items[0::2])[0] if op == 0x64 else elements if op == 0x91 else 0
                    push(made(elements + 1, depth + 1))
                    if op in b"ld":
                        cells.append(stack[-1])
                        sizes.append(len(items))
                        states.append(1)
                        stack[-1] = ~(len(cells) - 1)
            elif op in b"as":  # APPEND, SETITEM (the key hashed)
                items = [pop() for _ in range(2 if op == 0x73 else 1)][::-1]
                elements = changed(stack[-1], items)
                walked += count(items[:1])[0] if op == 0x73 else 0
            elif op in _MEMO:  # GET, PUT, BINPUT, LONG_BINPUT
                size = _MEMO[op] or data.index(b"\n", i) + 1 - i
                index = int(data[i : i + size]) if op in b"gp" else int.from_bytes(data[i : i + size], "little")
                i += size
                if op == 0x67:
                    item = memo[index]
                    if item < 0:
                        states[~item] = 2
                    push(item)
                elif index > len(memo):
                    _refuse(f"memo index {index} at byte {i} of a {len(data)}-byte pickle")
                else:
                    memo[index : index + 1] = [stack[-1]]
            elif op in _LINES:
                for _ in range(_LINES[op]):
                    i = data.index(b"\n", i) + 1
                push(_ATOM)
            elif op == 0x93:  # STACK_GLOBAL
                del stack[-2:]
                push(_ATOM)
            elif op == 0x30:  # POP (a MARK on top is popped instead)
                _ = marks.pop() if marks and marks[-1] == len(stack) else pop()
            elif op == 0x95 or op == 0x80:  # FRAME, PROTO
                i += 8 if op == 0x95 else 1
            elif op == 0x2E:  # STOP
                return walked
            else:
                _refuse(f"opcode {bytes([op])!r} at byte {i - 1} is not one DCP metadata uses")
            if walked > budget:
                _refuse(too_many)
    except (IndexError, ValueError) as error:
        raise pickle.UnpicklingError(f"not a well-formed pickle at byte {i}: {error}") from error
