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

"""The consolidation process: ``python -m <package>.worker --serve --settings JSON``.

Started once per run by :class:`.queue.ConsolidationQueue` (protocol there), it lowers its CPU priority, imports what
a consolidation needs, says it is ready and serves requests until its stdin ends. A ``ConsolidationError`` is answered
with its reason; any other exception is answered, then ends the process. Never imports NeMo, Lightning or
megatron-core. An ``--extension`` module's ``extend_worker(parent)`` runs first.
"""

import argparse
import importlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Tuple

from nemo_patch.training.settings import WORKER_NICENESS, ConsolidationSettings

__all__ = ["AFTER_PUBLISH", "CONSOLIDATORS", "NICENESS_VARIABLE", "PROCESS_LAUNCHERS", "WORKER_NICENESS"]
__all__ += ["build_parser", "main"]

#: The environment variable that sets the process's niceness (NeMo's tree: ``NEMO_CONSOLIDATION_WORKER_NICENESS``).
NICENESS_VARIABLE = "NEMO_PATCH_WORKER_NICENESS"
#: Extensions' ``launch(args, environ) -> (args, environ)``, applied before the queue starts the process; none here.
PROCESS_LAUNCHERS: List[Callable[[List[str], Mapping[str, str]], Tuple[List[str], Mapping[str, str]]]] = []
#: Extensions' ``consolidator(settings, preload) -> (run, options)``, or ``None`` where they leave ``settings`` to the
#: engine: ``run(checkpoint, dtype=..., global_step=..., max_shard_size=..., **options)`` consolidates (the first
#: answer counts; none here: the engine's ``consolidate_checkpoint`` with ``workers``).
CONSOLIDATORS: List[Callable[[ConsolidationSettings, bool], Optional[Tuple[Callable[..., Any], Dict[str, Any]]]]] = []
#: Extensions' ``after_publish(settings) -> runner``, or ``None``: ``runner(settings, checkpoint, global_step) ->
#: (result, stop)`` runs after each published output (``result.to_json()`` goes into the reply, ``result.describe()``
#: to stderr; ``stop``: end the process once answered); none here.
AFTER_PUBLISH: List[Callable[[ConsolidationSettings], Optional[Callable[..., Tuple[Any, bool]]]]] = []


