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

"""What the earlier stages hold back until the ``retention`` stage lands (see :mod:`upstream.changes`).

The retention stage adds: outputs kept under ``<root>/retained/`` when NeMo's top-k removes their checkpoints
(``ckpt_consolidation_keep``, ``training/retention.py``), the ``LATEST`` and ``BEST`` pointers
(``training/latest.py``), and the ``"best"`` cadence (``engine/best_checkpoint.py``, the ``best`` record of a save,
``consolidate_best_checkpoint``). Before it, the knob stage consolidates at ``"each"``, ``"every_n:<k>"`` and
``"latest"``, and a checkpoint NeMo removes takes its output with it (the removal still waits for a running
consolidation of it and drops a queued one: the safe top-k removal is the knob's).
"""

from upstream.transforms import Drop, DropArgument, Edit, Replace

UNTIL = "retention"

# --- engine ----------------------------------------------------------------------------------------------------------

ENGINE = [
    Drop("engine/errors.py", ("NoMonitoredMetricError",), until=UNTIL),
    Drop("engine/output_layout.py", ("RETAINED_DIRNAME",), until=UNTIL),
    Edit(
        "engine/checkpoint_layout.py",
        "    <root>/LATEST                                     the training side's pointer to the newest consolidated "
        "one\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "        # (the one ``LATEST`` names) whatever the two modification times say.\n",
        "        # whatever the two modification times say.\n",
        until=UNTIL,
    ),
    Edit(
        "engine/output_files.py",
        "(``consolidated/``, ``hf/``, ``retained/<name>/consolidated``)",
        "(``consolidated/``, ``hf/``)",
        until=UNTIL,
    ),
    Edit("engine/output_target.py", "(``LATEST``, a link of the user's)", "(a link of the user's)", until=UNTIL),
    # the "best" record of a checkpoint consolidated as the best, in metadata.json
    DropArgument("engine/consolidate.py", "consolidate_checkpoint", "best", until=UNTIL),
    Edit("engine/consolidate.py", "        if best is not None:\n            manifest.update(best=dict(best))\n", "",
         until=UNTIL),  # fmt: skip
    DropArgument("export/hf.py", "export_hf_checkpoint", "best", until=UNTIL),
    Edit("export/hf.py", "        if best is not None:\n            manifest.update(best=dict(best))\n", "",
         until=UNTIL),  # fmt: skip
]

# --- training/policy.py, schedule.py, queue.py, worker.py: no "best" cadence
# ------------------------------------------

POLICY_DOC = '''\
"""When a training run consolidates its distributed checkpoints: the cadence.

This module is the single place where the user-facing ``save_consolidated`` and ``ckpt_consolidation_frequency``
arguments are parsed and validated, once, when :class:`nemo_patch.training.settings.ConsolidationSettings` is made
from the user's values; every other part of the package gets the parsed :class:`ConsolidationPolicy`.

Accepted frequencies (:data:`ACCEPTED_FREQUENCIES`):

* ``"each"``: consolidate every finished checkpoint.
* ``"every_n:<k>"`` with ``k`` an integer >= 1: consolidate the k-th, 2k-th, ... finished checkpoint of the run (the
  count includes saves made before a resume).
* ``"latest"``: consolidate nothing during training; when ``fit`` ends, consolidate the newest finished checkpoint.

A policy is a tuple of :class:`CadencePhase` (one, starting at step 0) so that cadences that change at given global
steps can be added later without changing its users.
"""'''

