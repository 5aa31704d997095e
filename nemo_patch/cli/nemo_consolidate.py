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

"""``nemo-consolidate``: consolidate one NeMo 2 distributed checkpoint offline, on CPU, without writing code.

``--help`` and docs/cli.md list the options and exit codes. Imports NeMo only for ``--format hf`` and ``--verify`` with
a context; never the overlay or ``nemo_patch.testing``.
"""

import argparse
import codecs
import contextlib
import io
import logging
import os
import sys
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

from nemo_patch.cli.listing import add_list_options, check_list_arguments, run_list
from nemo_patch.cli.progress import human_size, progress_bar
from nemo_patch.cli.watch import _one_line, add_watch_options, check_watch_arguments, positive_seconds, run_watch
from nemo_patch.engine.checkpoint_layout import CheckpointLocation
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.huge_pages import prefer_huge_pages
from nemo_patch.engine.output_layout import DTYPE_NAMES, OUTPUT_DIRNAMES
from nemo_patch.engine.output_target import check_output_target, is_url, refuse_remote
from nemo_patch.training.config import SETTINGS, Setting
from nemo_patch.training.latest import locate_checkpoint

if TYPE_CHECKING:
    from nemo_patch.cli.distributed import LaunchedGroup
    from nemo_patch.engine.consolidate import ConsolidationResult

__all__ = ["main"]

PROG = "nemo-consolidate"
#: Exit codes that no error class carries (:mod:`nemo_patch.engine.errors` has the others): code -> (a few words for
#: ``--help``, what it means).
CLI_EXIT_CODES = {
    0: (
        "ok",
        "Success: the output was written and published (or, with ``--verify`` of an existing output, it matched).",
    ),
    2: ("usage", "Bad command line: ``argparse`` prints the usage and the reason."),
    21: (
        "overlay not active (--check)",
        "``--check``: the overlay would not be active in a new interpreter of this environment (the start-up hook did "
        "not run, ``NEMO_PATCH_DISABLE`` is set, or NeMo is unsupported or its files do not match the edits); the "
        "line on stderr says which. ``MegatronStrategy`` would refuse a consolidation argument there.",
    ),
    130: ("interrupted", "Interrupted (Ctrl-C, ``SIGINT``): nothing was published."),
}
#: ``-W`` filter for torch's import-time warning about the ``pynvml`` package.
_PYNVML_WARNING = "ignore:The pynvml package is deprecated:FutureWarning"
#: The encoding error handler of this command's stdout and stderr (:func:`_escape_unencodable`).
_ESCAPE_ERRORS = "nemo_patch.escape"


def _escape_unencodable(error: UnicodeError) -> Tuple[str, int]:
    """Encoding error handler: a file name's undecodable byte (a lone surrogate, ``\\udcff``) as ``\\xff``, any other
    character as ``backslashreplace`` writes it; printing a path never fails."""
    if not isinstance(error, UnicodeEncodeError):
        raise error

    def escaped(char: str) -> str:
        if 0xDC80 <= ord(char) <= 0xDCFF:  # Python's surrogateescape form of the byte ord(char) - 0xDC00
            return f"\\x{ord(char) - 0xDC00:02x}"
        return char.encode("ascii", "backslashreplace").decode("ascii")

    return "".join(escaped(char) for char in error.object[error.start : error.end]), error.end


codecs.register_error(_ESCAPE_ERRORS, _escape_unencodable)


@contextlib.contextmanager
def _printable_paths() -> Iterator[None]:
    """While the command runs, stdout and stderr (if ``strict`` or ``backslashreplace``) escape what they cannot
    encode (:func:`_escape_unencodable`): a path that is not UTF-8 (``ckpt-\\xff``) must not end the command with a
    traceback after it published its output."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors in ("strict", "backslashreplace"):
            changed.append((stream, stream.errors))
            stream.reconfigure(errors=_ESCAPE_ERRORS)
    try:
        yield
    finally:
        for stream, errors in changed:
            with contextlib.suppress(Exception):  # e.g. closed meanwhile
                stream.reconfigure(errors=errors)


def _setting_type(spec: Setting, flag: str, parse: Optional[Callable[[str], Any]]) -> Callable[[str], Any]:
    """argparse's ``type=`` for a setting's option ``flag``: ``parse``, then the setting's own validation (its
    message, naming the option, is argparse's error)."""

    def convert(text: str) -> Any:
        try:
            return spec.validate(text if parse is None else parse(text), flag)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = flag.lstrip("-")  # argparse names the type in some messages
    return convert


