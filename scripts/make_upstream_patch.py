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

"""Write the NeMo-native form of nemo-patch as a unified diff against NeMo's own source tree.

Usage: ``python scripts/make_upstream_patch.py [--nemo-src DIR] [--out FILE]``

``--nemo-src`` is the directory that holds NeMo's ``nemo/`` package: an unpacked ``nemo_toolkit`` wheel, or by default
the installed package of this interpreter (which ``pip`` unpacked from the pinned wheel; its files are checked against
the wheel's ``RECORD`` hashes). The diff, with ``a/`` and ``b/`` prefixes relative to that directory (NeMo's repository
root), applies with ``git apply`` and:

* adds ``nemo/lightning/io/consolidation/``: this package's layers as subpackages of it, imports renamed:
  ``engine/`` (the consolidation engine), ``training/`` (settings, cadence, schedule, queue, worker, callback,
  ``LATEST`` and the consolidating checkpoint IO; not the strategy subclass, which becomes edits of NeMo's strategy),
  ``export/`` (Hugging Face) and ``cli/`` (``nemo-consolidate``); the overlay does not move;
* edits ``nemo/lightning/pytorch/strategies/megatron_strategy.py``: the consolidation arguments on
  ``MegatronStrategy.__init__`` (documented and validated first), the IO built with them, the callback added in
  ``setup``, the wait in ``teardown``, the safe ``remove_checkpoint`` and ``consolidate_latest_checkpoint``;
* edits ``nemo/lightning/pytorch/strategies/utils.py``: ``create_checkpoint_io`` builds the consolidating IO when
  consolidation arguments are given;
* edits ``nemo/lightning/io/pl.py``: ``ConsolidatingMegatronCheckpointIO`` importable next to ``MegatronCheckpointIO``;
* adds ``tests/lightning/consolidation/``: the unit tests, ported (imports renamed), plus tests of the native strategy.

Every edit is anchored on exact text of NeMo 2.7.3; a missing anchor stops the script with the anchor named, so a
NeMo that moved on is noticed, not silently mis-patched. ``tests/test_upstream_patch.py`` applies the diff to a copy of
the pinned source and runs the ported tests there with the overlay disabled.
"""

import argparse
import base64
import csv
import difflib
import hashlib
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "nemo.lightning.io.consolidation"
PACKAGE_DIR = "nemo/lightning/io/consolidation"
STRATEGY = "nemo/lightning/pytorch/strategies/megatron_strategy.py"
STRATEGY_UTILS = "nemo/lightning/pytorch/strategies/utils.py"
IO_PL = "nemo/lightning/io/pl.py"
TESTS_DIR = "tests/lightning/consolidation"

#: nemo-patch subpackages that move into NeMo unchanged but for their imports (the overlay and the test helpers do
#: not move).
MOVED_PACKAGES = ["engine", "training", "export", "cli"]
#: Modules of those that do not move: the strategy subclass becomes edits of NeMo's own strategy.
NOT_MOVED = {"training/strategy.py"}
#: nemo-patch unit tests ported into NeMo's test layout.
PORTED_TESTS = [
    "test_consolidation_policy.py",
    "test_consolidation_schedule.py",
    "test_consolidation_settings.py",
]

HEADER = (REPO / "nemo_patch" / "engine" / "consolidate.py").read_text().split('"""', 1)[0]

PACKAGE_INIT = (
    HEADER
    + '''"""Checkpoint consolidation: finished distributed checkpoints to unsharded safetensors (or a Hugging Face
directory), at the cadence ``MegatronStrategy(ckpt_consolidation_frequency=...)`` asks for. ``engine`` holds the
consolidation itself (see ``engine.consolidate`` for the format), ``training`` the settings, cadence and the
consolidating checkpoint IO, ``export`` the Hugging Face export and ``cli`` the ``nemo-consolidate`` command."""
'''
)

