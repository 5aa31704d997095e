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

"""Check a Hugging Face export against its checkpoint, tensor by tensor, through NeMo's *importer* for the model class.

Every written tensor, mapped back by the importer (run on stand-ins, its transforms captured and replayed), must equal
the checkpoint's bit for bit (docs/outputs.md). Memory: about twice the model's weights. Imports torch and the engine
at module level; NeMo and ``transformers`` only inside the functions that need them.
"""

import contextlib
import logging
import math
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Set, Tuple, Union

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

from nemo_patch.engine.casting import cast_overflow
from nemo_patch.engine.checkpoint_layout import CheckpointLocation, inspect_checkpoint
from nemo_patch.engine.consolidate import ProgressCallback, read_state_dict
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError
from nemo_patch.engine.output_files import InvalidOutputError, output_weight_map
from nemo_patch.engine.safe_files import read_json_file
from nemo_patch.engine.tensor_sources import open_sources
from nemo_patch.engine.verify import VerificationError, tensors_bitwise_equal
from nemo_patch.engine.vocabulary import tokenizer_vocab_size
from nemo_patch.export.context_trust import context_loading
from nemo_patch.export.hf_stream import floating_dtype
from nemo_patch.export.layer_norms import te_layer_norm_names

__all__ = ["ImporterUnavailable", "TensorView", "VOCABULARY_TENSORS", "check_through_importer", "importer_class"]
__all__ += ["read_checkpoint_tensors", "verify_hf_output"]

logger = logging.getLogger(__name__)

#: The Megatron tensors whose rows are the (padded) vocabulary.
VOCABULARY_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_Call = Tuple[Any, Dict[str, Any], List[Any], List[str]]  # a captured call: source, mapping, transforms, ignored

#: ``io.apply_transforms`` is replaced for the duration of one importer's ``convert_state`` at a time.
_CAPTURE_LOCK = threading.Lock()


class ImporterUnavailable(Exception):
    """The check through NeMo's importer cannot run for this model class (the message says why); not a mismatch."""


class _MissingTensor(AttributeError):
    """A tensor the importer asked for by attribute is not in the written files (``hasattr`` says no)."""