def _add_setting_options(groups: Dict[str, Any]) -> None:
    """One option per setting of :data:`nemo_patch.training.config.SETTINGS` that declares one, in the group it names,
    with the field's default; its value is validated as the field is."""
    for spec in SETTINGS:
        if spec.cli is None:
            continue
        group = groups[spec.cli.group]
        if spec.default is False:
            group.add_argument(spec.cli.flag, action="store_true", help=spec.cli.help)
        else:  # with choices, no type: argparse checks choices after the type
            group.add_argument(
                spec.cli.flag, type=None if spec.cli.choices else _setting_type(spec, spec.cli.flag, spec.cli.parse),
                default=spec.default, choices=spec.cli.choices, metavar=spec.cli.metavar, help=spec.cli.help,
            )  # fmt: skip


def _path_argument(text: str) -> Any:
    """argparse's ``type=`` for a path: a :class:`~pathlib.Path`, but a URL (``s3://b/out``) as given, for
    :func:`.refuse_remote` to name it; a local ``./s3:/out`` is made absolute (``Path`` drops the ``./``)."""
    if is_url(text):
        return text
    path = Path(text)
    return path.absolute() if is_url(path) else path


#: How to get an output to remote storage, for the message of a URL given as ``--out``.
_UPLOAD_ADVICE = (
    ", then upload it with a post command, e.g. --post-command 'aws s3 cp --recursive --only-show-errors {output} "
    "s3://bucket/run/' (docs/after-consolidation.md, \"Upload: a model hub or object storage\")"
)


def _installed_version() -> str:
    """The distribution this command belongs to and its version, from the installed metadata (the CLI never imports
    the overlay): the distribution named after the top-level package, else the one that ships that package."""
    package = __name__.split(".")[0]
    names = [package.replace("_", "-")]
    with contextlib.suppress(Exception):  # a broken distribution elsewhere must not break --version
        names += metadata.packages_distributions().get(package, [])
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{package}, version unknown (no installed metadata)"


