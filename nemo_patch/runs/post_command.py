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

"""Run a user's command after a consolidated output is published: evaluate it, upload it, smoke-test it.

:func:`run_post_command` runs it through ``/bin/sh -c`` in the process that published the output, never in a training
process, and records the result in the output's ``metadata.json``; ``docs/after-consolidation.md`` has the whole
contract.

Standard library only; never torch, NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import json
import math
import os
import shlex
import signal
import string
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Tuple, Union

from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.output_layout import post_command_log_path
from nemo_patch.engine.safe_files import MAX_JSON_BYTES, read_json_file

__all__ = [
    "PostCommandError",
    "DEFAULT_POST_COMMAND_TIMEOUT",
    "PLACEHOLDERS",
    "PostCommandResult",
    "check_placeholders",
    "parse_metrics_line",
    "post_command_log_path",
    "record_result",
    "run_post_command",
]


class PostCommandError(ConsolidationError):
    """The command run after an output was published (``--post-command``, ``ConsolidationConfig.post_command``) failed
    or timed out; the output itself is complete and stays published, and its ``metadata.json`` records the result."""

    exit_code, summary = 17, "a --post-command that failed or timed out"


#: Seconds a post command may run by default.
DEFAULT_POST_COMMAND_TIMEOUT = 3600.0
_KILL_GRACE = 5.0
#: Seconds between SIGTERM and SIGKILL when the caller asks the command to stop (its own process is being ended and
#: has only a few seconds itself).
_STOP_GRACE = 2.0
#: What ``/bin/sh -c`` runs: a guard (a subshell in the command's process group, immune to SIGTERM, blocked reading
#: the pipe given as the shell's stdin; at EOF, when the process that runs the command is gone, SIGKILLed included, it
#: sends the group SIGTERM, then SIGKILL 2 s later), then the command itself (``$1``) in a shell of its own without
#: the pipe; the guard is ended when the command has, and the command's exit status is this shell's.
_GUARDED = (
    "exec 9<&0 </dev/null; ( trap '' TERM; read _ <&9; kill -TERM 0; sleep 2; kill -KILL 0 ) >/dev/null 2>&1 & "
    'guard=$!; exec 9<&-; /bin/sh -c "$1"; status=$?; kill -KILL $guard 2>/dev/null; exit $status'
)
#: The placeholders a command may use.
PLACEHOLDERS = ("output", "format", "global_step", "checkpoint")
_METADATA = "metadata.json"


@dataclass(frozen=True)
class PostCommandResult:
    """What a post command did.

    Attributes:
        command: the command as given (before the placeholders were replaced).
        returncode: its exit status (negative: killed by that signal), ``None`` if it could not be started.
        seconds: wall-clock seconds it ran.
        timed_out: whether it was stopped at its timeout.
        log: the log file's path (stdout and stderr).
        metrics: name -> value from the JSON lines it printed.
        error: why it could not be started, else ``None``; with ``stopped``, why it was stopped, if known.
        stopped: whether it was stopped before its end because the process that ran it was being ended (the end of
            ``fit`` stopped waiting for consolidations, or that process died).
    """

    command: str
    returncode: Optional[int]
    seconds: float
    timed_out: bool
    log: str
    metrics: Dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    stopped: bool = False

    @property
    def ok(self) -> bool:
        """Whether it ran to the end and exited 0."""
        return self.returncode == 0 and not self.timed_out and not self.stopped and self.error is None

    def describe(self) -> str:
        """One line for a log: how it ended and where its output is."""
        if self.stopped:
            how = (
                f"was stopped after {self.seconds:.1f} s ({self.error or 'its consolidation process was being ended'})"
            )
        elif self.error is not None:
            how = f"could not start: {self.error}"
        elif self.timed_out:
            how = f"timed out after {self.seconds:.1f} s and was stopped"
        else:
            how = f"exited {self.returncode} after {self.seconds:.1f} s"
        return f"post command {how} (log: {self.log})"

    def to_json(self) -> Dict[str, object]:
        """The JSON form recorded in ``metadata.json``."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "PostCommandResult":
        """The result :meth:`to_json` wrote; a missing or malformed field takes its empty value (never raises for a
        mapping)."""

        def number(value: Any) -> Optional[float]:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            return float(value) if ok else None

        code, error, metrics = data.get("returncode"), data.get("error"), data.get("metrics")
        return cls(
            command=str(data.get("command", "")),
            returncode=code if isinstance(code, int) and not isinstance(code, bool) else None,
            seconds=number(data.get("seconds")) or 0.0,
            timed_out=data.get("timed_out") is True,
            log=str(data.get("log", "")),
            metrics={
                str(name): value
                for name, value in (metrics.items() if isinstance(metrics, dict) else ())
                if number(value) is not None
            },
            error=None if error is None else str(error),
            stopped=data.get("stopped") is True,
        )


