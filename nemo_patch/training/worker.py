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

"""The consolidation process: ``python -m nemo_patch.training.worker <ckpt> --global-step N --settings JSON``.

Started by :class:`nemo_patch.training.queue.ConsolidationQueue` for one checkpoint, or ahead of time with ``--wait``
instead of a checkpoint: it then imports everything a consolidation needs and waits for its one request, a JSON line
``{"checkpoint": path, "global_step": n, "best": {...} | null}`` on stdin (end of input: it exits 0 having done
nothing). That is how the queue keeps the interpreter's start (about 2 s, mostly ``import torch``; more for the
``hf`` format, which imports NeMo) off the path of each request while every consolidation still has a process of its
own. It lowers its own CPU priority
(:data:`WORKER_NICENESS`) before importing torch, then runs the engine
(:func:`nemo_patch.engine.consolidate.consolidate_checkpoint`) or, for ``output_format="hf"``, the Hugging Face export
(:func:`nemo_patch.export.hf.export_hf_checkpoint`, which imports NeMo in this process to find the model's exporter).
It reads only files and uses no ``torch.distributed`` process group or collective (a consolidation calling a
collective on the training communicator is a known way to hang a run).

Must not import NeMo, Lightning or megatron-core itself (an import-linter contract in ``setup.cfg``; the ``hf``
export is the one, explicit, exception), so that the default ``safetensors`` consolidation starts in about the time
of ``import torch``.
"""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from nemo_patch.training.settings import WORKER_NICENESS, ConsolidationSettings

__all__ = ["WORKER_NICENESS", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The consolidation process's command line (see :func:`main`)."""
    parser = argparse.ArgumentParser(description="Consolidate one NeMo 2 distributed checkpoint (nemo_patch worker).")
    parser.add_argument("checkpoint", type=Path, nargs="?", default=None)
    parser.add_argument("--global-step", type=int, default=None)
    parser.add_argument("--best", type=json.loads, default=None)
    parser.add_argument("--wait", action="store_true", help="import, then read the request from stdin")
    parser.add_argument("--settings", type=ConsolidationSettings.from_json, default=ConsolidationSettings())
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Consolidate one checkpoint; on failure print one line (the reason) and return 1.

    Args:
        argv: ``<checkpoint dir> [--global-step N] [--best JSON] [--settings JSON]``, or ``--wait [--settings
            JSON]`` to read ``{"checkpoint", "global_step", "best"}`` from one stdin line. ``--best``: the checkpoint
            is the best by the monitored metric, ``{"monitor", "value", "mode"}``, recorded in ``metadata.json``;
            settings ``JSON`` from :meth:`ConsolidationSettings.to_json`, default settings when absent.

    Returns:
        The process exit code: 0 on success, 1 on a :class:`nemo_patch.engine.errors.ConsolidationError`.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.checkpoint is None) != args.wait:
        parser.error("give either a checkpoint or --wait")
    settings: ConsolidationSettings = args.settings
    try:
        os.nice(WORKER_NICENESS)  # before torch is imported: the import is CPU time too
    except OSError:  # a sandbox that forbids it; consolidation still works at the same priority
        pass
    # torch's own import warns about an old NVML binding on some machines; keep the process's output to its reason.
    warnings.filterwarnings("ignore", message=r"The pynvml package is deprecated", category=FutureWarning)
    import torch

    from nemo_patch.engine.errors import ConsolidationError
    from nemo_patch.engine.output_layout import DTYPE_NAMES

    consolidate: Callable[..., Any]
    if settings.output_format == "hf":
        from nemo_patch.export.hf import export_hf_checkpoint as consolidate

        if args.wait:
            _import_quietly("nemo.collections.llm")  # what finding the model's exporter imports; the slow part
    else:
        from nemo_patch.engine.consolidate import consolidate_checkpoint as consolidate
    if args.wait:
        line = sys.stdin.readline()
        if not line.strip():
            return 0  # the queue no longer needs this process
        request = json.loads(line)
        args.checkpoint, args.global_step = Path(request["checkpoint"]), request.get("global_step")
        args.best = request.get("best")
    options: Dict[str, Any] = {}
    if settings.output_format != "hf":  # the Hugging Face export writes through transformers, in this process
        from nemo_patch.engine.parts import default_workers

        options["workers"] = settings.workers or default_workers(share=4)
        if settings.nodes > 1:
            from nemo_patch.training.node_parts import FilePartsRunner

            runner = FilePartsRunner(settings.nodes, options["workers"], settings.timeout)
            options.update(parts=runner.parts(), parts_runner=runner)
    try:
        dtype = None if settings.dtype is None else getattr(torch, DTYPE_NAMES[settings.dtype])
        consolidate(
            args.checkpoint,
            global_step=args.global_step,
            max_shard_size=settings.max_shard_size,
            dtype=dtype,
            merge_adapters=settings.merge_adapters,
            best=args.best,
            **options,
        )
    except ConsolidationError as error:
        print(f"ConsolidationError: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _import_quietly(module: str) -> None:
    """Import ``module`` ahead of the request; a failure is left for the request itself to report."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - reported by the consolidation that needs it
        pass


if __name__ == "__main__":
    sys.exit(main())
