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

"""Every consolidation setting of a run, each declared once, and one frozen value holding them.

Each setting is one field of :class:`ConsolidationSettings` whose metadata (:func:`setting`) declares everything
else about it: its ``MegatronStrategy`` argument, its ``MegatronCheckpointIO`` argument, its default, how it is
validated, its help text and, where ``nemo-consolidate`` has it, its command-line option. :data:`SETTINGS` lists the
declarations in order; the strategy's and the checkpoint IO's signatures, docstrings and read-only views, the CLI's
options, the consolidation process's JSON, the upstream series' strategy edits and the documentation's argument
table are all made from it. Adding a setting is one field here plus its tests (and the code that uses it).

:meth:`ConsolidationSettings.from_arguments` validates the user's values, once, where the user gives them
(``MegatronStrategy.__init__``, or ``MegatronCheckpointIO.__init__`` when a user builds the checkpoint IO), and raises
``ValueError`` naming the argument and the accepted forms. From there the settings travel as one value: strategy ->
checkpoint IO -> consolidation queue -> the consolidation process's command line (:meth:`ConsolidationSettings.to_json`
once per queue, :meth:`ConsolidationSettings.from_json` once per process). Standard library only (plus the cadence in
:mod:`nemo_patch.training.policy` and the engine's torch-free output names).
"""

import inspect
import json
import math
import re
import textwrap
import typing
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union, cast

from nemo_patch.engine.output_layout import DEFAULT_MAX_SHARD_SIZE, DTYPE_NAMES, OUTPUT_DIRNAMES, dtype_name
from nemo_patch.engine.post_command import DEFAULT_POST_COMMAND_TIMEOUT, check_placeholders
from nemo_patch.training.policy import ConsolidationPolicy, parse_consolidation_frequency, resolve_policy

__all__ = [
    "ACCEPTED_FORMATS",
    "CHECKPOINT_IO_ARGUMENTS",
    "CliOption",
    "DEFAULT_FORMAT",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_POST_COMMAND_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "SETTINGS",
    "STRATEGY_ARGUMENTS",
    "ConsolidationSettings",
    "Setting",
    "arguments_docstring",
    "declare_settings",
    "init_signature",
    "keyword_parameters",
    "setting",
    "validate_dtype",
    "validate_flag",
    "validate_format",
    "validate_keep",
    "validate_max_pending",
    "validate_max_shard_size",
    "validate_post_command",
    "WORKER_NICENESS",
    "validate_count",
    "validate_timeout",
    "validate_workers",
]

#: Output formats of a consolidation: ``ckpt_consolidation_format`` and the CLI's ``--format``.
ACCEPTED_FORMATS = tuple(OUTPUT_DIRNAMES)
#: The default output format.
DEFAULT_FORMAT = "safetensors"
#: Default ``ckpt_consolidation_max_pending``: requests that may wait behind the running one.
DEFAULT_MAX_PENDING = 2
#: Default ``ckpt_consolidation_timeout``: how long the end of ``fit`` waits for consolidations, in seconds.
DEFAULT_TIMEOUT = 1800.0

#: How much lower a consolidation process's CPU priority is than the training process's (``os.nice`` increment): on a
#: busy node the training job's threads come first, and a consolidation uses the CPU time they leave.
WORKER_NICENESS = 10


@dataclass(frozen=True)
class CliOption:
    """How ``nemo-consolidate`` takes a setting on its command line.

    Attributes:
        flag: the option, e.g. ``"--max-shard-size"``.
        help: the option's help text (the CLI's own wording: its defaults may be resolved differently).
        group: the CLI's option group it is listed in (``"output"``, ``"adapters"``, ``"parallelism"``, ...).
        parse: turns the command-line string into the value handed to the setting's validator; a string that does
            not parse is handed on as it is, so that the validator's message names it. ``None``: the string itself.
            A ``bool`` setting is a flag (``store_true``) and has no parse.
        metavar: the value's name in the usage line (``None``: argparse's).
        choices: the accepted values, listed in the usage line (``None``: any the validator accepts).
    """

    flag: str
    help: str
    group: str
    parse: Optional[Callable[[str], Any]] = None
    metavar: Optional[str] = None
    choices: Optional[Tuple[str, ...]] = None


