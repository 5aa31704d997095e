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

The exporter registered for the context's model class runs its own ``apply``; only what needs a GPU or a trainer is
replaced (:class:`_OfflineExport`). docs/outputs.md describes the output, streaming, memory and verification. Imports
torch and the engine at module level; NeMo only inside the functions that need it.
"""

import contextlib
import copy
import functools
import gc
import inspect
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

from nemo_patch.engine.adapter_merge import lora_scale
from nemo_patch.engine.adapter_settings import adapter_base, peft_settings
from nemo_patch.engine.casting import checked_cast
from nemo_patch.engine.checkpoint_layout import CheckpointLocation, inspect_checkpoint
from nemo_patch.engine.consolidate import ConsolidationResult, ProgressCallback
from nemo_patch.engine.digests import source_fingerprint
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError, OutputExistsError
from nemo_patch.engine.metadata_checks import read_dcp_metadata
from nemo_patch.engine.output_layout import DEFAULT_MAX_SHARD_SIZE, FORMAT_VERSION, HF_DIRNAME, METADATA_FILENAME
from nemo_patch.engine.output_target import check_output_target, refuse_remote
from nemo_patch.engine.publish import staged_output
from nemo_patch.engine.save_identity import check_unchanged, save_identity, saved_again_instead
from nemo_patch.engine.tensor_sources import open_sources
from nemo_patch.engine.verify import VerificationError, tensors_bitwise_equal
from nemo_patch.engine.vocabulary import vocabulary_sizes
from nemo_patch.export.context_trust import context_loading
from nemo_patch.export.errors import AdapterCheckpointError, ExportError, unassigned_error
from nemo_patch.export.hf_stream import LazyCheckpointState, StreamedConversion, floating_dtype, saved_names
from nemo_patch.export.hf_verify import (
    ImporterUnavailable,
    TensorView,
    check_through_importer,
    read_checkpoint_tensors,
)
from nemo_patch.export.layer_norms import te_layer_norm_names

__all__ = ["HF_DIRNAME", "cast_floating", "checkpoint_dtype", "export_hf_checkpoint", "te_layer_norm_names"]

logger = logging.getLogger(__name__)


def checkpoint_dtype(state_dict: Dict[str, torch.Tensor]) -> torch.dtype:
    """The floating-point dtype that holds most of ``state_dict``'s floating-point bytes (the checkpoint's dtype).

    Raises:
        ConsolidationError: ``state_dict`` has no floating-point tensor.
    """
    return floating_dtype((tensor.dtype, tensor.numel() * tensor.element_size()) for tensor in state_dict.values())


def cast_floating(state_dict: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """``state_dict`` with every floating-point tensor in ``dtype`` (as NeMo's transforms expect); others unchanged.

    Raises:
        DtypeOverflowError: a finite value would become ``inf`` in ``dtype`` (naming the tensor).
    """
    return {
        name: (
            checked_cast(name, tensor, torch.empty(tensor.shape, dtype=dtype))
            if tensor.is_floating_point() and tensor.dtype != dtype
            else tensor
        )
        for name, tensor in state_dict.items()
    }


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class _StateSource:
    """What NeMo's exporters get from ``nemo_load`` here: the state dict and config (as NeMo's ``_ModelState``), and
    what some exporters' ``apply`` read of a model besides: ``dtype``, ``to(dtype)`` and ``module.<path>``."""

    def __init__(self, state_dict: Dict[str, torch.Tensor], config: Any, dtype: torch.dtype) -> None:
        self._state_dict: Any = state_dict  # or a LazyCheckpointState (streamed)
        self.config, self.dtype = config, dtype

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self._state_dict

    def to(self, dtype: torch.dtype) -> "_StateSource":
        if isinstance(self._state_dict, LazyCheckpointState):
            self._state_dict = self._state_dict.cast_to(dtype)
        else:
            self._state_dict = cast_floating(self._state_dict, dtype)
        self.dtype = dtype
        return self

    @property
    def module(self) -> TensorView:
        return TensorView(
            self._state_dict, missing=lambda key: AttributeError(f"The checkpoint has no tensor {key} or {key}.*")
        )