POLICY = [
    Replace("training/policy.py", None, POLICY_DOC, until=UNTIL),
    Edit(
        "training/policy.py",
        '"each", "latest", "best" or "every_n:<k>"',
        '"each", "latest" or "every_n:<k>"',
        until=UNTIL,
    ),
    Edit(
        "training/policy.py",
        'Cadence = Literal["each", "every_n", "best"]',
        'Cadence = Literal["each", "every_n"]',
        until=UNTIL,
    ),  # fmt: skip
    Edit("training/policy.py", 'r"(each|best|every_n:([0-9]+))', 'r"(each|every_n:([0-9]+))', until=UNTIL),
    Edit(
        "training/policy.py",
        '        cadence: ``"each"``, ``"every_n"`` or ``"best"``.\n',
        '        cadence: ``"each"`` or ``"every_n"``.\n',
        until=UNTIL,
    ),
    DropArgument("training/policy.py", "ConsolidationPolicy.is_due", "best", until=UNTIL),
    Edit(
        "training/policy.py",
        '            ``True`` in an ``"each"`` phase; ``index_in_phase % k == 0`` in ``"every_n:<k>"``; ``best`` in\n'
        '            ``"best"``; ``False`` for ``"latest"`` (which consolidates only when ``fit`` ends).\n',
        '            ``True`` in an ``"each"`` phase; ``index_in_phase % k == 0`` in ``"every_n:<k>"``; ``False`` '
        'for\n            ``"latest"`` (which consolidates only when ``fit`` ends).\n',
        until=UNTIL,
    ),
    Edit(
        "training/policy.py",
        '        return best if phase.cadence == "best" else True\n',
        "        return True\n",
        until=UNTIL,
    ),
    Drop("training/policy.py", ("ConsolidationPolicy.uses_best",), until=UNTIL),
    Edit(
        "training/policy.py",
        '        """Whether a phase is ``"each"`` or ``"every_n"`` (consolidations follow the save interval)."""\n'
        '        return any(phase.cadence != "best" for phase in self.phases)\n',
        '        """Whether a phase is ``"each"`` or ``"every_n"`` (consolidations follow the save interval)."""\n'
        "        return bool(self.phases)\n",
        until=UNTIL,
    ),
    Edit(
        "training/policy.py",
        '        value: ``"each"``, ``"latest"``, ``"best"`` or ``"every_n:<k>"`` (``k`` decimal digits, >= 1).',
        '        value: ``"each"``, ``"latest"`` or ``"every_n:<k>"`` (``k`` decimal digits, >= 1).',
        until=UNTIL,
    ),
    # schedule.py: a save has no "best" record
    Edit(
        "training/schedule.py",
        '``"best"`` is decided when a save is issued, from NeMo\'s own bookkeeping: the checkpoint IO marks a save\n'
        "(:attr:`CheckpointSave.best`) when ``ModelCheckpoint.best_model_path`` names it, which ``ModelCheckpoint`` "
        "sets\nbefore it calls ``trainer.save_checkpoint``.\n\n",
        "",
        until=UNTIL,
    ),
    Drop("training/schedule.py", ("CheckpointSave.best",), until=UNTIL),
    Edit(
        "training/schedule.py",
        "        best: set when ``ModelCheckpoint`` named this checkpoint its best one when it was saved (and the "
        "cadence\n"
        '            uses ``"best"``): ``{"monitor": name, "value": float, "mode": "min" | "max"}``, recorded in the '
        'output\'s\n'
        "            ``metadata.json``.\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "training/schedule.py",
        "        output: where its output lives now (``<path>/consolidated``, or under ``retained/`` after NeMo "
        "removed it).\n",
        "        output: where its output is (``<path>/consolidated``, or ``<path>/hf``).\n",
        until=UNTIL,
    ),
    Edit(
        "training/schedule.py",
        "self.policy.is_due(save.global_step, self.finished.in_phase, save.best is not None)",
        "self.policy.is_due(save.global_step, self.finished.in_phase)",
        until=UNTIL,
    ),
    # queue.py and worker.py: no "best" in a request
    Edit(
        "training/queue.py",
        '``{"checkpoint", "global_step", "best"}``',
        '``{"checkpoint", "global_step"}``',
        until=UNTIL,
    ),
    Edit(
        "training/queue.py",
        'json.dumps({"checkpoint": str(save.path), "global_step": save.global_step, "best": save.best})',
        'json.dumps({"checkpoint": str(save.path), "global_step": save.global_step})',
        until=UNTIL,
    ),
    Edit(
        "training/worker.py",
        '``{"checkpoint": path, "global_step": n, "best": {...} | null}``',
        '``{"checkpoint": path, "global_step": n}``',
        until=UNTIL,
    ),
    Edit("training/worker.py", '    parser.add_argument("--best", type=json.loads, default=None)\n', "", until=UNTIL),
    Edit(
        "training/worker.py",
        "        argv: ``<checkpoint dir> [--global-step N] [--best JSON] [--settings JSON]``, or ``--serve "
        "[--settings\n"
        '            JSON]`` to read ``{"checkpoint", "global_step", "best"}`` lines from stdin. ``--best``: the '
        'checkpoint\n            is the best by the monitored metric, ``{"monitor", "value", "mode"}``, recorded in '
        '``metadata.json``;\n'
        "            settings ``JSON`` from",
        "        argv: ``<checkpoint dir> [--global-step N] [--settings JSON]``, or ``--serve [--settings JSON]`` to "
        "read\n"
        '            ``{"checkpoint", "global_step"}`` lines from stdin; settings ``JSON`` from',
        until=UNTIL,
    ),
    Edit(
        "training/worker.py",
        "consolidate(args.checkpoint, args.global_step, args.best)",
        "consolidate(args.checkpoint, args.global_step)",
        until=UNTIL,
    ),
    Edit(
        "training/worker.py",
        'consolidate(Path(request["checkpoint"]), request.get("global_step"), request.get("best"))',
        'consolidate(Path(request["checkpoint"]), request.get("global_step"))',
        until=UNTIL,
    ),
    Edit(
        "training/worker.py",
        ") -> Callable[[Path, Optional[int], Optional[Dict[str, Any]]], Optional[str]]:\n"
        '    """Import what consolidating with ``settings`` needs; return ``consolidate(checkpoint, global_step, '
        'best)``,\n',
        ") -> Callable[[Path, Optional[int]], Optional[str]]:\n"
        '    """Import what consolidating with ``settings`` needs; return ``consolidate(checkpoint, global_step)``,\n',
        until=UNTIL,
    ),
    Edit(
        "training/worker.py",
        "    def consolidate(checkpoint: Path, global_step: Optional[int], best: Optional[Dict[str, Any]]) -> "
        "Optional[str]:\n",
        "    def consolidate(checkpoint: Path, global_step: Optional[int]) -> Optional[str]:\n",
        until=UNTIL,
    ),
    Edit("training/worker.py", "                best=best,\n", "", until=UNTIL),
]

