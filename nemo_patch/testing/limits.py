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

"""Resource limits for the tests that assert "memory and time bounded by the input's bytes" as a property.

:func:`address_space_limited` caps this process's address space (``RLIMIT_AS``) at what it has plus a margin, so an
amplification fails allocating instead of taking the machine. :func:`run_limited` runs a function in a forked child
under such a cap and a time budget, and reports the child's peak resident memory (beyond what it inherited) and CPU
seconds, for the test to compare with the input's bytes. :func:`property_settings` are the Hypothesis settings
those tests share.

Linux only (``/proc/self/statm``, ``/proc/self/clear_refs``, ``fork``). Test aid: nothing in the product imports
``nemo_patch.testing`` (import-linter contract). Standard library only.
"""

import contextlib
import os
import pickle
import resource
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Tuple

__all__ = ["LimitExceeded", "Usage", "address_space", "address_space_limited", "property_settings", "run_limited"]


def property_settings(examples: int) -> Any:
    """The Hypothesis settings of the property tests over crafted inputs: ``examples`` examples, the same ones at
    every run (``derandomize``), no deadline per example and no health check on slow or fixture-using examples (each
    example builds a file or a checkpoint; the bounds, not the clock, are what is asserted). Needs ``hypothesis``."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def address_space() -> int:
    """This process's address space in bytes (the virtual size ``RLIMIT_AS`` limits)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def address_space_limited(extra: int) -> Iterator[None]:
    """The soft ``RLIMIT_AS`` at this process's current address space plus ``extra`` bytes; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = address_space()
    limit = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@dataclass(frozen=True)
class Usage:
    """What a :func:`run_limited` child used.

    Attributes:
        peak_bytes: its peak resident memory beyond what it had when forked (``VmHWM`` after resetting it).
        cpu_seconds: its user + system CPU seconds.
        wall_seconds: its wall seconds.
    """

    peak_bytes: int
    cpu_seconds: float
    wall_seconds: float


class LimitExceeded(AssertionError):
    """A :func:`run_limited` child ran past its time budget, or died without a result (killed, out of memory)."""


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _child(function: Callable[[], Any], extra: int, seconds: float, write: int) -> None:
    """In the forked child: limits, run, report (never returns)."""
    code = 0
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM back to the current resident size
        start_rss, started, cpu = _status_bytes("VmRSS"), time.monotonic(), time.process_time()
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # past the budget the child ends, whatever it is doing
        signal.setitimer(signal.ITIMER_REAL, seconds)
        with address_space_limited(extra):
            try:
                value: Any = ("ok", function())
            except BaseException as error:  # noqa: B902 - reported to the parent
                value = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()[-4000:]}")
        signal.setitimer(signal.ITIMER_REAL, 0)
        usage = Usage(_status_bytes("VmHWM") - start_rss, time.process_time() - cpu, time.monotonic() - started)
        try:
            payload = pickle.dumps((value, usage))
        except Exception as error:  # noqa: B902 - a result that cannot be pickled
            payload = pickle.dumps((("error", f"unpicklable result: {error}"), usage))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
    except BaseException:  # noqa: B902 - the child must never return into the caller
        code = 70
    finally:
        os._exit(code)


def run_limited(function: Callable[[], Any], extra_address_space: int, seconds: float) -> Tuple[Any, Usage]:
    """Run ``function`` in a forked child whose address space may grow by ``extra_address_space`` bytes at most
    (``RLIMIT_AS``) and which is ended after ``seconds`` of wall time; return its result and its :class:`Usage`.

    The result must pickle. The child shares this process's state as of the fork (modules imported, audit hooks);
    what it changes in memory stays in the child, what it changes on disk does not.

    Raises:
        LimitExceeded: the child ran past ``seconds``, or ended without a result (killed by a signal, or a failure
            outside ``function``), naming how.
        AssertionError: ``function`` raised (its type, message and traceback).
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        _child(function, extra_address_space, seconds, write)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        payload = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        why = f"ran past its time budget of {seconds:g} s" if name == "SIGALRM" else f"was killed by {name}"
        raise LimitExceeded(f"the limited child {why}")
    if not payload:
        raise LimitExceeded(f"the limited child exited with code {os.waitstatus_to_exitcode(status)} without a result")
    (status_word, value), usage = pickle.loads(payload)
    if status_word != "ok":
        raise AssertionError(f"the limited child raised {value}")
    return value, usage