class _TokenizerSaving:
    """An exporter's ``tokenizer`` (and its ``tokenizer``) whose ``save_pretrained`` logs a warning instead of raising,
    as NeMo's Llama exporter does: a model whose context has no Hugging Face tokenizer still exports."""

    def __init__(self, get: Callable[[], Any], output_dir: Path) -> None:
        self._get, self._output_dir = get, output_dir

    def __getattr__(self, name: str) -> Any:
        if name == "save_pretrained":
            return self._save
        if name == "tokenizer":
            return _TokenizerSaving(lambda: self._get().tokenizer, self._output_dir)
        return getattr(self._get(), name)

    def _save(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._get().save_pretrained(*args, **kwargs)
        except Exception as error:
            logger.warning("No Hugging Face tokenizer saved with %s: %s", self._output_dir, error)


class _OfflineExport:
    """Mixed in before NeMo's registered exporter class so that its own ``apply`` runs offline, only these replaced:

    - ``nemo_load`` returns a :class:`_StateSource` of the checkpoint read by the engine, in the export's dtype;
    - ``init`` builds the target model in that dtype and records its parameters' storages (still there after
      ``convert_state``: never assigned);
    - ``convert_state`` is streamed (:mod:`.hf_stream`) unless ``stream=False``; its model saves through
      :meth:`_save_checked` (``max_shard_size``; a tied output embedding re-tied first; a tensor never assigned fails);
    - ``tokenizer`` saves as :class:`_TokenizerSaving` does; ``ckpt_load`` is refused for merged adapters.

    The per-export settings are attributes set by :func:`_exporter_for` and :func:`export_hf_checkpoint`.
    """

    _np_exporter_class: type
    _np_read: Callable[[], Dict[str, torch.Tensor]]
    _np_model_config: Any
    _np_dtype: Optional[torch.dtype]
    _np_merged: bool
    _np_max_shard_size: int
    _np_output_dir: Path
    _np_stream: bool = False
    _np_open: Callable[[], LazyCheckpointState]
    _np_compare_with: Optional[Path] = None  # set: the streamed conversion compares with these files, writes none

    def _np_reset(self) -> None:
        self._np_state: Any = None
        self._np_conversion: Optional[StreamedConversion] = None
        self._np_apply_path: Optional[Path] = None
        self._np_allocated: Dict[int, torch.Tensor] = {}
        self._np_saved: Optional[Dict[str, torch.Tensor]] = None
        self._np_ckpt_loaded = False

    def _np_source_state(self) -> Dict[str, torch.Tensor]:
        if self._np_state is None and self._np_stream:
            lazy = self._np_open()
            self._np_dtype = self._np_dtype or floating_dtype((s.dtype, s.nbytes) for s in lazy.specs.values())
            self._np_state = lazy.cast_to(self._np_dtype)
        if self._np_state is None:
            state = self._np_read()
            self._np_dtype = self._np_dtype or checkpoint_dtype(state)
            self._np_state = cast_floating(state, self._np_dtype)
        return self._np_state

    def _np_config(self) -> Any:
        """The model's config, copied, with its precision flags saying the export's dtype (``apply`` reads them)."""
        config = copy.copy(self._np_model_config)
        flags = {"fp16": self._np_dtype == torch.float16, "bf16": self._np_dtype == torch.bfloat16}
        for name, value in {**flags, "params_dtype": self._np_dtype}.items():
            if hasattr(config, name):
                object.__setattr__(config, name, value)
        return config

    def nemo_load(self, path: Any, trainer: Any = None, cpu: bool = True) -> Tuple[_StateSource, None]:
        state = self._np_source_state()
        assert self._np_dtype is not None
        return _StateSource(state, self._np_config(), self._np_dtype), None

    def apply(self, output_path: Any, *args: Any, **kwargs: Any) -> Any:
        self._np_apply_path = Path(output_path)
        return super().apply(output_path, *args, **kwargs)  # type: ignore[misc]

    def ckpt_load(self, path: Any) -> Any:
        if self._np_merged:
            raise ExportError(
                f"NeMo's {self._np_exporter_class.__qualname__} reads the distributed checkpoint itself, "
                "so it cannot export merged adapters; merge them with --format safetensors"
            )
        self._np_ckpt_loaded = True
        return super().ckpt_load(path)  # type: ignore[misc]

    def init(self, *args: Any, **kwargs: Any) -> Any:
        if self._np_dtype is None and not self._np_ckpt_loaded:
            self._np_source_state()  # the checkpoint's dtype (some exporters call init before nemo_load)
        base_init = super().init  # type: ignore[misc]
        signature = inspect.signature(base_init)
        if self._np_dtype is not None and "dtype" in signature.parameters:
            bound = signature.bind_partial(*args, **kwargs)
            bound.arguments["dtype"] = self._np_dtype
            args, kwargs = bound.args, bound.kwargs
        with torch.device("meta") if self._np_stream else contextlib.nullcontext():  # streamed: nothing assigned
            target = base_init(*args, **kwargs)
        dtype = self._np_dtype
        if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in target.parameters()):
            target = target.to(dtype)  # an init without a dtype (HFMixtralExporter.init()) builds fp32
        # Kept referenced until the output is saved, so that no assigned tensor can reuse one of these addresses.
        self._np_allocated.update({_storage(p): p for p in target.parameters() if not p.is_meta and p.numel()})
        return target

    def convert_state(self, source: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        from nemo.lightning import io

        nemo_apply, conversion = io.apply_transforms, None
        if self._np_stream:
            assert self._np_apply_path is not None
            name = self._np_exporter_class.__qualname__
            conversion = StreamedConversion(name, self._np_apply_path, self._np_max_shard_size, self._np_compare_with)
            io.apply_transforms = functools.partial(conversion.apply_transforms, nemo_apply)
        try:
            converted = super().convert_state(source, target, *args, **kwargs)  # type: ignore[misc]
        finally:
            if conversion is not None:
                io.apply_transforms = nemo_apply
        if conversion is not None and conversion.streamed:
            self._np_conversion = conversion
        converted.save_pretrained = functools.partial(self._save_checked, converted, converted.save_pretrained)
        return converted

    def _np_save_streamed(
        self, target: Any, state: Any, save: Callable[..., Any], output_path: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """The streamed conversion's ``save_pretrained``: the tensors to be saved must be those written (else
        :class:`ExportError`); writes the index, then the other files (``config.json``, ...) with no weights."""
        conversion = self._np_conversion
        assert conversion is not None
        names = saved_names(target, state)
        planned = [spec.name for spec in conversion.planned]
        if names != planned:
            extra, missing = sorted(set(names) - set(planned)), sorted(set(planned) - set(names))
            raise ExportError(
                f"NeMo's {self._np_exporter_class.__qualname__} saves other tensors than its transforms were streamed "
                f"for (to be saved, not written: {extra[:5]}; written, not to be saved: {missing[:5]})"
            )
        conversion.write_index()
        output_path = Path(output_path)
        scratch = Path(tempfile.mkdtemp(prefix=".np-config-", dir=output_path))
        try:
            kwargs.update(state_dict={}, safe_serialization=True)
            result = save(scratch, *args, **kwargs)
            for path in scratch.iterdir():
                if path.is_file() and not path.name.endswith(".safetensors") and not path.name.endswith(".index.json"):
                    os.replace(path, output_path / path.name)
        finally:
            shutil.rmtree(scratch)
        self._np_saved = {s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in conversion.planned}
        return result

    @property
    def tokenizer(self) -> _TokenizerSaving:
        return _TokenizerSaving(lambda: super(_OfflineExport, self).tokenizer, self._np_output_dir)  # type: ignore

    def _save_checked(self, target: Any, save: Callable[..., Any], output_path: Any, *args: Any, **kwargs: Any) -> Any:
        """``target.save_pretrained(output_path, ...)`` as ``apply`` calls it, after the checks in the class docstring.

        Raises:
            ExportError: a tensor to be written was never assigned by the exporter (the message names them).
        """
        if self._np_conversion is None and _is_peft_model(target):  # only the adapters, as PEFT exporters save them
            from peft import get_peft_model_state_dict

            embedding_layers = kwargs.get("save_embedding_layers", "auto")
            state = get_peft_model_state_dict(target, save_embedding_layers=embedding_layers)
        else:
            if kwargs.get("state_dict") is None and hasattr(target, "tie_weights"):
                target.tie_weights()  # an output embedding tied in the config shares the assigned input embedding
            state = kwargs.get("state_dict")
            state = target.state_dict() if state is None else state
            if self._np_conversion is not None:
                return self._np_save_streamed(target, state, save, output_path, *args, **kwargs)
            kwargs.update(max_shard_size=self._np_max_shard_size, safe_serialization=True)
        allocated = self._np_allocated
        unassigned = sorted(n for n, t in state.items() if t.is_meta or (t.numel() > 0 and _storage(t) in allocated))
        if unassigned:
            raise unassigned_error(self._np_exporter_class.__qualname__, unassigned)
        result = save(output_path, *args, **kwargs)
        self._np_saved = dict(state)
        return result


def _exporter_for(checkpoint_dir: Path, peft: bool = False) -> Tuple[Any, Any]:
    """The model from ``<checkpoint_dir>/context`` and NeMo's ``"hf"`` exporter (``"hf-peft"`` with ``peft``, whose
    PEFT method is read here already) for its class, with :class:`_OfflineExport` mixed in.

    Raises:
        ExportError: NeMo is not importable, the context cannot be read, or the class has no ``"hf"`` exporter.
        AdapterCheckpointError: with ``peft``, no ``"hf-peft"`` exporter, or the PEFT method cannot be read.
    """
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
        exporter_class = type(model_class.exporter("hf-peft" if peft else "hf", str(checkpoint_dir)))
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
    offline = type(exporter_class.__name__, (_OfflineExport, exporter_class), {"__module__": __name__})
    exporter = offline(str(checkpoint_dir))
    exporter._np_exporter_class, exporter._np_model_config = exporter_class, model.config
    exporter._np_reset()
    if peft:
        try:
            exporter.peft_obj = io.load_context(str(checkpoint_dir / "context"), subpath="model.model_transform")
        except Exception as error:
            raise AdapterCheckpointError(
                f"Cannot read the PEFT method from {checkpoint_dir / 'context'} (model.model_transform): {error}"
            ) from error
    return model, exporter


def _run_exporter(exporter: Any, output_dir: Path) -> Dict[str, torch.Tensor]:
    """Run NeMo's ``exporter.apply(output_dir)`` (an :class:`_OfflineExport`) and return the state dict it saved.

    Raises:
        ExportError: the exporter failed (NeMo's message) or saved no model its ``convert_state`` returned.
        ConsolidationError: or a subclass, from reading the checkpoint.
    """
    name = exporter._np_exporter_class.__qualname__
    try:
        exporter.apply(output_dir)
    except ConsolidationError:
        raise
    except Exception as error:
        raise ExportError(f"NeMo's {name} failed: {type(error).__name__}: {error}") from error
    finally:
        exporter._np_allocated.clear()
        exporter._np_state = None
    if exporter._np_saved is None:
        raise ExportError(f"NeMo's {name} saved no model converted by its convert_state")
    return exporter._np_saved


def _verify_against_checkpoint(
    location: CheckpointLocation,
    output_dir: Path,
    model: Any,
    exporter: Any,
    saved: Dict[str, torch.Tensor],
    peft: bool,
    base_checkpoint: Optional[Union[str, Path]],
) -> None:
    """``verify``: the written files against the checkpoint through NeMo's importer (:mod:`.hf_verify`; ``saved`` is
    dropped first), or, for a PEFT directory or where the importer cannot run (a warning says why), against ``saved``.

    Raises:
        VerificationError: a mismatch, naming the written tensor and its file.
    """
    if peft:  # NeMo registers no importer of Hugging Face PEFT directories
        _verify_hf(output_dir, saved)
        return
    streamed = any(tensor.is_meta for tensor in saved.values())  # the converted tensors are gone

    def drop_converted() -> None:
        saved.clear()
        gc.collect()  # the converted model refers to itself (its save_pretrained), so it goes with a collection

    try:
        check_through_importer(
            location,
            output_dir,
            model,
            merge_adapters=location.adapter,
            base_checkpoint=base_checkpoint,
            trust_remote_code=getattr(exporter, "trust_remote_code", None),
            before_reading=drop_converted,
        )
    except ImporterUnavailable as error:
        logger.warning(
            "Verifying %s against NeMo's exporter's converted model only (not the checkpoint): %s", output_dir, error
        )
        if streamed:  # converted again, streamed, each tensor compared with the written one (the rest to scratch)
            scratch = Path(tempfile.mkdtemp(prefix=".np-verify-", dir=output_dir))
            exporter._np_reset()
            exporter._np_compare_with = output_dir
            try:
                saved = _run_exporter(exporter, scratch)
            finally:
                exporter._np_compare_with = None
                shutil.rmtree(scratch, ignore_errors=True)
            if all(tensor.is_meta for tensor in saved.values()):  # else its transforms were not split this time
                return
        _verify_hf(output_dir, saved)


def _verify_hf(output_dir: Path, expected: Dict[str, torch.Tensor]) -> None:
    """Every tensor in the written safetensors files equals the exporter's converted tensor (bitwise)."""
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


def _give_files_the_default_mode(directory: Path) -> None:
    """Give every regular file under ``directory`` the mode a new file gets here (found by creating one, which unlike
    ``os.umask`` changes nothing for other threads): ``transformers`` writes its safetensors files with mode 0o600."""
    probe = directory / ".mode-probe"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        mode = stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


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
    run: Optional[str] = None,
    staging_dir: Optional[Union[str, Path]] = None,
    before_publish: Optional[Callable[[], None]] = None,
    trust_context: Optional[bool] = None,
    stream: bool = True,
) -> ConsolidationResult:
    """Write a ``transformers``-loadable directory for a finished NeMo 2 ``torch_dist`` checkpoint.

    Args:
        checkpoint_dir: the checkpoint directory (with ``context/`` and ``weights/``) or its ``weights/``.
        output_dir: where to publish; defaults to ``<ckpt>/hf``. Published atomically.
        global_step: recorded in ``metadata.json``.
        max_shard_size: bytes per safetensors file, passed to ``save_pretrained``.
        dtype: floating-point dtype of the exported weights (default: the checkpoint's); integer tensors keep theirs.
        overwrite: replace an existing output; if ``False`` it raises :class:`OutputExistsError` before any work.
        verify: compare every written tensor with the checkpoint's through NeMo's importer for the class
            (:mod:`nemo_patch.export.hf_verify`), or, without one that runs, with the converted model.
        allow_unfinished: export even if NeMo's unfinished marker is present.
        progress: called with ``(bytes read, bytes in all)`` while the checkpoint's weights are read.
        merge_adapters: for a LoRA adapter checkpoint, export the base model with the adapters merged; without it,
            an adapter checkpoint gives a Hugging Face PEFT directory through NeMo's ``"hf-peft"`` exporter.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.
        best: recorded as ``"best"`` in ``metadata.json``: ``{"monitor": name, "value": float, "mode": "min" |
            "max"}`` when the checkpoint was consolidated as the best by NeMo's ``ModelCheckpoint`` metric.
        run: recorded as ``"run"`` in ``metadata.json``: the training run the checkpoint belongs to.
        staging_dir: where the output is written before it is renamed into place (default: its parent).
        before_publish: called right before the output is renamed into place; if it raises, nothing is published.
        trust_context: ``False`` for a checkpoint from elsewhere: its ``context/`` is checked first and loaded off
            the network (:mod:`nemo_patch.export.context_trust`); ``True`` or ``None``: loaded as NeMo does.
        stream: convert and write one layer at a time (:mod:`nemo_patch.export.hf_stream`); ``False``: the whole
            model in memory, as NeMo's ``export_ckpt`` (the same files; a PEFT directory always).

    Returns:
        A :class:`nemo_patch.engine.consolidate.ConsolidationResult` (count and bytes of the tensors written).

    Raises:
        AdapterCheckpointError: a PEFT adapter checkpoint (without ``merge_adapters``) whose model class has no
            ``"hf-peft"`` exporter, or whose PEFT method cannot be read (exit code 12; the class is named).
        AdapterMergeError: the adapters cannot be merged (exit code 13; e.g. the base checkpoint is missing).
        ExportError: NeMo is not importable, the context cannot be read, the class has no ``"hf"`` exporter, NeMo's
            exporter fails, or it leaves a tensor to be written unassigned (the message names it); exit code 10.
        VerificationError: with ``verify``, a written tensor differs from the checkpoint's, is missing or comes from no
            checkpoint tensor (the message names the tensor and its file); exit code 9.
        ConsolidationError: or another subclass from :mod:`nemo_patch.engine.errors`, as for
            :func:`nemo_patch.engine.consolidate.consolidate_checkpoint`. Nothing partial is left on failure.
    """
    refuse_remote(checkpoint_dir, "the checkpoint")
    refuse_remote(output_dir or "", "the output")
    location = inspect_checkpoint(checkpoint_dir, allow_unfinished=allow_unfinished)
    ckpt_dir, weights_dir = location.checkpoint_dir, location.weights_dir
    peft = location.adapter and not merge_adapters
    output_dir = Path(output_dir) if output_dir is not None else ckpt_dir / HF_DIRNAME
    check_output_target(ckpt_dir, output_dir, overwrite)  # never the checkpoint, nor anything not a previous output
    if output_dir.exists() and not overwrite:
        raise OutputExistsError(f"{output_dir} exists (overwrite it with --force)")
    source = source_fingerprint(weights_dir)  # which save of the checkpoint this is, before anything is read
    identity = save_identity(ckpt_dir, allow_unfinished=True)  # compared before publishing: a re-save publishes none
    loading = context_loading(ckpt_dir / "context", trust_context is not False)  # checked now, if from elsewhere
    with loading():
        model, exporter = _exporter_for(ckpt_dir, peft)
    metadata: Any = None

    def read() -> Dict[str, torch.Tensor]:
        nonlocal metadata
        state, metadata = read_checkpoint_tensors(location, merge_adapters, base_checkpoint, progress)
        return state

    def open_lazy() -> LazyCheckpointState:
        nonlocal metadata
        sources = open_sources(location, None, merge_adapters, base_checkpoint)
        metadata = sources.model_metadata
        produce = sources.producer(reuse=False)
        specs = {output.spec.name: output.spec for output in sources.outputs}
        renamed = te_layer_norm_names(specs)  # type: ignore[arg-type]

        def read_one(name: str) -> torch.Tensor:
            try:
                return produce(renamed[name])  # type: ignore[arg-type]
            except ConsolidationError:
                raise
            except (Exception, CheckpointException) as error:
                raise CorruptShardError(f"Cannot read the weights of {weights_dir}: {error}") from error

        return LazyCheckpointState(renamed, read_one, None, progress)  # type: ignore[arg-type]

    exporter._np_read, exporter._np_dtype, exporter._np_merged = read, dtype, location.adapter and merge_adapters
    exporter._np_open, exporter._np_stream = open_lazy, stream and not peft
    exporter._np_max_shard_size, exporter._np_output_dir = max_shard_size, output_dir
    failure = f"Exporting {ckpt_dir} to Hugging Face"
    with staged_output(ckpt_dir, output_dir, overwrite, failure, "hf-", staging_dir, before_publish) as tmp_dir:
        try:
            with loading():  # the exporter loads the context's tokenizer
                saved = _run_exporter(exporter, tmp_dir)
        except (ConsolidationError, OSError) as error:  # a read that failed because the checkpoint was saved again
            changed = saved_again_instead(ckpt_dir, identity, error)
            if changed is not None:
                raise changed from error
            raise
        written: List[str] = []  # the tensor names written (headers only)
        for path in sorted(tmp_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                written.extend(handle.keys())
        total_bytes = sum(saved[n].numel() * saved[n].element_size() for n in written if n in saved)
        if verify:
            try:
                with loading():
                    _verify_against_checkpoint(location, tmp_dir, model, exporter, saved, peft, base_checkpoint)
            except VerificationError as error:  # named by the output's own path (nothing is published)
                raise VerificationError(str(error).replace(str(tmp_dir), str(output_dir))) from error
        saved.clear()
        if metadata is None:  # the exporter read the checkpoint itself (ckpt_load): only for the vocabulary sizes
            try:
                metadata = read_dcp_metadata(weights_dir)
            except Exception as error:  # only metadata.json's vocab_size depends on it
                logger.warning("Cannot read the metadata of %s: %s", weights_dir, error)
        manifest: Dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "format": "hf",
            "kind": "adapter" if peft else "model",
            "global_step": global_step,
            "source_checkpoint": os.path.relpath(weights_dir, output_dir),
            "source_metadata": source,
            "save": identity.as_json(),
            "exporter": f"{exporter._np_exporter_class.__module__}.{exporter._np_exporter_class.__qualname__}",
            "tensor_count": len(written),
            "total_bytes": total_bytes,
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "vocab_size": None if metadata is None else vocabulary_sizes(ckpt_dir, metadata),
        }
        if location.adapter:
            manifest.update(base_checkpoint=adapter_base(location.weights_dir), peft=peft_settings(ckpt_dir))
        if location.adapter and not peft:  # merged: as the safetensors format records it
            manifest.update(merged_adapters=lora_scale(manifest["peft"])[1])
        if best is not None:
            manifest.update(best=dict(best))
        if run is not None:
            manifest.update(run=run)
        (tmp_dir / METADATA_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _give_files_the_default_mode(tmp_dir)
        check_unchanged(ckpt_dir, identity, allow_unfinished)  # the save that was read, finished: else none published
    logger.info("Exported %s -> %s with %s", ckpt_dir, output_dir, manifest["exporter"])
    return ConsolidationResult(output_dir, len(written), total_bytes, global_step, {}, manifest["kind"])