STRATEGY_DOC = '''        **kwargs: Additional keyword arguments.
        save_consolidated (Optional[bool]): None (default) or False: no checkpoint consolidation unless a frequency is
            given; True: consolidate at "each" unless a frequency is given. False with a frequency raises ValueError.
        ckpt_consolidation_frequency (Optional[str]): when finished checkpoints are consolidated into unsharded
            safetensors: "each", "latest" (none during training, the newest finished checkpoint once when fit ends),
            "every_n:<k>" (the k-th, 2k-th, ... finished checkpoint, counted across resumes), "best" (those
            ModelCheckpoint ranked best by its monitored metric when saved; <root>/BEST names the best), or phases
            such as "every_n:10; each@50000". Giving one turns consolidation on; see
            nemo.lightning.io.consolidation.
        ckpt_consolidation_timeout (float): seconds the end of fit waits for running and queued consolidations.
        ckpt_consolidation_max_shard_size (Union[int, str]): most bytes per output safetensors file ("5GB").
        ckpt_consolidation_max_pending (int): consolidation requests that may wait behind the running one.
        ckpt_consolidation_keep (Optional[int]): consolidated outputs kept (under <root>/retained/) when top-k removes
            their checkpoints: None all, N while among the newest N outputs, 0 none.
        ckpt_consolidation_format (str): "safetensors" (<ckpt>/consolidated) or "hf" (<ckpt>/hf, through the model's
            registered Hugging Face exporter).
        ckpt_consolidation_dtype (Optional[str]): output dtype, "bf16", "fp16" or "fp32"; None keeps the
            checkpoint's.
        ckpt_consolidation_merge_adapters (bool): for PEFT (LoRA) adapter checkpoints, write the base model with the
            adapters merged instead of the adapters alone.
        ckpt_consolidation_workers (Optional[int]): writer processes per writing node; None is a quarter of its cores.
'''

STRATEGY_ARGS = """        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
        ckpt_consolidation_timeout: float = 1800.0,
        ckpt_consolidation_max_shard_size: Union[int, str] = 5_000_000_000,
        ckpt_consolidation_max_pending: int = 2,
        ckpt_consolidation_format: str = "safetensors",
        ckpt_consolidation_keep: Optional[int] = None,
        ckpt_consolidation_dtype: Optional[str] = None,
        ckpt_consolidation_merge_adapters: bool = False,
        ckpt_consolidation_workers: Optional[int] = None,
"""

STRATEGY_VALIDATION = """        # Consolidation settings: validated first, once.
        from nemo.lightning.io.consolidation.training.settings import ConsolidationSettings

        self.consolidation_settings = ConsolidationSettings.from_arguments(
            save_consolidated,
            ckpt_consolidation_frequency,
            timeout=ckpt_consolidation_timeout,
            max_shard_size=ckpt_consolidation_max_shard_size,
            max_pending=ckpt_consolidation_max_pending,
            output_format=ckpt_consolidation_format,
            keep=ckpt_consolidation_keep,
            dtype=ckpt_consolidation_dtype,
            merge_adapters=ckpt_consolidation_merge_adapters,
            workers=ckpt_consolidation_workers,
        )
        self.consolidation_policy = self.consolidation_settings.policy
"""

STRATEGY_CALLBACK = """
        # add the checkpoint consolidation callback if consolidation is on
        if self.consolidation_policy is not None:
            from nemo.lightning.io.consolidation.training.callback import ConsolidationCallback

            if not any(isinstance(callback, ConsolidationCallback) for callback in self.trainer.callbacks):
                self.trainer.callbacks.append(ConsolidationCallback(self.trainer))
"""

STRATEGY_TEARDOWN = '''        """Tearsdown the strategy"""
        consolidating_io = self._consolidating_io()
        if consolidating_io is not None:  # running and queued consolidations, up to the timeout
            try:
                consolidating_io.wait_for_consolidation(self.consolidation_settings.timeout)
                consolidating_io.close_consolidation_queue()
                from nemo.lightning.io.consolidation.training.callback import ConsolidationCallback

                trainer = getattr(self, "trainer", None)  # metrics of consolidations that ended while fit was ending
                for callback in getattr(trainer, "callbacks", None) or []:
                    if isinstance(callback, ConsolidationCallback):
                        callback.log_consolidation_metrics(trainer)
            except Exception as error:  # a consolidation problem never fails the run
                logging.error(f"Waiting for checkpoint consolidation failed: {error}")
'''

STRATEGY_REMOVE = """        ckpt = ckpt_to_dir(filepath)
        if self.is_global_zero:

            def remove() -> None:
                if os.path.islink(ckpt):
                    os.unlink(ckpt)
                else:
                    shutil.rmtree(ckpt)

            consolidating_io = self._consolidating_io()
            if consolidating_io is None:
                remove()
            else:  # never while it is being consolidated; a queued consolidation of it is dropped
                consolidating_io.remove_checkpoint_safely(Path(ckpt), remove)
"""

