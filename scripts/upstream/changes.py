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

"""What differs between a nemo-patch module and its NeMo form, stage by stage (see :mod:`upstream.transforms`).

``until=None``: the upstream form itself (the zarr reader, multi-node writes and the phase language stay in the
overlay; upstream-only fixes). ``until="<stage>"``: held back until that stage of the series lands (an earlier
stage's module without a later stage's feature). Every change is written against the overlay's source text.
"""

from upstream.changes_peft import PEFT
from upstream.changes_retention import RETENTION
from upstream.transforms import Drop, DropArgument, DropKeyword, Edit, Replace

# --- engine/parts.py: the writer pool lands with the "writers" stage; multi-node shares stay in the overlay --------

PARTS_DOC = '''\
"""One consolidation written by several processes: part jobs, and a pool of writer processes on this node.

A consolidation's output files are laid out and created first (:mod:`nemo_patch.engine.safetensors_writer`), then
their tensors are cut into parts (:func:`nemo_patch.engine.part_writer.split_parts`). A :class:`PartJob` is all a
process needs to fill one part: the checkpoint, the temporary output directory and the part's placements, plus the
options that change what is read (dtype, merged adapters). It is plain JSON (:meth:`PartJob.to_json`); whoever runs
it re-plans the outputs from the checkpoint's metadata and checks that the placements agree.

Writer processes are forked from the consolidating process when it can be forked safely (Linux ``fork``; no CUDA
context, no ``torch.distributed`` group and no other thread in it, as in a training run's consolidation process or
the converter script): they start in milliseconds, with torch already imported and the checkpoint's metadata already
read. Otherwise they come from a ``forkserver`` (one fresh interpreter that imports this module once), or are
spawned. Each runs one part with one torch thread; a failure in any part stops the others and fails the whole
consolidation with the part's own error.
"""'''

PARTS_DOC_ENGINE = '''\
"""The parts of a consolidation's output and the process that fills them.

A consolidation's output files are laid out and created first (:mod:`nemo_patch.engine.safetensors_writer`), then
their tensors are cut into parts (:func:`nemo_patch.engine.part_writer.split_parts`). A :class:`PartJob` is all a
process needs to fill one part: the checkpoint, the temporary output directory and the part's placements, plus the
options that change what is read (dtype, merged adapters). It is plain JSON (:meth:`PartJob.to_json`); whoever runs
it re-plans the outputs from the checkpoint's metadata and checks that the placements agree. Here one part is filled
in the consolidating process itself (:func:`run_parts`).
"""'''

FORK_IS_SAFE = '''\
def _fork_is_safe() -> bool:
    """Whether writers may be forked from this process: Linux ``fork``, and nothing in it that a forked child cannot
    carry on: no CUDA context, no ``torch.distributed`` group and no thread besides this one (a child gets copies of
    the other threads' locks, but not the threads). A training run's consolidation process and the converter script
    qualify; a process that built a model on a process group (``--verify`` against a context) does not."""
    import threading

    import torch.distributed

    return (
        "fork" in multiprocessing.get_all_start_methods()
        and not torch.cuda.is_initialized()
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
        and threading.active_count() == 1
    )'''

RUN_PARTS_ENGINE = '''\
def run_parts(
    jobs: Sequence[PartJob], sources: Sources, progress: Optional[Callable[[int], None]] = None
) -> List[PartResult]:
    """Fill ``jobs`` in this process, one after the other.

    Args:
        jobs: the parts.
        sources: this process's :class:`~nemo_patch.engine.tensor_sources.Sources` of the consolidation.
        progress: called with the total bytes written so far.

    Returns:
        One :class:`PartResult` per job, in order.

    Raises:
        ConsolidationError: or a subclass naming the cause (an unreadable shard file names the file).
        OSError: the output files cannot be written.
    """
    done = [0]

    def step(nbytes: int) -> None:
        done[0] += nbytes
        if progress is not None:
            progress(done[0])

    return [run_part(job, sources, step) for job in jobs]'''

CONSOLIDATE_WRITERS = '''\
Writers: the output files are laid out and created before any data is read, then their tensors are cut into parts
that ``workers`` processes on this node fill at once (:mod:`nemo_patch.engine.parts`). The bytes written do not depend
on how many: each tensor lands at the same offset, and ``metadata.json`` records per-tensor digests
(:mod:`nemo_patch.engine.digests`), which every writer computes for what it writes.'''

