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

"""Make NeMo's public ``MegatronStrategy`` name refer to :class:`nemo_patch.MegatronStrategy`.

Imports the standard library and :mod:`nemo_patch.overlay.hook` at module level; the training side's strategy (and
with it NeMo) only inside :func:`apply_overlay`, which runs once NeMo's strategy module has been executed.
"""

import sys

from nemo_patch.overlay.hook import STRATEGY_MODULE, TARGET_MODULE, overlay_disabled, strategy_module_importing

__all__ = ["apply_overlay", "overlay_applied"]


def overlay_applied() -> bool:
    """Whether NeMo's ``megatron_strategy.MegatronStrategy`` currently is :class:`nemo_patch.MegatronStrategy`."""
    module = sys.modules.get(TARGET_MODULE)
    strategy = sys.modules.get(STRATEGY_MODULE)
    return (
        module is not None
        and strategy is not None
        and module.MegatronStrategy is vars(strategy).get("MegatronStrategy")
    )


def apply_overlay() -> bool:
    """Replace NeMo's ``MegatronStrategy`` by :class:`nemo_patch.MegatronStrategy` in every loaded ``nemo`` module.

    That covers ``nemo.lightning.MegatronStrategy``, ``nemo.lightning.pytorch.strategies.MegatronStrategy`` and the
    defining module, plus any ``nemo.*`` module that imported the name before. Applying twice is harmless. Instances
    stay instances of NeMo's class (``nemo_patch.MegatronStrategy`` subclasses it). The class's ``__module__`` becomes
    NeMo's module, so references to it that are written to disk (a checkpoint's ``context/io.json``) use NeMo's
    public name, resolve to this class wherever the overlay is installed and to NeMo's own class elsewhere.

    Returns:
        ``True`` if the overlay is in effect; ``False`` if ``NEMO_PATCH_DISABLE`` turned it off, or if
        :mod:`nemo_patch.training.strategy` is being imported right now (the import hook applies it once that module
        has been executed).
    """
    if overlay_disabled() or strategy_module_importing():
        return False
    # Imported here, not at the top: the strategy module imports NeMo, whose import may be what called us.
    from nemo_patch.training.strategy import MegatronStrategy, NeMoMegatronStrategy

    # Under the overlay this class *is* NeMo's public MegatronStrategy: NeMo's IOMixin records it in a checkpoint's
    # context/io.json by that importable name (as stock NeMo does), not by nemo_patch's.
    MegatronStrategy.__module__ = TARGET_MODULE
    for name, module in list(sys.modules.items()):
        if (name == "nemo" or name.startswith("nemo.")) and module is not None:
            if module.__dict__.get("MegatronStrategy") is NeMoMegatronStrategy:
                setattr(module, "MegatronStrategy", MegatronStrategy)
    return True
