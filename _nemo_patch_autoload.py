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

"""Start-up entry of the nemo_patch overlay, run by the one line of ``nemo_patch.pth``.

Loads ``nemo_patch/overlay/hook.py`` (standard library only) *without* importing the ``nemo_patch`` package (which
would cost start-up time in every interpreter), and calls its ``install()`` with what runs before and after an edit
of a NeMo module (:func:`_prepare`, :func:`_after_exec`: they import the package, once NeMo is being imported). Kept
as a separate top-level file because ``.pth`` files can only import top-level modules; the logic itself lives in the
package, so an editable install always runs the current code.
"""

import importlib.util
import os
import sys
import types

HOOK_MODULE = "nemo_patch.overlay.hook"


def _prepare() -> None:
    """Called by the hook before its first edit: NeMo is being imported, so is the package (its version gate)."""
    from nemo_patch.overlay.apply import prepare

    prepare()


def _after_exec(module: types.ModuleType) -> None:
    """Called by the hook once an edited NeMo module was executed."""
    from nemo_patch.overlay.apply import after_exec

    after_exec(module)


def install() -> None:
    """Register the overlay's import hook (:mod:`nemo_patch.overlay.hook`); does nothing if nemo_patch is absent."""
    module = sys.modules.get(HOOK_MODULE)
    if module is None:
        spec = importlib.util.find_spec("nemo_patch")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        paths = [os.path.join(location, "overlay", "hook.py") for location in locations]
        paths = [path for path in paths if os.path.isfile(path)]
        if not paths:
            return
        module_spec = importlib.util.spec_from_file_location(HOOK_MODULE, paths[0])
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[HOOK_MODULE] = module
        module_spec.loader.exec_module(module)
    module.install(_prepare, _after_exec)