CONSOLIDATE_ONE_WRITER = '''\
Writing: the output files are laid out and created before any data is read, then their tensors are written at
their offsets (:mod:`nemo_patch.engine.parts`), and ``metadata.json`` records per-tensor digests
(:mod:`nemo_patch.engine.digests`), computed while the tensors are written.'''

# --- engine/checkpoint_reader.py: torch_dist only (the zarr reader stays in the overlay) ----------------------------

READER_DOC = '''\
"""Open a checkpoint's ``torch_dist`` weights for reading.

``torch_dist`` is ``torch.distributed.checkpoint``'s format: ``.metadata`` + ``*.distcp`` shard files
(:mod:`nemo_patch.engine.dcp_metadata`, :mod:`nemo_patch.engine.dcp_reader`). The ``Metadata`` gives the global
shape, dtype and chunks of each key, from which the output is named and planned (:mod:`nemo_patch.engine.plan`); the
reader reads a key, or one index of it along dimension 0, into a given tensor. megatron-core's deprecated ``zarr``
backend is recognised and refused (:mod:`nemo_patch.engine.checkpoint_layout`).
"""'''

# --- training/policy.py: one cadence (the phase language stays in the overlay) ---------------------------------------

POLICY_DOC = '''\
"""When a training run consolidates its distributed checkpoints: the cadence.

This module is the single place where the user-facing ``save_consolidated`` and ``ckpt_consolidation_frequency``
arguments are parsed and validated, once, when :class:`nemo_patch.training.settings.ConsolidationSettings` is made
from the user's values; every other part of the package gets the parsed :class:`ConsolidationPolicy`.

Accepted frequencies (:data:`ACCEPTED_FREQUENCIES`):

* ``"each"``: consolidate every finished checkpoint.
* ``"every_n:<k>"`` with ``k`` an integer >= 1: consolidate the k-th, 2k-th, ... finished checkpoint of the run (the
  count includes saves made before a resume).
* ``"best"``: consolidate a finished checkpoint when it was the best so far by NeMo's ``ModelCheckpoint``
  ``monitor``/``mode`` when it was saved (``ModelCheckpoint.best_model_path`` named it), and keep ``<root>/BEST`` on
  the best consolidated checkpoint; when ``fit`` ends, the run's best finished checkpoint is consolidated if it is
  not yet and ``BEST`` names it.
* ``"latest"``: consolidate nothing during training; when ``fit`` ends, consolidate the newest finished checkpoint.

A policy is a tuple of :class:`CadencePhase` (one, starting at step 0) so that cadences that change at given global
steps can be added later without changing its users.
"""'''

ACCEPTED = (
    '''ACCEPTED_FREQUENCIES = '"each", "latest", "best" or "every_n:<k>" with k an integer >= 1 (e.g. "every_n:5")\''''
)

# --- training/worker.py and queue.py: the process imports NeMo; huge pages through its environment -----------------

WORKER_DOC = '''\
"""The consolidation process: ``python -m nemo_patch.training.worker --serve --settings JSON``.

Started once per run by :class:`nemo_patch.training.queue.ConsolidationQueue`, it imports everything a consolidation
needs, writes ``{"ready": true}`` on stdout, then serves requests until its stdin ends: one JSON line per request on
stdin, ``{"checkpoint": path, "global_step": n, "best": {...} | null}``, and one JSON line per ended request on
stdout, ``{"error": null | "<one-line reason>"}``. Anything else printed (by this process, torch, NeMo or the engine)
goes to stderr: fd 1 is redirected to fd 2 before anything is imported, and the result lines go to a private copy of
the original stdout. So the interpreter's start (``import torch`` and this package's parents, ``nemo.lightning``:
seconds) is paid once per run, when ``fit`` sets up, instead of once per checkpoint.
``python -m nemo_patch.training.worker <ckpt> --global-step N`` consolidates one checkpoint and exits (0, or 1 with
the reason on stderr).

A request that fails with a :class:`~nemo_patch.engine.errors.ConsolidationError` is answered with its reason and the
process serves the next one; any other exception is answered too, then ends the process (exit 1, traceback on
stderr), and the queue starts a fresh one for the next request.

It imports at the CPU priority it was started with, so that it is ready by the first finished checkpoint, then
lowers its priority (:data:`WORKER_NICENESS`) for the consolidations, and runs the engine
(:func:`nemo_patch.engine.consolidate.consolidate_checkpoint`) or, for ``output_format="hf"``, the Hugging Face export
(:func:`nemo_patch.export.hf.export_hf_checkpoint`, which finds the model's exporter through NeMo). Its environment,
set by the queue, asks torch for transparent huge pages (:mod:`nemo_patch.engine.huge_pages`). It reads only files and
uses no ``torch.distributed`` process group or collective (a consolidation calling a collective on the training
communicator is a known way to hang a run).
"""'''

