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

"""Export a NeMo 2 ``torch_dist`` checkpoint as a Hugging Face model directory, with NeMo's own registered exporter.

The model class is read from the checkpoint's ``context/`` (NeMo's ``io.load_context``); its exporter is the one NeMo
registered for ``"hf"`` (``io.model_exporter(<class>, "hf")``, e.g. ``HFLlamaExporter`` for ``LlamaModel``). NeMo's
exporters normally load the checkpoint into a model on a GPU (``nemo_load``); here the weights come from this
package's consolidation engine instead (files only, CPU, no process group), and the exporter's own ``convert_state``
and ``init`` do the name and layout mapping, so the output is exactly what NeMo's exporter would write:
``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards plus ``model.safetensors.index.json``),
the tokenizer files when the context has a Hugging Face tokenizer, and this package's ``metadata.json``.

Layer-norm names (the one place both namings are handled): NeMo's Llama exporter maps the Transformer Engine
spec's fused names ``decoder.layers.<i>.self_attention.linear_qkv.layer_norm_weight`` and
``decoder.layers.<i>.mlp.linear_fc1.layer_norm_weight``. A model built with megatron-core's local (non-TE) spec, as on
CPU, holds ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight`` in its ``state_dict`` -- which is why NeMo's
stock ``export_ckpt`` fails on it -- but saves them in the distributed checkpoint under the TE names (its
``sharded_state_dict_keys_map``), so consolidated names are the TE names for both specs. :func:`te_layer_norm_names`
also renames local names that reach it (from a layer without that keys map), so both namings export correctly.

Memory: unlike the ``safetensors`` format, the exporter converts a whole model at once, so peak memory is about twice
the model's weights.

Imports torch and the engine at module level; NeMo only inside the functions that need it (``import
nemo_patch.export.hf`` imports no NeMo); never the training side, the overlay, the CLI or ``nemo_patch.testing``.
"""

import inspect
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import torch
from torch.distributed.checkpoint.api import CheckpointException

from nemo_patch.engine.adapter_merge import lora_scale
from nemo_patch.engine.adapter_settings import peft_settings
from nemo_patch.engine.checkpoint_layout import inspect_checkpoint
from nemo_patch.engine.consolidate import ConsolidationResult, ProgressCallback, read_state_dict
from nemo_patch.engine.errors import (
    AdapterCheckpointError,
    ConsolidationError,
    CorruptShardError,
    ExportError,
    OutputExistsError,
    VerificationError,
)
from nemo_patch.engine.output_layout import DEFAULT_MAX_SHARD_SIZE, FORMAT_VERSION, HF_DIRNAME, METADATA_FILENAME
from nemo_patch.engine.output_target import check_output_target
from nemo_patch.engine.plan import LAYER_PREFIX
from nemo_patch.engine.publish import staged_output
from nemo_patch.engine.verify import tensors_bitwise_equal
from nemo_patch.engine.vocabulary import vocabulary_sizes

__all__ = ["HF_DIRNAME", "cast_floating", "checkpoint_dtype", "export_hf_checkpoint", "te_layer_norm_names"]

logger = logging.getLogger(__name__)

_LOCAL_NORM = re.compile(rf"^(?P<layer>{LAYER_PREFIX})(?P<norm>input_layernorm|pre_mlp_layernorm)\.(?P<p>\w+)$")
_FUSED_INTO = {"input_layernorm": "self_attention.linear_qkv", "pre_mlp_layernorm": "mlp.linear_fc1"}


