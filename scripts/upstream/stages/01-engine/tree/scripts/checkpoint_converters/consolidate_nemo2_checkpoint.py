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

"""Consolidate a finished NeMo 2 distributed checkpoint (``torch_dist``) into unsharded safetensors, on the CPU.

Usage::

    python scripts/checkpoint_converters/consolidate_nemo2_checkpoint.py <ckpt> [--out DIR] [--dtype bf16|fp16|fp32]
        [--max-shard-size BYTES] [--workers N] [--verify] [--force]
        [--format safetensors|hf [--trust-context]]

``<ckpt>`` is a checkpoint directory (``<ckpt>/weights`` and ``<ckpt>/context``) or its ``weights/`` directory. The
output (default ``<ckpt>/consolidated``) holds ``model.safetensors`` (or shards plus ``model.safetensors.index.json``)
and ``metadata.json``; see ``nemo.lightning.io.consolidation.engine.consolidate``. No GPU, process group or model is
needed. ``--format hf`` writes ``<ckpt>/hf`` instead, a directory ``transformers`` loads, through the NeMo exporter
registered for the model class (NeMo is imported to find it); the checkpoint's ``context/`` must name only NeMo's,
megatron-core's, torch's, transformers' and Lightning's code, unless ``--trust-context`` (loading it runs that code).
``--workers N`` writer processes fill the output files at once (default: this node's cores, at most 8); the
output is the same, byte for byte, whatever the number. The exit code names the cause of a failure
(``nemo.lightning.io.consolidation.engine.errors``).
"""

import os

# torch's allocator reads this at its first allocation: huge pages for the consolidation's large tensors
# (nemo.lightning.io.consolidation.engine.huge_pages); a value the user set is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import List, Optional  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory or its weights/ directory")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: <ckpt>/consolidated)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast floating-point tensors")
    parser.add_argument("--max-shard-size", type=int, default=5_000_000_000, help="most bytes per safetensors file")
    parser.add_argument("--format", choices=["safetensors", "hf"], default="safetensors", help="output format")
    parser.add_argument("--trust-context", action="store_true", help="load a context that names code outside NeMo")
    parser.add_argument("--workers", type=int, default=None, help="writer processes (default: cores, at most 8)")
    parser.add_argument("--verify", action="store_true", help="compare every written tensor with the checkpoint")
    parser.add_argument("--force", action="store_true", help="replace a previous output")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Consolidate; returns the exit code (0, or the cause's code with a one-line reason on stderr)."""
    args = build_parser().parse_args(argv)
    import torch
    from nemo.lightning.io.consolidation.engine.consolidate import consolidate_checkpoint
    from nemo.lightning.io.consolidation.engine.errors import ConsolidationError
    from nemo.lightning.io.consolidation.engine.output_layout import DTYPE_NAMES
    from nemo.lightning.io.consolidation.engine.parts import default_workers

    options = dict(
        max_shard_size=args.max_shard_size,
        dtype=None if args.dtype is None else getattr(torch, DTYPE_NAMES[args.dtype]),
        overwrite=args.force,
        verify=args.verify,
    )
    try:
        if args.format == "hf":
            from nemo.lightning.io.consolidation.engine.checkpoint_layout import inspect_checkpoint
            from nemo.lightning.io.consolidation.export.context_trust import check_context_trusted
            from nemo.lightning.io.consolidation.export.hf import export_hf_checkpoint

            location = inspect_checkpoint(args.checkpoint)
            check_context_trusted(location.checkpoint_dir / "context", args.trust_context)
            result = export_hf_checkpoint(location.checkpoint_dir, args.out, **options)
        else:
            result = consolidate_checkpoint(
                args.checkpoint, args.out, workers=args.workers or default_workers(), **options
            )
    except ConsolidationError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    print(f"Consolidated {args.checkpoint} -> {result.output_dir}: {result.tensor_count} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