HUGE_PAGES_DOC = '''\
"""Let torch back a consolidation's large tensors with transparent huge pages (THP).

A consolidation allocates every output tensor, and ``torch.load`` every stored chunk, afresh: with 4 KiB pages each
first touch of each page is a page fault, one per 4 KiB of the checkpoint, twice. torch's CPU allocator (c10) has a
switch for that, the environment variable ``THP_MEM_ALLOC_ENABLE=1``: allocations of 2 MiB or more are then marked
``madvise(MADV_HUGEPAGE)``, so the kernel maps them 2 MiB at a time where THP is enabled
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``; with ``never`` nothing changes).
Measured on a 2.55 GB checkpoint on 2 cores: page faults fell from about 520,000 to 42,000 per consolidation and one
writer's wall time by about 20%.

c10 reads the variable once, at the process's first CPU tensor allocation, so it must be in the environment before
torch is imported: the consolidation queue starts the run's consolidation process with :func:`with_huge_pages`, and
the converter script sets it before its first import. A training process never does, so its allocator stays exactly
as its user set it up. Writer processes inherit it. A value the user set, ``0`` included, is kept.
"""'''

CHANGES = [
    # engine/parts.py
    Replace("engine/parts.py", None, PARTS_DOC),
    Drop("engine/parts.py", ("split_shares", "_NOT_FORK_SAFE")),
    Replace("engine/parts.py", "_fork_is_safe", FORK_IS_SAFE),
    Replace("engine/parts.py", None, PARTS_DOC_ENGINE, until="writers"),
    Drop(
        "engine/parts.py",
        (
            "MAX_WORKERS",
            "default_workers",
            "validate_workers",
            "_INHERITED",
            "_writer_main",
            "_fork_is_safe",
            "_context",
            "_describe",
        ),
        until="writers",
    ),
    Replace("engine/parts.py", "run_parts", RUN_PARTS_ENGINE, until="writers"),
    # engine/consolidate.py
    Edit(
        "engine/consolidate.py",
        "Writers: the output files are laid out and created before any data is read, then their tensors are cut into "
        "parts\nthat ``workers`` processes on this node fill at once (:mod:`nemo_patch.engine.parts`), or processes "
        "on "
        "several nodes\n(``parts_runner``: :mod:`nemo_patch.cli.distributed`). The bytes written do\nnot depend on "
        "how "
        "many: each tensor lands at the same offset, and ``metadata.json`` records per-tensor digests\n"
        "(:mod:`nemo_patch.engine.digests`), which every writer computes for what it writes.",
        CONSOLIDATE_WRITERS,
    ),
    Edit("engine/consolidate.py", CONSOLIDATE_WRITERS, CONSOLIDATE_ONE_WRITER, until="writers"),
    Edit(
        "engine/consolidate.py",
        "Consolidate a finished NeMo 2 ``torch_dist`` or ``zarr`` checkpoint",
        "Consolidate a finished NeMo 2 ``torch_dist`` checkpoint",
    ),
    Edit(
        "engine/consolidate.py",
        "        checkpoint_dir: the checkpoint directory (``<ckpt>``) or its ``weights/`` directory; "
        "``torch_dist`` or\n"
        "            megatron-core's ``zarr`` (:mod:`nemo_patch.engine.zarr_reader`: same output, bit for bit).\n",
        "        checkpoint_dir: the checkpoint directory (``<ckpt>``) or its ``weights/`` directory "
        "(``torch_dist``).\n",
    ),
    Drop("engine/consolidate.py", ("PartsRunner",)),
    Edit(
        "engine/consolidate.py",
        "    parts: Optional[int] = None,\n    parts_runner: Optional[PartsRunner] = None,\n",
        "",
    ),
    Edit(
        "engine/consolidate.py",
        "        parts: how many parts the tensors are cut into (default: ``workers``); with ``parts_runner``.\n"
        "        parts_runner: runs the parts instead of ``workers`` processes on this node (several nodes).\n",
        "",
    ),
    Edit(
        "engine/consolidate.py",
        "split_parts(layout, parts or _useful_workers(layout, workers))",
        "split_parts(layout, _useful_workers(layout, workers))",
    ),
    Edit(
        "engine/consolidate.py",
        "        if parts_runner is None:\n"
        "            report = None if progress is None else (lambda done: progress(done, total_bytes))\n"
        "            results = run_parts(jobs, sources, workers, report)\n"
        "        else:\n"
        "            results = parts_runner(jobs, sources)\n",
        "        report = None if progress is None else (lambda done: progress(done, total_bytes))\n"
        "        results = run_parts(jobs, sources, workers, report)\n",
    ),
    Edit("engine/consolidate.py", "    workers: int = 1,\n", "", until="writers"),
    Edit(
        "engine/consolidate.py",
        "        workers: writer processes on this node (>= 1; :func:`nemo_patch.engine.parts.default_workers` is the "
        "CLI's\n            default). The output is the same, byte for byte, whatever the number.\n",
        "",
        until="writers",
    ),
    Edit("engine/consolidate.py", "    workers = validate_workers(workers)\n", "", until="writers"),
    Edit(
        "engine/consolidate.py",
        "``max_shard_size`` < 1, ``workers`` < 1 or",
        "``max_shard_size`` < 1 or",
        until="writers",
    ),
    Edit(
        "engine/consolidate.py",
        "split_parts(layout, _useful_workers(layout, workers))",
        "split_parts(layout, 1)",
        until="writers",
    ),
    Drop("engine/consolidate.py", ("_useful_workers",), until="writers"),
    Edit(
        "engine/consolidate.py",
        "run_parts(jobs, sources, workers, report)",
        "run_parts(jobs, sources, report)",
        until="writers",
    ),
    # engine/checkpoint_reader.py, engine/checkpoint_layout.py: zarr recognised and refused
    Replace("engine/checkpoint_reader.py", None, READER_DOC),
    Edit(
        "engine/checkpoint_reader.py",
        "from nemo_patch.engine.zarr_reader import ZarrRegionReader, read_zarr_metadata\n",
        "",
    ),
    Edit(
        "engine/checkpoint_reader.py",
        '    if backend == "zarr":\n'
        "        metadata = read_zarr_metadata(weights_dir) if metadata is None else metadata\n"
        "        return metadata, ZarrRegionReader(weights_dir, metadata)\n",
        "",
    ),
    Edit(
        "engine/checkpoint_reader.py",
        "(:class:`DCPRegionReader`, :class:`ZarrRegionReader`)",
        "(:class:`DCPRegionReader`)",
    ),
    Edit(
        "engine/checkpoint_layout.py",
        'READABLE_BACKENDS = ("torch_dist", "zarr")',
        'READABLE_BACKENDS = ("torch_dist",)',
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "only 'torch_dist' and 'zarr' checkpoints can",
        "only 'torch_dist' checkpoints can",
        count=2,
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "it is read by :mod:`nemo_patch.engine.zarr_reader`. megatron-core",
        "it is recognised and refused (megatron-core deprecated it). megatron-core",
    ),
    Replace("engine/huge_pages.py", None, HUGE_PAGES_DOC),
    # training/policy.py: one cadence
    Replace("training/policy.py", None, POLICY_DOC),
    Replace("training/policy.py", "ACCEPTED_FREQUENCIES", ACCEPTED),
    Edit(
        "training/policy.py",
        "        value: ``\"each\"``, ``\"latest\"``, ``\"best\"``, ``\"every_n:<k>\"`` (``k`` decimal digits, >= 1), "
        "or phases\n            ``\"<cadence>; <cadence>@<step>; ...[; latest]\"`` (spaces only around ``;``). "
        "Anything else, including\n            non-strings, is rejected.\n",
        "        value: ``\"each\"``, ``\"latest\"``, ``\"best\"`` or ``\"every_n:<k>\"`` (``k`` decimal digits, >= "
        "1). "
        "Anything else,\n            including non-strings, is rejected.\n",
    ),
    Edit(
        "training/policy.py",
        "    items = _SEPARATOR.split(value)\n",
        "    items = _SEPARATOR.split(value)\n"
        "    if len(items) > 1:\n"
        "        raise _invalid(value, 'one cadence is expected (\";\" separates nothing)')\n",
    ),
    Edit(
        "training/schedule.py",
        " consolidates its 4th. With phases (``\"every_n:10; each@50000\"``) an\n``every_n`` phase counts the "
        "finished checkpoints saved in it, from 1, and that count is stored and restored the same\nway.\n",
        " consolidates its 4th.\n",
    ),
    # training/worker.py, training/queue.py
    Replace("training/worker.py", None, WORKER_DOC),
    Drop("training/worker.py", ("_niceness",)),
    Edit("training/worker.py", "os.nice(_niceness())", "os.nice(WORKER_NICENESS)"),
    Edit(
        "training/worker.py",
        "    prefer_huge_pages()  # before torch is imported: this process exists to consolidate\n",
        "",
    ),
    Edit(
        "training/queue.py",
        "from nemo_patch.engine.publish import tmp_dirs_of\n",
        "from nemo_patch.engine.huge_pages import with_huge_pages\nfrom nemo_patch.engine.publish import "
        "tmp_dirs_of\n",
    ),
    Edit(
        "training/queue.py",
        '    env["CUDA_VISIBLE_DEVICES"] = ""\n    return env\n',
        '    env["CUDA_VISIBLE_DEVICES"] = ""\n    return with_huge_pages(env)  # torch reads it before its first '
        'allocation\n',
    ),
]

