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

"""A state-machine property test of a save's identity (#45 item 6): a seeded random walk over REAL saves.

Every step acts on one NeMo log directory (one checkpoint root) as a user, a scheduler or a crash would:

* ``fit``: a real CPU fit of the tiny GPT (``nemo_patch.testing.fit_run`` in a subprocess): a new run (resume off:
  NeMo names reused checkpoints ``-v1``, ``-last-v1``) or a resume of the newest ``-last`` checkpoint; with the
  overlay's training-time consolidation (``each`` or ``every_n:2``) or stock NeMo (the overlay off) with the sidecar
  (``nemo-consolidate ROOT --watch``) beside it; ``every_n_train_steps`` 1 or 2, ``save_top_k`` -1, 1 or 2 (NeMo
  removes checkpoints), sync or async save; the training job killed (SIGKILL at a global step, in the middle of a
  consolidation, between a removal's record and its delete, or at a random moment), the sidecar killed (SIGKILL at a
  random moment) or stopped and restarted;
* ``watch``: the sidecar alone, ``--until-idle``, run to its end or SIGKILLed in the middle of its work (a drawn
  0-0.4 s after its first staging directory appears);
* ``resave``: a finished checkpoint saved again in place under its name with other tensors (megatron-core's
  ``dist_checkpointing.save``, as a Megatron-LM rollback does).

After every step two invariants are checked:

1. **Truth**: every published output (``<ckpt>/consolidated`` of a finished checkpoint,
   ``retained/<name>/consolidated``) holds its own save's tensors, bit for bit, read by megatron-core's
   ``dist_checkpointing.load_plain_tensors`` (:mod:`nemo_patch.testing.mcore_compare`, not the product's reader): a
   live checkpoint's output against that very
   checkpoint directory, a retained output against a copy of its checkpoint's weights taken the moment its save
   finished (``CheckpointSnapshots(copy=True)`` in the fit; the test's own copy for a re-save), the save it records
   (``metadata.json``'s ``save.finished_ns``: the modification time of the save's ``.metadata``).
   The one exemption: the output a checkpoint held when this test re-saved it in place (the product did not write it
   against the new save; the test checked it against the old one before).
2. **LATEST**: ``ROOT/LATEST`` names a live output of the newest save in run order (the order ``docs/retention.md``
   gives: saves of a known run by (run start, global step), after every save whose run is unknown, those by the time
   they finished), among the saves that have a live output. The ground truth is the test's own book of which step
   made which save, never the product's run ids. This is checked strictly after a step in which a product process
   ran to its end and nothing was killed; after a kill (or while a re-saved checkpoint waits for a sidecar) ``LATEST``
   may lag or dangle, but may never name anything but a live output. After a sidecar ran to its end, no staging
   directory of a dead sidecar is left in the root.

Cost: a fit is 15-40 s on a 2-core machine, a sidecar's start-up a few seconds. CI runs one walk of
``NEMO_PATCH_STATE_MACHINE_STEPS`` (default 6) steps with the fixed seed ``NEMO_PATCH_STATE_MACHINE_SEED`` (default
:data:`CI_SEED`). A longer run: ``NEMO_PATCH_STATE_MACHINE_EXAMPLES=50`` (walks with seeds ``SEED .. SEED+49``),
``NEMO_PATCH_STATE_MACHINE_STEPS=10`` (docs/development.md). A failure names its seed and step and keeps the walk's
directory (its step logs) for reproduction.
"""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple
from unittest import mock

import pytest
from conftest import REPO

from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.testing.mcore_compare import compare

#: The walk CI runs: its steps cover a new run and a resume, both consolidation sides, top-k removals, a re-save and
#: kills of training and of the sidecar (:func:`test_the_ci_walk_covers_every_kind_of_step`). On the code before #45 it
#: fails at step 1: two stock runs in one root with the sidecar beside each, the sidecar hard-linked run A's output
#: into run B's ``...step=1-consumed_samples=4.0-v1`` (seed 1002 finds the same in ``-last-v1``).
CI_SEED = 16352
SEED = int(os.environ.get("NEMO_PATCH_STATE_MACHINE_SEED", str(CI_SEED)))
EXAMPLES = int(os.environ.get("NEMO_PATCH_STATE_MACHINE_EXAMPLES", "1"))
STEPS = int(os.environ.get("NEMO_PATCH_STATE_MACHINE_STEPS", "6"))

