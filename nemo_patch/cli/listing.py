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

"""``nemo-consolidate ROOT --list [--json] [--verify]``: what was done with each checkpoint of a run (docs/cli.md).

Reads only: nothing is written, no lock is taken. Exit codes: 0; 3 when ``ROOT`` does not exist; 4 when it holds no
checkpoint and no retained output; 9 with ``--verify`` when an output's digests do not verify (the table is printed
first).
"""

import argparse
import contextlib
import json
import os
import stat
import struct
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from nemo_patch.cli.watch import ONE_CHECKPOINT_OPTIONS, given_options, human_size, output_is_complete
from nemo_patch.engine.errors import CheckpointNotFoundError, ConsolidationError, NotACheckpointError
from nemo_patch.engine.output_layout import OUTPUT_DIRNAMES, RETAINED_DIRNAME
from nemo_patch.runs.run_checkpoints import list_run_checkpoints
from nemo_patch.training.latest import read_output_metadata

__all__ = ["add_list_options", "check_list_arguments", "format_listing", "list_root", "run_list"]

#: Options (argparse's names) of a consolidation that mean nothing to ``--list``.
_NOT_WITH_LIST = ("watch", *ONE_CHECKPOINT_OPTIONS, "post_command")
#: safetensors' dtype names -> the names ``--dtype`` and ``torch`` use.
_DTYPES = {"F64": "fp64", "F32": "fp32", "BF16": "bf16", "F16": "fp16", "F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip
#: The largest safetensors header read for its dtypes (the format's own limit is 100 MB).
_MAX_HEADER = 100_000_000


def add_list_options(parser: argparse.ArgumentParser) -> None:
    """``--list`` and ``--json`` (the ``list`` group)."""
    group = parser.add_argument_group("list", "what was done with each checkpoint of a run")
    group.add_argument("--list", action="store_true", help="path is a checkpoint root: print one row per checkpoint "
                       "(global step, run, finished, its outputs' format, dtype, size and digests, LATEST/BEST, the "
                       "post command's result); with --verify, check every output's digests")  # fmt: skip
    group.add_argument("--json", action="store_true", help="with --list: one JSON document instead of the table")


def check_list_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Whether the command line asks for ``--list``; a usage error (exit 2) for ``--json`` without it, or for options
    that write an output with it."""
    if not args.list:
        if args.json:
            parser.error("--json only with --list")
        return False
    given = given_options(args, _NOT_WITH_LIST)
    if given:
        parser.error(f"--list writes nothing: {', '.join(given)} cannot be used with it")
    return True


def _header_dtypes(path: Path) -> List[str]:
    """The dtypes of the tensors in a safetensors file, from its header only (``[]`` when it cannot be read)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO planted there must not block the listing
            return []
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0) as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > _MAX_HEADER:
                return []
            header = json.loads(handle.read(length))
        return sorted({str(entry.get("dtype")) for key, entry in header.items() if key != "__metadata__"})
    except (OSError, ValueError, struct.error, AttributeError):
        return []


def _size_on_disk(output: Path) -> int:
    total = 0
    with contextlib.suppress(OSError), os.scandir(output) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def _post_command_status(record: Any) -> Optional[str]:
    """A few words for the post command's recorded result, or ``None`` when none is recorded."""
    if not isinstance(record, dict):
        return None
    if record.get("stopped"):
        return "stopped"
    if record.get("error"):
        return "did not start"
    if record.get("timed_out"):
        return "timed out"
    code = record.get("returncode")
    return f"exit {code}" if isinstance(code, int) else "not run"


def _recorded_run(manifest: Dict[str, Any]) -> Optional[str]:
    save = manifest.get("save")
    run = save.get("run") if isinstance(save, dict) else None
    run = run if run is not None else manifest.get("run")
    return run if isinstance(run, str) else None