# --- cli/nemo_consolidate.py: one process per consolidation (multi-node launches stay in the overlay) ---------------

CLI = "cli/nemo_consolidate.py"

CHANGES += [
    Edit(CLI, "Usage (also ``python -m nemo_patch``)::", "Usage::"),
    Edit(CLI, "distributed checkpoint (torch_dist or zarr) into", "distributed checkpoint (torch_dist) into"),
    Edit(CLI, "    nemo-consolidate --version\n", ""),
    Edit(
        CLI,
        "    torchrun --nnodes N --nproc-per-node 1 ... -m nemo_patch <path> ... [--timeout SECONDS]\n"
        "                     (or srun; see nemo_patch.cli.distributed)\n",
        "",
    ),
    Edit(
        CLI,
        ":mod:`nemo_patch.engine.parts`); launched by ``torchrun`` or ``srun`` on several nodes, each node runs its "
        "share\n(:mod:`nemo_patch.cli.distributed`). The output is",
        ":mod:`nemo_patch.engine.parts`). The output is",
    ),
    Edit(CLI, "    from nemo_patch.cli.distributed import LaunchedGroup\n    from nemo_patch", "    from nemo_patch"),
    Drop(CLI, ("_installed_version", "_VersionAction", "_seconds")),
    Edit(CLI, '    parser.add_argument("--version", action=_VersionAction)\n', ""),
    Edit(
        CLI,
        '("parallelism", "writer processes, and ranks under torchrun or srun")',
        '("parallelism", "writer processes")',
    ),
    Edit(
        CLI,
        '    groups["parallelism"].add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS", '
        'help="under "\n'
        '                                       "torchrun or srun: how long a rank waits for another\'s next message '
        'before "\n'
        '                                       "the run ends with exit code 15 (default: 3600; a rank waits for the '
        'others\' "\n'
        '                                       "parts once its own is written, so this must cover how much longer a '
        'slower "\n'
        '                                       "node takes over its share of a large model, and rank 0\'s planning, '
        '--verify "\n'
        '                                       "and publishing)")  # fmt: skip\n',
        "",
    ),
    Edit(
        CLI,
        "    prefer_huge_pages()  # before torch is imported: this process exists to consolidate\n",
        "",
    ),
    Edit(
        CLI,
        "    from nemo_patch.cli.distributed import LaunchedGroup\n\n"
        "    try:\n"
        "        group = LaunchedGroup.from_environment(args.timeout)\n"
        "        if group is not None:\n"
        "            group.join(vars(args))  # every rank's arguments compared with rank 0's, before any work\n"
        "            if group.rank != 0:\n"
        "                return group.serve()  # rank 0 reports the outcome, once; every rank reports a lost peer\n"
        "    except ConsolidationError as error:\n"
        '        print(f"{PROG}: error: {error}", file=sys.stderr)\n'
        "        return error.exit_code\n"
        "    if group is None:\n"
        "        return _consolidate(args, None)\n"
        "    code = _consolidate(args, group)\n"
        "    group.finish(code)\n"
        "    return code\n",
        "    return _consolidate(args)\n",
    ),
    Edit(
        CLI,
        'def _consolidate(args: argparse.Namespace, group: Optional["LaunchedGroup"]) -> int:\n'
        '    """Consolidate as ``args`` say (on rank 0 of ``group`` when launched on several nodes); returns the exit '
        'code."""\n',
        "def _consolidate(args: argparse.Namespace) -> int:\n"
        '    """Consolidate as ``args`` say; returns the exit code."""\n',
    ),
    Edit(
        CLI,
        "            if group is not None:\n"
        "                group.release()  # rank 0 verifies alone: the other ranks exit 0\n",
        "",
    ),
    Edit(
        CLI,
        "            if group is not None:\n"
        "                group.release()  # rank 0 exports alone: the other ranks exit 0\n",
        "",
    ),
    Edit(
        CLI,
        "            if group is not None:\n"
        '                options.update(parts=group.parts(options["workers"]), parts_runner=group.run)\n',
        "",
    ),
    Edit(
        CLI,
        "            f\"{f' by {group.world_size} nodes'"
        " if group is not None and args.format == 'safetensors' else ''}\"\n",
        "",
    ),
]

