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

"""The edits of NeMo's own files (the knob stage): ``MegatronStrategy`` takes the consolidation arguments.

Every edit is anchored on exact text that NeMo 2.5.3 and 2.7.3 share; a missing anchor stops the script naming it.
The strategy gets what the overlay's ``MegatronStrategy`` subclass (``nemo_patch/training/strategy.py``) adds, in
NeMo's style: the arguments on ``__init__`` (documented before ``**kwargs``, validated first into one frozen
``ConsolidationSettings``), the consolidating IO built by ``create_checkpoint_io``, the consolidation callback added in
``setup`` (with its ``setup`` hook run there, since Lightning ran the callbacks' hooks before the strategy's
``setup``), the wait for consolidations in ``teardown`` (the other ranks wait for global rank 0 on the job's store),
the safe top-k removal, and ``consolidate_latest_checkpoint``/``consolidate_best_checkpoint``.
"""

from typing import Callable, Dict, List

STRATEGY = "nemo/lightning/pytorch/strategies/megatron_strategy.py"
STRATEGY_UTILS = "nemo/lightning/pytorch/strategies/utils.py"
IO_PL = "nemo/lightning/io/pl.py"
PEFT = "nemo/lightning/pytorch/callbacks/peft.py"
#: NeMo files the series edits.
EDITED = [STRATEGY, STRATEGY_UTILS, IO_PL, PEFT]
#: The stage that edits them.
STAGE = "knob"
#: Arguments of the overlay's ``MegatronStrategy`` that the series does not give NeMo's (yet), and why. A new
#: argument of the overlay must be added to :data:`STRATEGY_ARGS` or here (``tests/test_upstream_patch.py``).
NOT_UPSTREAMED_ARGUMENTS = {
    "ckpt_consolidation_post_command": "a command run after each consolidation (issue #31): a follow-up pull request",
    "ckpt_consolidation_post_command_timeout": "its timeout",
}

STRATEGY_DOC = '''\
        save_consolidated (Optional[bool]): None (default) or False: no checkpoint consolidation unless a frequency is
            given; True: consolidate at "each" unless a frequency is given. False with a frequency raises ValueError.
        ckpt_consolidation_frequency (Optional[str]): which finished checkpoints are consolidated into unsharded
            safetensors, off the training path: "each", "every_n:<k>" (the k-th, 2k-th, ... finished checkpoint,
            counted across resumes), "best" (those ModelCheckpoint ranked best by its monitored metric when saved;
            <root>/BEST names the best) or "latest" (none during training, the newest finished checkpoint once when
            fit ends). Giving one turns consolidation on; see docs/source/checkpoints/consolidation.rst.
        ckpt_consolidation_timeout (float): seconds the end of fit waits for running and queued consolidations.
        ckpt_consolidation_max_shard_size (Union[int, str]): most bytes per output safetensors file ("5GB").
        ckpt_consolidation_max_pending (int): consolidation requests that may wait behind the running one.
        ckpt_consolidation_format (str): "safetensors" (<ckpt>/consolidated) or "hf" (<ckpt>/hf, through the model's
            registered Hugging Face exporter).
        ckpt_consolidation_keep (Optional[int]): consolidated outputs kept (under <root>/retained/) when top-k removes
            their checkpoints: None all, N while among the newest N outputs, 0 none.
        ckpt_consolidation_dtype (Optional[str]): output dtype, "bf16", "fp16" or "fp32"; None keeps the
            checkpoint's.
        ckpt_consolidation_merge_adapters (bool): for PEFT (LoRA) adapter checkpoints, write the base model with the
            adapters merged instead of the adapters alone.
        ckpt_consolidation_workers (Optional[int]): writer processes of a consolidation; None is a quarter of the
            node's cores (1 to 8).
        **kwargs: Additional keyword arguments.
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

STRATEGY_VALIDATION = """        # Checkpoint consolidation settings: validated first, once.
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


def _replace_once(text: str, anchor: str, replacement: str, where: str) -> str:
    count = text.count(anchor)
    if count != 1:
        raise SystemExit(f"{where}: expected the anchor once, found it {count} times:\n{anchor}")
    return text.replace(anchor, replacement)


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


def edits(stage_keys: List[str], stage: str) -> Dict[str, Callable[[str], str]]:
    """NeMo path -> edit, for the stages up to ``stage``."""
    if stage_keys.index(stage) < stage_keys.index(STAGE):
        return {}
    return {STRATEGY: patched_strategy, STRATEGY_UTILS: patched_utils, IO_PL: patched_pl, PEFT: patched_peft}
