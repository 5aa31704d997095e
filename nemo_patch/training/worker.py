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

"""The consolidation process: ``python -m nemo_patch.training.worker --serve --settings JSON``.

Started once per run by :class:`nemo_patch.training.queue.ConsolidationQueue`, it imports everything a consolidation
needs, writes ``{"ready": true}`` on stdout, then serves requests until its stdin ends: one JSON line per request on
stdin, ``{"checkpoint": path, "global_step": n, "best": {...} | null}``, and one JSON line per ended request on
stdout, ``{"error": null | "<one-line reason>"}``. Anything else printed (by this process, torch or the engine) goes to
stderr: fd 1 is redirected to fd 2 before anything is imported, and the result lines go to a private copy of the
original stdout. With a post command (``ConsolidationConfig.post_command``), a request whose output was published
first gets the line ``{"published": true}``, then the command runs here
(:func:`nemo_patch.engine.post_command.run_post_command`), and its result line carries ``"post_command"``: the
JSON form of :class:`~nemo_patch.engine.post_command.PostCommandResult`. A SIGTERM while the command runs (the end of
``fit`` stopped waiting) stops the command's process group, answers with its result (``stopped``) and ends this
process. So the interpreter's start (2-5 s, mostly ``import torch``; more for the ``hf`` format, which
imports NeMo) is paid once per run instead of once per checkpoint. ``python -m nemo_patch.training.worker <ckpt>
--global-step N`` consolidates one checkpoint and exits (0, or 1 with the reason on stderr).

A request that fails with a :class:`~nemo_patch.engine.errors.ConsolidationError` is answered with its reason and the
process serves the next one; any other exception is answered too, then ends the process (exit 1, traceback on
stderr), and the queue starts a fresh one for the next request.

It imports at the CPU priority it was started with, so that it is ready by the first finished checkpoint (a start
paid once per run), then lowers its priority (:data:`WORKER_NICENESS`) for the consolidations, and runs the engine
(:func:`nemo_patch.engine.consolidate.consolidate_checkpoint`) or, for ``format="hf"``, the Hugging Face export
(:func:`nemo_patch.export.hf.export_hf_checkpoint`, which imports NeMo in this process to find the model's exporter).
It reads only files and uses no ``torch.distributed`` process group or collective (a consolidation calling a
collective on the training communicator is a known way to hang a run). On a GPU node it touches no GPU and is the OOM
killer's first choice: the queue starts it with ``CUDA_VISIBLE_DEVICES=""`` and without the training job's rank
variables, and it raises its ``oom_score_adj`` (+500) before importing anything and, given ``--parent PID``, dies with
that process (``PR_SET_PDEATHSIG``; :mod:`nemo_patch.engine.process_limits`); its writers inherit all of it.

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
from typing import IO, Any, Callable, Dict, List, Optional

from nemo_patch.engine.huge_pages import prefer_huge_pages
from nemo_patch.engine.process_limits import die_with_parent, raise_oom_score
from nemo_patch.training.settings import WORKER_NICENESS, ConsolidationSettings

try:  # a later addition: a command run after each output is published (ConsolidationConfig.post_command)
    from nemo_patch.training import hooks
except ModuleNotFoundError as missing:  # pragma: no cover
    if not str(missing.name).startswith(__package__):
        raise
    hooks = None  # type: ignore[assignment]

__all__ = ["WORKER_NICENESS", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The consolidation process's command line (see :func:`main`)."""
    parser = argparse.ArgumentParser(description="Consolidate NeMo 2 distributed checkpoints (nemo_patch worker).")
    parser.add_argument("checkpoint", type=Path, nargs="?", default=None)
    parser.add_argument("--global-step", type=int, default=None)
    parser.add_argument("--best", type=json.loads, default=None)
    parser.add_argument("--serve", action="store_true", help="import, then serve JSON requests from stdin")
    parser.add_argument("--settings", type=ConsolidationSettings.from_json, default=ConsolidationSettings())
    parser.add_argument("--parent", type=int, default=None, help="die (SIGKILL) when this process dies")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Consolidate one checkpoint, or serve requests (``--serve``) until the end of stdin.

    Args:
        argv: ``<checkpoint dir> [--global-step N] [--best JSON] [--settings JSON]``, or ``--serve [--settings
            JSON]`` to read ``{"checkpoint", "global_step", "best"}`` lines from stdin. ``--best``: the checkpoint
            is the best by the monitored metric, ``{"monitor", "value", "mode"}``, recorded in ``metadata.json``;
            settings ``JSON`` from :meth:`ConsolidationSettings.to_json`, default settings when absent;
            ``--parent PID``: the process that started this one, which this one dies with.

    Returns:
        The process exit code. One checkpoint: 0 on success, 1 on a
        :class:`nemo_patch.engine.errors.ConsolidationError` (its reason printed on stderr). ``--serve``: 0 at the
        end of stdin; an exception other than ``ConsolidationError`` propagates after its result line is written.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.checkpoint is None) != args.serve:
        parser.error("give either a checkpoint or --serve")
    raise_oom_score()  # the OOM killer picks this process and its writers (they inherit it) before a training rank
    if args.parent is not None:
        die_with_parent(args.parent)  # a training process that dies leaves no consolidation behind
    results: Optional[IO[str]] = None
    if args.serve:  # fd 1 carries result lines only: a private copy of it for them, stderr for everything else
        sys.stdout.flush()
        results = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
    settings: ConsolidationSettings = args.settings
    # torch's own import warns about an old NVML binding on some machines; keep the process's output to its reason.
    warnings.filterwarnings("ignore", message=r"The pynvml package is deprecated", category=FutureWarning)
    prefer_huge_pages()  # before torch is imported: this process exists to consolidate
    consolidate = _consolidator(settings, preload=args.serve)
    try:
        os.nice(_niceness())  # the consolidations yield to the training job's threads
    except OSError:  # a sandbox that forbids it; consolidation still works at the same priority
        pass
    if results is None:
        error = consolidate(args.checkpoint, args.global_step, args.best)
        if error is not None:
            print(error, file=sys.stderr, flush=True)
        elif settings.config.post_command is not None and hooks is not None:
            done, _ = hooks.run_post_command(settings, args.checkpoint, args.global_step)
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
            error = consolidate(Path(request["checkpoint"]), request.get("global_step"), request.get("best"))
        except BaseException as unexpected:  # answered, then raised: the process ends, the next request gets a new one
            results.write(json.dumps({"error": f"{type(unexpected).__name__}: {unexpected}"}) + "\n")
            raise
        reply: Dict[str, Any] = {"error": error}
        stopped = False
        if error is None and settings.config.post_command is not None and hooks is not None:
            results.write(json.dumps({"published": True}) + "\n")  # a death from here on leaves the output published
            done, stopped = hooks.run_post_command(settings, Path(request["checkpoint"]), request.get("global_step"))
            reply["post_command"] = done.to_json()
        results.write(json.dumps(reply) + "\n")
        if stopped:
            return 0  # asked to end (SIGTERM) while the command ran: answered, now end


