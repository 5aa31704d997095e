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

"""The edits of NeMo's own files: ``MegatronStrategy`` takes the consolidation arguments (the knob stage and, for
their arguments and methods, the retention and PEFT stages).

Every edit is anchored on exact text that NeMo 2.5.3 and 2.7.3 share; a missing anchor stops the script naming it.
The strategy gets what the overlay's ``MegatronStrategy`` subclass (``nemo_patch/training/strategy.py``) adds, in
NeMo's style: the arguments on ``__init__`` (documented before ``**kwargs``, validated first into one frozen
``ConsolidationSettings``), the consolidating IO built by ``create_checkpoint_io``, the consolidation callback added in
``setup`` (with its ``setup`` hook run there, since Lightning ran the callbacks' hooks before the strategy's
``setup``), the wait for consolidations in ``teardown`` (the other ranks wait for global rank 0 on the job's store),
the safe top-k removal and ``consolidate_latest_checkpoint`` (knob); ``ckpt_consolidation_keep`` and
``consolidate_best_checkpoint`` (retention); ``ckpt_consolidation_merge_adapters`` and NeMo's PEFT callback keeping
the consolidation settings when it rebuilds the checkpoint IO (PEFT).
"""

import json
import sys
import textwrap
import types
from typing import Any, Callable, Dict, Optional, Sequence

STRATEGY = "nemo/lightning/pytorch/strategies/megatron_strategy.py"
STRATEGY_UTILS = "nemo/lightning/pytorch/strategies/utils.py"
IO_PL = "nemo/lightning/io/pl.py"
PEFT = "nemo/lightning/pytorch/callbacks/peft.py"
#: NeMo files the series edits.
EDITED = [STRATEGY, STRATEGY_UTILS, IO_PL, PEFT]
#: NeMo's checkpoints docs index: in a NeMo source checkout, not in the ``nemo_toolkit`` wheel (no ``docs/``). Where
#: it is there, the first patch lists its new page in the index's toctree.
DOCS_INDEX = "docs/source/checkpoints/intro.rst"
DOCS_PAGE_ENTRY = "consolidation"
#: The stage that edits them first.
STAGE = "knob"
#: The settings module as the series writes it (its ``SETTINGS`` declare the strategy's arguments).
SETTINGS_MODULE = "nemo/lightning/io/consolidation/training/settings.py"
#: Arguments of the overlay's ``MegatronStrategy`` (settings it declares) that the series does not give NeMo's (yet),
#: and why. ``tests/test_upstream_patch.py`` checks that every other declared setting reaches NeMo's strategy.
NOT_UPSTREAMED_ARGUMENTS = {
    "ckpt_consolidation_post_command": "a command run after each consolidation (issue #31): a follow-up pull request",
    "ckpt_consolidation_post_command_timeout": "its timeout",
}
#: The settings passed to ``ConsolidationSettings.from_arguments`` by position.
POSITIONAL_SETTINGS = ("save_consolidated", "frequency")

Landed = Callable[[Optional[str]], bool]