# --- training/coordinator.py: no pointers, no retained outputs, no "best"
# ----------------------------------------------

COORDINATOR_RECONCILE = '''\
def reconcile(self, root: Path) -> None:
    """When training starts (global rank 0, after NeMo's own start-up clean-up): consolidate what the journal of an
    earlier run of this root lists as due but never finished (that run was killed), or say once that it cannot."""
    self._resume_journal(Path(root))'''

COORDINATOR = [
    Edit(
        "training/coordinator.py",
        "consolidation process, the outputs and the ``-last`` copies that receive them, ``LATEST``/``BEST``, the "
        "outputs kept\nwhen NeMo removes their checkpoints, the journal of due consolidations and the metrics.",
        "consolidation process, the outputs and the ``-last`` copies that receive them, the journal of due "
        "consolidations\nand the metrics.",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "* links into a ``-last`` copy and the keeping of an output before a removal never interleave.",
        "* links into a ``-last`` copy and a removal never interleave.",
        until=UNTIL,
    ),
    Drop("training/coordinator.py", ("best_record",), until=UNTIL),
    Edit(
        "training/coordinator.py",
        '    """Schedule, queue, outputs, ``-last`` links, pointers, retention, journal and metrics of one run '
        '(global rank 0).',
        '    """Schedule, queue, outputs, ``-last`` links, journal and metrics of one run (global rank 0).',
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        #: The trainer's ``ModelCheckpoint``: its ``best_model_path`` tells which saves are the best so "
        "far.\n        self.checkpoint_callback: Optional[Any] = None\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        if policy.consolidates_periodically or policy.uses_best:\n            self.queue.start_process()\n",
        "        if policy.consolidates_periodically:\n            self.queue.start_process()\n",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        ``fit``, saved again by a second one): it is kept as a removal would keep it, the pointers move off "
        "it, and\n        it is deleted, so that it is never taken for the new weights' output.",
        "        ``fit``, saved again by a second one): it is deleted, so that it is never taken for the new "
        "weights'\n        output.",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "                self._keep_outputs_and_move_pointers(checkpoint_dir)  # moves the earlier save's output if "
        "kept\n",
        "",
        until=UNTIL,
    ),
    DropArgument("training/coordinator.py", "ConsolidationCoordinator.register", "best", until=UNTIL),
    Edit(
        "training/coordinator.py",
        "            save = self.schedule.register(Path(checkpoint_dir), global_step, self.fit)\n"
        "            save.best = best\n"
        "        return save\n",
        "            return self.schedule.register(Path(checkpoint_dir), global_step, self.fit)\n",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        if newest.consolidated:\n"
        "            self._point(newest.path)\n"
        "        elif not newest.state.outstanding:\n",
        "        if not newest.consolidated and not newest.state.outstanding:\n",
        until=UNTIL,
    ),
    Drop("training/coordinator.py", ("ConsolidationCoordinator.consolidate_best",), until=UNTIL),
    Edit(
        "training/coordinator.py",
        '        """End of ``fit``: queue what is due (all of it: see the queue\'s ``bounded``), with ``latest`` the '
        'newest\n'
        "        checkpoint and with ``best`` the best one; forget saves that never finished (each is "
        "logged).\"\"\"\n",
        '        """End of ``fit``: queue what is due (all of it: see the queue\'s ``bounded``) and, with ``latest``, '
        'the\n        newest checkpoint; forget saves that never finished (each is logged)."""\n',
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        if self.schedule.policy.uses_best:\n            self.consolidate_best()\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        consolidate that save (``latest``'s newest checkpoint, ``best``'s best one), and its output is then "
        "linked",
        "        consolidate that save (``latest``'s newest checkpoint), and its output is then linked",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "  # removed before it could start, or its output went with it (keep=0)\n",
        "  # removed before it could start, or its output went with it\n",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "            replace: Dict[str, bytes] = {}\n"
        "            if output != source.path / name:  # kept under retained/: its metadata.json was rewritten for "
        "that place\n                metadata = json.loads((output / METADATA_FILENAME).read_text())\n"
        '                metadata.pop("retained_from", None)\n'
        '                if isinstance(metadata.get("source_checkpoint"), str):\n'
        '                    metadata["source_checkpoint"] = os.path.relpath(copy.path / "weights", copy.path / '
        'name)\n                replace[METADATA_FILENAME] = (json.dumps(metadata, indent=2, sort_keys=True) + '
        '"\\n").encode()\n'
        "            try:\n"
        "                link_output(output, copy.path / name, replace_files=replace)\n",
        "            try:\n" "                link_output(output, copy.path / name)\n",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        (logged); a running one delays ``remove`` until it has ended. Then its output is kept as\n"
        "        ``ckpt_consolidation_keep`` says and ``LATEST``/``BEST`` move off it, and ``remove`` runs.\"\"\"",
        "        (logged); a running one delays ``remove`` until it has ended. Then ``remove`` runs (the checkpoint's "
        "output,\n"
        '        if any, goes with it)."""',
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "                self._deleting.add(checkpoint_dir)\n"
        "                self._keep_outputs_and_move_pointers(checkpoint_dir)\n",
        "                self._deleting.add(checkpoint_dir)\n",
        until=UNTIL,
    ),
    Drop(
        "training/coordinator.py",
        (
            "ConsolidationCoordinator._keep_outputs_and_move_pointers",
            "ConsolidationCoordinator._move_pointer_off",
            "ConsolidationCoordinator._point",
            "ConsolidationCoordinator._set_aside",
        ),
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        self._ended(save, record=self._record(save))\n"
        "        self._point(save.path)\n"
        "        if save.best is not None:\n"
        "            self._point(save.path, BEST_NAME)\n"
        '            logger.info("%s -> %s", BEST_NAME, save.path.name)\n'
        "        if self.settings.keep is not None:  # a new output may push a retained one out of the newest N\n"
        "            with self.lock:\n"
        "                try:\n"
        "                    prune_retained(save.path.parent, self.settings.output_dirname, self.settings.keep)\n"
        "                except OSError:\n"
        '                    logger.exception("Could not prune the retained outputs in %s", save.path.parent)\n'
        "                self._move_pointer_off(save.path.parent, LATEST_NAME, None)\n",
        "        self._ended(save, record=self._record(save))\n",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        "        (oldest first), made now: an output is named where it is now (under ``retained/`` once NeMo removed "
        "its\n        checkpoint, e.g. a removal that waited for that consolidation) and its ``metadata.json`` read "
        "from there.",
        "        (oldest first), made now (an output's ``metadata.json`` is read now).",
        until=UNTIL,
    ),
    Replace("training/coordinator.py", "ConsolidationCoordinator.reconcile", COORDINATOR_RECONCILE, until=UNTIL),
    Edit(
        "training/coordinator.py",
        "            if save.best is not None:\n" '                entry["best"] = save.best\n',
        "",
        until=UNTIL,
    ),
    Edit(
        "training/coordinator.py",
        '            save.best = entry.get("best") if isinstance(entry.get("best"), dict) else None\n',
        "",
        until=UNTIL,
    ),
]

