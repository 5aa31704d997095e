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

"""One frozen value holding every consolidation setting of a run, validated once where the user gives it.

:class:`ConsolidationSettings` is made by :meth:`ConsolidationSettings.from_arguments` in
``MegatronStrategy.__init__`` (or ``MegatronCheckpointIO.__init__`` when a user builds the checkpoint IO), which
validates each value and raises ``ValueError`` naming the argument and the accepted forms. From there it travels as
one value: strategy -> checkpoint IO -> consolidation queue -> the consolidation process's command line
(:meth:`ConsolidationSettings.to_json` once per queue, :meth:`ConsolidationSettings.from_json` once per process).
Standard library only (plus the cadence in :mod:`nemo_patch.training.policy` and the engine's torch-free output names).
"""

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Mapping, Optional, Union, cast

from nemo_patch.engine.output_layout import DEFAULT_MAX_SHARD_SIZE, DTYPE_NAMES, OUTPUT_DIRNAMES, dtype_name
from nemo_patch.engine.post_command import DEFAULT_POST_COMMAND_TIMEOUT, check_placeholders
from nemo_patch.training.policy import ConsolidationPolicy, parse_consolidation_frequency, resolve_policy

__all__ = [
    "ACCEPTED_FORMATS",
    "CHECKPOINT_IO_ARGUMENTS",
    "DEFAULT_FORMAT",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_POST_COMMAND_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "STRATEGY_ARGUMENTS",
    "ConsolidationSettings",
    "setting_view",
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

#: Setting -> the name of the argument that gives it to ``MegatronStrategy`` (used in error messages).
STRATEGY_ARGUMENTS: Mapping[str, str] = {
    "timeout": "ckpt_consolidation_timeout",
    "max_shard_size": "ckpt_consolidation_max_shard_size",
    "max_pending": "ckpt_consolidation_max_pending",
    "output_format": "ckpt_consolidation_format",
    "keep": "ckpt_consolidation_keep",
    "dtype": "ckpt_consolidation_dtype",
    "merge_adapters": "ckpt_consolidation_merge_adapters",
    "workers": "ckpt_consolidation_workers",
    "post_command": "ckpt_consolidation_post_command",
    "post_command_timeout": "ckpt_consolidation_post_command_timeout",
}
#: Setting -> the name of the argument that gives it to ``nemo_patch.MegatronCheckpointIO`` (which has no timeout: the
#: strategy's teardown waits).
CHECKPOINT_IO_ARGUMENTS: Mapping[str, str] = {
    "max_shard_size": "consolidation_max_shard_size",
    "max_pending": "consolidation_max_pending",
    "output_format": "consolidation_format",
    "keep": "consolidation_keep",
    "dtype": "consolidation_dtype",
    "merge_adapters": "consolidation_merge_adapters",
    "workers": "consolidation_workers",
    "post_command": "consolidation_post_command",
    "post_command_timeout": "consolidation_post_command_timeout",
}


@dataclass(frozen=True)
class ConsolidationSettings:
    """Every consolidation setting of a run (immutable; make it with :meth:`from_arguments`).

    Attributes:
        save_consolidated: the user's ``save_consolidated`` (``None``, ``True`` or ``False``), as given.
        frequency: the user's ``ckpt_consolidation_frequency`` string, as given (``None`` if not given).
        policy: the cadence those two resolve to; ``None`` when consolidation is off.
        output_format: ``"safetensors"`` (``<ckpt>/consolidated``) or ``"hf"`` (``<ckpt>/hf``).
        max_shard_size: most bytes of tensor data per output safetensors file (>= 1).
        max_pending: consolidation requests that may wait behind the running one (>= 0).
        timeout: seconds the end of ``fit`` waits for running and queued consolidations (> 0, finite).
        keep: how many consolidated outputs survive NeMo's top-k removal of their checkpoints
            (:mod:`nemo_patch.training.retention`): ``None`` all of them, ``N`` while among the run's newest ``N``
            outputs, ``0`` none (NeMo's removal deletes them).
        dtype: the floating-point dtype of the outputs, ``"bf16"``, ``"fp16"`` or ``"fp32"``; ``None`` keeps the
            checkpoint's. Integer and bool tensors keep theirs.
        merge_adapters: for PEFT (LoRA) adapter checkpoints, write the base model with the adapters merged instead of
            the adapters alone.
        workers: writer processes per node for the ``safetensors`` format (>= 1); ``None`` is
            :func:`nemo_patch.engine.parts.default_workers` with ``share=4``, a quarter of the node's cores (1 to 8),
            decided on the node that writes.
        post_command: a shell command the consolidation process runs after each output it publishes
            (:func:`nemo_patch.engine.post_command.run_post_command`), ``None`` for none.
        post_command_timeout: seconds that command may run (> 0, finite).
    """

    save_consolidated: Optional[bool] = None
    frequency: Optional[str] = None
    policy: Optional[ConsolidationPolicy] = None
    output_format: str = DEFAULT_FORMAT
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    max_pending: int = DEFAULT_MAX_PENDING
    timeout: float = DEFAULT_TIMEOUT
    keep: Optional[int] = None
    dtype: Optional[str] = None
    merge_adapters: bool = False
    workers: Optional[int] = None
    post_command: Optional[str] = None
    post_command_timeout: float = DEFAULT_POST_COMMAND_TIMEOUT

    @classmethod
    def from_arguments(
        cls,
        save_consolidated: Optional[bool] = None,
        frequency: Optional[str] = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
        max_pending: int = DEFAULT_MAX_PENDING,
        output_format: str = DEFAULT_FORMAT,
        keep: Optional[int] = None,
        dtype: Optional[object] = None,
        merge_adapters: bool = False,
        workers: Optional[int] = None,
        post_command: Optional[str] = None,
        post_command_timeout: float = DEFAULT_POST_COMMAND_TIMEOUT,
        names: Mapping[str, str] = STRATEGY_ARGUMENTS,
    ) -> "ConsolidationSettings":
        """Validate the user's values and make the settings.

        Args:
            save_consolidated: ``None``, ``True`` or ``False`` (see :func:`nemo_patch.training.policy.resolve_policy`).
            frequency: ``None``, or a value :func:`nemo_patch.training.policy.parse_consolidation_frequency` accepts.
            timeout: seconds, a number > 0.
            max_shard_size: bytes as an ``int`` >= 1, or a size string such as ``"5GB"`` or ``"500MiB"``.
            max_pending: an ``int`` >= 0.
            output_format: ``"safetensors"`` or ``"hf"``.
            keep: ``None`` or an ``int`` >= 0.
            dtype: ``None``, ``"bf16"``, ``"fp16"``, ``"fp32"``, their torch names or a ``torch.dtype``
                (:func:`nemo_patch.engine.output_layout.dtype_name`); kept as the short name.
            merge_adapters: ``True`` or ``False``.
            workers: ``None`` or an ``int`` >= 1.
            post_command: ``None`` or a non-empty shell command using only the placeholders ``{output}``,
                ``{format}``, ``{global_step}``, ``{checkpoint}``.
            post_command_timeout: seconds, a number > 0.
            names: the argument names to use in error messages (:data:`STRATEGY_ARGUMENTS` or
                :data:`CHECKPOINT_IO_ARGUMENTS`).

        Raises:
            ValueError: for any invalid or contradictory value; the message names the argument and what is accepted.
        """
        return cls(
            save_consolidated=save_consolidated,
            frequency=frequency,
            policy=resolve_policy(save_consolidated, frequency),
            output_format=validate_format(output_format, names["output_format"]),
            max_shard_size=validate_max_shard_size(max_shard_size, names["max_shard_size"]),
            max_pending=validate_max_pending(max_pending, names["max_pending"]),
            timeout=validate_timeout(timeout, names.get("timeout", STRATEGY_ARGUMENTS["timeout"])),
            keep=validate_keep(keep, names["keep"]),
            dtype=validate_dtype(dtype, names["dtype"]),
            merge_adapters=validate_flag(merge_adapters, names["merge_adapters"]),
            workers=None if workers is None else validate_count(workers, names["workers"], "writer processes"),
            post_command=validate_post_command(post_command, names["post_command"]),
            post_command_timeout=validate_timeout(post_command_timeout, names["post_command_timeout"]),
        )

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
        """The output directory's name inside a checkpoint directory: ``consolidated`` or ``hf``."""
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
        known = {field.name for field in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ValueError(f"not nemo_patch consolidation settings: {text[:200]!r}")
        policy = data.get("policy")
        data["policy"] = None if policy is None else parse_consolidation_frequency(policy)
        return cls(**data)


def setting_view(setting: str, doc: str) -> Any:
    """A read-only property that returns ``self.consolidation_settings.<setting>``: how the strategy and the checkpoint
    IO expose their settings under their own argument names (``ckpt_consolidation_timeout``,
    ``consolidation_max_pending``, ...)."""
    return property(lambda self: getattr(self.consolidation_settings, setting), doc=doc)


def _invalid(name: str, value: object, accepted: str) -> ValueError:
    return ValueError(f"Invalid {name} {value!r}: expected {accepted}.")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def validate_count(value: object, name: str, what: str) -> int:
    """Return ``value`` if it is an ``int`` >= 1 (not ``bool``): a number of writer processes.

    Raises:
        ValueError: for anything else; the message names the argument and the accepted values.
    """
    if _is_int(value, 1):
        return cast(int, value)
    raise _invalid(name, value, f"a whole number of {what} >= 1")


def validate_timeout(value: object, name: str = STRATEGY_ARGUMENTS["timeout"]) -> float:
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


def validate_max_shard_size(value: object, name: str = STRATEGY_ARGUMENTS["max_shard_size"]) -> int:
    """Return ``value`` as bytes of tensor data per safetensors file (>= 1).

    Args:
        value: an ``int`` (not ``bool``), or a string as ``transformers``' ``save_pretrained(max_shard_size=...)``
            takes it: a number with an optional unit, ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000) or
            ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), e.g. ``"5GB"``, ``"500MiB"``, ``"1000000"``.
        name: the argument's name, for the message.

    Raises:
        ValueError: for anything else; the message names the accepted forms.
    """
    if isinstance(value, int) and _is_int(value, 1):
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if match:
            size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
            if size >= 1:
                return size
    raise _invalid(name, value, 'an integer number of bytes >= 1 or a size such as "5GB" or "500MiB"')


def validate_format(value: object, name: str = STRATEGY_ARGUMENTS["output_format"]) -> str:
    """Return ``value`` if it is ``"safetensors"`` (this package's layout) or ``"hf"`` (a Hugging Face directory).

    Raises:
        ValueError: for anything else; the message names the accepted forms.
    """
    if isinstance(value, str) and value in ACCEPTED_FORMATS:
        return value
    raise _invalid(name, value, '"safetensors" or "hf"')


def validate_dtype(value: object, name: str = STRATEGY_ARGUMENTS["dtype"]) -> Optional[str]:
    """Return ``None`` (keep the checkpoint's dtype) or the short name of ``value`` (``"bf16"``, ``"fp16"``,
    ``"fp32"``; also accepted: ``"bfloat16"``, ``"float16"``, ``"float32"`` and ``torch.dtype`` objects).

    Raises:
        ValueError: for anything else; the message names the accepted forms.
    """
    if value is None:
        return None
    try:
        return dtype_name(value)
    except ValueError:
        raise _invalid(name, value, f"None (the checkpoint's dtype) or one of {', '.join(map(repr, DTYPE_NAMES))}")


def validate_flag(value: object, name: str) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not a truthy stand-in such as ``1`` or ``"yes"``).

    Raises:
        ValueError: for anything else.
    """
    if isinstance(value, bool):
        return value
    raise _invalid(name, value, "True or False")


def validate_keep(value: object, name: str = STRATEGY_ARGUMENTS["keep"]) -> Optional[int]:
    """Return ``value`` (``None``: keep every consolidated output; an ``int`` >= 0, not ``bool``: keep the newest N).

    Raises:
        ValueError: for anything else; the message names the accepted forms.
    """
    if value is None or (isinstance(value, int) and _is_int(value, 0)):
        return value
    raise _invalid(name, value, "None (keep every consolidated output) or an integer >= 0 (e.g. 3)")


def validate_post_command(value: object, name: str = STRATEGY_ARGUMENTS["post_command"]) -> Optional[str]:
    """Return ``value``: ``None`` (no command), or a shell command (a non-empty string) whose placeholders are among
    ``{output}``, ``{format}``, ``{global_step}`` and ``{checkpoint}`` (literal braces doubled).

    Raises:
        ValueError: for anything else; the message names the argument and the accepted form.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _invalid(name, value, "None or a shell command such as 'python eval.py {output}'")
    try:
        check_placeholders(value)
    except ValueError as error:
        raise ValueError(f"Invalid {name}: {error}.") from None
    return value


def validate_max_pending(value: object, name: str = STRATEGY_ARGUMENTS["max_pending"]) -> int:
    """Return ``value`` (consolidation requests that may wait behind the running one, an ``int`` >= 0; not ``bool``).

    Raises:
        ValueError: for anything else; the message names the accepted form.
    """
    if isinstance(value, int) and _is_int(value, 0):
        return value
    raise _invalid(name, value, "an integer >= 0 (e.g. 2)")