class _WrittenTensors(Mapping[str, torch.Tensor]):
    """The written safetensors files as a read-only state dict, loading a tensor each time it is read and recording
    the reads, grouped by the target they end up in (:class:`_Imported`)."""

    def __init__(self, output_dir: Path, weight_map: Mapping[str, str]) -> None:
        self._output_dir, self._weight_map = output_dir, dict(weight_map)
        self._handles: Dict[str, Any] = {}
        self._stack = contextlib.ExitStack()
        self.read: Set[str] = set()
        self.group: List[str] = []
        self.group_closed = False

    def _handle(self, name: str) -> Any:
        filename = self._weight_map[name]  # KeyError for a name not written
        handle = self._handles.get(filename)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(self._output_dir / filename), framework="pt"))
            self._handles[filename] = handle
        return handle

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._handle(name)
        if self.group_closed:
            self.group, self.group_closed = [], False
        self.group.append(name)
        self.read.add(name)
        return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)

    def shape(self, name: str) -> Tuple[int, ...]:
        """The tensor's shape, from its file's header."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self) -> Optional[torch.dtype]:
        """The floating-point dtype of most of the tensors (headers only), ``None`` if none is floating."""
        dtypes = [_SAFETENSORS_DTYPES.get(self._handle(name).get_slice(name).get_dtype()) for name in self._weight_map]
        return floating_dtype((dtype, 1) for dtype in dtypes if dtype is not None) if any(dtypes) else None

    def file(self, name: str) -> Path:
        return self._output_dir / self._weight_map[name]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


class TensorView:
    """Attribute access to a state's tensors by their dotted names (``source.model.embed_tokens.weight``), as some
    exporters' ``apply`` and importers' transforms read a model; a name that is neither a tensor nor a prefix of one
    raises ``missing(name)``."""

    def __init__(
        self, state: Mapping[str, torch.Tensor], prefix: str = "", missing: Callable[[str], Exception] = _MissingTensor
    ) -> None:
        self._state, self._prefix, self._missing = state, prefix, missing

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        key = f"{self._prefix}{name}"
        if key in self._state:
            return self._state[key]
        if any(other.startswith(f"{key}.") for other in self._state):
            return TensorView(self._state, f"{key}.", self._missing)
        raise self._missing(key)


class _WrittenModel:
    """The Hugging Face model an importer's ``convert_state`` gets: ``config`` (from ``config.json``),
    ``state_dict()`` (the written tensors) and attribute access to them."""

    def __init__(self, config: Any, tensors: Mapping[str, torch.Tensor]) -> None:
        self.config, self._tensors = config, tensors

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(TensorView(self._tensors), name)


class _Imported(MutableMapping[str, torch.Tensor]):
    """The NeMo model's state dict an importer's transforms fill (the checkpoint's names), keeping what each transform
    (``step``) assigns and the written tensors it was made from. A target read before it is assigned (filled in place,
    as by NeMo's Mixtral importer) is a new tensor of the checkpoint's shape, NaN-filled if floating (in ``dtype``)."""

    def __init__(
        self, names: Mapping[str, torch.Tensor], sources: Optional[_WrittenTensors], dtype: torch.dtype
    ) -> None:
        self._names, self._sources, self._dtype = names, sources, dtype
        self.assigned: Dict[str, torch.Tensor] = {}
        self.made_from: Dict[str, List[str]] = {}
        self.made_by: Dict[str, Any] = {}
        self.fresh: Dict[str, torch.Tensor] = {}
        self.step: Any = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.assigned:
            return self.assigned[name]
        if name not in self.fresh:
            like = self._names[name]  # KeyError for a name the checkpoint does not hold
            dtype = self._dtype if like.is_floating_point() else like.dtype
            fill = float("nan") if dtype.is_floating_point else 0
            self.fresh[name] = torch.full(tuple(like.shape), fill, dtype=dtype)
        return self.fresh[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self.assigned[name] = value
        self.made_by[name] = self.step
        if self._sources is not None:
            self.made_from[name] = list(self._sources.group)
            self._sources.group_closed = True

    def __delitem__(self, name: str) -> None:
        self.assigned.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


class _CheckpointModel:
    """The NeMo model an importer's ``convert_state`` gets: the context's ``config`` and the state to fill."""

    def __init__(self, config: Any, state: _Imported) -> None:
        self.config, self.state = config, state

    def state_dict(self) -> _Imported:
        return self.state


def importer_class(model_class: type) -> Optional[type]:
    """NeMo's ``"hf"`` importer registered for ``model_class`` exactly (as NeMo looks it up), or ``None``."""
    return (getattr(model_class, "_IMPORTERS", None) or {}).get(f"{model_class}hf")


def _hf_config(output_dir: Path) -> Any:
    """``config.json`` as ``AutoConfig`` reads it (no remote code), else a ``PretrainedConfig`` of its keys."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        keys = read_json_file(output_dir / "config.json")  # a bounded regular file (no FIFO) before transformers
    except (OSError, ValueError) as unreadable:
        raise VerificationError(f"Cannot read {output_dir / 'config.json'}: {unreadable}") from unreadable
    try:
        return AutoConfig.from_pretrained(str(output_dir), trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - any failure: fall back to the keys themselves
        logger.debug("AutoConfig cannot read %s (%s); reading its keys", output_dir, error)
        return PretrainedConfig.from_dict(keys)


@contextlib.contextmanager
def _captured_apply_transforms(stand_in: _CheckpointModel) -> Iterator[List[_Call]]:
    """While the block runs, ``io.apply_transforms`` records a call for ``stand_in`` as ``(source, mapping, transforms,
    state_dict_ignored_entries)`` and returns ``stand_in``; any other call is NeMo's. One block at a time."""
    from nemo.lightning import io

    calls: List[_Call] = []
    with _CAPTURE_LOCK:
        original = io.apply_transforms

        def apply_transforms(
            source: Any,
            target: Any,
            mapping: Dict[str, Any],
            transforms: Optional[List[Any]] = None,
            state_dict_ignored_entries: Optional[List[str]] = None,
            cast_dtype: Optional[torch.dtype] = None,
        ) -> Any:
            if target is not stand_in:
                return original(source, target, mapping, transforms or [], state_dict_ignored_entries or [],
                                cast_dtype)  # fmt: skip
            calls.append((source, dict(mapping), list(transforms or []), list(state_dict_ignored_entries or [])))
            return stand_in

        io.apply_transforms = apply_transforms
        try:
            yield calls
        finally:
            io.apply_transforms = original


def _allowed_vocabulary_sizes(checkpoint_dir: Path, model: Any) -> Set[int]:
    """The vocabulary sizes the checkpoint records besides its padded rows: its tokenizer's and its config's."""
    sizes = {tokenizer_vocab_size(checkpoint_dir), getattr(getattr(model, "config", None), "vocab_size", None)}
    try:
        sizes.add(getattr(getattr(model, "tokenizer", None), "vocab_size", None))
    except Exception as error:  # noqa: BLE001 - a tokenizer that cannot say its size is just not a size
        logger.debug("No vocabulary size from the context's tokenizer: %s", error)
    return {size for size in sizes if isinstance(size, int) and not isinstance(size, bool) and size > 0}


def _tensors_text(names: List[str], written: _WrittenTensors) -> str:
    """``Tensor <name> in <file>``, or ``Tensors <a>, <b> in <file>`` (each with its file when they differ)."""
    files = {written.file(name) for name in names}
    shown = names[:4]
    more = ", ..." if len(names) > len(shown) else ""
    if len(files) == 1:
        return f"Tensor{'s' if len(names) > 1 else ''} {', '.join(shown)}{more} in {files.pop()}"
    return "Tensors " + ", ".join(f"{name} (in {written.file(name)})" for name in shown) + more


def _gives(made_from: List[str], written: _WrittenTensors, name: str, importer_name: str) -> str:
    """``Tensor <a> in <file> gives <name> through NeMo's <importer>``, or ``... <name> from no written tensor``."""
    if not made_from:
        return f"NeMo's {importer_name} makes {name} from no written tensor"
    verb = "gives" if len(made_from) == 1 else "give"
    return f"{_tensors_text(made_from, written)} {verb} {name} through NeMo's {importer_name}"


def _trace(
    step: Any,
    name: str,
    sources: List[str],
    written: _WrittenTensors,
    source_config: Any,
    target_config: Any,
    like: torch.Tensor,
) -> Optional[Tuple[torch.Tensor, List[Tuple[str, int, Tuple[int, ...]]]]]:
    """Run ``step`` (the transform that made ``name``) on stand-ins of ``sources`` whose elements encode their own
    positions (``4 * k + 1`` for the ``k``-th element of all of them, in float64, exact), so that each element of the
    result says which written element it was moved from.

    Returns:
        ``(result, [(source, first k, shape), ...])``, or ``None`` when the transform cannot run on the stand-ins or
        computes rather than moves (a result element not of the form ``4 * k + 1``).
    """
    from nemo.lightning.io.state import TransformCTX

    traced: Dict[str, torch.Tensor] = {}
    spans: List[Tuple[str, int, Tuple[int, ...]]] = []
    offset = 0
    for source in sources:
        shape = written.shape(source)
        count = math.prod(shape)
        traced[source] = ((torch.arange(count, dtype=torch.float64) + offset) * 4 + 1).reshape(shape)
        spans.append((source, offset, shape))
        offset += count
    if offset >= 2**50:
        return None
    state = _Imported({name: like}, None, torch.float64)
    source_model, target_model = _WrittenModel(source_config, traced), _CheckpointModel(target_config, state)
    ctx = TransformCTX(source=source_model, source_state=traced, target=target_model, target_state=state)
    try:
        step(ctx)
    except Exception as error:  # noqa: BLE001 - no trace, only a less precise message
        logger.debug("Cannot trace %s: %s", name, error)
        return None
    result = state.assigned.get(name)
    if not isinstance(result, torch.Tensor) or result.dtype != torch.float64:
        return None
    known = result[~torch.isnan(result)]
    if known.numel() and not bool(((known - 1) % 4 == 0).all() and (known >= 1).all() and (known < 4 * offset).all()):
        return None
    return result, spans


def _mismatch(
    name: str,
    value: torch.Tensor,
    expected: torch.Tensor,
    made_from: List[str],
    trace: Optional[Tuple[torch.Tensor, List[Tuple[str, int, Tuple[int, ...]]]]],
    written: _WrittenTensors,
    importer_name: str,
) -> str:
    """The message for ``name`` made unequal to ``expected``: the written element it came from if ``trace`` says."""
    if expected.is_floating_point() and expected.element_size() in _BITS:  # bitwise
        bits = _BITS[expected.element_size()]
        differs = expected.contiguous().view(bits) != value.contiguous().view(bits)
    else:
        differs = expected != value
    position = [int(i) for i in torch.nonzero(differs)[0].tolist()] if differs.any() else [0] * value.dim()
    where = tuple(position)
    held, got = expected[where].item(), value[where].item()
    if trace is not None:
        traced, spans = trace
        code = traced[where].item() if traced.shape == value.shape else float("nan")
        if not math.isnan(code):
            k = int(code - 1) // 4
            source, start, shape = next(span for span in spans if span[1] <= k < span[1] + math.prod(span[2]))
            index = [int(i) for i in torch.unravel_index(torch.tensor(k - start), shape)]
            return (
                f"Tensor {source} in {written.file(source)} differs from the checkpoint at {index}: NeMo's "
                f"{importer_name} puts that element in {name} at {position}, where the checkpoint holds {held!r}, not "
                f"{got!r}"
            )
    return (
        f"{_gives(made_from, written, name, importer_name)}, which differs from the checkpoint's at {position}: "
        f"{got!r}, not {held!r}"
    )


def check_through_importer(
    location: CheckpointLocation,
    output_dir: Path,
    model: Any,
    merge_adapters: bool = False,
    base_checkpoint: Optional[Union[str, Path]] = None,
    trust_remote_code: Optional[bool] = None,
    before_reading: Optional[Callable[[], None]] = None,
) -> int:
    """Compare every tensor of the Hugging Face directory ``output_dir`` with the checkpoint through NeMo's importer.

    Args:
        location: the checkpoint (:func:`~nemo_patch.engine.checkpoint_layout.inspect_checkpoint`).
        output_dir: the written Hugging Face directory.
        model: the checkpoint's model from its context: its class selects the importer, which reads its ``config``.
        merge_adapters: the output has the adapters merged: the oracle is the merged model.
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.
        trust_remote_code: set on the importer as its ``apply`` would (some importers' ``config`` reads it).
        before_reading: called once the check can run, before the checkpoint's tensors are read.

    Returns:
        The number of written tensors checked.

    Raises:
        ImporterUnavailable: the class has no ``"hf"`` importer, or its ``convert_state`` cannot run on stand-ins.
        VerificationError: a tensor differs, is missing or is unexplained (names it and its file), or the written
            files cannot be read.
        ConsolidationError: or a subclass, from reading the checkpoint.
    """
    model_class = type(model)
    importer_type = importer_class(model_class)
    if importer_type is None:
        raise ImporterUnavailable(f"NeMo has no Hugging Face importer for {model_class.__module__}."
                                  f"{model_class.__qualname__}")  # fmt: skip
    importer_name = importer_type.__qualname__
    try:
        weight_map = output_weight_map(output_dir)
    except (OSError, InvalidOutputError) as error:
        raise VerificationError(f"Cannot read the weights of {output_dir}: {error}") from error
    hf_config = _hf_config(output_dir)
    written = _WrittenTensors(output_dir, weight_map)
    try:
        dtype = written.dtype() or torch.float32
        # 1. The importer's mapping, from its convert_state on stand-ins: the checkpoint's names and shapes (meta
        #    tensors, named as read_checkpoint_tensors names them: nothing read yet) and the written files.
        outputs = open_sources(location, None, merge_adapters, base_checkpoint).outputs
        meta = {o.spec.name: torch.empty(o.spec.shape, dtype=o.spec.dtype, device="meta") for o in outputs}
        target = _CheckpointModel(model.config, _Imported(te_layer_norm_names(meta), written, dtype))
        source, mapping, transforms, ignored = _importer_mapping(importer_type, output_dir, hf_config, written, target,
                                                                 trust_remote_code)  # fmt: skip
        if before_reading is not None:
            before_reading()

        # 2. The checkpoint's tensors (the oracle) and the importer's results from the written tensors.
        oracle, _ = read_checkpoint_tensors(location, merge_adapters, base_checkpoint)
        imported = target.state = _Imported(oracle, written, dtype)
        written.read, written.group, written.group_closed = set(), [], False  # the reads of convert_state on stand-ins
        _replay(importer_name, output_dir, source, target, mapping, transforms, written)

        # 3. Every checkpoint tensor made, and equal to the checkpoint's.
        vocabulary = _allowed_vocabulary_sizes(location.checkpoint_dir, model)
        hf_vocab = getattr(hf_config, "vocab_size", None)

        def gives(name: str) -> str:
            return _gives(imported.made_from.get(name) or [], written, name, importer_name)

        for name in list(oracle):
            expected = oracle.pop(name)
            value = imported.assigned.pop(name, None)
            made_from = imported.made_from.get(name) or []
            if value is None:
                if name in ignored:
                    continue
                raise VerificationError(
                    f"The checkpoint's {name} is not in {output_dir}: NeMo's {importer_name} makes it from no "
                    "tensor there"
                )
            if not isinstance(value, torch.Tensor):
                raise VerificationError(f"{gives(name)} as a {type(value).__name__}, not a tensor")
            fresh = imported.fresh.pop(name, None)
            in_place = fresh is not None and value.data_ptr() == fresh.data_ptr()
            like, rows = expected, None
            if (name in VOCABULARY_TENSORS and expected.dim() and isinstance(hf_vocab, int)
                    and hf_vocab < expected.shape[0] and hf_vocab in vocabulary):  # fmt: skip
                rows = hf_vocab
                expected = expected[:rows]  # megatron-core's padding rows, pruned by the exporter
                if in_place:
                    value = value[:rows]
            if tuple(value.shape) != tuple(expected.shape):
                raise VerificationError(
                    f"{gives(name)} with shape {tuple(value.shape)}; the checkpoint's is {tuple(expected.shape)}"
                    + (f" (its first {rows} rows: the vocabulary)" if rows is not None else "")
                )
            if expected.is_floating_point() and value.is_floating_point():
                overflow = cast_overflow(expected, value)
                if overflow is not None:  # the cast below would turn the same values into the same inf
                    raise VerificationError(f"{gives(name)} with inf where the checkpoint is finite: {overflow}")
                expected = expected.to(value.dtype)
            if not tensors_bitwise_equal(expected, value):
                trace = None
                if made_from and imported.made_by.get(name) is not None:
                    trace = _trace(imported.made_by[name], name, made_from, written, hf_config, model.config, like)
                    if trace is not None and rows is not None and trace[0].shape[0] != rows:
                        trace = (trace[0][:rows], trace[1])
                raise VerificationError(_mismatch(name, value, expected, made_from, trace, written, importer_name))
        extra = sorted(imported.assigned)
        if extra:
            raise VerificationError(f"{gives(extra[0])}, which the checkpoint does not hold")

        # 4. Every written tensor read for some checkpoint tensor.
        unread = [name for name in weight_map if name not in written.read]
        if unread:
            raise VerificationError(
                f"Tensor {unread[0]} in {written.file(unread[0])} comes from no tensor of the checkpoint: NeMo's "
                f"{importer_name} maps it to none" + (f" ({len(unread)} such tensors)" if len(unread) > 1 else "")
            )
        return len(weight_map)
    finally:
        written.close()


def _importer_mapping(
    importer_type: type,
    output_dir: Path,
    hf_config: Any,
    written: _WrittenTensors,
    target: _CheckpointModel,
    trust_remote_code: Optional[bool],
) -> _Call:
    """``(source, mapping, transforms, state_dict_ignored_entries)`` as NeMo's importer's ``convert_state`` hands
    them to ``io.apply_transforms`` for the stand-ins (the written files, ``target``).

    Raises:
        ImporterUnavailable: ``convert_state`` needs more than stand-ins, or does not call ``apply_transforms`` once.
        VerificationError: ``convert_state`` fails otherwise (NeMo's message), or reads a tensor that is not written.
    """
    importer_name = importer_type.__qualname__
    importer = importer_type(str(output_dir))
    if not hasattr(importer, "trust_remote_code"):
        importer.trust_remote_code = trust_remote_code
    try:
        with _captured_apply_transforms(target) as calls:
            importer.convert_state(_WrittenModel(hf_config, written), target)
    except _MissingTensor as error:
        raise VerificationError(
            f"{output_dir} lacks the tensor {error}, which NeMo's {importer_name} reads"
        ) from error
    except (AttributeError, TypeError, NotImplementedError) as error:
        raise ImporterUnavailable(
            f"NeMo's {importer_name}.convert_state needs more than the tensors' names and the config: "
            f"{type(error).__name__}: {error}"
        ) from error
    except Exception as error:  # noqa: BLE001 - NeMo's message, as a mismatch of the written directory
        raise VerificationError(
            f"NeMo's {importer_name} cannot read {output_dir} back: {type(error).__name__}: {error}"
        ) from error
    if len(calls) != 1:
        raise ImporterUnavailable(
            f"NeMo's {importer_name}.convert_state called io.apply_transforms {len(calls)} times for the model (once "
            "is what this check replays)"
        )
    return calls[0]


def _replay(
    importer_name: str,
    output_dir: Path,
    source: Any,
    target: _CheckpointModel,
    mapping: Dict[str, Any],
    transforms: List[Any],
    written: _WrittenTensors,
) -> None:
    """Run the importer's ``mapping`` and ``transforms`` into ``target``'s state dict, as ``io.apply_transforms`` does.

    Raises:
        VerificationError: a transform fails on the written tensors (a tensor missing, a shape that does not fit),
            naming the transform and the written tensors it last read.
    """
    from nemo.lightning.io.state import StateDictTransform, TransformCTX

    # source: the written files, or the _ModelState of modified tensors an importer rebuilt them as
    ctx = TransformCTX(source=source, source_state=source.state_dict(), target=target, target_state=target.state)
    for step in [StateDictTransform(key, value) for key, value in mapping.items()] + list(transforms):
        target.state.step = step
        try:
            ctx = step(ctx)
        except _MissingTensor as error:
            raise VerificationError(
                f"{output_dir} lacks the tensor {error}, which NeMo's {importer_name} reads"
            ) from error
        except AttributeError as error:  # a stand-in lacks what the transform reads: not a mismatch, but no check
            raise VerificationError(
                f"Cannot check {output_dir} through NeMo's {importer_name}: a transform needs more of a model than "
                f"this check has: {error}"
            ) from error
        except Exception as error:  # noqa: BLE001 - NeMo's message about the written tensors
            keys = f" {getattr(step, 'source_key', '?')} -> {getattr(step, 'target_key', '?')}"
            read = written.group if not written.group_closed else []
            last = f"; last read: {_tensors_text(read, written)}" if read else ""
            raise VerificationError(
                f"NeMo's {importer_name} cannot map {output_dir} back to the checkpoint's names (its transform"
                f"{keys}{last}): {type(error).__name__}: {error}"
            ) from error
    target.state.step = None


def verify_hf_output(
    checkpoint_dir: Union[str, Path],
    output_dir: Union[str, Path],
    merge_adapters: bool = False,
    base_checkpoint: Optional[Union[str, Path]] = None,
    allow_unfinished: bool = False,
    trust_context: bool = False,
) -> int:
    """Check a Hugging Face directory written for a checkpoint against the checkpoint, through NeMo's importer.

    Args:
        checkpoint_dir: the checkpoint directory (with ``context/`` and ``weights/``).
        output_dir: the Hugging Face directory.
        merge_adapters: the output is of an adapter checkpoint with its adapters merged (the oracle is too).
        base_checkpoint: with ``merge_adapters``, the base model's checkpoint, if not where NeMo recorded it.
        allow_unfinished: check an unfinished checkpoint's output too.
        trust_context: load the context whatever it names; else it is checked first and loaded off the network
            (:mod:`nemo_patch.export.context_trust`).

    Returns:
        The number of written tensors checked.

    Raises:
        VerificationError: a mismatch (the message names the written tensor and its file), or the check cannot run
            for this model class (no ``"hf"`` importer, or one that needs more than names and a config).
        UntrustedContextError: the context may not be loaded without ``trust_context``.
        ConsolidationError: or a subclass, from reading the checkpoint.
    """
    location = inspect_checkpoint(checkpoint_dir, allow_unfinished=allow_unfinished)
    loading = context_loading(location.checkpoint_dir / "context", trust_context)  # checked now unless trusted
    try:
        from nemo.lightning import io
    except ImportError as error:
        raise VerificationError(f"Checking a Hugging Face output needs NeMo importable: {error}") from error
    try:
        with loading():
            model = io.load_context(str(location.checkpoint_dir / "context"), subpath="model")
    except Exception as error:
        raise VerificationError(f"Cannot read the model class from {location.checkpoint_dir / 'context'}: "
                                f"{error}") from error  # fmt: skip
    try:
        with loading():
            return check_through_importer(location, Path(output_dir), model, merge_adapters, base_checkpoint)
    except ImporterUnavailable as error:
        raise VerificationError(f"Cannot check {output_dir} against {location.checkpoint_dir}: {error}") from error


def read_checkpoint_tensors(
    location: CheckpointLocation,
    merge_adapters: bool = False,
    base_checkpoint: Optional[Union[str, Path]] = None,
    progress: Optional[ProgressCallback] = None,
) -> Tuple[Dict[str, torch.Tensor], Any]:
    """The checkpoint's tensors as NeMo's exporters and importers name them (:func:`.layer_norms.te_layer_norm_names`)
    and its DCP metadata (:func:`~nemo_patch.engine.consolidate.read_state_dict`'s, which ``progress`` reports on).

    Raises:
        ConsolidationError: or a subclass (:class:`CorruptShardError` for a shard that cannot be read).
    """
    try:
        state, metadata = read_state_dict(location, merge_adapters, progress, base_checkpoint)
    except ConsolidationError:
        raise
    except (Exception, CheckpointException) as error:
        raise CorruptShardError(f"Cannot read the weights of {location.weights_dir}: {error}") from error
    return te_layer_norm_names(state), metadata