@dataclass(frozen=True)
class Setting:
    """The declaration of one consolidation setting (one field of :class:`ConsolidationSettings`).

    Attributes:
        field: the :class:`ConsolidationSettings` attribute, e.g. ``"max_shard_size"``.
        strategy_argument: ``MegatronStrategy``'s keyword argument, e.g. ``"ckpt_consolidation_max_shard_size"``.
        io_argument: ``nemo_patch.MegatronCheckpointIO``'s keyword argument, ``None`` where it has none (the
            timeout: the strategy's teardown waits).
        default: the default value (also the dataclass field's default).
        annotation: the argument's type as source text, e.g. ``"Union[int, str]"``.
        validate: ``(value, argument name) -> value``: the accepted value in its stored form; raises ``ValueError``
            naming the argument and the accepted forms.
        help: what the argument means (reStructuredText; the strategy's docstring and the documentation's table).
        cli: the ``nemo-consolidate`` option, ``None`` when the CLI has none.
    """

    field: str
    strategy_argument: str
    io_argument: Optional[str]
    default: Any
    annotation: str
    validate: Callable[[Any, str], Any]
    help: str
    cli: Optional[CliOption] = None


def setting(
    default: Any,
    *,
    strategy: str,
    io: Optional[str],
    annotation: str,
    validate: Callable[[Any, str], Any],
    help: str,
    cli: Optional[CliOption] = None,
) -> Any:
    """A :class:`ConsolidationSettings` field declaring one setting (see :class:`Setting` for the arguments)."""
    declared = dict(strategy_argument=strategy, io_argument=io, annotation=annotation, validate=validate, help=help)
    return field(default=default, metadata={"setting": dict(declared, cli=cli)})


def _invalid(name: str, value: object, accepted: str) -> ValueError:
    return ValueError(f"Invalid {name} {value!r}: expected {accepted}.")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_option(name: str) -> bool:
    """Whether ``name`` is a command-line option (``--dtype``) rather than a Python argument."""
    return name.startswith("--")


def _as_given(value: object, name: str) -> Any:
    """The cadence arguments are checked together, by :func:`nemo_patch.training.policy.resolve_policy`."""
    return value


def _number(text: str) -> Union[float, str]:
    try:
        return float(text)
    except ValueError:
        return text


def _whole_number(text: str) -> Union[int, str]:
    return int(text) if text.strip().isdecimal() else text  # isdigit() also takes "²", which int() does not


def validate_count(value: object, name: str, what: str) -> int:
    """Return ``value`` if it is an ``int`` >= 1 (not ``bool``): a number of writer processes.

    Raises:
        ValueError: for anything else; the message names the argument and the accepted values.
    """
    if _is_int(value, 1):
        return cast(int, value)
    raise _invalid(name, value, f"a whole number of {what} >= 1")


def validate_workers(value: object, name: str) -> Optional[int]:
    """Return ``value``: ``None`` (the default number of writer processes) or an ``int`` >= 1 (not ``bool``).

    Raises:
        ValueError: for anything else; the message names the argument and the accepted values.
    """
    return None if value is None else validate_count(value, name, "writer processes")