def _output_row(checkpoint: Optional[Path], output: Path, verify: bool) -> Dict[str, Any]:
    """What one output directory is (keys: :func:`list_root`); ``checkpoint`` is ``None`` for a retained output."""
    manifest = read_output_metadata(output) or {}
    files: Dict[str, Any] = manifest["files"] if isinstance(manifest.get("files"), dict) else {}
    names = sorted(name for name in files if isinstance(name, str) and name.endswith(".safetensors"))
    if not names:
        names = sorted(path.name for path in output.glob("*.safetensors"))
    dtypes = sorted({_DTYPES.get(dtype, dtype) for name in names for dtype in _header_dtypes(output / name)})
    recorded = any(isinstance(entry, dict) and "tensors_blake3" in entry for entry in files.values())
    row: Dict[str, Any] = {
        "dir": output.name,
        "path": str(output),
        "format": manifest.get("format") or ("hf" if output.name == OUTPUT_DIRNAMES["hf"] else "safetensors"),
        "kind": manifest.get("kind"),
        "complete": output_is_complete(checkpoint, output) if checkpoint is not None else bool(manifest),
        "global_step": manifest.get("global_step"),
        "run": _recorded_run(manifest),
        "dtype": dtypes,
        "requested_dtype": manifest.get("dtype"),
        "tensor_count": manifest.get("tensor_count"),
        "bytes": _size_on_disk(output),
        "digests": "recorded" if recorded else "none",
        "digest_error": None,
        "linked_from": manifest.get("linked_from"),
        "best": manifest.get("best"),
        "post_command": manifest.get("post_command"),
        "post_command_status": _post_command_status(manifest.get("post_command")),
    }
    if verify and recorded:
        from nemo_patch.engine.digests import verify_digests

        try:
            verify_digests(output)
            row["digests"] = "verified"
        except ConsolidationError as error:
            row["digests"], row["digest_error"] = "FAILED", " ".join(str(error).split())
    return row


def _outputs(directory: Path) -> List[Path]:
    return [directory / name for name in OUTPUT_DIRNAMES.values() if (directory / name).is_dir()]


def _pointed(root: Path, name: str) -> Optional[str]:
    try:
        return os.readlink(root / name) if (root / name).is_symlink() else None
    except OSError:
        return None


def _checkpoint_run(path: Path) -> Optional[str]:
    """The run id the checkpoint's ``common.pt`` records (the overlay's callback state), or ``None``."""
    try:
        from nemo_patch.engine.save_identity import save_identity

        return save_identity(path, allow_unfinished=True).run
    except (ImportError, OSError, ValueError, ConsolidationError):
        return None


def list_root(path: Path, verify: bool = False) -> Dict[str, Any]:
    """What ``path``'s checkpoints and outputs are.

    Args:
        path: a checkpoint root, the run directory holding ``checkpoints/``, or a Megatron-LM save directory.
        verify: check each output's recorded digests (reads every output file once).

    Returns:
        ``{"root", "layout", "latest", "best", "checkpoints": [...], "retained": [...]}``; each checkpoint is
        ``{"name", "path", "global_step", "run", "finished", "not_finished", "copy", "marks", "consolidated",
        "outputs"}``, each output ``{"dir", "path", "format", "kind", "complete", "global_step", "run", "dtype" (the
        tensors' dtypes), "requested_dtype", "tensor_count", "bytes" (on disk), "digests", "digest_error",
        "linked_from", "best", "post_command", "post_command_status"}``. A retained entry is a checkpoint entry
        without ``finished``.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        NotACheckpointError: it holds no checkpoint and no retained output.
        OSError: it cannot be listed.
    """
    from nemo_patch.runs.checkpoint_root import checkpoint_root, global_step_in_name, is_copy_name

    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    root = Path(os.path.abspath(checkpoint_root(path)))
    if not root.is_dir():
        raise NotACheckpointError(f"{root} is not a directory of checkpoints")
    listing = list_run_checkpoints(root)
    latest, best = _pointed(root, "LATEST"), _pointed(root, "BEST")
    found: List[tuple] = [(c.global_step, c.copy, c.path.name, c.path, None) for c in listing.finished]
    for unfinished, why in listing.not_finished.items():
        step = global_step_in_name(unfinished.name)
        if step is None and unfinished.name.startswith("iter_") and unfinished.name[5:].isdigit():
            step = int(unfinished.name[5:])
        found.append((step, is_copy_name(unfinished.name), unfinished.name, unfinished, why))
    found.sort(key=lambda item: (item[0] is None, item[0] or 0, item[1], item[2]))
    same_step = {checkpoint.path: [other.path for other in listing.finished if other.global_step ==
                                   checkpoint.global_step and other.path != checkpoint.path]
                 for checkpoint in listing.finished}  # fmt: skip
    checkpoints = []
    for step, copy, name, directory, why in found:
        outputs = [_output_row(directory, output, verify) for output in _outputs(directory)]
        for output in outputs:  # NeMo's -last copy gets its step's output during training (hard links, as recorded)
            source = next((other for other in same_step.get(directory, []) if not output["complete"]
                           and output_is_complete(other, Path(output["path"]))), None)  # fmt: skip
            if source is not None:
                output["complete"], output["linked_from"] = True, source.name
        run = next((output["run"] for output in outputs if output["run"]), None) or _checkpoint_run(directory)
        checkpoints.append({
            "name": name, "path": str(directory), "global_step": step, "run": run, "finished": why is None,
            "not_finished": why, "copy": bool(copy),
            "marks": [mark for mark, target in (("LATEST", latest), ("BEST", best)) if target == name],
            "consolidated": any(output["complete"] for output in outputs), "outputs": outputs,
        })  # fmt: skip
    retained = []
    kept = root / RETAINED_DIRNAME
    for directory in sorted(kept.iterdir()) if kept.is_dir() and not kept.is_symlink() else []:
        outputs = [_output_row(None, output, verify) for output in _outputs(directory)]
        if not outputs:
            continue
        name = f"{RETAINED_DIRNAME}/{directory.name}"
        retained.append({
            "name": name, "path": str(directory),
            "global_step": next((o["global_step"] for o in outputs if o["global_step"] is not None), None),
            "run": next((output["run"] for output in outputs if output["run"]), None), "copy": False,
            "marks": [mark for mark, target in (("LATEST", latest), ("BEST", best)) if target == name],
            "consolidated": True, "outputs": outputs,
        })  # fmt: skip
    if not checkpoints and not retained and (root / "weights").is_dir():
        raise NotACheckpointError(f"{root} is a checkpoint, not a checkpoint root: list {root.parent}")
    if not checkpoints and not retained:
        raise NotACheckpointError(f"{root} holds no checkpoint ('<name>/weights/' or 'iter_<N>/' directories)")
    return {"root": str(root), "layout": listing.layout, "latest": latest, "best": best, "checkpoints": checkpoints,
            "retained": retained}  # fmt: skip