RETAINED = "retained"
LATEST = "LATEST"
_STEP = re.compile(r"step=(\d+)")
_LAST = re.compile(r"-last(-v\d+)?$")


# ----------------------------------------------------------------------------------------------------------------
# The walk: steps drawn from a seeded generator
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One step of a walk (see the module docstring); ``options`` are drawn, the rest is what happened."""

    kind: str  # "fit" | "watch" | "resave"
    options: Dict[str, Any]
    killed: bool = False
    note: str = ""

    def describe(self) -> str:
        text = f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.options.items())})"
        return text + (" KILLED" if self.killed else "") + (f" [{self.note}]" if self.note else "")


def draw_step(rng: random.Random, index: int, has_checkpoints: bool) -> Step:
    """The ``index``-th step of a walk (the first is always a fit)."""
    roll = rng.random()
    if index > 0 and has_checkpoints and roll < 0.18:
        return Step("watch", {"frequency": rng.choice(["each", "each", "latest"]),
                              "kill_after": rng.choice([None, round(rng.uniform(0.0, 4.0), 1)])})  # fmt: skip
    if index > 0 and has_checkpoints and roll < 0.32:
        return Step("resave", {"pick": rng.random(), "delta": round(rng.uniform(0.1, 1.0), 3)})
    stock = rng.random() < 0.45
    options: Dict[str, Any] = {
        "stock": stock,
        "new_run": index == 0 or rng.random() < 0.4,
        "steps": rng.randint(2, 4),
        "save_every": rng.choice([1, 2]),
        "top_k": rng.choice([-1, 1, 2]),
        "async_save": rng.random() < 0.5,
    }
    kills = [None, None, "die", "sigkill"]
    if stock:
        options["sidecar"] = rng.choice(["beside", "beside", "killed", "none"])
    else:
        options["frequency"] = rng.choice(["each", "every_n:2"])
        kills += ["jobkill"] + (["killremoval"] if options["top_k"] > 0 else [])
    options["kill"] = rng.choice(kills)
    options["kill_at"] = round(rng.uniform(0.2, 0.9), 2)  # where in the fit (fraction of its steps or of its time)
    if options["sidecar" if stock else "kill"] in ("killed", "sigkill"):
        options["kill_after"] = round(rng.uniform(4.0, 30.0), 1)
    return Step("fit", options)


# ----------------------------------------------------------------------------------------------------------------
# The test's own book of saves (the ground truth)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Save:
    """One save the walk made: a checkpoint name and its ``.metadata`` (mtime, size), a copy of its weights, and its
    place in run order."""

    name: str
    finished_ns: int
    size: int
    snapshot: Path
    stock: bool
    run: int  # the walk's index of the fit that started its run (overlay saves); unused for stock saves
    global_step: int
    fit: int  # the walk's index of the step that made it

    @property
    def last_copy(self) -> bool:
        return bool(_LAST.search(self.name))


@dataclass
class Book:
    """Every save of the walk, and what the invariants need to remember between steps."""

    saves: List[Save] = field(default_factory=list)
    #: Outputs a checkpoint held when the test re-saved it in place: (checkpoint name, inode of its metadata.json).
    stale: Set[Tuple[str, int]] = field(default_factory=set)
    #: (output path, file keys) already compared and found true.
    compared: Set[Tuple[Any, ...]] = field(default_factory=set)

    def find(self, name: str, finished_ns: int, size: int) -> Optional[Save]:
        for save in self.saves:
            if (save.name, save.finished_ns, save.size) == (name, finished_ns, size):
                return save
        return None

    def order(self, save: Save) -> Tuple[Any, ...]:
        """Run order: a save of a known run after every save whose run is unknown; known runs by when the run
        started, then global step; unknown ones by when they finished (a ``-last`` copy with its step's save)."""
        if not save.stock:
            return (1, save.run, save.global_step)
        if save.last_copy:
            own = [s for s in self.saves if s.fit == save.fit and s.stock and not s.last_copy
                   and s.global_step == save.global_step]  # fmt: skip
            if own:
                return (0, max(s.finished_ns for s in own))
        return (0, save.finished_ns)


def _global_step(name: str) -> int:
    """NeMo's ``step=<N>`` in a checkpoint name is the 0-based index of the last step: the global step is N + 1."""
    found = _STEP.search(name)
    assert found, name
    return int(found.group(1)) + 1


def _metadata_key(checkpoint: Path) -> Optional[Tuple[int, int]]:
    try:
        info = os.stat(checkpoint / "weights" / ".metadata")
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _finished_checkpoints(root: Path) -> List[Path]:
    """The root's checkpoints whose save finished and that NeMo has not marked unfinished (being removed)."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or path.name == RETAINED or path.is_symlink() or not path.is_dir():
            continue
        if path.name.endswith("-unfinished") or (root / f"{path.name}-unfinished").exists():
            continue
        if (path / "weights" / ".metadata").is_file() and _STEP.search(path.name):
            found.append(path)
    return found


def _copy_weights(weights: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for file in sorted(weights.rglob("*")):
        if file.is_file():
            (target / file.relative_to(weights)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target / file.relative_to(weights))


# ----------------------------------------------------------------------------------------------------------------
# The walk's machine
# ----------------------------------------------------------------------------------------------------------------


class Walk:
    """One walk over one log directory; :meth:`run` draws and applies steps, checking both invariants after each."""

    def __init__(self, seed: int, steps: int, base: Path) -> None:
        self.seed, self.steps, self.base = seed, steps, base
        self.rng = random.Random(seed)
        self.out = base / "log"  # the NeMo log dir
        self.root = self.out / "tiny_gpt" / "checkpoints"
        self.book = Book()
        self.done: List[Step] = []
        self.runs: Dict[int, int] = {}  # not used for stock; fit index -> run index
        self.fits = 0

    # -- reporting ---------------------------------------------------------------------------------------------

    def history(self) -> str:
        lines = [f"walk seed={self.seed} (NEMO_PATCH_STATE_MACHINE_SEED={self.seed}), dir {self.base}"]
        lines += [f"  step {i}: {step.describe()}" for i, step in enumerate(self.done)]
        return "\n".join(lines)

    def fail(self, message: str) -> None:
        pytest.fail(f"{message}\n{self.history()}", pytrace=False)

    # -- steps -------------------------------------------------------------------------------------------------

    def run(self) -> List[Step]:
        for index in range(self.steps):
            step = draw_step(self.rng, index, bool(_finished_checkpoints(self.root)))
            self.done.append(step)
            strict = getattr(self, f"_{step.kind}")(step, index)
            self._register(index, step)
            self._check_truth(step)
            self._check_latest(step, strict)
            if strict and (step.kind == "watch" or step.options.get("sidecar") in ("beside", "killed")):
                self._check_no_dead_staging()
        return self.done

    def _step_dir(self, index: int) -> Path:
        path = self.base / f"step-{index}"
        path.mkdir(exist_ok=True)
        return path

    def _resumed(self) -> Optional[Path]:
        """The checkpoint NeMo 2.7.3's ``AutoResume`` picks: the finished ``*last`` checkpoint (a ``-last-v1`` is not
        one) modified last."""
        found = [p for p in _finished_checkpoints(self.root) if p.name.endswith("last")]
        return max(found, key=lambda p: p.lstat().st_mtime) if found else None

    def _fit(self, step: Step, index: int) -> bool:
        options = step.options
        resumed = None if options["new_run"] else self._resumed()
        start = _global_step(resumed.name) if resumed else 0
        max_steps = start + options["steps"]
        if resumed is not None and not options["stock"]:
            own = self._save_of(resumed)
            run = own.run if own is not None and not own.stock else index  # a stock checkpoint records no run
        else:
            run = index
        self.runs[index] = run
        step.note = f"resumes {resumed.name} at {start}" if resumed else "new run"
        args: Dict[str, Any] = dict(max_steps=max_steps, save_every=options["save_every"], monitor="step",
                                    save_top_k=options["top_k"], async_save=options["async_save"],
                                    snapshot_copies=True, new_run=options["new_run"],
                                    lr=f"{1e-3 * (1 + 0.3 * index):.6f}")  # fmt: skip
        if not options["stock"]:
            args.update(frequency=options["frequency"], max_pending=8)
        kill = options["kill"]
        if kill == "die" and max_steps - 1 > start:
            args["fault"] = f"die:{start + 1 + int(options['kill_at'] * (max_steps - 2 - start))}"
        elif kill in ("jobkill", "killremoval"):
            args["fault"] = f"{kill}:1"
        logs = self._step_dir(index)
        watcher = None
        if options.get("sidecar") in ("beside", "killed"):
            watcher = _Watcher(self.root, logs / "sidecar.log", frequency="each", until_idle=None)
            if options["sidecar"] == "killed":
                watcher.kill_after(options["kill_after"])
        fit = _FitProcess(self.out, logs / "fit.log", stock=options["stock"], **args)
        if kill == "sigkill":  # 1.8-5.3 s after its first save started
            fit.kill_after(0.8 + 5 * options["kill_at"], ready="Global Checkpoint Save")
        code = fit.wait()
        if (self.out / "snapshots").is_dir():
            shutil.move(str(self.out / "snapshots"), logs / "snapshots")
        killed = code == -signal.SIGKILL
        if code not in (0, -signal.SIGKILL):
            self.fail(f"step {index}: the fit failed (rc={code}); see {logs / 'fit.log'}:\n{fit.tail()}")
        step.killed = killed
        if watcher is not None:
            watcher.stop()
            step.killed = killed or watcher.killed
            # the sidecar (re)started once the training job has ended, run until idle: whatever the training job and
            # the first sidecar left (a kill's included), the sidecar has done its part now
            again = _Watcher(self.root, logs / "sidecar-final.log", frequency="each", until_idle=2.0)
            if again.wait() != 0:
                step.note += f"; the restarted sidecar exited {again.proc.returncode}"
            return True
        if options["stock"]:
            return False  # nothing of the product ran
        return not killed and self._published_in(logs)

    def _published_in(self, logs: Path) -> bool:
        """Whether the overlay's fit reported a completed consolidation."""
        try:
            report = json.loads((self.out / "report.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(report.get("completed_steps")) and report.get("global_rank_zero", True)

    def _watch(self, step: Step, index: int) -> bool:
        logs = self._step_dir(index)
        kill_after = step.options["kill_after"]
        watcher = _Watcher(self.root, logs / "watch.log", frequency=step.options["frequency"], until_idle=2.0)
        if kill_after is not None:  # 0-0.4 s after its first staging directory appears: in the middle of its work
            root = self.root
            watcher.kill_after(kill_after / 10, ready=lambda: any(root.glob(f"{TMP_PREFIX}*")) or root.exists()
                               and "Consolidated " in watcher.log.read_text(errors="replace"))  # fmt: skip
        code = watcher.wait()
        step.killed = watcher.killed
        if not watcher.killed and code != 0:
            step.note = f"rc={code}"
        return not watcher.killed and step.options["frequency"] == "each"

    def _resave(self, step: Step, index: int) -> bool:
        candidates = [p for p in _finished_checkpoints(self.root) if not _LAST.search(p.name)]
        if not candidates:
            step.note = "nothing to re-save"
            return False
        checkpoint = candidates[int(step.options["pick"] * len(candidates))]
        own = self._save_of(checkpoint)
        output = checkpoint / "consolidated" / "metadata.json"
        if output.is_file():
            self._check_truth(step)  # the old output is its old save's before it goes stale
            self.book.stale.add((checkpoint.name, output.stat().st_ino))
        _resave_in_place(checkpoint / "weights", step.options["delta"])
        key = _metadata_key(checkpoint)
        assert key is not None
        snapshot = self._step_dir(index) / "snapshots" / checkpoint.name / "weights"
        _copy_weights(checkpoint / "weights", snapshot)
        self.book.saves.append(Save(checkpoint.name, key[0], key[1], snapshot, own.stock if own else True,
                                    own.run if own else index, _global_step(checkpoint.name), index))  # fmt: skip
        step.note = f"re-saved {checkpoint.name}"
        return False  # nothing of the product ran: LATEST may name the re-saved checkpoint's stale output

    # -- the book ----------------------------------------------------------------------------------------------

    def _save_of(self, checkpoint: Path) -> Optional[Save]:
        key = _metadata_key(checkpoint)
        return self.book.find(checkpoint.name, *key) if key else None

    def _register(self, index: int, step: Step) -> None:
        """Book the saves this step made: the fit's snapshots (copied as each save finished), then any finished
        checkpoint of the root not booked yet (a save the fit was killed after, before its snapshot)."""
        stock = bool(step.options.get("stock"))
        run = self.runs.get(index, index)
        snapshots = self.base / f"step-{index}" / "snapshots"
        for snapshot in sorted(snapshots.iterdir()) if step.kind == "fit" and snapshots.is_dir() else []:
            info = os.stat(snapshot / "weights" / ".metadata")
            if self.book.find(snapshot.name, info.st_mtime_ns, info.st_size) is None:
                self.book.saves.append(Save(snapshot.name, info.st_mtime_ns, info.st_size, snapshot / "weights",
                                            stock, run, _global_step(snapshot.name), index))  # fmt: skip
        for checkpoint in _finished_checkpoints(self.root):
            key = _metadata_key(checkpoint)
            if key is None or self.book.find(checkpoint.name, *key) is not None:
                continue
            if step.kind != "fit":
                self.fail(f"step {index}: {checkpoint.name} holds a save no fit made ({step.kind})")
            target = self.base / f"step-{index}" / "late-snapshots" / checkpoint.name / "weights"
            _copy_weights(checkpoint / "weights", target)
            self.book.saves.append(Save(checkpoint.name, key[0], key[1], target, stock, run,
                                        _global_step(checkpoint.name), index))  # fmt: skip

    # -- the invariants ----------------------------------------------------------------------------------------

    def _outputs(self) -> List[Tuple[Path, Path, Optional[Save], bool]]:
        """Every published output: (entry the pointer would name, output dir, its save, stale). A live checkpoint's
        output's save is the checkpoint's current save; a retained one's is the save its metadata.json records."""
        found: List[Tuple[Path, Path, Optional[Save], bool]] = []
        for checkpoint in _finished_checkpoints(self.root):
            output = checkpoint / "consolidated"
            if not (output / "metadata.json").is_file():
                continue
            stale = (checkpoint.name, (output / "metadata.json").stat().st_ino) in self.book.stale
            found.append((checkpoint, output, self._save_of(checkpoint), stale))
        retained = self.root / RETAINED
        for entry in sorted(retained.iterdir()) if retained.is_dir() else []:
            output = entry / "consolidated"
            if entry.name.startswith(".") or not (output / "metadata.json").is_file():
                continue
            found.append((entry, output, self._retained_save(entry, output), False))
        return found

    def _retained_save(self, entry: Path, output: Path) -> Optional[Save]:
        metadata = json.loads((output / "metadata.json").read_text())
        name = metadata.get("retained_from") or entry.name
        recorded = (metadata.get("save") or {}).get("finished_ns")
        same_name = [save for save in self.book.saves if save.name == name]
        exact = [save for save in same_name if save.finished_ns == recorded]
        if exact:
            return exact[-1]
        for save in same_name:  # no identity recorded (an older output): the save of that name it equals
            try:
                compare(save.snapshot, output)
                return save
            except AssertionError:
                continue
        return None

    def _check_truth(self, step: Step) -> None:
        for entry, output, save, stale in self._outputs():
            if stale:
                continue
            if entry.parent == self.root:
                weights = entry / "weights"
            elif save is None:
                self.fail(f"after step {len(self.done) - 1}: {entry.relative_to(self.root)} (retained) holds none of "
                          "the saves of its checkpoint's name this walk made (nor the one it records)")  # fmt: skip
                return
            else:
                weights = save.snapshot
            key = (str(output), _file_keys(output), _file_keys(weights))
            if key in self.book.compared:
                continue
            try:
                compare(weights, output)
            except AssertionError as error:
                self.fail(f"after step {len(self.done) - 1}: TRUTH violated: {entry.relative_to(self.root)}/"
                          f"consolidated is not its own save ({weights}): {error}")  # fmt: skip
            self.book.compared.add(key)

    def _check_no_dead_staging(self) -> None:
        """After a sidecar ran to its end: no staging directory of a dead sidecar is left in the root (#45: "stale
        staging directories of a dead watcher are removed on the next start"; a killed one leaves its own)."""
        for entry in sorted(self.root.glob(f"{TMP_PREFIX}*")) if self.root.is_dir() else []:
            owner = entry.name[len(TMP_PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                self.fail(f"after step {len(self.done) - 1}: a dead sidecar's staging directory is left after a "
                          f"sidecar ran to its end: {entry.name}")  # fmt: skip

    def _check_latest(self, step: Step, strict: bool) -> None:
        outputs = [(entry, save) for entry, _, save, stale in self._outputs() if not stale and save is not None]
        link = self.root / LATEST
        where = f"after step {len(self.done) - 1} ({'strict' if strict else 'after a kill or a re-save'})"
        named: Optional[Path] = None
        if os.path.lexists(link):
            target = Path(os.path.realpath(link))
            if not target.exists():
                if strict:
                    self.fail(f"{where}: LATEST dangles ({os.readlink(link)})")
                return
            named = target
            live = {entry.resolve(): save for entry, save in outputs}
            stale = {entry.resolve() for entry, _, _, is_stale in self._outputs() if is_stale}
            if named not in live:
                if named in stale and not strict:
                    return  # the checkpoint the test re-saved; a sidecar's next pass moves on
                self.fail(f"{where}: LATEST names {os.readlink(link)}, which is not a live output")
        if not strict:
            return
        if not outputs:
            if named is not None:
                self.fail(f"{where}: LATEST names {os.readlink(link)} but the root has no output")
            return
        newest = max(self.book.order(save) for _, save in outputs)
        expected = sorted(str(entry.relative_to(self.root)) for entry, save in outputs
                          if self.book.order(save) == newest)  # fmt: skip
        if named is None:
            self.fail(f"{where}: no LATEST, expected one of {expected}")
        saves = {entry.resolve(): save for entry, save in outputs}
        got = saves[named]  # type: ignore[index]
        if self.book.order(got) != newest:
            self.fail(f"{where}: LATEST VIOLATED: it names {os.readlink(link)} (order {self.book.order(got)}), "
                      f"the newest save in run order with a live output is {expected} (order {newest})")  # fmt: skip


def _file_keys(directory: Path) -> Tuple[Tuple[str, int, int, int], ...]:
    """(name, inode, size, mtime_ns) of every file under ``directory``: a comparison is done again when one changes."""
    keys = []
    for file in sorted(directory.rglob("*")):
        if file.is_file():
            info = file.stat()
            keys.append((str(file.relative_to(directory)), info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(keys)


# ----------------------------------------------------------------------------------------------------------------
# Processes: a fit, a sidecar, a re-save
# ----------------------------------------------------------------------------------------------------------------


class _Process:
    """A subprocess in a session of its own (so that a SIGKILL reaches it and every process it started)."""

    #: Every process started, so that a failing walk leaves none behind (:meth:`kill_all`).
    started: List["_Process"] = []

    @classmethod
    def kill_all(cls) -> None:
        """SIGKILL every process this test started that still runs (and its session)."""
        while cls.started:
            process = cls.started.pop()
            if process.proc.poll() is None:
                process.kill()
                process.proc.wait()

    def __init__(self, args: List[str], log: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.log = log
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")  # its log lines as they are written
        self._handle = open(log, "w")
        self.proc = subprocess.Popen(args, stdout=self._handle, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     start_new_session=True)  # fmt: skip
        _Process.started.append(self)
        self.killed = False
        self._timer: Optional[threading.Thread] = None
        self._cancelled = threading.Event()

    def kill_after(self, seconds: float, ready: Any = None) -> None:
        """SIGKILL it ``seconds`` after it starts, or after its log first shows ``ready`` (a string), or after
        ``ready()`` (a callable) first holds: its start-up, a few seconds on a loaded machine, does not count."""

        def is_ready() -> bool:
            if callable(ready):
                return bool(ready())
            return ready in self.log.read_text(errors="replace")

        def wait_then_kill() -> None:
            deadline = time.monotonic() + 300
            while ready is not None and time.monotonic() < deadline and self.proc.poll() is None:
                if is_ready():
                    break
                time.sleep(0.01)
            if not self._cancelled.wait(seconds):
                self.kill()

        self._timer = threading.Thread(target=wait_then_kill, daemon=True)
        self._timer.start()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 900) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._cancelled.set()
            if self._timer is not None:
                self._timer.join()
            self._handle.close()
        if self.killed:  # every process of its session, not only the leader
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return code

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


class _FitProcess(_Process):
    def __init__(self, out: Path, log: Path, stock: bool, **options: Any) -> None:
        args = [sys.executable, "-m", "nemo_patch.testing.fit_run", "--out", str(out),
                "--json", str(out / "report.json")]  # fmt: skip
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is not None and value is not False:
                args += [flag, str(value)]
        env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
        if stock:
            args.append("--stock")
            env["NEMO_PATCH_DISABLE"] = "1"
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").unlink(missing_ok=True)
        super().__init__(args, log, env)


class _Watcher(_Process):
    def __init__(self, root: Path, log: Path, frequency: str, until_idle: Optional[float]) -> None:
        args = [sys.executable, "-m", "nemo_patch", str(root), "--watch", "--frequency", frequency,
                "--poll-interval", "0.2", "--workers", "1"]  # fmt: skip
        if until_idle is not None:
            args += ["--until-idle", str(until_idle)]
        env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
        super().__init__(args, log, env)

    def kill_after(self, seconds: float, ready: Optional[str] = "Watching ") -> None:
        super().kill_after(seconds, ready)

    def wait(self, timeout: float = 900) -> int:
        code = super().wait(timeout)
        if "Traceback (most recent call last)" in self.log.read_text(errors="replace"):
            pytest.fail(f"the sidecar crashed (rc={code}): {self.log}\n{self.tail()}", pytrace=False)
        return code

    def stop(self) -> int:
        """SIGTERM (the watcher abandons what it writes and exits), then wait."""
        self._cancelled.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout=300)


def _resave_in_place(weights: Path, delta: float) -> None:
    """Save the checkpoint's weights again in place with megatron-core's ``dist_checkpointing.save``: every tensor
    (the model's plus ``delta``), the common state as it was. megatron-core only warns ("Overwriting") and writes
    ``.metadata`` last, as a Megatron-LM rollback does."""
    import pathlib

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with torch.serialization.safe_globals([pathlib.PosixPath, pathlib.Path]):
            plain = dist_checkpointing.load_plain_tensors(str(weights))
            common = dist_checkpointing.load_common_state_dict(str(weights))
        state: Dict[str, Any] = dict(common)
        for key, tensor in plain.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if key.startswith("module.") and tensor.is_floating_point() and "_extra_state" not in key:
                tensor = tensor + delta
            state[key] = ShardedTensor.from_rank_offsets(key, tensor.contiguous(), replica_id=0)
        time.sleep(0.01)  # a modification time after the old save's
        # megatron-core's writer synchronizes CUDA and broadcasts its status from the current CUDA device: on the CPU
        with (
            mock.patch.object(torch.cuda, "synchronize", lambda *args, **kwargs: None),
            mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        ):
            dist_checkpointing.save(state, str(weights))
    finally:
        if created:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------------------


def _kinds(seed: int, steps: int) -> Set[str]:
    """What a walk's drawn steps exercise, as far as the draw alone tells (``has_checkpoints`` taken as true)."""
    rng = random.Random(seed)
    kinds: Set[str] = set()
    for index in range(steps):
        step = draw_step(rng, index, True)
        options = step.options
        kinds.add(step.kind)
        if step.kind == "fit":
            kinds.add("stock NeMo with the sidecar beside" if options.get("sidecar") in ("beside", "killed") else "")
            kinds.add("" if options["stock"] else "training-time consolidation")
            if index > 0:
                kinds.add("a new run in the root" if options["new_run"] else "a resume")
            kinds.add("top-k removals" if options["top_k"] > 0 else "")
            kinds.add("training killed" if options["kill"] else "")
            kinds.add("sidecar killed" if options.get("sidecar") == "killed" else "")
        if step.kind == "watch" and options["kill_after"] is not None:
            kinds.add("sidecar killed")
    return kinds - {""}


def test_the_ci_walk_covers_every_kind_of_step():
    """The CI walk's draw covers every kind of step #45 item 6 names (cheap: nothing runs)."""
    wanted = {"fit", "watch", "resave", "stock NeMo with the sidecar beside", "training-time consolidation",
              "a new run in the root", "a resume", "top-k removals", "training killed", "sidecar killed"}  # fmt: skip
    assert wanted <= _kinds(CI_SEED, 6), sorted(wanted - _kinds(CI_SEED, 6))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SEED, SEED + EXAMPLES))
def test_save_identity_random_walk(seed, tmp_path):
    """A walk of real fits, sidecars, kills and re-saves over one log directory; both invariants after every step."""
    walk = Walk(seed, STEPS, tmp_path)
    started = time.monotonic()
    try:
        walk.run()
    finally:
        _Process.kill_all()
    print(walk.history())
    print(f"{len(walk.book.saves)} saves, {len(walk.book.compared)} outputs compared, "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