def declarations(settings_text: str) -> Sequence[Any]:
    """The ``SETTINGS`` of the settings module as a stage of the series writes it (``settings_text``): the module is
    run with its package's imports pointed back at the overlay's modules, which define the same names. A setting a
    stage holds back (``ckpt_consolidation_keep`` before the retention stage, ...) is not in it, so the strategy's
    arguments follow the stage without a list of their own; their defaults, types and documentation are the
    declarations'."""
    source = settings_text.replace("from nemo.lightning.io.consolidation.", "from nemo_patch.")
    module = types.ModuleType("_upstream_consolidation_settings")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(source, SETTINGS_MODULE, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return [spec for spec in module.SETTINGS if spec.strategy_argument not in NOT_UPSTREAMED_ARGUMENTS]


def _default_source(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return f"{value:_}"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def strategy_doc(settings: Sequence[Any]) -> str:
    """The new arguments' entries in ``MegatronStrategy``'s docstring (before ``**kwargs``), in NeMo's
    ``name (type): text`` form, from the declarations' help."""
    entries = [
        textwrap.fill(
            f"{spec.strategy_argument} ({spec.annotation}): {spec.help}",
            width=119,
            initial_indent=" " * 8,
            subsequent_indent=" " * 12,
            break_on_hyphens=False,
            break_long_words=False,
        )
        + "\n"
        for spec in settings
    ]
    return "".join(entries) + "        **kwargs: Additional keyword arguments.\n"


def strategy_args(settings: Sequence[Any]) -> str:
    """The new arguments' lines in ``__init__``'s signature: the declared annotations and defaults."""
    return "".join(
        f"        {spec.strategy_argument}: {spec.annotation} = {_default_source(spec.default)},\n"
        for spec in settings
    )


def strategy_validation(settings: Sequence[Any]) -> str:
    """The first statements of ``__init__``: every argument validated, once, into ``self.consolidation_settings``."""
    arguments = "".join(
        (
            f"            {spec.strategy_argument},\n"
            if spec.field in POSITIONAL_SETTINGS
            else f"            {spec.field}={spec.strategy_argument},\n"
        )
        for spec in settings
    )
    return (
        "        # Checkpoint consolidation settings: validated first, once.\n"
        "        from nemo.lightning.io.consolidation.training.settings import ConsolidationSettings\n\n"
        "        self.consolidation_settings = ConsolidationSettings.from_arguments(\n"
        f"{arguments}"
        "        )\n"
        "        self.consolidation_policy = self.consolidation_settings.policy\n"
    )


STRATEGY_CALLBACK = """
        # add the checkpoint consolidation callback if consolidation is on; Lightning ran the callbacks' setup hooks
        # before this method, so the callback's own setup (which starts the consolidation process) is run here
        if self.consolidation_policy is not None:
            from nemo.lightning.io.consolidation.training.callback import ConsolidationCallback

            if not any(isinstance(callback, ConsolidationCallback) for callback in self.trainer.callbacks):
                consolidation_callback = ConsolidationCallback(self.trainer)
                self.trainer.callbacks.append(consolidation_callback)
                consolidation_callback.setup(self.trainer, self.lightning_module, stage=trainer_fn)
"""

STRATEGY_TEARDOWN = '''        """Tearsdown the strategy"""
        consolidating_io = self._consolidating_io()
        if consolidating_io is not None:  # running and queued consolidations, up to the timeout
            from nemo.lightning.io.consolidation.training.fit_end import FitEnd

            fit_end = FitEnd(self.consolidation_settings.timeout)
            try:
                if not self.is_global_zero:  # leave fit together with global rank 0
                    fit_end.wait()
                consolidating_io.wait_for_consolidation(self.consolidation_settings.timeout)
                consolidating_io.close_consolidation_queue()
                from nemo.lightning.io.consolidation.training.callback import ConsolidationCallback

                trainer = getattr(self, "trainer", None)  # metrics of consolidations that ended while fit was ending
                for callback in getattr(trainer, "callbacks", None) or []:
                    if isinstance(callback, ConsolidationCallback):
                        callback.log_consolidation_metrics(trainer)
            except Exception as error:  # a consolidation problem never fails the run
                logging.error(f"Waiting for checkpoint consolidation failed: {error}")
            finally:
                if self.is_global_zero:
                    fit_end.release()
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
'''

STRATEGY_BEST_METHOD = '''
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

UTILS_FACTORY = """    elif kwargs.get("consolidation_settings") is not None:  # consolidation is on
        from nemo.lightning.io.pl import ConsolidatingMegatronCheckpointIO

        checkpoint_io = ConsolidatingMegatronCheckpointIO(**kwargs)
    else:
        from nemo.lightning.io.pl import MegatronCheckpointIO

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


def _replace_once(text: str, anchor: str, replacement: str, where: str) -> str:
    count = text.count(anchor)
    if count != 1:
        raise SystemExit(f"{where}: expected the anchor once, found it {count} times:\n{anchor}")
    return text.replace(anchor, replacement)


def patched_strategy(text: str, has: Landed, settings: Sequence[Any]) -> str:
    """NeMo's ``megatron_strategy.py`` with checkpoint consolidation built in, as far as the stages ``has`` says, with
    the arguments the ``settings`` declare."""
    text = _replace_once(text, "        **kwargs: Additional keyword arguments.\n", strategy_doc(settings), STRATEGY)
    text = _replace_once(
        text,
        "        use_gloo_process_groups: bool = True,\n        **kwargs,\n    ) -> None:\n",
        "        use_gloo_process_groups: bool = True,\n"
        + strategy_args(settings)
        + "        **kwargs,\n    ) -> None:\n"
        + strategy_validation(settings),
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
    methods = STRATEGY_METHODS + (STRATEGY_BEST_METHOD if has("retention") else "")
    text = _replace_once(
        text,
        '        """CheckpointIO setter"""\n        self._checkpoint_io = io\n',
        '        """CheckpointIO setter"""\n        self._checkpoint_io = io\n' + methods,
        STRATEGY,
    )
    return text


def patched_utils(text: str) -> str:
    """NeMo's strategy ``utils.py`` whose ``create_checkpoint_io`` builds the consolidating IO when asked to."""
    anchor = (
        "    else:\n"
        "        from nemo.lightning.io.pl import MegatronCheckpointIO\n\n"
        "        checkpoint_io = MegatronCheckpointIO(**kwargs)\n"
    )
    return _replace_once(text, anchor, UTILS_FACTORY, STRATEGY_UTILS)


def patched_pl(text: str) -> str:
    """NeMo's ``io/pl.py`` with ``ConsolidatingMegatronCheckpointIO`` importable next to ``MegatronCheckpointIO``."""
    typing_line = text.split("\nfrom typing import ", 1)[1].split("\n")[0] if "\nfrom typing import " in text else ""
    if "Any" not in [name.strip() for name in typing_line.split(",")]:
        raise SystemExit(f"{IO_PL}: expected 'Any' among its typing imports")
    return text.rstrip("\n") + "\n" + PL_EXPORT


def patched_peft(text: str) -> str:
    """NeMo's PEFT callback rebuilds the checkpoint IO in its ``setup`` from the strategy's checkpoint arguments: the
    consolidation arguments go with them, so that a LoRA run consolidates its adapter checkpoints too."""
    anchor = (
        "            ckpt_io_kwargs = {\n"
        "                arg: getattr(trainer.strategy, arg)\n"
        "                for arg in filter(lambda x: hasattr(trainer.strategy, x), ckpt_io_kwarg_names)\n"
        "            }\n"
    )
    keep = (
        "            # keep the strategy's checkpoint consolidation (ckpt_consolidation_* arguments) in the new IO\n"
        "            consolidation_io_kwargs = getattr(trainer.strategy, \"_consolidation_io_kwargs\", None)\n"
        "            if consolidation_io_kwargs is not None:\n"
        "                ckpt_io_kwargs.update(consolidation_io_kwargs())\n"
    )
    return _replace_once(text, anchor, anchor + keep, PEFT)


def patched_docs_index(text: str) -> str:
    """NeMo's ``docs/source/checkpoints/intro.rst`` with ``consolidation`` as the last entry of its toctree."""
    lines = text.splitlines(keepends=True)
    starts = [number for number, line in enumerate(lines) if line.strip() == ".. toctree::"]
    if len(starts) != 1:
        raise SystemExit(f"{DOCS_INDEX}: expected one toctree, found {len(starts)}")
    last = starts[0]
    for number in range(starts[0] + 1, len(lines)):
        if lines[number].strip() and not lines[number].startswith((" ", "\t")):
            break  # the end of the directive's block
        if lines[number].strip() and not lines[number].strip().startswith(":"):
            last = number  # an entry
    if last == starts[0]:
        raise SystemExit(f"{DOCS_INDEX}: its toctree lists no page to add {DOCS_PAGE_ENTRY!r} after")
    indent = lines[last][: len(lines[last]) - len(lines[last].lstrip())]
    lines.insert(last + 1, f"{indent}{DOCS_PAGE_ENTRY}\n")
    return "".join(lines)


def edits(has: Landed, settings_text: Optional[str]) -> Dict[str, Callable[[str], str]]:
    """NeMo path -> edit, for the stages that have landed (``has(stage)``); ``settings_text``: the settings module as
    the series writes it at this stage (its declarations give the strategy's arguments). The docs index is edited
    from the first stage on, where the NeMo tree has it."""
    if not has(STAGE):
        return {DOCS_INDEX: patched_docs_index}
    if settings_text is None:
        raise SystemExit(f"the {STAGE!r} stage edits MegatronStrategy from {SETTINGS_MODULE}, which it does not add")
    settings = declarations(settings_text)
    found = {
        DOCS_INDEX: patched_docs_index,
        STRATEGY: lambda text: patched_strategy(text, has, settings),
        STRATEGY_UTILS: patched_utils,
        IO_PL: patched_pl,
    }
    if has("peft"):
        found[PEFT] = patched_peft
    return found
