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

"""The errors ``nemo-consolidate`` can end with (each :class:`~nemo_patch.engine.errors.ConsolidationError` subclass
declares its exit code and summary), for the CLI's epilog, the documentation's table and a peer's reported error."""

import importlib
from typing import Dict, List, Type

from nemo_patch.engine.errors import ConsolidationError

__all__ = ["ERROR_MODULES", "error_classes"]

#: The modules that define consolidation errors.
ERROR_MODULES = (
    "nemo_patch.engine.errors",
    "nemo_patch.engine.casting",
    "nemo_patch.engine.output_target",
    "nemo_patch.engine.part_writer",
    "nemo_patch.engine.verify",
    "nemo_patch.engine.adapter_merge",
    "nemo_patch.runs.best_checkpoint",
    "nemo_patch.runs.post_command",
    "nemo_patch.export.errors",
    "nemo_patch.cli.distributed",
)


def error_classes() -> Dict[str, Type[ConsolidationError]]:
    """Every :class:`ConsolidationError` class (itself included) defined in :data:`ERROR_MODULES`, by name, in exit
    code order."""
    for module in ERROR_MODULES:
        importlib.import_module(module)
    found: List[Type[ConsolidationError]] = []
    pending: List[Type[ConsolidationError]] = [ConsolidationError]
    while pending:
        cls = pending.pop()
        if cls.__module__ in ERROR_MODULES and cls not in found:
            found.append(cls)
        pending.extend(cls.__subclasses__())
    return {cls.__name__: cls for cls in sorted(found, key=lambda cls: (cls.exit_code, cls.__name__))}