def format_listing(listing: Dict[str, Any], extra: Optional[Dict[str, Dict[str, str]]] = None) -> str:
    """The table of :func:`list_root`'s result: one row per checkpoint and output (a second output's first cell:
    ``+``). ``extra``: more columns after the global step, ``{header: {name: cell}}`` (the demo's ``val_loss``)."""
    extra = extra or {}
    header = ["checkpoint", "global step", *extra, "run", "finished", "consolidated", "format", "dtype", "size",
              "digests", "post command"]  # fmt: skip
    rows = [header]
    for entry in listing["checkpoints"] + listing["retained"]:
        marks = f"   <- {', '.join(entry['marks'])}" if entry["marks"] else ""
        step = "-" if entry["global_step"] is None else str(entry["global_step"])
        finished = "-" if "finished" not in entry else ("yes" if entry["finished"] else "no")
        first = [entry["name"] + marks, step, *(column.get(entry["name"], "-") for column in extra.values()),
                 entry["run"] or "-", finished]  # fmt: skip
        outputs = entry["outputs"] or [None]
        for index, output in enumerate(outputs):
            lead = first if index == 0 else ["+", "", *("" for _ in extra), "", ""]
            if output is None:
                rows.append(lead + ["no", "-", "-", "-", "-", "-"])
                continue
            done = "kept" if "finished" not in entry else ("yes" if output["complete"] else "outdated")
            rows.append(lead + [
                done, output["format"], ",".join(output["dtype"]) or "-",
                human_size(output["bytes"]), output["digests"], output["post_command_status"] or "-",
            ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def run_list(args: argparse.Namespace) -> int:
    """``nemo-consolidate ROOT --list``: print the table (or ``--json``); returns the exit code (module docstring)."""
    from nemo_patch.engine.verify import VerificationError

    try:
        listing = list_root(args.path, verify=args.verify)
    except ConsolidationError as error:
        print(f"nemo-consolidate: error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(f"nemo-consolidate: error: cannot list {args.path}: {error}", file=sys.stderr)
        return CheckpointNotFoundError.exit_code if isinstance(error, FileNotFoundError) else 1
    if args.json:
        print(json.dumps(listing, indent=2))
    else:
        print(f"checkpoints in {listing['root']}:")
        print(format_listing(listing))
    failed = [output for entry in listing["checkpoints"] + listing["retained"] for output in entry["outputs"]
              if output["digests"] == "FAILED"]  # fmt: skip
    if failed:
        print(f"nemo-consolidate: error: {len(failed)} output(s) do not match their recorded digests; first: "
              f"{failed[0]['digest_error']}", file=sys.stderr)  # fmt: skip
        return VerificationError.exit_code
    return 0
