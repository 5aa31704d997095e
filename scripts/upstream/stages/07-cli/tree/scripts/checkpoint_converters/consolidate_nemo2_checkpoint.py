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

"""Consolidate a finished NeMo 2 distributed checkpoint into unsharded safetensors or a Hugging Face directory.

Usage: ``python scripts/checkpoint_converters/consolidate_nemo2_checkpoint.py <path> [options]``; ``--help`` lists
them (``--format hf``, ``--dtype``, ``--verify``, ``--best``, ``--workers``, ``--post-command``, ...) and the exit
codes. See ``nemo.lightning.io.consolidation.cli.nemo_consolidate``.
"""

import os
import sys
from typing import List, Optional

# torch's allocator reads this at its first allocation: huge pages for the consolidation's large tensors
# (nemo.lightning.io.consolidation.engine.huge_pages); a value the user set is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main(argv: Optional[List[str]] = None) -> int:
    """Run the converter command on ``argv`` (default: the command line); returns its exit code."""
    from nemo.lightning.io.consolidation.cli.nemo_consolidate import main as consolidate

    return consolidate(argv)


if __name__ == "__main__":
    sys.exit(main())
