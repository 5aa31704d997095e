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

"""Find and replace the base checkpoint IO inside Lightning's ``_WrappingCheckpointIO`` layers.

Imports Lightning only; never NeMo, the overlay, the CLI or ``nemo_patch.testing``.
"""

from typing import Any, Callable

from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

__all__ = ["find_base_checkpoint_io", "replace_base_checkpoint_io"]


def find_base_checkpoint_io(checkpoint_io: Any) -> Any:
    """The innermost checkpoint IO under any Lightning ``_WrappingCheckpointIO`` layers (e.g. NeMo's async one)."""
    while isinstance(checkpoint_io, _WrappingCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


def replace_base_checkpoint_io(checkpoint_io: Any, make: Callable[[Any], Any]) -> Any:
    """Replace the innermost checkpoint IO of a wrapper chain by ``make(innermost)``; wrappers are kept.

    Returns:
        The new outermost checkpoint IO (``make(checkpoint_io)`` when there are no wrappers).
    """
    if not isinstance(checkpoint_io, _WrappingCheckpointIO):
        return make(checkpoint_io)
    wrapper = checkpoint_io
    while isinstance(wrapper.checkpoint_io, _WrappingCheckpointIO):
        wrapper = wrapper.checkpoint_io
    # Lightning's setter refuses to replace a configured base IO; assign the attribute it guards.
    wrapper._checkpoint_io = make(wrapper.checkpoint_io)
    return checkpoint_io
