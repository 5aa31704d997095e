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

A consolidation allocates every output tensor, and ``torch.load`` every stored chunk, afresh: with 4 KiB pages each
first touch of each page is a page fault, one per 4 KiB of the checkpoint, twice. torch's CPU allocator (c10) has a
switch for that, the environment variable ``THP_MEM_ALLOC_ENABLE=1``: allocations of 2 MiB or more are then marked
``madvise(MADV_HUGEPAGE)`` (``hg`` in the mapping's ``VmFlags``, proc(5)), so the kernel maps them 2 MiB at a time
where THP is enabled (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``; with ``never``
nothing changes). Measured with ``scripts/bench_consolidation.py``'s 2.55 GB checkpoint on 2 cores: page faults fell
from about 520,000 to 42,000 per consolidation and one writer's wall time by about 20%.

c10 reads the variable once, at the process's first CPU tensor allocation (seen with torch 2.13: ``import torch``
makes none, but a library imported after it may), so :func:`prefer_huge_pages` runs before torch is imported. The
entry points of the processes that exist only to consolidate call it (the run's consolidation process,
``nemo-consolidate``); a training process never does, so its
allocator stays exactly as its user set it up. Writer processes inherit it (fork, or the environment of
the forkserver). A value the user set, ``0`` included, is kept.

Standard library only.
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
