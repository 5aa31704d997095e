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

"""How a run's checkpoints are consolidated: :class:`ConsolidationConfig`, each setting one field, declared once.

Each field's metadata (:func:`setting`) is the setting's only declaration: its validator, its help text (from the
class's ``Attributes:``) and its command-line option (:class:`CliOption`). A config is validated once, when it is made,
and stores values in one normal form, so that configs compare and serialise by value (NeMo's ``context/io.json``,
fiddle, NeMo-Run). Standard library only (plus the engine's torch-free output names).
"""

import inspect
import math
import re
import typing
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union, cast

from nemo_patch.engine.output_layout import DEFAULT_MAX_SHARD_SIZE, DTYPE_NAMES, OUTPUT_DIRNAMES, dtype_name

__all__ = ["CliOption", "ConsolidationConfig", "SETTINGS", "Setting", "annotation_text", "documented_attributes"]
__all__ += ["ACCEPTED_FORMATS", "DEFAULT_FORMAT", "DEFAULT_MAX_PENDING", "DEFAULT_POST_COMMAND_TIMEOUT"]
__all__ += ["DEFAULT_TIMEOUT", "setting", "validate_dtype", "validate_fields", "validate_flag"]
__all__ += ["validate_format", "validate_keep", "validate_max_pending", "validate_max_shard_size"]
__all__ += ["validate_post_command", "validate_timeout", "validate_workers", "consolidation_config"]

#: Output formats of a consolidation: ``ConsolidationConfig.format`` and the CLI's ``--format``.
ACCEPTED_FORMATS = tuple(OUTPUT_DIRNAMES)
DEFAULT_FORMAT = "safetensors"
#: Default ``ConsolidationConfig.max_pending``: requests that may wait behind the running one.
DEFAULT_MAX_PENDING = 2
#: Default ``ConsolidationConfig.timeout``: how long the end of ``fit`` waits for consolidations, in seconds.
DEFAULT_TIMEOUT = 1800.0
#: Default ``ConsolidationConfig.post_command_timeout``, in seconds.
DEFAULT_POST_COMMAND_TIMEOUT = 3600.0


@dataclass(frozen=True)
class CliOption:
    """How the command line takes a setting: its ``flag``, ``help``, option ``group``, how a string is parsed
    before validation (``None``: as it is; a string that does not parse is handed on, for the validator's message),
    the value's ``metavar`` and the ``choices`` listed in the usage line."""

    flag: str
    help: str
    group: str
    parse: Optional[Callable[[str], Any]] = None
    metavar: Optional[str] = None
    choices: Optional[Tuple[str, ...]] = None


@dataclass(frozen=True)
class Setting:
    """One setting: a field of :class:`ConsolidationConfig` with its default, annotation, validator (``(value,
    name) -> value`` in its stored form, or ``ValueError`` naming ``name``), help text and command-line option."""

    field: str
    default: Any
    annotation: Any
    validate: Callable[[Any, str], Any]
    help: str
    cli: Optional[CliOption] = None

    @property
    def name(self) -> str:
        """``ConsolidationConfig.<field>``, for messages."""
        return f"ConsolidationConfig.{self.field}"


def setting(default: Any, *, validate: Callable[[Any, str], Any], cli: Optional[CliOption] = None) -> Any:
    """A :class:`ConsolidationConfig` field declaring one setting (see :class:`Setting`; its help text is the field's
    entry in the class's ``Attributes:``)."""
    return field(default=default, metadata={"setting": dict(validate=validate, cli=cli)})


def _invalid(name: str, value: object, accepted: str) -> ValueError:
    return ValueError(f"Invalid {name} {value!r}: expected {accepted}.")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_option(name: str) -> bool:
    """Whether ``name`` is a command-line option (``--dtype``) rather than a Python argument."""
    return name.startswith("--")


def _number(text: str) -> Union[float, str]:
    try:
        return float(text)
    except ValueError:
        return text


def _whole_number(text: str) -> Union[int, str]:
    return int(text) if text.strip().isdecimal() else text  # isdigit() also takes "²", which int() does not


def validate_workers(value: object, name: str) -> Optional[int]:
    """``None`` (the default number of writer processes) or an ``int`` >= 1."""
    if value is None or _is_int(value, 1):
        return cast(Optional[int], value)
    raise _invalid(name, value, "a whole number of writer processes >= 1")


