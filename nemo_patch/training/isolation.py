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

"""The consolidation process kept apart from the training job on a GPU node (Linux): no rank of the job (a library
looking for the rank variables must not find them), no GPU visible (no CUDA context on a training rank's GPU), the OOM
killer's first choice, dead with the training process that started it. Its writers inherit all of it.
"""

import os
import threading
from typing import Dict, List, Mapping, Optional

from nemo_patch.engine.huge_pages import prefer_huge_pages
from nemo_patch.engine.process_limits import die_with_parent, raise_oom_score

__all__ = ["environment", "parent_arguments", "set_up"]

#: The training job's rank variables (torchrun, Lightning, SLURM, MPI), and prefixes of more.
_PROCESS_GROUP_VARIABLES = tuple(
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME "
    "NODE_RANK MASTER_ADDR MASTER_PORT SLURM_PROCID SLURM_LOCALID SLURM_NODEID SLURM_NTASKS SLURM_NPROCS "
    "OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_SIZE PMI_RANK "
    "PMI_SIZE PMIX_RANK".split()
)
_PROCESS_GROUP_PREFIXES = ("TORCHELASTIC_",)


def environment(environ: Mapping[str, str]) -> Dict[str, str]:
    """The consolidation process's environment: ``environ`` without the rank variables, with no GPU visible."""
    env = {
        name: value
        for name, value in environ.items()
        if name not in _PROCESS_GROUP_VARIABLES and not name.startswith(_PROCESS_GROUP_PREFIXES)
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def parent_arguments() -> List[str]:
    """``--parent <this pid>`` when the main thread starts the process (the death signal follows the thread that
    starts it, so only the main thread, which lives as long as the process, asks for it)."""
    return ["--parent", str(os.getpid())] if threading.current_thread() is threading.main_thread() else []


def set_up(parent: Optional[int]) -> None:
    """In the consolidation process, before torch: the OOM killer's first choice, dead with ``parent``, huge pages."""
    raise_oom_score()
    if parent is not None:
        die_with_parent(parent)
    prefer_huge_pages()