STRATEGY_METHODS = '''
    def _consolidation_io_kwargs(self) -> Dict[str, Any]:
        """The checkpoint IO arguments that turn consolidation on (none when it is off)."""
        if self.consolidation_policy is None:
            return {}
        return dict(consolidation_settings=self.consolidation_settings)

    def _consolidating_io(self) -> Optional[Any]:
        """The consolidating checkpoint IO inside any wrappers, or None."""
        if self.consolidation_policy is None or not self._checkpoint_io:
            return None
        from nemo.lightning.io.consolidation.training.checkpoint_io import MegatronCheckpointIO as ConsolidatingIO
        from nemo.lightning.io.consolidation.training.io_chain import find_base_checkpoint_io

        base = find_base_checkpoint_io(self._checkpoint_io)
        return base if isinstance(base, ConsolidatingIO) else None

    def consolidate_latest_checkpoint(self, wait: bool = True) -> Optional[Path]:
        """Consolidate the newest finished checkpoint of this run now (what "latest" does when fit ends).

        Args:
            wait: wait for it, up to ckpt_consolidation_timeout seconds.

        Returns:
            The output directory once it exists, else None (nothing finished yet, consolidation off, another rank,
            not waited for, timed out or failed; failures are logged).
        """
        consolidating_io = self._consolidating_io()
        if consolidating_io is None or not consolidating_io.consolidate_newest():
            return None
        if wait:
            consolidating_io.wait_for_consolidation(self.consolidation_settings.timeout)
            consolidating_io.end_consolidation_process_unless_fitting()
        newest = consolidating_io.consolidation.newest_finished
        if newest is None or not newest.consolidated:
            return None
        return newest.path / consolidating_io.consolidation_settings.output_dirname

    def consolidate_best_checkpoint(self, wait: bool = True) -> Optional[Path]:
        """Consolidate the run's best finished checkpoint by ModelCheckpoint's monitored metric now, unless its
        output exists, and point <root>/BEST at it (what "best" does when fit ends).

        Args:
            wait: wait for it, up to ckpt_consolidation_timeout seconds.

        Returns:
            The output directory once it exists, else None (no best recorded, not finished or removed, consolidation
            off, another rank, not waited for, timed out or failed; each is logged).
        """
        consolidating_io = self._consolidating_io()
        if consolidating_io is None or not self.is_global_zero:
            return None
        if consolidating_io.checkpoint_callback is None and getattr(self, "trainer", None) is not None:
            consolidating_io.checkpoint_callback = self.trainer.checkpoint_callback
        best = consolidating_io.consolidate_best()
        if best is None:
            return None
        if wait:
            consolidating_io.wait_for_consolidation(self.consolidation_settings.timeout)
            consolidating_io.end_consolidation_process_unless_fitting()
        return best.path / consolidating_io.consolidation_settings.output_dirname if best.consolidated else None
'''

UTILS_FACTORY = """        from nemo.lightning.io.pl import MegatronCheckpointIO

        if kwargs.get("consolidation_settings") is not None:
            from nemo.lightning.io.pl import ConsolidatingMegatronCheckpointIO as MegatronCheckpointIO

        checkpoint_io = MegatronCheckpointIO(**kwargs)
"""

PL_EXPORT = '''

def __getattr__(name: str) -> Any:
    """``ConsolidatingMegatronCheckpointIO``: ``MegatronCheckpointIO`` that also consolidates finished checkpoints
    (see ``nemo.lightning.io.consolidation``); imported on first use, its module imports this one."""
    if name == "ConsolidatingMegatronCheckpointIO":
        from nemo.lightning.io.consolidation.training import checkpoint_io

        return checkpoint_io.MegatronCheckpointIO
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
'''

