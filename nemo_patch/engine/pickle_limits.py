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

"""Bounds on what a ``.metadata`` pickle may make the unpickler build, checked before anything is built.

:mod:`.dcp_metadata` resolves only allowlisted names, but an allowlisted pickle can still cost
unbounded memory or crash the interpreter: a memo index near 2**32 makes CPython allocate a memo array of that size,
and a deeply nested tuple used as a dict key crashes it in C recursion. :func:`prescan_pickle` walks the opcodes with
``pickletools.genops`` (no object is made) and refuses such files; :mod:`.dcp_metadata` calls it
when this module is present.

Standard library only.
"""

import pickle
import pickletools
from typing import Dict

__all__ = ["MAX_NESTING", "prescan_pickle"]

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