def validate_timeout(value: object, name: str) -> float:
    """Seconds, an ``int`` or ``float`` > 0 and finite (not ``bool``), as a float."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise _invalid(name, value, "a number of seconds > 0 (e.g. 1800)")


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def validate_max_shard_size(value: object, name: str) -> int:
    """Bytes of tensor data per safetensors file (>= 1): an ``int``, or a string as ``transformers``'
    ``save_pretrained(max_shard_size=...)`` takes it, ``"5GB"`` (powers of 1000), ``"500MiB"`` (powers of 1024), case
    aside a final lowercase ``b`` after a power of 1000, which counts bits as there (``"5Gb"`` is 625,000,000 bytes);
    rounded down."""
    if isinstance(value, int) and _is_int(value, 1):
        return value
    if isinstance(value, str):
        text = value.strip()
        match = _SIZE.fullmatch(text)
        if match:
            unit = match.group(2) or ""
            try:
                size = Fraction(match.group(1)) * _UNITS[unit.upper()]  # exact, any size
            except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
                size = Fraction(0)
            if text.endswith("b") and not unit.lower().endswith("ib"):
                size /= 8  # bits, as transformers reads "5Gb"
            if int(size) >= 1:
                return int(size)
    raise _invalid(name, value, 'an integer number of bytes >= 1 or a size such as "5GB" or "500MiB"')


def validate_format(value: object, name: str) -> str:
    """``"safetensors"`` (this package's layout) or ``"hf"`` (a Hugging Face directory)."""
    if isinstance(value, str) and value in ACCEPTED_FORMATS:
        return value
    raise _invalid(name, value, '"safetensors" or "hf"')


def validate_dtype(value: object, name: str) -> Optional[str]:
    """``None`` (the checkpoint's dtype) or the short name (``"bf16"``, ``"fp16"``, ``"fp32"``) of ``value``: one of
    those, ``"bfloat16"``, ``"float16"``/``"half"``, ``"float32"``/``"float"`` (any case, with or without ``torch.``)
    or a ``torch.dtype``. A command-line option's message (``name`` ``--...``) leaves ``None`` out."""
    if value is None:
        return None
    try:
        return dtype_name(value)
    except ValueError:
        accepted = f"one of {', '.join(map(repr, DTYPE_NAMES))}"
        raise _invalid(name, value, accepted if _is_option(name) else f"None (the checkpoint's dtype) or {accepted}")


def validate_flag(value: object, name: str) -> bool:
    """``True`` or ``False`` (not a stand-in such as ``1`` or ``"yes"``)."""
    if isinstance(value, bool):
        return value
    raise _invalid(name, value, "True or False")


def validate_keep(value: object, name: str) -> Optional[int]:
    """``None`` (keep every consolidated output) or an ``int`` >= 0 (the newest N)."""
    if value is None or (isinstance(value, int) and _is_int(value, 0)):
        return value
    raise _invalid(name, value, "None (keep every consolidated output) or an integer >= 0 (e.g. 3)")


def validate_post_command(value: object, name: str) -> Optional[str]:
    """``None`` or a shell command whose placeholders are among ``{output}``, ``{format}``, ``{global_step}`` and
    ``{checkpoint}`` (literal braces doubled)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        accepted = "a shell command such as 'python eval.py {output}'"
        raise _invalid(name, value, accepted if _is_option(name) else f"None or {accepted}")
    from nemo_patch.runs.post_command import check_placeholders

    try:
        check_placeholders(value)
    except ValueError as error:
        raise ValueError(f"Invalid {name}: {error}.") from None
    return value


def validate_max_pending(value: object, name: str) -> int:
    """Consolidation requests that may wait behind the running one, an ``int`` >= 0."""
    if isinstance(value, int) and _is_int(value, 0):
        return value
    raise _invalid(name, value, "an integer >= 0 (e.g. 2)")


@dataclass(frozen=True)
class ConsolidationConfig:
    """How a run's finished checkpoints are consolidated (immutable, validated when made):
    ``MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation=ConsolidationConfig(dtype="bf16"))``.
    Values are kept in one normal form: ``dtype`` as its short name, ``max_shard_size`` as bytes, timeouts as floats.

    Attributes:
        format: ``"safetensors"`` (default): ``<ckpt>/consolidated/`` with this package's layout (megatron-core names,
            any model); ``"hf"``: ``<ckpt>/hf/``, a ``transformers``-loadable directory written through NeMo's
            registered exporter for the model class (e.g. Llama); see the documentation's Outputs page. Either runs in
            the consolidation process, off the training path.
        dtype: floating-point dtype of the outputs, ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or a ``torch.dtype``, or its
            name, e.g. ``"bfloat16"``; kept as the short name); ``None`` (default) keeps the checkpoint's. Integer
            tensors are never cast.
        max_shard_size: most bytes of tensor data per output safetensors file (Hugging Face's sharding; default 5 *
            10**9): an int, or a size string as ``save_pretrained(max_shard_size=...)`` takes it (``"5GB"``,
            ``"500MiB"``; kept as bytes).
        workers: writer processes on each writing node (``safetensors`` format); ``None`` (default) is a quarter of the
            node's cores, 1 to 8, decided on the node that writes; never more than the output has tensors. The output
            is the same whatever the number.
        keep: what happens to a consolidated output when NeMo's top-k retention (``ModelCheckpoint(save_top_k=...)``)
            removes its checkpoint: ``None`` (default) keeps every one, as ``<root>/retained/<checkpoint name>/``;
            ``N`` keeps one while it is among the run's newest ``N`` consolidated outputs; ``0`` keeps none (it goes
            with its checkpoint). ``LATEST`` never names a removed checkpoint. See the documentation's Retention page.
        max_pending: how many consolidation requests may wait behind the running one while training runs (default 2).
            When one more arrives, the oldest waiting request is skipped (logged), so a cadence faster than
            consolidation never builds an unbounded backlog. Saves that finish when fit ends are all queued (the
            end-of-fit wait bounds them).
        timeout: how long, in seconds, the end of ``fit`` (normal or by an exception) waits for running and queued
            consolidations before giving up on them (logged). Default 1800.
        merge_adapters: for PEFT (LoRA) runs, whose checkpoints hold only the adapters: ``False`` (default) writes
            ``adapter_model.safetensors``; ``True`` writes the base model with the adapters merged as NeMo's
            ``LoRAMerge`` computes it (``model.safetensors``, or a full ``transformers`` directory with the ``"hf"``
            format).
        post_command: a shell command the consolidation process runs after each output it publishes, never a training
            process: ``{output}``, ``{format}``, ``{global_step}`` and ``{checkpoint}`` are replaced (shell-quoted);
            its output goes to ``<output>.post-command.log``, its result (exit code, seconds, metrics from the JSON
            lines of numbers it prints) into the output's ``metadata.json`` and, on global rank 0, the log; the metrics
            go to the trainer's loggers at the checkpoint's global step. A failure is a warning; training goes on.
            While it runs the next consolidation waits (queued requests count against ``max_pending``). ``None``
            (default): none.
        post_command_timeout: seconds the post command may run before its process group is stopped (recorded as timed
            out). Default 3600.

    Raises:
        ValueError: for an invalid value, naming ``ConsolidationConfig.<field>`` and the accepted forms.
    """

    format: str = setting(
        DEFAULT_FORMAT,
        validate=validate_format,
        cli=CliOption(
            "--format",
            "output format: safetensors (default) or hf (a Hugging Face directory)",
            "output",
            choices=ACCEPTED_FORMATS,
        ),
    )
    dtype: Optional[str] = setting(
        None,
        validate=validate_dtype,
        cli=CliOption(
            "--dtype", "cast floating-point tensors: bf16, fp16 or fp32 (default: keep the checkpoint's)", "output"
        ),
    )
    # Union: NeMo-Run's command line parses an override (``ckpt_consolidation.max_shard_size=5GB``) by this annotation
    max_shard_size: Union[int, str] = setting(
        DEFAULT_MAX_SHARD_SIZE,
        validate=validate_max_shard_size,
        cli=CliOption("--max-shard-size", "bytes of tensor data per file, e.g. 5GB (default) or 500MiB", "output"),
    )
    workers: Optional[int] = setting(
        None,
        validate=validate_workers,
        cli=CliOption(
            "--workers",
            "writer processes on this node (safetensors format; default: its cores, at most "
            "8); under torchrun or srun, on each node",
            "parallelism",
            _whole_number,
        ),
    )
    keep: Optional[int] = setting(None, validate=validate_keep)
    max_pending: int = setting(DEFAULT_MAX_PENDING, validate=validate_max_pending)
    timeout: float = setting(DEFAULT_TIMEOUT, validate=validate_timeout)
    merge_adapters: bool = setting(
        False,
        validate=validate_flag,
        cli=CliOption(
            "--merge-adapters",
            "for a PEFT (LoRA) adapter checkpoint: write its base model with the "
            "adapters merged instead of the adapters alone",
            "adapters",
        ),
    )
    post_command: Optional[str] = setting(
        None,
        validate=validate_post_command,
        cli=CliOption(
            "--post-command",
            "run CMD (with /bin/sh) after the output is published: {output}, {format}, "
            "{global_step}, {checkpoint} are replaced (and set as NEMO_CONSOLIDATED_* variables); its output "
            "goes to <output>.post-command.log, its result into metadata.json; a JSON line of numbers it "
            "prints is recorded as metrics",
            "output",
            metavar="CMD",
        ),
    )
    post_command_timeout: float = setting(
        DEFAULT_POST_COMMAND_TIMEOUT,
        validate=validate_timeout,
        cli=CliOption(
            "--post-command-timeout",
            "stop the post command after this many seconds (default 3600)",
            "output",
            _number,
            "SECONDS",
        ),
    )

    def __post_init__(self) -> None:
        validate_fields(self, {})

    def changed(self) -> Dict[str, Any]:
        """The fields whose value is not the default, in field order."""
        return {
            spec.field: getattr(self, spec.field) for spec in SETTINGS if getattr(self, spec.field) != spec.default
        }


def validate_fields(config: ConsolidationConfig, names: Mapping[str, str]) -> None:
    """Validate every field of ``config`` in place, storing each value in its normal form; ``names`` gives a field
    another name in messages (default: ``ConsolidationConfig.<field>``).

    Raises:
        ValueError: an invalid value.
    """
    for spec in SETTINGS:
        name, value = names.get(spec.field) or spec.name, getattr(config, spec.field)
        object.__setattr__(config, spec.field, spec.validate(value, name))


def documented_attributes(docstring: str) -> Dict[str, str]:
    """The ``Attributes:`` entries of a Google-style class docstring: name -> its text on one line.

    Raises:
        ValueError: the docstring has no ``Attributes:`` section.
    """
    section = re.search(r"\n( *)Attributes:\n(.*?)(?:\n\s*\n|$)", docstring, flags=re.S)
    if section is None:
        raise ValueError("no Attributes: section")
    entries: Dict[str, str] = {}
    indent, name = len(section.group(1)) + 4, ""
    for line in section.group(2).splitlines():
        match = re.match(rf" {{{indent}}}(\w+): (.*)", line)
        if match:
            name, entries[match.group(1)] = match.group(1), match.group(2)
        elif name:
            entries[name] += " " + line.strip()
    return entries


_HINTS = typing.get_type_hints(ConsolidationConfig)
_HELP = documented_attributes(ConsolidationConfig.__doc__ or "")
#: The declarations of every setting, in field order (help texts from the class's ``Attributes:``).
SETTINGS: Tuple[Setting, ...] = tuple(
    Setting(
        field=field_.name,
        default=field_.default,
        annotation=_HINTS[field_.name],
        help=_HELP.get(field_.name, ""),
        **field_.metadata["setting"],
    )
    for field_ in fields(ConsolidationConfig)  # every field is a setting, declared with setting()
)


def annotation_text(annotation: Any) -> str:
    """A type annotation as Python source, names without their modules (``Optional[int]``)."""
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(annotation))


def consolidation_config(**fields: Any) -> Any:
    """``run.Config(ConsolidationConfig, **fields)``, a NeMo-Run configuration of a :class:`ConsolidationConfig`: the
    factory that NeMo-Run's command line (``nemo llm pretrain/finetune``) and recipe overrides call by its dotted name
    (this module's, or the package's export), e.g. ``trainer.strategy.ckpt_consolidation=<name>(dtype=bf16)``; later
    overrides reach its fields (``trainer.strategy.ckpt_consolidation.max_pending=3``). Its signature is
    ``ConsolidationConfig``'s, so NeMo-Run parses each value as that field's type.

    Args:
        **fields: ``ConsolidationConfig`` fields (docs/strategy-arguments.md).

    Returns:
        A ``nemo_run.Config`` of :class:`ConsolidationConfig`.

    Raises:
        ValueError: a field value :class:`ConsolidationConfig` refuses (checked now, on the launcher).
        TypeError: a name that is not a field.
        ModuleNotFoundError: ``nemo_run`` is not installed.
    """
    import nemo_run as run

    ConsolidationConfig(**fields)  # refuses a bad value on the launcher, not in the job
    return run.Config(ConsolidationConfig, **fields)


#: What the constructor accepts where it differs from the stored type (NeMo-Run parses a value by the annotation).
_ACCEPTED = {"dtype": Optional[Union[str, Any]]}
consolidation_config.__signature__ = inspect.signature(ConsolidationConfig).replace(  # type: ignore[attr-defined]
    parameters=[
        parameter.replace(annotation=_ACCEPTED.get(name, parameter.annotation))
        for name, parameter in inspect.signature(ConsolidationConfig).parameters.items()
    ],
    return_annotation="nemo_run.Config[ConsolidationConfig]",
)