class _RunAndExit(argparse.Action):
    """An option that runs ``const(parser)`` (which exits) as soon as it is parsed: ``--version``, ``--check``."""

    def __init__(self, option_strings: List[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        self.const(parser)


def _print_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: ``<prog> (<distribution> <version>)`` on stdout, as argparse's own version action."""
    print(f"{parser.prog} ({_installed_version()})")
    parser.exit()


def _check(parser: argparse.ArgumentParser) -> None:
    """``--check`` (:mod:`nemo_patch.cli.check`): one line, then exit 0, or 21 with the reason."""
    from nemo_patch.cli.check import OVERLAY_OFF_EXIT_CODE, check_overlay

    active, line = check_overlay()
    if active:
        print(line)
        parser.exit(0)
    parser.exit(OVERLAY_OFF_EXIT_CODE, f"{parser.prog}: error: nemo_patch overlay not active: {line}\n")


def _exit_codes_epilog() -> str:
    """``Exit codes: 0 ok, 2 usage, 3 path missing, ..., 1 other, 130 interrupted.``: from the error classes'
    ``exit_code`` and ``summary`` (:mod:`nemo_patch.engine.errors`) and :data:`CLI_EXIT_CODES`."""
    from nemo_patch.cli.exit_codes import error_classes

    cli = {code: words for code, (words, _) in CLI_EXIT_CODES.items()}
    codes = [(0, cli[0]), (2, cli[2])]
    codes += [(cls.exit_code, cls.summary) for cls in error_classes().values() if cls is not ConsolidationError]
    codes += [(code, words) for code, words in cli.items() if code not in (0, 2, 130)]
    codes += [(ConsolidationError.exit_code, ConsolidationError.summary), (130, cli[130])]
    return "Exit codes: " + ", ".join(f"{code} {summary}" for code, summary in codes) + "."


class _Parser(argparse.ArgumentParser):
    """Makes the exit-code epilog when help is printed: the error classes live in modules that import torch, which
    ``nemo-consolidate --version`` and a usage error need not load."""

    def format_help(self) -> str:
        if self.epilog is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"The pynvml package is deprecated", category=FutureWarning)
                self.epilog = _exit_codes_epilog()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``nemo-consolidate``."""
    parser = _Parser(
        prog=PROG,
        description="Consolidate a NeMo 2 distributed checkpoint (torch_dist or zarr) into unsharded safetensors "
        "(or a Hugging Face model directory).",
    )
    groups = {
        name: parser.add_argument_group(name, text)
        for name, text in [
            ("input", "the checkpoint to consolidate"),
            ("output", "what is written, and where"),
            ("adapters", "PEFT (LoRA) adapter checkpoints"),
            ("best", "the best checkpoint of a run"),
            ("parallelism", "writer processes, and ranks under torchrun or srun"),
        ]
    }
    group = groups["input"]
    group.add_argument("path", type=_path_argument, help="checkpoint directory, its weights/ directory, a "
                       "checkpoint root (LATEST, else the newest finished checkpoint), or the run directory holding "
                       "checkpoints/")  # fmt: skip
    group.add_argument("--trust-context", action="store_true", help="load the checkpoint's context/ even if it names "
                       "code a NeMo model's context has no need of (that code is imported and run): only for "
                       "checkpoints whose writer you trust")  # fmt: skip
    group.add_argument("--allow-unfinished", action="store_true",
                       help="consolidate a checkpoint whose save never finished (unsafe)")  # fmt: skip
    group = groups["output"]
    group.add_argument("--out", type=_path_argument, default=None, help="output directory (default: "
                       "<ckpt>/consolidated, or <ckpt>/hf for --format hf); a local or mounted one: a URL (s3://...) "
                       "exits 19, upload with --post-command instead (a local directory named like one: "
                       "./s3:/out)")  # fmt: skip
    group.add_argument("--verify", action="store_true", help="re-read the output and compare every tensor with "
                       "the checkpoint; with an existing safetensors output and no --force, only check that output "
                       "(for an existing hf one: "
                       "nemo_patch.export.hf_verify.verify_hf_output)")  # fmt: skip
    group.add_argument("--force", action="store_true", help="replace an existing output: only a previous output of "
                       "nemo-consolidate or an empty directory (anything else exits 7)")  # fmt: skip
    groups["adapters"].add_argument("--base-checkpoint", type=_path_argument, default=None, help="with "
                                    "--merge-adapters: the base model's checkpoint (default: the path NeMo recorded "
                                    "in weights/adapter_metadata.json, a relative one resolved against the current "
                                    "directory)")  # fmt: skip
    group = groups["best"]
    group.add_argument("--best", action="store_true", help="path is a run's checkpoint root: consolidate its best "
                       "finished checkpoint by the metric NeMo's ModelCheckpoint monitored (from its state in the "
                       "checkpoints, else from the metric in their names)")  # fmt: skip
    group.add_argument("--monitor", default=None, help="with --best: the metric (default: the one ModelCheckpoint "
                       "recorded, else val_loss)")  # fmt: skip
    group.add_argument("--mode", choices=["min", "max"], default=None, help="with --best: whether lower or higher "
                       "is better (default: ModelCheckpoint's, else min)")  # fmt: skip
    groups["parallelism"].add_argument(
        "--timeout", type=positive_seconds, default=None, metavar="SECONDS",
        help="under torchrun or srun: how long a rank waits for another's next message before the run ends with exit "
        "code 15 (default: 3600; a rank waits for the others' parts once its own is written, so this must cover how "
        "much longer a slower node takes over its share of a large model, and rank 0's planning, --verify and "
        "publishing)",
    )  # fmt: skip
    _add_setting_options(groups)
    add_watch_options(parser)
    add_list_options(parser)
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary line")
    parser.add_argument("--progress-interval", type=positive_seconds, default=None, metavar="SECONDS",
                        help="when stderr is not a terminal (a job log): seconds between progress lines (bytes done "
                        "and in all, MB/s, time left; default 30; also with --watch)")  # fmt: skip
    parser.add_argument("--version", action=_RunAndExit, const=_print_version, help="print the version and exit")
    parser.add_argument("--check", action=_RunAndExit, const=_check, help="job-start guard: exit 0 with one line if "
                        "NeMo's MegatronStrategy would be edited by the overlay in a new interpreter of this "
                        "environment, else exit 21 with the reason")  # fmt: skip
    return parser


@contextlib.contextmanager
def _nemo_output_held_back(drop_stdout: bool = False) -> Iterator[None]:
    """Hold back what importing NeMo prints on stderr (its start-up warnings say nothing about this command), so a
    failure is reported in one line; shown after all if something unexpected goes wrong. ``drop_stdout``: stdout
    (file descriptor 1: NeMo's logging handler holds the stream) goes to ``/dev/null``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in ((1, 2) if drop_stdout else (2,))}
    with (
        tempfile.TemporaryFile(mode="w+b") as held,
        open(held.fileno(), "w", errors=_ESCAPE_ERRORS, closefd=False) as held_text,
        open(os.devnull, "w") as devnull,
    ):
        os.dup2(held.fileno(), 2)  # what C code and child processes write
        if drop_stdout:
            os.dup2(devnull.fileno(), 1)
        try:
            with contextlib.redirect_stderr(held_text):  # what Python code writes
                yield
        except ConsolidationError:
            raise
        except BaseException:
            held_text.flush()
            os.dup2(saved[2], 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace")[-20000:])
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, original in saved.items():
                os.dup2(original, fd)
                os.close(original)


def _context_shapes(location: "CheckpointLocation", trust: bool) -> Optional[Dict[str, Tuple[int, ...]]]:
    """The names and shapes of the model in the checkpoint's ``context/`` (``--verify``), or ``None`` with a warning
    on stderr when there is no context or the model cannot be built here (the tensor comparison still runs)."""
    if location.adapter or not (location.checkpoint_dir / "context").is_dir():  # adapters are not the context's model
        return None
    from nemo_patch.export.context_model import context_model_shapes

    try:
        with _nemo_output_held_back(drop_stdout=True):  # NeMo logs its model building on stdout
            return context_model_shapes(location.checkpoint_dir, trust_context=trust)
    except ConsolidationError as error:
        print(f"{PROG}: warning: names and shapes not compared with the checkpoint's context: {error}",
              file=sys.stderr)  # fmt: skip
        return None


def _verify_existing(
    location: "CheckpointLocation", output_dir: Path, quiet: bool, started: float, trust: bool
) -> int:
    """``--verify`` on an output that exists: compare it with the checkpoint (and its context's model), write
    nothing."""
    from nemo_patch.engine.digests import verify_digests
    from nemo_patch.engine.safe_files import read_json_file
    from nemo_patch.engine.verify import verify_consolidated, verify_identity, verify_names_and_shapes

    expected = _context_shapes(location, trust)
    verify_identity(location.checkpoint_dir, output_dir)  # made from the save the checkpoint holds now
    count = verify_consolidated(location.weights_dir, output_dir)
    if expected is not None:
        verify_names_and_shapes(output_dir, expected, "the model in the checkpoint's context")
    try:  # per-tensor digests: format version 2 and later
        digests = int(read_json_file(output_dir / "metadata.json").get("format_version", 0)) >= 2
    except (OSError, ValueError, TypeError, AttributeError):
        digests = False
    if digests:
        verify_digests(output_dir)
    if not quiet:
        print(f"Verified {output_dir} against {location.checkpoint_dir}: {count} tensors match "
              f"({time.perf_counter() - started:.1f} s)")  # fmt: skip
    return 0


@_printable_paths()
def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the exit code (docs/cli.md)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.base_checkpoint is not None and not args.merge_adapters:
        parser.error("--base-checkpoint is only used with --merge-adapters")
    listing = check_list_arguments(parser, args)
    policy = check_watch_arguments(parser, args)
    if (args.monitor is not None or args.mode is not None) and not args.best and policy is None:
        parser.error("--monitor and --mode are only used with --best, or --watch")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # torch's own import warns about an old NVML binding on some machines; it says nothing about this command. The
    # -W option also reaches the writer processes' interpreters (multiprocessing passes sys.warnoptions on).
    warnings.filterwarnings("ignore", message=r"The pynvml package is deprecated", category=FutureWarning)
    if _PYNVML_WARNING not in sys.warnoptions:
        sys.warnoptions.append(_PYNVML_WARNING)
    if listing:
        return run_list(args)
    prefer_huge_pages()  # before torch is imported: this process exists to consolidate
    if policy is not None:
        return run_watch(args, policy, write_output)
    from nemo_patch.cli.distributed import LaunchedGroup

    try:
        group = LaunchedGroup.from_environment(args.timeout)
        if group is not None:
            group.join(vars(args))  # every rank's arguments compared with rank 0's, before any work
            if group.rank != 0:
                return group.serve()  # rank 0 reports the outcome, once; every rank reports a lost peer
    except ConsolidationError as error:
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return error.exit_code
    code = _consolidate(args, group)
    if group is not None:
        group.finish(code)
    return code


def write_output(
    args: argparse.Namespace, checkpoint_dir: Path, out: Optional[Path], hold_nemo_output: bool = False, **options: Any
) -> "ConsolidationResult":
    """Write one checkpoint's output (also ``--watch``'s) with the command line's ``--format``, ``--dtype``,
    ``--verify``, ``--max-shard-size``, ``--workers`` and ``--trust-context``; returns the engine's result.

    Args:
        out: the output directory (``None``: the default one in the checkpoint).
        hold_nemo_output: hold back what importing NeMo prints (:func:`_nemo_output_held_back`).
        options: more arguments of the engine's ``consolidate_checkpoint`` / ``export_hf_checkpoint``.

    Raises:
        ConsolidationError: the output could not be written (nothing was published).
    """
    import torch

    options.update(dtype=None if args.dtype is None else getattr(torch, DTYPE_NAMES[args.dtype]), verify=args.verify)
    if args.max_shard_size is not None:
        options["max_shard_size"] = args.max_shard_size
    if args.format == "hf":
        from nemo_patch.export.context_trust import check_context_trusted
        from nemo_patch.export.hf import export_hf_checkpoint

        with _nemo_output_held_back(drop_stdout=True) if hold_nemo_output else contextlib.nullcontext():
            check_context_trusted(checkpoint_dir / "context", args.trust_context)  # imports NeMo, which logs on stdout
        with _nemo_output_held_back() if hold_nemo_output else contextlib.nullcontext():
            return export_hf_checkpoint(checkpoint_dir, out, trust_context=args.trust_context, **options)
    from nemo_patch.engine.consolidate import consolidate_checkpoint
    from nemo_patch.engine.parts import default_workers

    options.setdefault("workers", args.workers or default_workers())
    return consolidate_checkpoint(checkpoint_dir, out, **options)


def _consolidate(args: argparse.Namespace, group: Optional["LaunchedGroup"]) -> int:
    """Consolidate as ``args`` say (on rank 0 of ``group`` when launched on several nodes); returns the exit code."""
    from nemo_patch.engine.save_identity import global_step_of

    # The progress bar's stream: still the terminal under the hold-back.
    terminal = os.fdopen(os.dup(2), "w", buffering=1, errors=_ESCAPE_ERRORS)
    update, close_bar = progress_bar(not args.quiet, terminal, args.progress_interval)
    started = time.perf_counter()
    try:
        try:
            refuse_remote(args.path, "the checkpoint")  # exit 19 for a URL
            if args.base_checkpoint is not None:
                refuse_remote(args.base_checkpoint, "the base checkpoint")
            if args.out is not None:
                refuse_remote(args.out, "--out", _UPLOAD_ADVICE)
            best = None
            if args.best:
                from nemo_patch.runs.best_checkpoint import find_best_checkpoint

                best = find_best_checkpoint(args.path, args.monitor, args.mode)
                if not args.quiet:
                    print(f"Best checkpoint by {best.monitor} ({best.mode}): {best.checkpoint_dir.name}, "
                          f"{best.monitor}={best.value:.6g} (from the {best.source})", file=sys.stderr)  # fmt: skip
            location = locate_checkpoint(
                best.checkpoint_dir if best else args.path, allow_unfinished=args.allow_unfinished
            )
            if not location.finished:
                print(f"{PROG}: warning: {location.checkpoint_dir} is unfinished; consolidating it anyway "
                      "(--allow-unfinished): the output may be incomplete or wrong", file=sys.stderr)  # fmt: skip
            options: Dict[str, Any] = dict(
                overwrite=args.force, allow_unfinished=args.allow_unfinished, progress=update,
                merge_adapters=args.merge_adapters, base_checkpoint=args.base_checkpoint,
                best=best.record() if best else None, global_step=global_step_of(location.checkpoint_dir),
            )  # fmt: skip
            out = args.out or location.checkpoint_dir / OUTPUT_DIRNAMES[args.format]
            verify_only = args.verify and not args.force and args.format == "safetensors" and out.is_dir()
            check_output_target(location.checkpoint_dir, out, args.force, read_only=verify_only)
            if group is not None and (verify_only or args.format == "hf"):
                group.release()  # rank 0 verifies or exports alone: the other ranks exit 0
            if verify_only:
                return _verify_existing(location, out, args.quiet, started, args.trust_context)
            if args.format == "safetensors":
                from nemo_patch.engine.parts import default_workers

                options["workers"] = args.workers or default_workers()
                if args.verify:
                    options["expected_shapes"] = _context_shapes(location, args.trust_context)
                if group is not None:
                    options.update(parts=group.world_size * options["workers"], parts_runner=group.run)
            result = write_output(args, location.checkpoint_dir, args.out, hold_nemo_output=True, **options)
        finally:
            close_bar()
            terminal.close()
    except ConsolidationError as error:
        ended = str(error).endswith("its save never ended")  # the engine's message names no option of this command
        hint = " (--allow-unfinished consolidates what it holds anyway)" if ended else ""
        print(f"{PROG}: error: {_one_line(error)}{hint}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130  # CLI_EXIT_CODES
    except Exception as error:  # noqa: BLE001 - a bug, not bad input: still one line and the documented exit code 1
        print(f"{PROG}: error: unexpected {type(error).__name__}: {_one_line(error)} (nothing was written; please "
              "report this with the command line)", file=sys.stderr)  # fmt: skip
        return 1
    seconds = time.perf_counter() - started
    if not args.quiet:
        rate = result.total_bytes / seconds if seconds > 0 else 0.0
        print(
            f"Consolidated {location.checkpoint_dir} -> {result.output_dir}: {result.tensor_count} "
            f"{'adapter tensors' if result.kind == 'adapter' else 'tensors'}, "
            f"{human_size(result.total_bytes)} in {seconds:.1f} s ({human_size(rate)}/s)"
            f"{f' by {group.world_size} nodes' if group is not None and args.format == 'safetensors' else ''}"
            f"{', verified' if args.verify else ''}"
        )
    if args.post_command is not None:
        return _post_command(args, location, result)
    return 0


def _post_command(args: argparse.Namespace, location: "CheckpointLocation", result: "ConsolidationResult") -> int:
    """``--post-command``: run it on the published output (:mod:`nemo_patch.runs.post_command`); exit code 17 with
    one line when it fails or times out (the output stays published: it is complete)."""
    from nemo_patch.runs.post_command import PostCommandError, run_post_command

    done = run_post_command(args.post_command, result.output_dir, args.format, result.global_step,
                            location.checkpoint_dir, timeout=args.post_command_timeout)  # fmt: skip
    if not done.ok:
        print(f"{PROG}: error: {PostCommandError.__name__}: {done.describe()}", file=sys.stderr)
        return PostCommandError.exit_code
    if not args.quiet:
        print(f"Post command: {done.describe()}" + (f"; metrics {done.metrics}" if done.metrics else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