def _consolidator(
    settings: ConsolidationSettings, preload: bool
) -> Callable[[Path, Optional[int], Optional[Dict[str, Any]]], Optional[str]]:
    """Import what consolidating with ``settings`` needs; return ``consolidate(checkpoint, global_step, best)``,
    which returns ``None`` or the one-line reason of a :class:`~nemo_patch.engine.errors.ConsolidationError`."""
    import torch

    from nemo_patch.engine.errors import ConsolidationError
    from nemo_patch.engine.output_layout import DTYPE_NAMES

    run: Callable[..., Any]
    if settings.config.format == "hf":
        from nemo_patch.export.hf import export_hf_checkpoint as run

        if preload:
            _import_quietly("nemo.collections.llm")  # what finding the model's exporter imports; the slow part
    else:
        from nemo_patch.engine.consolidate import consolidate_checkpoint as run
    dtype = None if settings.config.dtype is None else getattr(torch, DTYPE_NAMES[settings.config.dtype])

    def consolidate(checkpoint: Path, global_step: Optional[int], best: Optional[Dict[str, Any]]) -> Optional[str]:
        options: Dict[str, Any] = {}
        if settings.config.format != "hf":  # the Hugging Face export writes through transformers, in this process
            from nemo_patch.engine.parts import default_workers

            options["workers"] = settings.config.workers or default_workers(share=4)
        try:
            run(
                checkpoint,
                global_step=global_step,
                max_shard_size=settings.config.max_shard_size,
                dtype=dtype,
                merge_adapters=settings.config.merge_adapters,
                best=best,
                **options,
            )
        except ConsolidationError as error:
            return f"ConsolidationError: {error}"
        return None

    return consolidate


def _niceness() -> int:
    """:data:`WORKER_NICENESS`, or ``NEMO_PATCH_WORKER_NICENESS`` (an int from 0 to 19) when set: e.g. 0 where the
    consolidation should not yield to the node's other processes. Any other value is ignored, as is one that is not
    ASCII digits (``"²"`` is a digit to ``str.isdigit`` but not to ``int``) or has too many for ``int``."""
    value = os.environ.get("NEMO_PATCH_WORKER_NICENESS", "").strip()
    try:
        niceness = int(value) if value.isascii() and value.isdigit() else -1
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        niceness = -1
    return niceness if 0 <= niceness <= 19 else WORKER_NICENESS


def _import_quietly(module: str) -> None:
    """Import ``module`` ahead of the request; a failure is left for the request itself to report."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - reported by the consolidation that needs it
        pass


if __name__ == "__main__":
    sys.exit(main())
