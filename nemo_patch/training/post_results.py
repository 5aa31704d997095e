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

"""The post command of a training run: run in the consolidation process after each publish (:func:`run_post_command`),
and its result read in the training process when the consolidation is reaped (:func:`read_post_command`)."""

import logging
import signal
from pathlib import Path
from typing import Any, List, Optional, Tuple

from nemo_patch.runs.post_command import PostCommandResult, record_result
from nemo_patch.runs.post_command import run_post_command as run_command

__all__ = ["read_post_command", "run_post_command"]

logger = logging.getLogger(__name__)


def read_post_command(settings: Any, save: Any, output: Path) -> PostCommandResult:
    """What the post command did after ``save``'s output ``output`` was published (``save.post_command``, the
    consolidation process's report), logged: one INFO line, or a WARNING when it failed, timed out or was stopped (the
    output stays published either way). A result lost with the consolidation process is recorded in the output's
    ``metadata.json`` with what is known."""
    post = PostCommandResult.from_json(save.post_command)
    if not post.command:  # lost with the consolidation process: record what is known
        post = PostCommandResult.from_json({**save.post_command, "command": settings.config.post_command or ""})
        try:
            record_result(output, post)
        except OSError:
            logger.debug("Could not record the post command's loss in %s", output, exc_info=True)
    (logger.info if post.ok else logger.warning)(
        "After publishing %s (global step %d): %s%s%s",
        output,
        save.global_step,
        post.describe(),
        f"; metrics {post.metrics}" if post.metrics else "",
        "" if post.ok else "; the output stays published, training goes on",
    )
    return post


def run_post_command(settings: Any, checkpoint: Path, global_step: Optional[int]) -> Tuple[PostCommandResult, bool]:
    """Run the post command on ``checkpoint``'s published output; returns its result and whether a SIGTERM asked this
    process to end meanwhile (the command was then stopped: this process answers before it ends, rather than dying
    with the command's result unsaid). Never raises for anything the command does."""
    asked: List[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
    try:
        result = run_command(
            settings.config.post_command,
            checkpoint / settings.output_dirname,
            settings.config.format,
            global_step if isinstance(global_step, int) and global_step >= 0 else None,
            checkpoint,
            timeout=settings.config.post_command_timeout,
            should_stop=lambda: bool(asked),
        )
    except Exception as error:  # noqa: BLE001 - e.g. an unwritable log file: reported, the output stays published
        result = PostCommandResult(
            settings.config.post_command, None, 0.0, False, "", error=f"{type(error).__name__}: {error}"
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return result, bool(asked)
