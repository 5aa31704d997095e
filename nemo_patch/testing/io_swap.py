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

"""Replace a trainer's checkpoint IO in a callback's ``setup``, the way NeMo's PEFT callback does.

NeMo's ``PEFT.setup`` rebuilds the strategy's checkpoint IO with ``create_checkpoint_io(wrapping_ckpt_io=...)``
(``AsyncFinalizableCheckpointIO`` > ``WrappedAdapterIO`` > NeMo's stock ``MegatronCheckpointIO``) and assigns
``trainer.strategy._checkpoint_io`` directly. :class:`SwapCheckpointIO` does the same with a plain pass-through
wrapper in place of ``WrappedAdapterIO`` (``"stock"``: NeMo's ``MegatronCheckpointIO`` at the bottom, which
consolidation can be re-installed into), or with a subclass of it that nemo_patch does not know (``"custom"``).

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from nemo.utils.callbacks.dist_ckpt_io import AsyncCompatibleCheckpointIO

__all__ = ["SwapCheckpointIO"]


class _PassThroughIO(_WrappingCheckpointIO, AsyncCompatibleCheckpointIO):
    """A wrapper that changes nothing (stands where NeMo's ``WrappedAdapterIO`` stands in a PEFT run; like it, it can
    be wrapped by NeMo's async IO)."""

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> Any:
        """The wrapped IO's save (its async request, for an async save)."""
        assert self.checkpoint_io is not None, "a wrapper always wraps an IO"
        return self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)


class SwapCheckpointIO(Callback):
    """Rebuilds ``trainer.strategy._checkpoint_io`` in ``setup``.

    Args:
        kind: ``"stock"`` (NeMo's ``create_checkpoint_io`` with a pass-through wrapper) or ``"custom"`` (the same
            with a ``MegatronCheckpointIO`` subclass at the bottom).

    Raises:
        ValueError: for another ``kind``.
    """

    def __init__(self, kind: str) -> None:
        if kind not in ("stock", "custom"):
            raise ValueError(f"Invalid kind {kind!r}: expected 'stock' or 'custom'")
        self.kind = kind

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Replace the strategy's checkpoint IO (as ``PEFT.setup`` does)."""
        from nemo.lightning.io.pl import MegatronCheckpointIO
        from nemo.lightning.pytorch.strategies.utils import create_checkpoint_io

        class CustomCheckpointIO(MegatronCheckpointIO):
            """A user's own checkpoint IO."""

        strategy = trainer.strategy
        kwargs = {"save_ckpt_format": strategy.save_ckpt_format, "async_save": strategy.async_save}
        wrapper = _PassThroughIO
        if self.kind == "custom":
            strategy._checkpoint_io = wrapper(CustomCheckpointIO(**kwargs))
        else:
            strategy._checkpoint_io = create_checkpoint_io(wrapping_ckpt_io=wrapper, **kwargs)