# --- training/settings.py: one cadence; the converter command's options land with the CLI stage ---------------------

SETTINGS_DOC = '''\
"""Every consolidation setting of a run, each declared once, and one frozen value holding them.

Each setting is one field of :class:`ConsolidationSettings` whose metadata (:func:`setting`) declares everything
else about it: its ``MegatronStrategy`` argument, its ``MegatronCheckpointIO`` argument, its default, how it is
validated and its help text. :data:`SETTINGS` lists the declarations in order; the checkpoint IO's signature,
docstring and read-only views and the consolidation process's JSON are made from it, and ``MegatronStrategy``'s
arguments and their documentation follow it.
Where the converter command takes a setting, the declaration names its command-line option too.

:meth:`ConsolidationSettings.from_arguments` validates the user's values, once, where the user gives them
(``MegatronStrategy.__init__``, or ``MegatronCheckpointIO.__init__`` when a user builds the checkpoint IO), and raises
``ValueError`` naming the argument and the accepted forms. From there the settings travel as one value: strategy ->
checkpoint IO -> consolidation queue -> the consolidation process's command line (:meth:`ConsolidationSettings.to_json`
once per queue, :meth:`ConsolidationSettings.from_json` once per process).
"""'''

CADENCE_HELP = '''\
_CADENCE_HELP = (
    "``None`` (default), ``\\"each\\"`` (every finished checkpoint), ``\\"latest\\"`` (none during training; the "
    "newest finished checkpoint once when ``fit`` ends), ``\\"every_n:<k>\\"`` (the k-th, 2k-th, ... finished "
    "checkpoint of the run, counted across resumes; k an integer >= 1) or ``\\"best\\"`` (a finished checkpoint that "
    "NeMo's ``ModelCheckpoint`` ranked best by its ``monitor``/``mode`` when it was saved; ``<root>/BEST`` names the "
    "best consolidated one; needs a monitored metric). Giving a frequency turns consolidation on."
)'''