def te_layer_norm_names(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Rename local-spec layer norms to the Transformer Engine spec's fused names NeMo's exporters expect.

    ``decoder.layers.<i>.input_layernorm.<p>`` becomes ``decoder.layers.<i>.self_attention.linear_qkv.layer_norm_<p>``
    and ``decoder.layers.<i>.pre_mlp_layernorm.<p>`` becomes ``decoder.layers.<i>.mlp.linear_fc1.layer_norm_<p>``
    (``<p>`` is ``weight`` or ``bias``), but only where the layer has that fused linear layer (a dense MLP; an MoE
    layer keeps its ``pre_mlp_layernorm``, as the TE spec does). Names already in TE form are unchanged.

    Args:
        state_dict: consolidated name -> tensor.

    Returns:
        A new dict with the same tensors.
    """
    renamed = {}
    for name, tensor in state_dict.items():
        match = _LOCAL_NORM.match(name)
        if match:
            fused = f"{match.group('layer')}{_FUSED_INTO[match.group('norm')]}"
            if f"{fused}.weight" in state_dict:
                name = f"{fused}.layer_norm_{match.group('p')}"
        renamed[name] = tensor
    return renamed


def checkpoint_dtype(state_dict: Dict[str, torch.Tensor]) -> torch.dtype:
    """The floating-point dtype that holds most of ``state_dict``'s floating-point bytes (the checkpoint's dtype).

    Raises:
        ConsolidationError: ``state_dict`` has no floating-point tensor.
    """
    sizes: Dict[torch.dtype, int] = {}
    for tensor in state_dict.values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    if not sizes:
        raise ConsolidationError("The checkpoint holds no floating-point model tensors to export")
    return max(sizes, key=lambda dtype: sizes[dtype])


def cast_floating(state_dict: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """``state_dict`` with every floating-point tensor in ``dtype``; integer and bool tensors unchanged.

    NeMo's state transforms assert that source and target dtypes agree (``dtype mismatch between source and target
    state dicts``), and the exporter's target model is built in the requested dtype, so the source is cast first.
    """
    return {
        name: tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor
        for name, tensor in state_dict.items()
    }


def _init_target(exporter: Any, dtype: torch.dtype) -> Any:
    """The exporter's empty ``transformers`` model in ``dtype``: NeMo's exporters differ in whether ``init`` takes the
    dtype (``HFLlamaExporter.init(dtype)``) or not (``HFMixtralExporter.init()``, which builds the config's default,
    fp32); the latter is cast."""
    if len(inspect.signature(exporter.init).parameters) >= 1:
        return exporter.init(dtype)
    return exporter.init().to(dtype)


def _exporter_for(checkpoint_dir: Path, peft: bool = False) -> Any:
    """NeMo's registered ``"hf"`` exporter (``"hf-peft"`` with ``peft``) for the model class in
    ``<checkpoint_dir>/context``; the PEFT exporter is given the context's PEFT object (``model_transform``), as NeMo's
    own ``apply`` does."""
    try:
        from nemo.lightning import io
    except ImportError as error:
        raise ExportError(f"--format hf needs NeMo (nemo_toolkit[lightning]) importable: {error}") from error
    try:
        model = io.load_context(str(checkpoint_dir / "context"), subpath="model")
    except Exception as error:
        raise ExportError(f"Cannot read the model class from {checkpoint_dir / 'context'}: {error}") from error
    model_class = type(model)
    name = f"{model_class.__module__}.{model_class.__qualname__}"
    try:
        exporter = model_class.exporter("hf-peft" if peft else "hf", str(checkpoint_dir))
    except (ValueError, AttributeError) as error:
        if peft:
            raise AdapterCheckpointError(
                f"NeMo has no Hugging Face PEFT ('hf-peft') exporter for {name} (the model class of the adapter "
                f"checkpoint {checkpoint_dir}); merge the adapters (--merge-adapters) or use --format safetensors"
            ) from error
        raise ExportError(
            f"NeMo has no Hugging Face exporter for {name} (the model class of {checkpoint_dir}); use --format "
            "safetensors"
        ) from error
    if peft:
        try:
            exporter.peft_obj = io.load_context(str(checkpoint_dir / "context"), subpath="model.model_transform")
        except Exception as error:
            raise AdapterCheckpointError(
                f"Cannot read the PEFT method from {checkpoint_dir / 'context'} (model.model_transform): {error}"
            ) from error
    return model, exporter


def _verify_hf(output_dir: Path, expected: Dict[str, torch.Tensor]) -> None:
    """Every tensor in the written safetensors files equals the exporter's converted tensor (bitwise)."""
    from safetensors import safe_open

    seen = set()
    for path in sorted(output_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                seen.add(name)
                actual, want = handle.get_tensor(name), expected.get(name)
                if want is None or not tensors_bitwise_equal(want, actual):
                    raise VerificationError(f"Tensor {name} in {path} differs from the exported model's")
    written = {expected[name].data_ptr() for name in seen if name in expected}
    missing = sorted(name for name in set(expected) - seen if expected[name].data_ptr() not in written)  # tied
    if missing:
        raise VerificationError(f"{output_dir} lacks tensors of the exported model: {missing[:5]}")


def export_hf_checkpoint(
    checkpoint_dir: Union[str, Path],
    output_dir: Optional[Union[str, Path]] = None,
    global_step: Optional[int] = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = True,
    verify: bool = False,
    allow_unfinished: bool = False,
    progress: Optional[ProgressCallback] = None,
    merge_adapters: bool = False,
    base_checkpoint: Optional[Union[str, Path]] = None,
    best: Optional[Mapping[str, Any]] = None,
) -> ConsolidationResult:
    """Write a ``transformers``-loadable directory for a finished NeMo 2 ``torch_dist`` checkpoint.

    Args:
        checkpoint_dir: the checkpoint directory (with ``context/`` and ``weights/``) or its ``weights/``.
        output_dir: where to publish; defaults to ``<ckpt>/hf``. Published atomically.
        global_step: recorded in ``metadata.json``.
        max_shard_size: bytes per safetensors file, passed to ``save_pretrained``.
        dtype: floating-point dtype of the exported weights; default: the checkpoint's (:func:`checkpoint_dtype`).
            Integer and bool tensors keep theirs.
        overwrite: replace an existing output; if ``False`` it raises :class:`OutputExistsError` before any work.
        verify: re-read the written files and compare every tensor with the exporter's converted model.
        allow_unfinished: export even if NeMo's unfinished marker is present.
        progress: called with ``(bytes read, bytes in all)`` while the checkpoint's weights are read.
        merge_adapters: for a LoRA adapter checkpoint, export the base model with the adapters merged (a full
            ``transformers`` directory; :mod:`nemo_patch.engine.adapter_merge`). Without it, an adapter checkpoint
            gives a Hugging Face PEFT directory (``adapter_model.safetensors`` + ``adapter_config.json``) through
            NeMo's ``"hf-peft"`` exporter, which ``peft.PeftModel.from_pretrained`` loads onto the base model.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.
        best: recorded as ``"best"`` in ``metadata.json`` when the checkpoint was consolidated as the best by a
            monitored metric: ``{"monitor": name, "value": float, "mode": "min" | "max"}`` (NeMo's
            ``ModelCheckpoint``'s).

    Returns:
        A :class:`nemo_patch.engine.consolidate.ConsolidationResult` (``tensor_count`` and ``total_bytes`` of the
        exported model's ``state_dict``).

    Raises:
        AdapterCheckpointError: a PEFT adapter checkpoint (without ``merge_adapters``) whose model class has no
            ``"hf-peft"`` exporter, or whose PEFT method cannot be read (exit code 12; the class is named).
        AdapterMergeError: the adapters cannot be merged (exit code 13; e.g. the base checkpoint is missing).
        ExportError: NeMo is not importable, the context cannot be read, or the model class has no ``"hf"``
            exporter (the message names the class).
        ConsolidationError: or another subclass from :mod:`nemo_patch.engine.errors`, as for
            :func:`nemo_patch.engine.consolidate.consolidate_checkpoint`. Nothing partial is left on failure.
    """
    location = inspect_checkpoint(checkpoint_dir, allow_unfinished=allow_unfinished)
    ckpt_dir, weights_dir = location.checkpoint_dir, location.weights_dir
    peft = location.adapter and not merge_adapters
    output_dir = Path(output_dir) if output_dir is not None else ckpt_dir / HF_DIRNAME
    check_output_target(ckpt_dir, output_dir, overwrite)  # never the checkpoint, nor anything not a previous output
    if output_dir.exists() and not overwrite:
        raise OutputExistsError(f"{output_dir} exists (overwrite it with --force)")
    model, exporter = _exporter_for(ckpt_dir, peft)
    try:
        state, metadata = read_state_dict(location, merge_adapters, progress, base_checkpoint)
        state = te_layer_norm_names(state)
    except ConsolidationError:
        raise
    except (Exception, CheckpointException) as error:
        raise CorruptShardError(f"Cannot read the weights of {weights_dir}: {error}") from error

    from nemo.lightning.io.state import _ModelState

    requested_dtype, dtype = dtype, dtype or checkpoint_dtype(state)
    state = cast_floating(state, dtype)
    with staged_output(ckpt_dir, output_dir, overwrite, f"Exporting {ckpt_dir} to Hugging Face", "hf-") as tmp_dir:
        target = _init_target(exporter, dtype)
        target = exporter.convert_state(_ModelState(state, model.config), target).cpu()
        del state
        if peft:  # as NeMo's HF PEFT exporter saves: adapter_model.safetensors + adapter_config.json
            from peft import get_peft_model_state_dict

            target.save_pretrained(tmp_dir, save_embedding_layers=False)
            saved = get_peft_model_state_dict(target, save_embedding_layers=False)
        else:
            target.save_pretrained(tmp_dir, max_shard_size=max_shard_size, safe_serialization=True)
            try:
                exporter.tokenizer.tokenizer.save_pretrained(tmp_dir)
            except Exception as error:  # as NeMo's own exporter: a model without a HF tokenizer still exports
                logger.warning("No Hugging Face tokenizer saved with %s: %s", output_dir, error)
            saved = target.state_dict()
        if verify:
            _verify_hf(tmp_dir, saved)
        manifest = {
            "format_version": FORMAT_VERSION,
            "format": "hf",
            "kind": "adapter" if peft else "model",
            "global_step": global_step,
            "source_checkpoint": os.path.relpath(weights_dir, output_dir),
            "exporter": f"{type(exporter).__module__}.{type(exporter).__qualname__}",
            "tensor_count": len(saved),
            "total_bytes": sum(t.numel() * t.element_size() for t in saved.values()),
            "dtype": None if requested_dtype is None else str(requested_dtype).removeprefix("torch."),
            "vocab_size": vocabulary_sizes(ckpt_dir, metadata),
        }
        if location.adapter:
            manifest.update(base_checkpoint=location.adapter_base, peft=peft_settings(ckpt_dir))
        if location.adapter and not peft:  # merged: as the safetensors format records it
            manifest.update(merged_adapters=lora_scale(manifest["peft"])[1])
        if best is not None:
            manifest.update(best=dict(best))
        (tmp_dir / METADATA_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    logger.info("Exported %s -> %s with %s", ckpt_dir, output_dir, manifest["exporter"])
    kind = manifest["kind"]
    return ConsolidationResult(output_dir, manifest["tensor_count"], manifest["total_bytes"], global_step, {}, kind)