NATIVE_STRATEGY_TEST = (
    HEADER
    + '''"""MegatronStrategy's checkpoint consolidation arguments, natively in NeMo (no overlay)."""

import sys

import pytest

import nemo.lightning as nl
from nemo.lightning.io.consolidation.training.checkpoint_io import MegatronCheckpointIO as ConsolidatingIO
from nemo.lightning.io.consolidation.training.io_chain import find_base_checkpoint_io
from nemo.lightning.io.consolidation.training.policy import parse_consolidation_frequency
from nemo.lightning.io.pl import ConsolidatingMegatronCheckpointIO, MegatronCheckpointIO


def test_nemo_class_is_the_native_one():
    assert "nemo_patch" not in sys.modules  # the overlay is off: this is NeMo's own code
    assert nl.MegatronStrategy.__module__ == "nemo.lightning.pytorch.strategies.megatron_strategy"
    assert ConsolidatingMegatronCheckpointIO is ConsolidatingIO


def test_default_is_stock_checkpoint_io():
    strategy = nl.MegatronStrategy()
    assert strategy.consolidation_policy is None
    assert type(find_base_checkpoint_io(strategy.checkpoint_io)) is MegatronCheckpointIO


@pytest.mark.parametrize(
    "kwargs, policy",
    [
        ({"ckpt_consolidation_frequency": "latest"}, parse_consolidation_frequency("latest")),
        ({"ckpt_consolidation_frequency": "every_n:5"}, parse_consolidation_frequency("every_n:5")),
        ({"ckpt_consolidation_frequency": "best; each@100"}, parse_consolidation_frequency("best; each@100")),
        ({"save_consolidated": True}, parse_consolidation_frequency("each")),
    ],
)
def test_frequency_reaches_the_checkpoint_io(kwargs, policy):
    strategy = nl.MegatronStrategy(ckpt_consolidation_max_shard_size="1GB", **kwargs)
    base = find_base_checkpoint_io(strategy.checkpoint_io)
    assert isinstance(base, ConsolidatingIO) and base.consolidation_policy == policy
    assert base.consolidation_max_shard_size == 10**9


@pytest.mark.parametrize(
    "kwargs, accepted",
    [
        ({"ckpt_consolidation_frequency": "weekly"}, '"each", "latest", "best" or "every_n:<k>"'),
        ({"ckpt_consolidation_frequency": "every_n:0"}, '"each", "latest", "best" or "every_n:<k>"'),
        ({"ckpt_consolidation_frequency": "each; best"}, 'needs "@<global step>"'),
        ({"save_consolidated": False, "ckpt_consolidation_frequency": "each"}, "contradicts"),
        ({"ckpt_consolidation_timeout": 0}, "a number of seconds > 0"),
        ({"ckpt_consolidation_max_pending": -1}, "an integer >= 0"),
        ({"ckpt_consolidation_format": "onnx"}, '"safetensors" or "hf"'),
        ({"ckpt_consolidation_keep": -1}, "None (keep every consolidated output) or an integer >= 0"),
    ],
)
def test_bad_values_raise_at_construction(kwargs, accepted):
    with pytest.raises(ValueError, match=accepted.replace("(", r"\\(").replace(")", r"\\)")):
        nl.MegatronStrategy(**kwargs)
'''
)


def _replace_once(text: str, anchor: str, replacement: str, where: str) -> str:
    count = text.count(anchor)
    if count != 1:
        raise SystemExit(f"{where}: expected the anchor once, found it {count} times:\n{anchor}")
    return text.replace(anchor, replacement)


def _rename_imports(source: str) -> str:
    source = source.replace("nemo_patch.", f"{PACKAGE}.")
    return source.replace("python -m nemo_patch", f"python -m {PACKAGE}.cli.nemo_consolidate")


def patched_strategy(text: str) -> str:
    """NeMo's ``megatron_strategy.py`` with checkpoint consolidation built in."""
    text = _replace_once(text, "        **kwargs: Additional keyword arguments.\n", STRATEGY_DOC, STRATEGY)
    text = _replace_once(
        text,
        "        use_gloo_process_groups: bool = True,\n        **kwargs,\n    ) -> None:\n",
        "        use_gloo_process_groups: bool = True,\n"
        + STRATEGY_ARGS
        + "        **kwargs,\n    ) -> None:\n"
        + STRATEGY_VALIDATION,
        STRATEGY,
    )
    text = _replace_once(
        text,
        "                self.trainer.callbacks.append(AsyncFinalizerCallback())\n",
        "                self.trainer.callbacks.append(AsyncFinalizerCallback())\n" + STRATEGY_CALLBACK,
        STRATEGY,
    )
    text = _replace_once(text, '        """Tearsdown the strategy"""\n', STRATEGY_TEARDOWN, STRATEGY)
    text = _replace_once(
        text,
        "        ckpt = ckpt_to_dir(filepath)\n        if self.is_global_zero:\n            if os.path.islink(ckpt):\n"
        "                os.unlink(ckpt)\n            else:\n                shutil.rmtree(ckpt)\n",
        STRATEGY_REMOVE,
        STRATEGY,
    )
    text = _replace_once(
        text,
        "                load_directly_on_device=self.load_directly_on_device,\n            )\n",
        "                load_directly_on_device=self.load_directly_on_device,\n"
        "                **self._consolidation_io_kwargs(),\n            )\n",
        STRATEGY,
    )
    text = _replace_once(
        text,
        '        """CheckpointIO setter"""\n        self._checkpoint_io = io\n',
        '        """CheckpointIO setter"""\n        self._checkpoint_io = io\n' + STRATEGY_METHODS,
        STRATEGY,
    )
    return text


