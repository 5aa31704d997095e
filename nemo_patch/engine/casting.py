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

"""The dtype cast of floating-point output tensors, refusing one that would turn finite weights into ``inf``."""

import math
import sys
from dataclasses import replace
from typing import List, Optional

import torch

from nemo_patch.engine import tensor_sources
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.plan import OutputTensor

__all__ = ["DtypeOverflowError", "cast_outputs", "cast_overflow", "checked_cast"]


class DtypeOverflowError(ConsolidationError):
    """The output dtype cannot hold a finite value of the checkpoint (e.g. above 65504 in ``fp16``); the message names
    the tensor and its largest magnitude. Underflow to 0 is precision loss and is not refused."""

    exit_code, summary = 18, "a dtype too narrow for the checkpoint's values (finite values would become inf)"


def cast_outputs(outputs: List[OutputTensor], dtype: Optional[torch.dtype]) -> List[OutputTensor]:
    """``outputs`` with floating-point tensors cast to ``dtype`` (``None``: kept; integer tensors are never cast).

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype.
    """
    if dtype is None:
        return outputs
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype (bf16, fp16, fp32), got {dtype}")
    return [replace(o, spec=replace(o.spec, dtype=dtype)) if o.spec.dtype.is_floating_point else o for o in outputs]


def cast_overflow(source: torch.Tensor, cast: torch.Tensor) -> Optional[str]:
    """Whether casting ``source`` gave ``cast`` (same shape) an ``inf`` where ``source`` is finite: ``None``, or what
    overflowed (for messages). Checked when ``cast``'s range is smaller, with one ``aminmax`` pass unless that finds a
    non-finite value; underflow to 0 is precision loss, not overflow."""
    if not source.dtype.is_floating_point or not cast.dtype.is_floating_point or cast.numel() == 0:
        return None
    if torch.finfo(cast.dtype).max >= torch.finfo(source.dtype).max:
        return None
    low, high = torch.aminmax(cast)
    if math.isfinite(float(low)) and math.isfinite(float(high)):
        return None
    finite = torch.isfinite(source)
    lost = int((finite & ~torch.isfinite(cast)).sum())
    if lost == 0:  # non-finite in the source already
        return None
    largest, most = float(source[finite].abs().max()), torch.finfo(cast.dtype).max
    return (
        f"{lost} finite value(s) of {source.dtype} become inf in {cast.dtype} (largest magnitude {largest:.6g}; "
        f"{cast.dtype} holds at most {most:.6g})"
    )


def checked_cast(name: str, source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ``source`` into ``out`` (the output dtype) and return it, refusing a cast that overflows.

    Raises:
        DtypeOverflowError: naming the tensor and its largest magnitude.
    """
    overflow = cast_overflow(source, out.copy_(source))
    if overflow is not None:
        raise DtypeOverflowError(f"{name}: {overflow}; refusing to write inf for finite weights (use bf16)")
    return out


tensor_sources.casting = sys.modules[__name__]  # the dtype casts of every consolidation's outputs