def parse_metrics_line(line: str) -> Optional[Dict[str, float]]:
    """The metrics in one line of a post command's stdout: a JSON object whose values are all finite numbers (not
    booleans) and whose keys are non-empty strings; ``None`` for any other line."""
    line = line.strip()
    if not (line.startswith("{") and line.endswith("}")):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict) or not value:
        return None
    metrics = {}
    for name, number in value.items():
        if not name or isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            return None
        metrics[name] = float(number)
    return metrics


def check_placeholders(command: str) -> str:
    """``command`` with its placeholders replaced by empty values: a check that it names only the four, bare.

    Raises:
        ValueError: ``command`` names another placeholder, or one of the four with a conversion, a format spec, an
            index or an attribute (``{output!r}``, ``{output[0]}``: each would put another text, unquoted, in place
            of the shell-quoted value), or has a lone brace; the message lists the four.
    """
    return _expand(command, {name: "" for name in PLACEHOLDERS})


def _expand(command: str, values: Mapping[str, str]) -> str:
    quoted = {name: shlex.quote(value) for name, value in values.items()}
    try:
        parts = list(string.Formatter().parse(command))
    except ValueError as error:  # a lone brace
        raise _placeholder_error(command, str(error)) from None
    text = []
    for literal, name, format_spec, conversion in parts:
        text.append(literal)
        if name is None:
            continue
        if conversion is not None or format_spec:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{format_spec}" if format_spec else "")
            raise _placeholder_error(command, f"placeholder {shown + '}'!r} has a conversion or format spec")
        if name not in quoted:  # also an index or attribute: {output[0]}, {output.__class__}
            raise _placeholder_error(command, f"unknown placeholder {name!r}")
        text.append(quoted[name])
    return "".join(text)


def _placeholder_error(command: str, what: str) -> ValueError:
    return ValueError(
        f"post command {command!r}: {what}; use {{output}}, {{format}}, {{global_step}} or {{checkpoint}}, each "
        "bare (no !conversion, :format, [index] or .attribute; double the braces for literal ones)"
    )


def _create_in_place_of(path: Path) -> BinaryIO:
    """A new, empty file opened for writing that is now ``path``: created under a random name beside it with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` and renamed over ``path`` (whatever was there is replaced, never opened).

    Raises:
        OSError: it cannot be created, or ``path`` is a directory (nothing is left behind).
    """
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return os.fdopen(fd, "wb")


