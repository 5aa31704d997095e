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

"""The names and shapes a consolidated output must have, from the model a checkpoint's NeMo ``context/`` describes.

:func:`context_model_shapes` builds that model with TP = PP = EP = CP = 1 on the ``meta`` device, inside a
one-process ``gloo`` group (megatron-core builds modules only with its process groups initialised). Imports torch and
the engine at module level; NeMo and megatron-core only inside :func:`context_model_shapes`.
"""

from pathlib import Path
from typing import Dict, Tuple

import torch

from nemo_patch.engine.load import canonical_key_map
from nemo_patch.export.context_trust import context_loading
from nemo_patch.export.errors import ExportError

__all__ = ["context_model_shapes"]

#: Config fields set for the build: one rank of everything, no sequence parallelism, CPU-style creation (which makes
#: the parameters where the default device says: ``meta``), no initialisation.
_SINGLE_RANK = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "sequence_parallel": False,
    "use_cpu_initialization": True,
    "perform_initialization": False,
}


def context_model_shapes(checkpoint_dir: Path, trust_context: bool = False) -> Dict[str, Tuple[int, ...]]:
    """Consolidated name -> shape of every weight of the TP=1 model described by ``<checkpoint_dir>/context``.

    Args:
        checkpoint_dir: a NeMo 2 checkpoint directory holding ``context/``.
        trust_context: build whatever ``context/io.json`` names; else the context is checked first and loaded off
            the network (:func:`nemo_patch.export.context_trust.context_loading`).

    Returns:
        Name -> shape (a tuple of ints); ``_extra_state`` entries are not weights and are left out.

    Raises:
        ExportError: NeMo is not importable, the context cannot be read, a process group is already initialised in
            this process, or the model cannot be built here (e.g. its spec needs Transformer Engine); says which.
        UntrustedContextError: the context may not be loaded without ``trust_context``.
    """
    loading = context_loading(Path(checkpoint_dir) / "context", trust_context)  # checked now unless trusted
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from nemo.lightning import io
    except ImportError as error:
        raise ExportError(f"Comparing with the checkpoint's context needs NeMo importable: {error}") from error
    try:
        with loading():
            model = io.load_context(str(Path(checkpoint_dir) / "context"), subpath="model")
        config = model.config
    except Exception as error:
        raise ExportError(f"Cannot read the model from {Path(checkpoint_dir) / 'context'}: {error}") from error
    if dist.is_initialized():
        raise ExportError("Cannot build the context's model inside a process that has a process group")
    for name, value in _SINGLE_RANK.items():
        if hasattr(config, name):
            setattr(config, name, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        with torch.device("meta"), loading():
            module = config.configure_model(tokenizer=getattr(model, "tokenizer", None))
        state = module.state_dict()
        return {canonical: tuple(state[key].shape) for key, canonical in canonical_key_map(module).items()}
    except Exception as error:
        raise ExportError(
            f"Cannot build the model of {Path(checkpoint_dir) / 'context'} ({type(config).__name__}) here: "
            f"{type(error).__name__}: {error}"
        ) from error
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
