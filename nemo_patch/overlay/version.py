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

"""Which NeMo releases nemo_patch supports, checked before anything of NeMo's is imported (standard library and
``packaging`` only, never NeMo nor other ``nemo_patch`` modules)."""

import os
from importlib import metadata, util

from packaging.version import Version

__all__ = ["SUPPORTED_NEMO", "check_nemo_version"]

#: Human-readable supported range (NeMo 2.x, the releases that have ``MegatronStrategy``).
SUPPORTED_NEMO = "nemo_toolkit >= 2.5, < 3 (NeMo 2.x)"
_MIN, _MAX = Version("2.5.0"), Version("3.0.0")


def check_nemo_version() -> str:
    """Raise unless the installed ``nemo_toolkit`` is supported.

    Returns:
        The installed ``nemo_toolkit`` version string.

    Raises:
        ImportError: if ``nemo_toolkit`` is not installed, is outside :data:`SUPPORTED_NEMO` (NeMo 3.x has no
            ``MegatronStrategy``), or lacks ``nemo.lightning.pytorch.strategies.megatron_strategy``.
    """
    try:
        version = metadata.version("nemo_toolkit")
    except metadata.PackageNotFoundError:
        raise ImportError(f"nemo_patch needs {SUPPORTED_NEMO}; nemo_toolkit is not installed.") from None
    parsed = Version(version)
    if parsed >= _MAX:
        raise ImportError(
            f"nemo_patch supports {SUPPORTED_NEMO}; found nemo_toolkit {version}. NeMo 3.x has no "
            "MegatronStrategy (nemo.lightning), so there is nothing to overlay: install nemo_toolkit 2.x."
        )
    if parsed.release < _MIN.release:
        raise ImportError(f"nemo_patch supports {SUPPORTED_NEMO}; found nemo_toolkit {version}.")
    # Looked up on disk, not imported: find_spec("nemo.lightning") would import the nemo package.
    spec = util.find_spec("nemo")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not any(os.path.isdir(os.path.join(location, "lightning")) for location in locations):
        raise ImportError(f"nemo_patch supports {SUPPORTED_NEMO}; nemo_toolkit {version} has no nemo.lightning.")
    return version
