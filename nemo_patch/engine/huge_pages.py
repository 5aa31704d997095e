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

"""Let torch back a consolidation's large tensors with transparent huge pages (THP).

With ``THP_MEM_ALLOC_ENABLE=1`` torch's CPU allocator (c10) marks allocations of 2 MiB or more
``madvise(MADV_HUGEPAGE)``: far fewer page faults for the output tensors and stored chunks a consolidation allocates
afresh (``docs/benchmarks.md``). c10 reads the variable once, at the first CPU tensor allocation, so
:func:`prefer_huge_pages` runs before torch is imported, in the processes that exist only to consolidate (never in a
training process); writer processes inherit it. A value the user set, ``0`` included, is kept. Standard library only.
"""

import os
import sys

__all__ = ["THP_VARIABLE", "prefer_huge_pages"]

#: torch's switch for ``MADV_HUGEPAGE`` on CPU allocations of 2 MiB or more (c10 ``alloc_cpu``).
THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for this process and its children, unless the environment already sets it.

    Returns:
        ``True`` when it set the variable before torch was imported, so that it surely takes effect in this process;
        ``False`` when the environment already had a value (kept) or torch was already imported (c10 may have read
        the variable by then; child processes get it either way).
    """
    if THP_VARIABLE in os.environ:
        return False
    os.environ[THP_VARIABLE] = "1"
    return "torch" not in sys.modules
