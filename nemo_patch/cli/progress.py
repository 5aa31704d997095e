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

"""Progress of a consolidation: a bar on a terminal, else (a job log) a line at most every ``--progress-interval``
seconds (docs/cli.md)."""

import time
from typing import Callable, List, Optional, TextIO, Tuple

__all__ = ["DEFAULT_INTERVAL", "LogProgress", "human_size", "progress_bar"]

#: Seconds between two progress lines in a log, by default.
DEFAULT_INTERVAL = 30.0


class LogProgress:
    """A progress callback ``(done, total)`` (bytes) that writes one line to ``stream`` at most every ``interval``
    seconds (none before the first interval): bytes done and in all, the rate since the start, the time left.

    Args:
        stream: where the lines go (the command's stderr).
        size: formats a number of bytes (:func:`human_size`: ``"305.2 KB"``).
        interval: seconds between lines (> 0); also the delay before the first.
        label: what is consolidated (the checkpoint's name), or ``None``.
        clock: the monotonic clock (seconds), replaced in tests.
    """

    def __init__(
        self,
        stream: TextIO,
        size: Callable[[float], str],
        interval: float = DEFAULT_INTERVAL,
        label: Optional[str] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.size, self.interval, self.label, self.clock = stream, size, interval, label, clock
        self.started = self.last = clock()
        self.lines = 0

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.last < self.interval:
            return
        self.last = now
        self.lines += 1
        seconds = max(now - self.started, 1e-9)
        rate = done / seconds
        left = f"about {(total - done) / rate:.0f} s left" if rate > 0 and total >= done else "time left unknown"
        percent = f" ({100 * done / total:.0f}%)" if total > 0 else ""
        where = f" {self.label}" if self.label else ""
        self.stream.write(f"nemo-consolidate: progress{where}: {self.size(done)} of {self.size(total)}{percent}, "
                          f"{self.size(rate)}/s, {left}\n")  # fmt: skip
        self.stream.flush()


def human_size(size: float) -> str:
    """Bytes in decimal units for messages: ``"305.2 KB"``, ``"12 B"``."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1000
    return f"{size:.1f} GB"


def progress_bar(
    enabled: bool, stream: TextIO, interval: Optional[float] = None, label: Optional[str] = None
) -> Tuple[Callable[[int, int], None], Callable[[], None]]:
    """A bytes progress bar (done / total, rate) on ``stream`` when it is a terminal; when it is not (a job log), a
    progress line every ``interval`` seconds (:class:`nemo_patch.cli.progress.LogProgress`, naming ``label``); no-ops
    when not ``enabled``."""
    if not enabled:
        return (lambda done, total: None), (lambda: None)
    if not stream.isatty():
        return LogProgress(stream, human_size, interval or DEFAULT_INTERVAL, label), (lambda: None)
    from tqdm import tqdm

    bar: List[tqdm] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(
                tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="consolidating", file=stream)
            )
        bar[0].update(done - bar[0].n)

    return update, (lambda: bar[0].close() if bar else None)
