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

"""What parsing a ``.metadata`` costs: the product's loader (:func:`nemo_patch.engine.metadata_checks.
read_dcp_metadata`: bounded, allowlisted, checked) against an unrestricted ``pickle.load`` of the same file.

The files are DCP metadata as ``torch.distributed.checkpoint`` writes it, built with torch's own classes
(``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``): ``KEYS``
tensor entries (a 2-D tensor of two chunks each, as TP=2 stores it), pickled as DCP pickles it. Each parse runs in a
forked child, so its peak resident set (``ru_maxrss`` of the child, less the child's size when it started) and wall
time are its own.

Usage: ``python scripts/bench_metadata_parse.py [KEYS ...]`` (default: 100000 1000000); prints one line per file and
per loader, then the ratios (product / pickle.load) of memory, wall time and CPU time (user + system: on a shared
machine, the figure other jobs disturb least).
"""

import argparse
import os
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_patch.engine.metadata_checks import read_dcp_metadata  # noqa: E402


def build_metadata(keys: int) -> Metadata:
    """DCP metadata of ``keys`` 2-D fp32 tensors, each stored as two chunks along dimension 0."""
    entries: Dict[str, TensorStorageMetadata] = {}
    storage: Dict[MetadataIndex, _StorageInfo] = {}
    offset = 0
    for number in range(keys):
        fqn = f"model.decoder.layers.{number // 16}.mlp.linear_fc{number % 16}.weight"
        rows, cols = 64 + number % 7, 32
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([rows // 2, cols])),
            ChunkStorageMetadata(offsets=torch.Size([rows // 2, 0]), sizes=torch.Size([rows - rows // 2, cols])),
        ]
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, cols]), chunks)
        for rank, chunk in enumerate(chunks):
            length = chunk.sizes[0] * cols * 4
            storage[MetadataIndex(fqn, chunk.offsets)] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            offset += length
    return Metadata(state_dict_metadata=entries, storage_data=storage)  # type: ignore[arg-type]


def _plain(path: Path) -> None:
    with open(path, "rb") as handle:
        pickle.load(handle)


def _product(path: Path) -> None:
    read_dcp_metadata(path.parent)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(load: Callable[[Path], None], path: Path) -> Tuple[float, float, float]:
    """``(peak MiB above the child's start, wall seconds, CPU seconds)`` of ``load(path)`` in a forked child."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.close(read)
        start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started, cpu = time.perf_counter(), _cpu()
        load(path)
        seconds, cpu = time.perf_counter() - started, _cpu() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        os.write(write, f"{(peak - start_rss) / 1024:.1f} {seconds:.3f} {cpu:.3f}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as result:
        text = result.read()
    _, status = os.waitpid(child, 0)
    if status != 0 or not text:
        raise RuntimeError(f"the child measuring {load.__name__} failed (status {status})")
    peak, seconds, cpu = text.split()
    return float(peak), float(seconds), float(cpu)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keys", nargs="*", type=int, default=[100_000, 1_000_000])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        for keys in args.keys:
            directory = Path(scratch) / f"k{keys}"
            directory.mkdir()
            path = directory / ".metadata"
            metadata = build_metadata(keys)
            with open(path, "wb") as handle:  # as FileSystemWriter writes it
                pickle.dump(metadata, handle)
            del metadata
            size = path.stat().st_size
            plain, product = measure(_plain, path), measure(_product, path)
            print(f"{keys} keys, {size / 2**20:.1f} MiB: pickle.load %.0f MiB %.2f s (CPU %.2f s); "
                  "read_dcp_metadata %.0f MiB %.2f s (CPU %.2f s)" % (*plain, *product))  # fmt: skip
            ratios = [mine / max(theirs, 1e-9) for mine, theirs in zip(product, plain)]
            print("  ratios (product / pickle.load): memory %.2fx, time %.2fx, CPU time %.2fx" % tuple(ratios))
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