SETTINGS = "training/settings.py"

CHANGES += [
    Replace(SETTINGS, None, SETTINGS_DOC),
    Replace(SETTINGS, "_CADENCE_HELP", CADENCE_HELP),
    Edit(SETTINGS, "8); under torchrun or srun, on each node", "8)"),
    Edit(
        SETTINGS, "``<ckpt>/consolidated/`` with this package's layout", "``<ckpt>/consolidated/`` in unsharded form"
    ),
    # the overlay's documentation pages (NeMo's is docs/source/checkpoints/consolidation.rst)
    Edit(
        SETTINGS,
        "(e.g. Llama); see the documentation's Outputs page. Either runs in ",
        "(e.g. Llama). Either runs in ",
    ),
    Edit(SETTINGS, "removed checkpoint. See the documentation's Retention page.", "removed checkpoint."),
    # until the CLI stage: no command-line options in the declarations
    Edit(
        SETTINGS,
        "\nWhere the converter command takes a setting, the declaration names its command-line option too.",
        "",
        until="cli",
    ),  # fmt: skip
    DropKeyword(SETTINGS, "setting", "cli", until="cli"),
    DropArgument(SETTINGS, "setting", "cli", until="cli"),
    Edit(SETTINGS, 'metadata={"setting": dict(declared, cli=cli)}', 'metadata={"setting": declared}', until="cli"),
    Drop(SETTINGS, ("CliOption", "Setting.cli", "_number", "_whole_number"), until="cli"),
    Edit(SETTINGS, "        cli: the ``nemo-consolidate`` option, ``None`` when the CLI has none.\n", "", until="cli"),
]

