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

"""A test aid: run megatron-core's checkpoint saving and NeMo's MegatronStrategy on a machine without a GPU.

Checkpoint consolidation reads files only; its tests need real ``torch_dist`` checkpoints, which megatron-core and
NeMo write with a few CUDA calls even when nothing else about the model needs a GPU. :func:`megatron_on_cpu` patches
exactly those for the duration of a ``with`` block (a no-op side stream, ``current_device`` 0, CUDA device arguments
rewritten to the CPU, ``.cuda()`` the identity, no CUDA RNG tracker, ``synchronize``/``empty_cache`` no-ops, CPU
tensors' ``type()`` named as CUDA ones for megatron-core's mixed-precision optimizer, NeMo's device fix after a load
the identity, and NeMo's LoRA without Transformer Engine). Never used by library code.
"""

import contextlib
import sys
import types
from typing import Any, Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        if func in (torch.Tensor.to, torch.Tensor.cuda) or getattr(func, "__name__", "") == "to":
            kwargs.pop("non_blocking", None)
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NoStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _noop_fork(self: Any, name: str = "") -> Iterator[None]:
    yield


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    name = _TENSOR_TYPE(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def _identity(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Patch the CUDA assumptions of megatron-core and NeMo away for the duration of the block."""
    from megatron.core.tensor_parallel import random as mcore_random
    from nemo.lightning.io import pl as nemo_io_pl

    patches = [
        mock.patch.object(torch.cuda, "Stream", _NoStream),
        mock.patch.object(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        mock.patch.object(torch.cuda, "synchronize", _noop),
        mock.patch.object(torch.cuda, "empty_cache", _noop),
        mock.patch.object(torch.cuda, "manual_seed", _noop),
        mock.patch.object(torch.cuda, "manual_seed_all", _noop),
        mock.patch.object(torch.Tensor, "cuda", _identity),
        mock.patch.object(torch.nn.Module, "cuda", _identity),
        mock.patch.object(torch.Tensor, "type", _cuda_type_name),
        mock.patch.object(mcore_random.CudaRNGStatesTracker, "fork", _noop_fork),
        mock.patch.object(mcore_random.CudaRNGStatesTracker, "add", _noop),
        mock.patch.object(nemo_io_pl, "_fix_tensors_device", lambda ckpt: ckpt),
    ]
    if "megatron.core.transformer.moe.moe_utils" in sys.modules:
        moe_utils = sys.modules["megatron.core.transformer.moe.moe_utils"]
        patches.append(
            mock.patch.object(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), create=True)
        )
    if "nemo.collections.llm" in sys.modules:
        from nemo.collections.llm.peft import lora as peft_lora
        from nemo.collections.llm.peft import utils as peft_utils

        no_te = types.SimpleNamespace(Linear=type("NoTransformerEngineLinear", (), {}))
        patches += [mock.patch.object(peft_lora, "te", no_te), mock.patch.object(peft_utils, "HAVE_TE", False)]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(_CudaToCpuMode())
        yield