def build_parser() -> argparse.ArgumentParser:
    """The consolidation process's command line (see :func:`main`)."""
    parser = argparse.ArgumentParser(
        description="Consolidate NeMo 2 distributed checkpoints (the consolidation process)."
    )
    parser.add_argument("checkpoint", type=Path, nargs="?", default=None)
    parser.add_argument("--global-step", type=int, default=None)
    parser.add_argument("--best", type=json.loads, default=None)
    parser.add_argument("--run", default=None, help="the training run's id, for metadata.json")
    parser.add_argument("--serve", action="store_true", help="import, then serve JSON requests from stdin")
    parser.add_argument("--settings", type=ConsolidationSettings.from_json, default=ConsolidationSettings())
    parser.add_argument("--parent", type=int, default=None, help="the training process that started this one")
    parser.add_argument("--extension", action="append", default=[], help="a module with extend_worker(parent)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Consolidate one checkpoint, or serve requests (``--serve``) until the end of stdin.

    Args:
        argv: ``<checkpoint dir> [--global-step N] [--best JSON] [--run ID] [--settings JSON]``, or ``--serve
            [--settings JSON]`` (``--best``: the best-checkpoint record for ``metadata.json``, ``--run``: the
            training run's id recorded there; settings from :meth:`ConsolidationSettings.to_json`).

    Returns:
        One checkpoint: 0, or 1 on a ``ConsolidationError``. ``--serve``: 0 at the end of stdin.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.checkpoint is None) != args.serve:
        parser.error("give either a checkpoint or --serve")
    for extension in args.extension:  # set up before torch is imported
        importlib.import_module(extension).extend_worker(args.parent)
    results: Optional[IO[str]] = None
    if args.serve:  # fd 1 carries result lines only: a private copy of it for them, stderr for everything else
        sys.stdout.flush()
        results = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
    settings: ConsolidationSettings = args.settings
    # Run with ``python -m``, this file is ``__main__`` and extensions registered in the module as they import it.
    registry = importlib.import_module(__spec__.name) if __spec__ is not None else sys.modules[__name__]
    after_publish = next((run for run in (after(settings) for after in registry.AFTER_PUBLISH) if run), None)
    # torch's own import warns about an old NVML binding on some machines; keep the process's output to its reason.
    warnings.filterwarnings("ignore", message=r"The pynvml package is deprecated", category=FutureWarning)
    _lower_priority(_niceness())  # the consolidations yield to the training job's threads
    consolidate = _consolidator(settings, args.serve, registry.CONSOLIDATORS)
    if results is None:
        error = consolidate(args.checkpoint, args.global_step, args.best, args.run)
        if error is not None:
            print(error, file=sys.stderr, flush=True)
        elif after_publish is not None:
            done, _ = after_publish(settings, args.checkpoint, args.global_step)
            print(done.describe(), file=sys.stderr, flush=True)
        return 0 if error is None else 1
    results.write(json.dumps({"ready": True}) + "\n")
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0  # end of input: the run is over
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            error = consolidate(
                Path(request["checkpoint"]), request.get("global_step"), request.get("best"), request.get("run")
            )
        except BaseException as unexpected:  # answered, then raised: the process ends, the next request gets a new one
            results.write(json.dumps({"error": f"{type(unexpected).__name__}: {unexpected}"}) + "\n")
            raise
        reply: Dict[str, Any] = {"error": error}
        stopped = False
        if error is None and after_publish is not None:
            results.write(json.dumps({"published": True}) + "\n")  # a death from here on leaves the output published
            done, stopped = after_publish(settings, Path(request["checkpoint"]), request.get("global_step"))
            reply["post_command"] = done.to_json()
        results.write(json.dumps(reply) + "\n")
        if stopped:
            return 0  # asked to end (SIGTERM) while the command ran: answered, now end


def _consolidator(
    settings: ConsolidationSettings, preload: bool, consolidators: List[Any]
) -> Callable[[Path, Optional[int], Optional[Dict[str, Any]], Optional[str]], Optional[str]]:
    """Import what consolidating with ``settings`` needs (the first of ``consolidators``, :data:`CONSOLIDATORS`, that
    answers, else the engine); return ``consolidate(checkpoint, global_step, best, run_id)``, which returns ``None`` or
    the one-line reason of a ``ConsolidationError``."""
    import torch

    from nemo_patch.engine.errors import ConsolidationError
    from nemo_patch.engine.output_layout import DTYPE_NAMES

    chosen = next((found for found in (each(settings, preload) for each in consolidators) if found), None)
    if chosen is None:
        from nemo_patch.engine.consolidate import consolidate_checkpoint
        from nemo_patch.engine.parts import default_workers

        chosen = consolidate_checkpoint, {"workers": settings.config.workers or default_workers(share=4)}
    run, more = chosen
    dtype = None if settings.config.dtype is None else getattr(torch, DTYPE_NAMES[settings.config.dtype])

    def consolidate(
        checkpoint: Path, global_step: Optional[int], best: Optional[Dict[str, Any]], run_id: Optional[str]
    ) -> Optional[str]:
        options = {"global_step": global_step, "max_shard_size": settings.config.max_shard_size, **more}
        if best is not None:
            options["best"] = best
        if run_id is not None:
            options["run"] = run_id
        try:
            run(checkpoint, dtype=dtype, **options)
        except ConsolidationError as error:
            return f"ConsolidationError: {error}"
        return None

    return consolidate


def _lower_priority(niceness: int) -> None:
    """``os.nice(niceness)`` (up to 19) for every thread: Linux lowers the calling thread only, and threads started
    earlier (torch's, when a package imported it) keep theirs. A sandbox that forbids it leaves the priority as is."""
    try:
        niceness = os.nice(min(niceness, 19 - os.nice(0)))
        for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
            os.setpriority(os.PRIO_PROCESS, int(task), niceness)
    except (OSError, ValueError):  # also a thread that ended meanwhile
        pass


def _niceness() -> int:
    """:data:`NICENESS_VARIABLE` when it is ASCII digits for 0 to 19, else :data:`WORKER_NICENESS`."""
    value = os.environ.get(NICENESS_VARIABLE, "").strip()
    try:
        niceness = int(value) if value.isascii() and value.isdigit() else -1
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        niceness = -1
    return niceness if 0 <= niceness <= 19 else WORKER_NICENESS


if __name__ == "__main__":
    sys.exit(main())