# --- engine/errors.py: the multi-node peer error stays in the overlay with cli/distributed.py -----------------------

CHANGES += [
    Drop("engine/errors.py", ("PeerError",)),
    Edit(
        "engine/errors.py",
        "are the one list of exit codes: ``nemo-consolidate --help`` and the documentation's table\n"
        "are made from them.",
        "are the one list of exit codes.",
    ),
]

# --- the retention and PEFT stages: what the earlier stages hold back until they land --------------------------------

CHANGES += RETENTION + PEFT

# --- the converter script of the engine stage, as the writers and hf stages extend it --------------------------------

CONVERTER_TREE = "tree/scripts/checkpoint_converters/consolidate_nemo2_checkpoint.py"

CHANGES += [
    # until the hf stage: no --format hf, no --trust-context
    Edit(CONVERTER_TREE, "        [--format safetensors|hf [--trust-context]]\n", "", until="hf"),
    Edit(
        CONVERTER_TREE,
        "needed. ``--format hf`` writes ``<ckpt>/hf`` instead, a directory ``transformers`` loads, through the NeMo "
        "exporter\nregistered for the model class (NeMo is imported to find it); the checkpoint's ``context/`` must "
        "name only NeMo's,\nmegatron-core's, torch's, transformers' and Lightning's code, unless ``--trust-context`` "
        "(loading it runs that code).\n``--workers N``",
        "needed. ``--workers N``",
        until="hf",
    ),
    Edit(
        CONVERTER_TREE,
        '    parser.add_argument("--format", choices=["safetensors", "hf"], default="safetensors", '
        'help="output format")\n'
        '    parser.add_argument("--trust-context", action="store_true", '
        'help="load a context that names code outside NeMo")\n',
        "",
        until="hf",
    ),
    Edit(
        CONVERTER_TREE,
        '        if args.format == "hf":\n'
        "            from nemo.lightning.io.consolidation.engine.checkpoint_layout import inspect_checkpoint\n"
        "            from nemo.lightning.io.consolidation.export.context_trust import check_context_trusted\n"
        "            from nemo.lightning.io.consolidation.export.hf import export_hf_checkpoint\n\n"
        "            location = inspect_checkpoint(args.checkpoint)\n"
        '            check_context_trusted(location.checkpoint_dir / "context", args.trust_context)\n'
        "            result = export_hf_checkpoint(location.checkpoint_dir, args.out, **options)\n"
        "        else:\n"
        "            result = consolidate_checkpoint(\n"
        "                args.checkpoint, args.out, workers=args.workers or default_workers(), **options\n"
        "            )\n",
        "        result = consolidate_checkpoint(args.checkpoint, args.out, workers=args.workers or "
        "default_workers(), **options)\n",
        until="hf",
    ),
    # until the writers stage: no --workers
    Edit(
        CONVERTER_TREE,
        "[--max-shard-size BYTES] [--workers N] [--verify] [--force]",
        "[--max-shard-size BYTES] [--verify] [--force]",
        until="writers",
    ),
    Edit(
        CONVERTER_TREE,
        "``--workers N`` writer processes fill the output files at once (default: this node's cores, at most 8); the\n"
        "output is the same, byte for byte, whatever the number. The exit code names the cause of a failure\n"
        "(``nemo.lightning.io.consolidation.engine.errors``).",
        "The exit code names the cause of a failure (``nemo.lightning.io.consolidation.engine.errors``).",
        until="writers",
    ),
    Edit(
        CONVERTER_TREE,
        '    parser.add_argument("--workers", type=int, default=None, help="writer processes (default: cores, at most '
        '8)")\n',
        "",
        until="writers",
    ),
    Edit(
        CONVERTER_TREE,
        "    from nemo.lightning.io.consolidation.engine.parts import default_workers\n",
        "",
        until="writers",
    ),
    Edit(CONVERTER_TREE, "workers=args.workers or default_workers(), ", "", until="writers"),
]
