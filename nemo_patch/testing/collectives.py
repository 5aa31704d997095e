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

"""The job's collectives around ``fit``, for the end-of-fit test: a short process-group timeout and a barrier after
``fit``, as a script that validates or synchronises after training runs one.

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import datetime
import json
import time
from pathlib import Path
from typing import Any, Dict

from lightning.pytorch.callbacks import Callback

__all__ = ["ProcessGroupTimeout", "barrier_after_fit"]


class ProcessGroupTimeout(Callback):
    """When training starts, on every rank, the job's default process group times out after ``seconds`` (as NCCL's
    10 minutes would, shorter). Set then, after the rendezvous, whose own wait NeMo's timeout would shorten too."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import torch.distributed as dist

        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.seconds))


def barrier_after_fit(out: Path) -> Dict[str, Any]:
    """``torch.distributed.barrier()`` on the job's process group; the outcome (``ok``, ``rank``, ``seconds`` and the
    ``error`` of a failed barrier) is written to ``<out>/after-fit-rank<r>.json`` and returned."""
    import torch.distributed as dist

    rank = dist.get_rank()
    start = time.perf_counter()
    result: Dict[str, Any] = {"ok": True, "rank": rank}
    try:
        dist.barrier()
    except Exception as error:  # noqa: BLE001 - what the test looks for: a process-group timeout
        result.update(ok=False, error=f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}")
    result["seconds"] = time.perf_counter() - start
    (Path(out) / f"after-fit-rank{rank}.json").write_text(json.dumps(result))
    return result
