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

"""Run a real NeMo ``MegatronStrategy`` fit on a CPU-only machine: a test and demo aid, never product code.

NeMo 2.x and megatron-core assume CUDA in a handful of places even when the model, the optimizer and the
checkpoint format have nothing CUDA-specific about them. :func:`megatron_on_cpu` patches exactly those
places for the duration of a ``with`` block so that ``nl.Trainer(accelerator="cpu", strategy=nl.MegatronStrategy())``
can train a tiny GPT, save real ``torch_dist`` distributed checkpoints through NeMo's checkpoint IO and load them
back. Nothing is patched unless the context manager is entered; leaving it restores every patched attribute.

What is stubbed, and why (NeMo 2.7.3, megatron-core 0.15.3, torch 2.13 CPU build; see
``../shared/NOTES-nemo-on-cpu.md`` in the development workspace):

1. ``torch.cuda.Stream`` / ``torch.cuda.stream``: ``MegatronParallel.init_model_parallel`` wraps the DDP
   set-up in a side stream. Replaced by a no-op stream.
2. ``torch.cuda.current_device`` returns ``0`` and a :class:`~torch.overrides.TorchFunctionMode` rewrites every
   ``device=`` argument that names CUDA (``"cuda"``, ``"cuda:0"``, ``0``, ``torch.device("cuda")``) to the CPU and
   drops ``pin_memory=True``/``non_blocking`` hints: megatron DDP's grad buffers, the optimizer's loss scale and
   NeMo's batch moves all allocate on the current CUDA device.
3. ``torch.Tensor.cuda`` / ``torch.nn.Module.cuda`` return their receiver unchanged.
4. megatron-core's CUDA RNG tracker: ``fork`` becomes a no-op context (random ops use the CPU generator), and
   ``torch.cuda.manual_seed``/``manual_seed_all`` seed nothing; there is no CUDA generator to fork.
5. ``nemo.lightning.io.pl._fix_tensors_device``, which asserts CUDA is initialised after a checkpoint load,
   becomes the identity.
6. ``torch.cuda.synchronize`` and ``torch.cuda.empty_cache`` become no-ops.
7. ``torch.Tensor.type()`` called with no argument names a CPU tensor's type as its CUDA one
   (``torch.BFloat16Tensor`` -> ``torch.cuda.BFloat16Tensor``): megatron-core's mixed-precision optimizer
   (``Float16OptimizerWithFloat16Params``, used for ``bf16-mixed`` and ``16-mixed``) accepts only parameters whose
   type string is a CUDA one. ``type(dtype)`` conversions are unchanged.
8. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is defined as ``None``: megatron-core 0.15.3 imports it
   only with Transformer Engine yet tests ``te_general_gemm is not None`` in the MoE router's forward, a
   ``NameError`` without TE; ``None`` selects its own plain ``torch`` path.
9. NeMo's LoRA without Transformer Engine: ``nemo.collections.llm.peft.lora.te`` is NeMo's placeholder module, which
   raises on any attribute, yet ``LoRA.transform`` compares ``m.__class__ == te.Linear``; it becomes a namespace whose
   ``Linear`` no module is. ``nemo.collections.llm.peft.utils.HAVE_TE`` comes out ``True`` because megatron-core
   0.15.3 defines its ``TE*Linear`` names as mock stand-ins without TE (and ``isinstance`` on them raises); it is set
   to ``False``, as it is on a machine without TE and without those stand-ins.

The model itself must also be CPU-friendly (local non-TE layer spec, fp32, ``use_cpu_initialization=True``, no
fusions, ``OptimizerConfig(clip_grad=0.0)``) and batches must carry an ``attention_mask``: see
:mod:`nemo_patch.testing.tiny_gpt`.

Test and demo aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import contextlib
import types
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["megatron_on_cpu"]


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch function and tensor method call."""

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


def _identity_receiver(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Context manager that lets NeMo's ``MegatronStrategy`` train, save and load on the CPU.

    A test/demo aid: it monkeypatches torch, megatron-core and NeMo for the duration of the block (see the
    module docstring for the exact list) and restores everything on exit. Never use it in a real training job.

    Yields:
        None.
    """
    from unittest import mock

    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils
    from nemo.collections.llm.peft import lora as peft_lora
    from nemo.collections.llm.peft import utils as peft_utils
    from nemo.lightning.io import pl as nemo_io_pl

    patches = [
        mock.patch.object(torch.cuda, "Stream", _NoStream),
        mock.patch.object(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        mock.patch.object(torch.cuda, "synchronize", _noop),
        mock.patch.object(torch.cuda, "empty_cache", _noop),
        mock.patch.object(torch.cuda, "manual_seed", _noop),
        mock.patch.object(torch.cuda, "manual_seed_all", _noop),
        mock.patch.object(torch.Tensor, "cuda", _identity_receiver),
        mock.patch.object(torch.nn.Module, "cuda", _identity_receiver),
        mock.patch.object(torch.Tensor, "type", _cuda_type_name),
        mock.patch.object(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), create=True),
        mock.patch.object(mcore_random.CudaRNGStatesTracker, "fork", _noop_fork),
        mock.patch.object(mcore_random.CudaRNGStatesTracker, "add", _noop),
        mock.patch.object(nemo_io_pl, "_fix_tensors_device", lambda ckpt: ckpt),
        mock.patch.object(peft_lora, "te", types.SimpleNamespace(Linear=type("NoTransformerEngineLinear", (), {}))),
        mock.patch.object(peft_utils, "HAVE_TE", False),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)  # type: ignore[arg-type]
        stack.enter_context(_CudaToCpuMode())
        yield