def record_result(output_dir: Union[str, Path], result: PostCommandResult) -> None:
    """Add ``result`` to the output's ``metadata.json`` under ``"post_command"``, atomically (a new file, created with
    ``O_EXCL | O_NOFOLLOW``, synced and renamed over it); nothing when there is no readable ``metadata.json``."""
    output_dir = Path(output_dir)
    path = output_dir / _METADATA
    try:
        manifest = read_json_file(path, MAX_JSON_BYTES)
    except (OSError, ValueError):
        return
    if not isinstance(manifest, dict):
        return
    manifest["post_command"] = result.to_json()
    tmp = output_dir / f".{_METADATA}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_post_command(
    command: str,
    output_dir: Union[str, Path],
    output_format: str,
    global_step: Optional[int],
    checkpoint_dir: Union[str, Path],
    timeout: float = DEFAULT_POST_COMMAND_TIMEOUT,
    should_stop: Optional[Callable[[], bool]] = None,
) -> PostCommandResult:
    """Run ``command`` for a published output and record the result in its ``metadata.json``.

    Args:
        command: a shell command; ``{output}``, ``{format}``, ``{global_step}``, ``{checkpoint}`` are replaced.
        output_dir: the published output directory.
        output_format: ``"safetensors"`` or ``"hf"``.
        global_step: the checkpoint's global step, ``None`` if unknown.
        checkpoint_dir: the checkpoint the output was made from.
        timeout: seconds before the command's process group is stopped (> 0).
        should_stop: asked about once a second while the command runs; when it returns ``True`` the command's process
            group is stopped (SIGTERM, SIGKILL 2 s later) and the result says ``stopped``.

    Returns:
        A :class:`PostCommandResult`. Never raises for anything the command does.

    Raises:
        ValueError: ``timeout`` is not a positive number, or ``command`` names a placeholder other than the four.
    """
    if not timeout > 0:
        raise ValueError(f"the post command's timeout must be a positive number of seconds, got {timeout!r}")
    # absolute: the command may change directory, and a relative path would mean nothing in another process's
    output_dir, checkpoint_dir = Path(os.path.abspath(output_dir)), Path(os.path.abspath(checkpoint_dir))
    values = {
        "output": str(output_dir),
        "format": output_format,
        "global_step": "" if global_step is None else str(global_step),
        "checkpoint": str(checkpoint_dir),
    }
    expanded = _expand(command, values)
    env = dict(os.environ, **{f"NEMO_CONSOLIDATED_{name.upper()}": value for name, value in values.items()})
    log_path = post_command_log_path(output_dir)
    started = time.monotonic()
    metrics: Dict[str, float] = {}
    try:
        with _create_in_place_of(log_path) as log:
            guard_read, guard_write = os.pipe()  # this process holds the only writer: EOF for the guard once it ends
            try:
                process = subprocess.Popen(
                    ["/bin/sh", "-c", _GUARDED, "sh", expanded],
                    stdin=guard_read,  # the guard's; the command's own stdin is /dev/null
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    start_new_session=True,  # its own process group: a timeout stops everything it started
                )
            except BaseException:
                os.close(guard_write)
                raise
            finally:
                os.close(guard_read)
            try:
                timed_out, stopped = _collect(process, log, metrics, started + timeout, should_stop)
            except BaseException:  # e.g. KeyboardInterrupt: nothing the command started outlives this call
                _stop(process, _STOP_GRACE)
                raise
            finally:
                os.close(guard_write)
    except OSError as error:
        result = PostCommandResult(command, None, time.monotonic() - started, False, str(log_path), error=str(error))
    else:
        seconds, code = time.monotonic() - started, process.returncode
        result = PostCommandResult(command, code, seconds, timed_out, str(log_path), metrics, stopped=stopped)
    record_result(output_dir, result)
    return result


def _collect(
    process: subprocess.Popen,
    log: BinaryIO,
    metrics: Dict[str, float],
    deadline: float,
    should_stop: Optional[Callable[[], bool]] = None,
) -> Tuple[bool, bool]:
    """Copy the command's stdout into ``log`` line by line (collecting metrics) until it ends, ``deadline`` passes or
    ``should_stop`` says so; returns ``(timed_out, stopped)``."""
    import selectors

    if process.stdout is None:
        raise ValueError("the post command's stdout is not a pipe")
    asked = should_stop or (lambda: False)
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)

    def take(lines: List[bytes]) -> None:
        for line in lines:
            metrics.update(parse_metrics_line(line.decode("utf-8", errors="replace")) or {})

    pending = b""
    while True:
        remaining = deadline - time.monotonic()
        timed_out = remaining <= 0
        stopped = not timed_out and asked()
        if timed_out or stopped:
            break
        if not selector.select(timeout=min(remaining, 1.0)):
            continue
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        log.write(chunk)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        take(lines)
        if len(pending) > 1 << 20:  # a line longer than 1 MiB is no metrics line
            pending = b""
    take([pending])
    selector.close()
    process.stdout.close()
    while not (timed_out or stopped):  # it may have closed its stdout and run on
        try:
            process.wait(timeout=min(max(deadline - time.monotonic(), 0.0), 1.0))
            break
        except subprocess.TimeoutExpired:
            timed_out = time.monotonic() >= deadline
            stopped = not timed_out and asked()
    if timed_out or stopped:
        _stop(process, _STOP_GRACE if stopped else _KILL_GRACE)
        process.wait()
    return timed_out, stopped


def _stop(process: subprocess.Popen, grace: float = _KILL_GRACE) -> None:
    """SIGTERM to the command's process group, SIGKILL after ``grace`` seconds."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
    except ProcessLookupError:  # the group is gone
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