def validate_timeout(value: object, name: str) -> float:
    """Return ``value`` (seconds, an ``int`` or ``float`` > 0 and finite; not ``bool``) as a float.

    Raises:
        ValueError: for anything else; the message names the accepted form.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise _invalid(name, value, "a number of seconds > 0 (e.g. 1800)")


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def validate_max_shard_size(value: object, name: str) -> int:
    """Return ``value`` as bytes of tensor data per safetensors file (>= 1).

    Args:
        value: an ``int`` (not ``bool``), or a string as ``transformers``' ``save_pretrained(max_shard_size=...)``
            takes it: a number with an optional unit, ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000) or
            ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), e.g. ``"5GB"``, ``"500MiB"``, ``"1000000"``. Units are
            case-insensitive except for a final lowercase ``b`` after a power of 1000 (or alone), which counts bits,
            as ``transformers.utils.hub.convert_file_size_to_int`` reads it: ``"5Gb"`` and ``"5gb"`` are 625,000,000
            bytes, ``"5GB"`` and ``"5gB"`` 5,000,000,000; ``"5GiB"`` and ``"5gib"`` are bytes. The bytes are rounded
            down, as there.
        name: the argument's name, for the message.

    Raises:
        ValueError: for anything else; the message names the accepted forms.
    """
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
    """Return ``value`` if it is ``"safetensors"`` (this package's layout) or ``"hf"`` (a Hugging Face directory).

    Raises:
        ValueError: for anything else; the message names the accepted forms.
    """
    if isinstance(value, str) and value in ACCEPTED_FORMATS:
        return value
    raise _invalid(name, value, '"safetensors" or "hf"')


def validate_dtype(value: object, name: str) -> Optional[str]:
    """Return ``None`` (keep the checkpoint's dtype) or the short name of ``value`` (``"bf16"``, ``"fp16"``,
    ``"fp32"``; also accepted, case-insensitive, with or without ``torch.``: ``"bfloat16"``, ``"float16"``/``"half"``,
    ``"float32"``/``"float"``, and ``torch.dtype`` objects: :func:`nemo_patch.engine.output_layout.dtype_name`).

    Raises:
        ValueError: for anything else; the message names the accepted forms (for a command-line option, ``name``
            starting with ``--``, without ``None``, which a command line cannot give).
    """
    if value is None:
        return None
    try:
        return dtype_name(value)
    except ValueError:
        accepted = f"one of {', '.join(map(repr, DTYPE_NAMES))}"
        raise _invalid(name, value, accepted if _is_option(name) else f"None (the checkpoint's dtype) or {accepted}")


def validate_flag(value: object, name: str) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not a truthy stand-in such as ``1`` or ``"yes"``).

    Raises:
        ValueError: for anything else.
    """
    if isinstance(value, bool):
        return value
    raise _invalid(name, value, "True or False")


def validate_keep(value: object, name: str) -> Optional[int]:
    """Return ``value`` (``None``: keep every consolidated output; an ``int`` >= 0, not ``bool``: keep the newest N).

    Raises:
        ValueError: for anything else; the message names the accepted forms.
    """
    if value is None or (isinstance(value, int) and _is_int(value, 0)):
        return value
    raise _invalid(name, value, "None (keep every consolidated output) or an integer >= 0 (e.g. 3)")


def validate_post_command(value: object, name: str) -> Optional[str]:
    """Return ``value``: ``None`` (no command), or a shell command (a non-empty string) whose placeholders are among
    ``{output}``, ``{format}``, ``{global_step}`` and ``{checkpoint}`` (literal braces doubled).

    Raises:
        ValueError: for anything else; the message names the argument and the accepted form.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        accepted = "a shell command such as 'python eval.py {output}'"
        raise _invalid(name, value, accepted if _is_option(name) else f"None or {accepted}")
    try:
        check_placeholders(value)
    except ValueError as error:
        raise ValueError(f"Invalid {name}: {error}.") from None
    return value


def validate_max_pending(value: object, name: str) -> int:
    """Return ``value`` (consolidation requests that may wait behind the running one, an ``int`` >= 0; not ``bool``).

    Raises:
        ValueError: for anything else; the message names the accepted form.
    """
    if isinstance(value, int) and _is_int(value, 0):
        return value
    raise _invalid(name, value, "an integer >= 0 (e.g. 2)")


_CADENCE_HELP = (
    "``None`` (default), ``\"each\"`` (every finished checkpoint), ``\"latest\"`` (none during training; the newest "
    "finished checkpoint once when ``fit`` ends) or ``\"every_n:<k>\"`` (the k-th, 2k-th, ... finished checkpoint of "
    "the run, counted across resumes; k an integer >= 1), ``\"best\"`` (a finished checkpoint that NeMo's "
    "``ModelCheckpoint`` ranked best by its ``monitor``/``mode`` when it was saved; ``<root>/BEST`` names the best "
    "consolidated one; needs a monitored metric), or phases that change the cadence at given global steps, e.g. "
    "``\"every_n:10; each@50000\"``, ``\"best; each@90000\"``, ``\"every_n:20; latest\"`` (the grammar is on the "
    "documentation's Cadences page). Giving a frequency turns consolidation on; the other consolidation arguments "
    "have no effect without it (a warning says so)."
)


@dataclass(frozen=True)
class ConsolidationSettings:
    """Every consolidation setting of a run (immutable; make it with :meth:`from_arguments`).

    Each field but :attr:`policy` is one setting, declared with :func:`setting`; :data:`SETTINGS` lists the
    declarations (their ``help`` says what each field means).

    Attributes:
        policy: the cadence ``save_consolidated`` and ``frequency`` resolve to; ``None`` when consolidation is off.
    """

    save_consolidated: Optional[bool] = setting(
        None,
        strategy="save_consolidated",
        io="save_consolidated",
        annotation="Optional[bool]",
        validate=_as_given,
        help="``None`` (default) or ``False``: no consolidation, exactly NeMo's behaviour, unless a frequency is "
        "given. ``True``: consolidate, at ``\"each\"`` unless a frequency is given.",
    )
    frequency: Optional[str] = setting(
        None,
        strategy="ckpt_consolidation_frequency",
        io="ckpt_consolidation_frequency",
        annotation="Optional[str]",
        validate=_as_given,
        help=_CADENCE_HELP,
    )
    timeout: float = setting(
        DEFAULT_TIMEOUT,
        strategy="ckpt_consolidation_timeout",
        io=None,
        annotation="float",
        validate=validate_timeout,
        help="how long, in seconds, the end of ``fit`` (normal or by an exception) waits for running and queued "
        "consolidations before giving up on them (logged). Default 1800.",
    )
    max_shard_size: int = setting(
        DEFAULT_MAX_SHARD_SIZE,
        strategy="ckpt_consolidation_max_shard_size",
        io="consolidation_max_shard_size",
        annotation="Union[int, str]",
        validate=validate_max_shard_size,
        help="most bytes of tensor data per output safetensors file (Hugging Face's sharding; default 5 * 10**9): an "
        "int, or a size string as ``save_pretrained(max_shard_size=...)`` takes it (``\"5GB\"``, ``\"500MiB\"``).",
        cli=CliOption("--max-shard-size", "bytes of tensor data per file, e.g. 5GB (default) or 500MiB", "output"),
    )
    max_pending: int = setting(
        DEFAULT_MAX_PENDING,
        strategy="ckpt_consolidation_max_pending",
        io="consolidation_max_pending",
        annotation="int",
        validate=validate_max_pending,
        help="how many consolidation requests may wait behind the running one while training runs (default 2). When "
        "one more arrives, the oldest waiting request is skipped (logged), so a cadence faster than consolidation "
        "never builds an unbounded backlog. Saves that finish when fit ends are all queued (the end-of-fit wait "
        "bounds them).",
    )
    output_format: str = setting(
        DEFAULT_FORMAT,
        strategy="ckpt_consolidation_format",
        io="consolidation_format",
        annotation="str",
        validate=validate_format,
        help="``\"safetensors\"`` (default): ``<ckpt>/consolidated/`` with this package's layout (megatron-core "
        "names, any model); ``\"hf\"``: ``<ckpt>/hf/``, a ``transformers``-loadable directory written through NeMo's "
        "registered exporter for the model class (e.g. Llama); see the documentation's Outputs page. Either runs in "
        "the consolidation process, off the training path.",
        cli=CliOption(
            "--format",
            "output format: safetensors (default) or hf (a Hugging Face directory)",
            "output",
            choices=ACCEPTED_FORMATS,
        ),
    )
    keep: Optional[int] = setting(
        None,
        strategy="ckpt_consolidation_keep",
        io="consolidation_keep",
        annotation="Optional[int]",
        validate=validate_keep,
        help="what happens to a consolidated output when NeMo's top-k retention (``ModelCheckpoint(save_top_k=...)``) "
        "removes its checkpoint: ``None`` (default) keeps every one, as ``<root>/retained/<checkpoint name>/``; ``N`` "
        "keeps one while it is among the run's newest ``N`` consolidated outputs; ``0`` keeps none (it goes with its "
        "checkpoint). ``LATEST`` never names a removed checkpoint. See the documentation's Retention page.",
    )
    dtype: Optional[str] = setting(
        None,
        strategy="ckpt_consolidation_dtype",
        io="consolidation_dtype",
        annotation="Optional[Any]",
        validate=validate_dtype,
        help="floating-point dtype of the outputs, ``\"bf16\"``, ``\"fp16\"`` or ``\"fp32\"`` (or a ``torch.dtype``); "
        "``None`` (default) keeps the checkpoint's. Integer tensors are never cast.",
        cli=CliOption(
            "--dtype", "cast floating-point tensors: bf16, fp16 or fp32 (default: keep the checkpoint's)", "output"
        ),
    )
    merge_adapters: bool = setting(
        False,
        strategy="ckpt_consolidation_merge_adapters",
        io="consolidation_merge_adapters",
        annotation="bool",
        validate=validate_flag,
        help="for PEFT (LoRA) runs, whose checkpoints hold only the adapters: ``False`` (default) writes "
        "``adapter_model.safetensors``; ``True`` writes the base model with the adapters merged as NeMo's "
        "``LoRAMerge`` computes it (``model.safetensors``, or a full ``transformers`` directory with the ``\"hf\"`` "
        "format).",
        cli=CliOption(
            "--merge-adapters",
            "for a PEFT (LoRA) adapter checkpoint: write its base model with the "
            "adapters merged instead of the adapters alone",
            "adapters",
        ),
    )
    workers: Optional[int] = setting(
        None,
        strategy="ckpt_consolidation_workers",
        io="consolidation_workers",
        annotation="Optional[int]",
        validate=validate_workers,
        help="writer processes on each writing node (``safetensors`` format); ``None`` (default) is a quarter of the "
        "node's cores, 1 to 8, decided on the node that writes; never more than the output has tensors. The output is "
        "the same whatever the number.",
        cli=CliOption(
            "--workers",
            "writer processes on this node (safetensors format; default: its cores, at most "
            "8); under torchrun or srun, on each node",
            "parallelism",
            _whole_number,
        ),
    )
    post_command: Optional[str] = setting(
        None,
        strategy="ckpt_consolidation_post_command",
        io="consolidation_post_command",
        annotation="Optional[str]",
        validate=validate_post_command,
        help="a shell command the consolidation process runs after each output it publishes, never a training "
        "process: ``{output}``, ``{format}``, ``{global_step}`` and ``{checkpoint}`` are replaced (shell-quoted); its "
        "output goes to ``<output>.post-command.log``, its result (exit code, seconds, metrics from the JSON lines of "
        "numbers it prints) into the output's ``metadata.json`` and, on global rank 0, the log; the metrics go to the "
        "trainer's loggers at the checkpoint's global step. A failure is a warning; training goes on. While it runs "
        "the next consolidation waits (queued requests count against ``ckpt_consolidation_max_pending``). ``None`` "
        "(default): none.",
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
        strategy="ckpt_consolidation_post_command_timeout",
        io="consolidation_post_command_timeout",
        annotation="float",
        validate=validate_timeout,
        help="seconds the post command may run before its process group is stopped (recorded as timed out). Default "
        "3600.",
        cli=CliOption(
            "--post-command-timeout",
            "stop the post command after this many seconds (default 3600)",
            "output",
            _number,
            "SECONDS",
        ),
    )
    policy: Optional[ConsolidationPolicy] = None

    @classmethod
    def from_arguments(
        cls,
        save_consolidated: Optional[bool] = None,
        frequency: Optional[str] = None,
        *,
        names: Optional[Mapping[str, str]] = None,
        **values: Any,
    ) -> "ConsolidationSettings":
        """Validate the user's values and make the settings.

        Args:
            save_consolidated: ``None``, ``True`` or ``False`` (see :func:`nemo_patch.training.policy.resolve_policy`).
            frequency: ``None``, or a value :func:`nemo_patch.training.policy.parse_consolidation_frequency` accepts.
            names: the argument names to use in error messages, by field (:data:`STRATEGY_ARGUMENTS`, the default,
                or :data:`CHECKPOINT_IO_ARGUMENTS`).
            **values: the other settings by field name (``timeout=``, ``max_shard_size=``, ...; see
                :data:`SETTINGS`); a setting not given takes its default.

        Raises:
            TypeError: a keyword that is not a setting's field.
            ValueError: for any invalid or contradictory value; the message names the argument and what is accepted.
        """
        unknown = set(values) - {spec.field for spec in SETTINGS}
        if unknown:
            raise TypeError(f"not a consolidation setting: {', '.join(sorted(unknown))}")
        names = STRATEGY_ARGUMENTS if names is None else names
        given = dict(values, save_consolidated=save_consolidated, frequency=frequency)
        validated = {
            spec.field: spec.validate(
                given.get(spec.field, spec.default), names.get(spec.field) or spec.strategy_argument
            )
            for spec in SETTINGS
        }
        return cls(**validated, policy=resolve_policy(save_consolidated, frequency))

    @property
    def requested(self) -> bool:
        """Whether the user gave ``save_consolidated`` or a frequency (``False`` or a frequency included)."""
        return self.save_consolidated is not None or self.frequency is not None

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are consolidated."""
        return self.policy is not None

    @property
    def output_dirname(self) -> str:
        """The output directory's name inside a checkpoint directory, ``consolidated`` or ``hf``."""
        return OUTPUT_DIRNAMES[self.output_format]

    def to_json(self) -> str:
        """The settings as one JSON object (for the consolidation process's command line)."""
        fields_ = asdict(self)
        fields_["policy"] = None if self.policy is None else str(self.policy)
        return json.dumps(fields_, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ConsolidationSettings":
        """The settings :meth:`to_json` wrote.

        Raises:
            ValueError: ``text`` is not such a JSON object (malformed, or with fields this version does not know).
        """
        data: Dict[str, Any] = json.loads(text)
        known = {field_.name for field_ in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ValueError(f"not nemo_patch consolidation settings: {text[:200]!r}")
        policy = data.get("policy")
        data["policy"] = None if policy is None else parse_consolidation_frequency(policy)
        return cls(**data)


#: The declarations of every setting, in the order of the strategy's arguments.
SETTINGS: Tuple[Setting, ...] = tuple(
    Setting(field=field_.name, default=field_.default, **field_.metadata["setting"])
    for field_ in fields(ConsolidationSettings)
    if "setting" in field_.metadata
)
#: Setting -> the name of the argument that gives it to ``MegatronStrategy`` (used in error messages).
STRATEGY_ARGUMENTS: Mapping[str, str] = {spec.field: spec.strategy_argument for spec in SETTINGS}
#: Setting -> the name of the argument that gives it to ``nemo_patch.MegatronCheckpointIO`` (which has no timeout: the
#: strategy's teardown waits).
CHECKPOINT_IO_ARGUMENTS: Mapping[str, str] = {
    spec.field: spec.io_argument for spec in SETTINGS if spec.io_argument is not None
}


def _owned(owner: str) -> List[Tuple[str, Setting]]:
    """``(argument name, declaration)`` of each setting ``owner`` (``"strategy"`` or ``"io"``) takes, in order.

    Raises:
        ValueError: ``owner`` is neither.
    """
    if owner not in ("strategy", "io"):
        raise ValueError(f"owner must be 'strategy' or 'io', not {owner!r}")
    names = STRATEGY_ARGUMENTS if owner == "strategy" else CHECKPOINT_IO_ARGUMENTS
    return [(names[spec.field], spec) for spec in SETTINGS if spec.field in names]


def keyword_parameters(owner: str) -> List[inspect.Parameter]:
    """The keyword-only parameters that ``owner`` (``"strategy"`` or ``"io"``) adds to its ``__init__``: one per
    setting it takes, with the declared default and annotation (for its ``__signature__``).

    Raises:
        ValueError: ``owner`` is neither.
    """
    return [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=spec.default, annotation=_annotation(spec.annotation)
        )
        for name, spec in _owned(owner)
    ]


def _annotation(text: str) -> Any:
    """The typing object a declared annotation names (``"Optional[int]"`` -> ``Optional[int]``), as a signature
    written out in source holds it: NeMo-Run's command-line overrides convert values by it and cannot use the text."""
    holder = type("Annotated", (), {"__annotations__": {"value": text}})
    return typing.get_type_hints(holder, vars(typing))["value"]


def init_signature(owner: str, base: Callable[..., Any], extra: Sequence[inspect.Parameter] = ()) -> inspect.Signature:
    """``(self, <base's arguments>, *, <owner's settings>, <extra>, <base's **kwargs>)``: the signature of ``owner``'s
    (``"strategy"`` or ``"io"``) ``__init__``, which takes its settings through ``**kwargs`` and passes the rest on to
    ``base`` (NeMo's ``__init__``), for ``help()``, IDEs and NeMo's configuration tools (NeMo-Run converts command-line
    values by the annotations of NeMo's arguments too). A parameter of ``base`` named as one of ours is left out.

    Raises:
        ValueError: ``owner`` is neither.
    """
    ours = [*keyword_parameters(owner), *extra]
    names = {parameter.name for parameter in ours}
    inherited = [parameter for parameter in inspect.signature(base).parameters.values() if parameter.name not in names]
    # A stable sort by kind: base's positional ones, its *args and keyword-only ones, then ours, then its **kwargs.
    return inspect.Signature(sorted([*inherited, *ours], key=lambda parameter: parameter.kind), return_annotation=None)


def arguments_docstring(owner: str, indent: int = 8, width: int = 119) -> str:
    """The ``Args:`` entries of ``owner``'s (``"strategy"`` or ``"io"``) settings, Google style: one
    ``name: help`` entry per setting, wrapped at ``width`` columns, continuation lines indented four more.

    Raises:
        ValueError: ``owner`` is neither.
    """
    entries = []
    for name, spec in _owned(owner):
        lines = textwrap.wrap(
            f"{name}: {spec.help}",
            width=width,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent + 4),
            break_on_hyphens=False,
        )
        entries.append("\n".join(lines))
    return "\n".join(entries)


def declare_settings(
    cls: Type[Any], owner: str, base: Callable[..., Any], extra: Sequence[inspect.Parameter] = ()
) -> None:
    """Make ``cls`` (the strategy or the checkpoint IO, per ``owner``) show the settings it takes through ``**kwargs``:
    its ``__init__``'s ``__signature__`` (:func:`init_signature` with ``base`` and ``extra``), its docstring's
    ``{consolidation arguments}`` line replaced by their ``Args:`` entries (:func:`arguments_docstring`), and one
    read-only property per setting, named as its argument, returning ``self.consolidation_settings.<field>``.

    Raises:
        ValueError: ``owner`` is neither ``"strategy"`` nor ``"io"``.
    """
    setattr(cls.__init__, "__signature__", init_signature(owner, base, extra))
    cls.__doc__ = (cls.__doc__ or "").replace("        {consolidation arguments}", arguments_docstring(owner))

    def view(field_: str) -> Callable[[Any], Any]:
        return lambda self: getattr(self.consolidation_settings, field_)

    for name, spec in _owned(owner):
        setattr(cls, name, property(view(spec.field), doc=f"The ``{name}`` setting (read-only)."))