# --- training/callback.py
# ----------------------------------------------------------------------------------------------

CALLBACK = [
    Edit(
        "training/callback.py",
        'busy with an earlier one at that moment. Consolidated outputs themselves are kept under <root>/%s/ "\n'
        '        "(ckpt_consolidation_keep). To consolidate every due checkpoint',
        'busy with an earlier one at that moment. To consolidate every due checkpoint',
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        "        str(policy),\n        RETAINED_DIRNAME,\n",
        "        str(policy),\n",
        until=UNTIL,
    ),  # fmt: skip
    Edit(
        "training/callback.py",
        "``save_top_k`` with ``_del_model_without_trainer`` (a plain ``rmtree``), not through\n"
        "    ``strategy.remove_checkpoint``. Wrapped here (on this ``ModelCheckpoint`` instance, once), each deletion "
        "first\n    keeps the checkpoint's output and moves ``LATEST``/``BEST`` off it, as a removal through the "
        "strategy does; the\n    deletion itself (and NeMo's barrier in it) is NeMo's, on every rank.",
        "``save_top_k`` with ``_del_model_without_trainer`` (a plain ``rmtree``), not through\n"
        "    ``strategy.remove_checkpoint``. Wrapped here (on this ``ModelCheckpoint`` instance, once), each deletion "
        "first\n    waits for a running consolidation of the checkpoint and drops a queued one, as a removal through "
        "the strategy\n    does; the deletion itself (and NeMo's barrier in it) is NeMo's, on every rank.",
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        '_never_fails_training("keeping the output of a checkpoint NeMo deletes")',
        '_never_fails_training("the consolidation of a checkpoint NeMo deletes")',
        until=UNTIL,
    ),
    Drop("training/callback.py", ("check_best_has_a_metric",), until=UNTIL),
    Edit(
        "training/callback.py",
        '    * ``on_fit_start``: with a ``"best"`` cadence, check that ``ModelCheckpoint`` monitors a metric (else\n'
        "      ``ValueError``, before any training step) and hand it to the checkpoint IO.\n",
        "    * ``on_fit_start``: tell the checkpoint IO that a ``fit`` starts.\n",
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        "    * ``on_train_end``: the same, then, with ``latest``, consolidate the newest finished checkpoint and, "
        "with\n      ``best``, the best one (``on_exception`` too: a run ending by an exception or a preemption).\n",
        "    * ``on_train_end``: the same, then, with ``latest``, consolidate the newest finished checkpoint\n"
        "      (``on_exception`` too: a run ending by an exception or a preemption).\n",
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        '        """Hand the trainer\'s ``ModelCheckpoint`` to the checkpoint IO and tell it a ``fit`` starts (global '
        'steps may\n'
        "        start again); route the checkpoints ``ModelCheckpoint`` deletes by itself through it\n"
        '        (:func:`_route_nemo_deletions`). A ``"best"`` cadence without a monitored metric raises '
        '``ValueError`` here,\n        on every rank, before any training step."""\n',
        '        """Tell the checkpoint IO a ``fit`` starts (global steps may start again); route the checkpoints\n'
        '        ``ModelCheckpoint`` deletes by itself through it (:func:`_route_nemo_deletions`)."""\n',
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        "        check_best_has_a_metric(trainer.checkpoint_callback, io.consolidation_policy)\n"
        "        io.checkpoint_callback = trainer.checkpoint_callback\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        "        temporary output that a killed consolidation process left in the run's checkpoint directories and "
        "retained\n        outputs (:func:`nemo_patch.engine.publish.remove_stale_tmp_dirs`), then repair "
        "``LATEST``/``BEST`` and queue\n        what an earlier, killed run of this root left due",
        "        temporary output that a killed consolidation process left in the run's checkpoint directories\n"
        "        (:func:`nemo_patch.engine.publish.remove_stale_tmp_dirs`), then queue what an earlier, killed run of "
        "this\n        root left due",
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        "            retained = Path(dirpath) / RETAINED_DIRNAME\n"
        "            entries = list(Path(dirpath).iterdir()) + (list(retained.iterdir()) if retained.is_dir() else "
        "[])\n            for checkpoint_dir in entries:\n",
        "            for checkpoint_dir in Path(dirpath).iterdir():\n",
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        '"checking LATEST, BEST and the consolidations an earlier run left due"',
        '"queueing the consolidations an earlier run left due"',
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        '        """``fit`` is ending by an exception: with ``latest``, still queue the newest finished checkpoint, '
        'with\n'
        "        ``best`` the best one (the strategy's teardown then waits for them, up to its timeout).\"\"\"\n",
        '        """``fit`` is ending by an exception: with ``latest``, still queue the newest finished checkpoint '
        '(the\n        strategy\'s teardown then waits for it, up to its timeout)."""\n',
        until=UNTIL,
    ),
    Edit(
        "training/callback.py",
        "            if policy.consolidates_at_fit_end:\n"
        "                io.consolidate_newest()\n"
        "            if policy.uses_best and io.checkpoint_callback is not None:\n"
        "                io.consolidate_best()\n",
        "            if policy.consolidates_at_fit_end:\n" "                io.consolidate_newest()\n",
        until=UNTIL,
    ),
]