def patched_utils(text: str) -> str:
    """NeMo's strategy ``utils.py`` whose ``create_checkpoint_io`` builds the consolidating IO when asked to."""
    anchor = (
        "        from nemo.lightning.io.pl import MegatronCheckpointIO\n\n"
        "        checkpoint_io = MegatronCheckpointIO(**kwargs)\n"
    )
    return _replace_once(text, anchor, UTILS_FACTORY, STRATEGY_UTILS)


def new_files() -> Dict[str, str]:
    """Repository path -> content of every file the patch adds."""
    files = {f"{PACKAGE_DIR}/__init__.py": PACKAGE_INIT}
    for package in MOVED_PACKAGES:
        for source in sorted((REPO / "nemo_patch" / package).glob("*.py")):
            relative = f"{package}/{source.name}"
            if relative not in NOT_MOVED:
                files[f"{PACKAGE_DIR}/{relative}"] = _rename_imports(source.read_text())
    files[f"{TESTS_DIR}/__init__.py"] = ""
    for name in PORTED_TESTS:
        files[f"{TESTS_DIR}/{name}"] = _rename_imports((REPO / "tests" / name).read_text())
    files[f"{TESTS_DIR}/test_megatron_strategy_consolidation.py"] = NATIVE_STRATEGY_TEST
    return files


def _check_against_record(nemo_src: Path, paths: List[str]) -> None:
    """The files to patch must be the pinned wheel's (``RECORD`` sha256), not a locally modified copy."""
    records = list(nemo_src.glob("nemo_toolkit-*.dist-info/RECORD"))
    if not records:
        return  # an unpacked wheel without its dist-info, or a source checkout: nothing to compare against
    hashes = {row[0]: row[1] for row in csv.reader(records[0].read_text().splitlines()) if len(row) >= 2}
    for path in paths:
        digest = hashlib.sha256((nemo_src / path).read_bytes()).digest()
        expected = f"sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()}"
        if hashes.get(path) != expected:
            raise SystemExit(f"{nemo_src / path} differs from the installed wheel's RECORD: not pristine NeMo source")


def _diff(path: str, old: Optional[str], new: str) -> str:
    old_lines = [] if old is None else old.splitlines(keepends=True)
    body = difflib.unified_diff(
        old_lines, new.splitlines(keepends=True), "/dev/null" if old is None else f"a/{path}", f"b/{path}"
    )
    header = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if old is None else "")
    text = "".join(body)
    if not text:  # an empty new file
        return header
    return header + text


def make_patch(nemo_src: Path) -> Tuple[str, List[str]]:
    """The unified diff and the list of paths it touches."""
    edited = {
        STRATEGY: patched_strategy,
        STRATEGY_UTILS: patched_utils,
        IO_PL: lambda text: text.rstrip("\n") + "\n" + PL_EXPORT,
    }
    _check_against_record(nemo_src, list(edited))
    parts, paths = [], []
    for path, edit in edited.items():
        old = (nemo_src / path).read_text()
        parts.append(_diff(path, old, edit(old)))
        paths.append(path)
    for path, content in sorted(new_files().items()):
        if (nemo_src / path).exists():
            raise SystemExit(f"{nemo_src / path} already exists: this NeMo already has the feature?")
        parts.append(_diff(path, None, content))
        paths.append(path)
    return "".join(parts), paths


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nemo-src", type=Path, default=None, help="directory holding nemo/ (default: installed)")
    parser.add_argument("--out", type=Path, default=None, help="patch file (default: stdout)")
    args = parser.parse_args(argv)
    nemo_src = args.nemo_src
    if nemo_src is None:
        import importlib.util

        spec = importlib.util.find_spec("nemo")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("NeMo is not installed here; pass --nemo-src")
        nemo_src = Path(list(spec.submodule_search_locations)[0]).parent
    patch, paths = make_patch(nemo_src)
    if args.out is None:
        sys.stdout.write(patch)
    else:
        args.out.write_text(patch)
        print(f"wrote {args.out}: {len(paths)} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