# --- training/checkpoint_io.py --------------------------------------------------------------------------------------

CHECKPOINT_IO = [
    Edit(
        "training/checkpoint_io.py",
        '__all__ = ["ConsolidationRecord", "MegatronCheckpointIO", "best_record"]',
        '__all__ = ["ConsolidationRecord", "MegatronCheckpointIO"]',
        until=UNTIL,
    ),
    Edit(
        "training/checkpoint_io.py",
        "    :func:`nemo_patch.engine.consolidate.consolidate_checkpoint`); ``<root>/LATEST`` then points at the "
        "newest one.\n",
        "    :func:`nemo_patch.engine.consolidate.consolidate_checkpoint`).\n",
        until=UNTIL,
    ),
    Edit("training/checkpoint_io.py", "        self._checkpoint_callback: Optional[Any] = None\n", "", until=UNTIL),
    Drop(
        "training/checkpoint_io.py",
        (
            "MegatronCheckpointIO.checkpoint_callback",  # the property,
            "MegatronCheckpointIO.checkpoint_callback",  # then its setter
            "MegatronCheckpointIO._names_best",
            "MegatronCheckpointIO.consolidate_best",
        ),
        until=UNTIL,
    ),
    Edit(
        "training/checkpoint_io.py",
        "            best = (\n"
        "                best_record(self.checkpoint_callback)\n"
        "                if coordinator.schedule.policy.uses_best and self._names_best(path)\n"
        "                else None\n"
        "            )\n"
        '            save = coordinator.register(Path(ckpt_to_dir(path)), int(checkpoint.get("global_step", -1)), '
        'best)\n',
        '            save = coordinator.register(Path(ckpt_to_dir(path)), int(checkpoint.get("global_step", -1)))\n',
        until=UNTIL,
    ),
    Edit(
        "training/checkpoint_io.py",
        "        \"\"\"Run ``remove`` for a checkpoint (NeMo's removal, from any thread) without racing its "
        "consolidation, keeping\n        its consolidated output as ``ckpt_consolidation_keep`` says and moving "
        "``LATEST``/``BEST`` off it first (see\n"
        '        :meth:`ConsolidationCoordinator.remove_checkpoint`)."""',
        "        \"\"\"Run ``remove`` for a checkpoint (NeMo's removal, from any thread) without racing its "
        "consolidation (see\n"
        '        :meth:`ConsolidationCoordinator.remove_checkpoint`)."""',
        until=UNTIL,
    ),
]

# --- training/settings.py: no keep; a cadence without "best" -------------------------------------------------------

CADENCE_HELP = '''\
_CADENCE_HELP = (
    "``None`` (default), ``\\"each\\"`` (every finished checkpoint), ``\\"latest\\"`` (none during training; the "
    "newest finished checkpoint once when ``fit`` ends) or ``\\"every_n:<k>\\"`` (the k-th, 2k-th, ... finished "
    "checkpoint of the run, counted across resumes; k an integer >= 1). Giving a frequency turns consolidation on."
)'''

SETTINGS = [
    Drop("training/settings.py", ("ConsolidationSettings.keep", "validate_keep"), until=UNTIL),
    Replace("training/settings.py", "_CADENCE_HELP", CADENCE_HELP, until=UNTIL),
]

RETENTION = ENGINE + POLICY + COORDINATOR + CALLBACK + CHECKPOINT_IO + SETTINGS

# --- the knob stage's strategy test: "best" and keep are accepted from the retention stage on --------------------

STRATEGY_TESTS = "tree/tests/lightning/consolidation/test_megatron_strategy_consolidation.py"

RETENTION += [
    Edit("docs/04-knob.rst", "its output is kept (see below).", "its output goes with it.", until=UNTIL),
    Edit(STRATEGY_TESTS, '        ({"ckpt_consolidation_frequency": "best"}, "best"),\n', "", until=UNTIL),
    Edit(
        STRATEGY_TESTS,
        "'\"each\", \"latest\", \"best\" or \"every_n:<k>\"'",
        "'\"each\", \"latest\" or \"every_n:<k>\"'",
        until=UNTIL,
    ),
    Edit(
        STRATEGY_TESTS,
        '        ({"ckpt_consolidation_keep": -1}, "None (keep every consolidated output) or an integer >= 0"),\n',
        "",
        until=UNTIL,
    ),
]
