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

"""Consolidate a finished NeMo 2 ``torch_dist`` checkpoint into unsharded safetensors files, offline::

    python -m nemo_patch.engine.converter <ckpt> [--out DIR] [--max-shard-size 5GB] [--overwrite]

No GPU or process group; ``.metadata`` is unpickled with an allowlist (:mod:`.dcp_metadata`), tensors read by
PyTorch's DCP loader one entry at a time. Memory: one output file's tensors plus one checkpoint entry.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Tuple, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_patch.engine.checkpoint_layout import CONSOLIDATED_DIRNAME, CheckpointLocation, inspect_checkpoint
from nemo_patch.engine.dcp_metadata import load_dcp_metadata
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError, OutputExistsError, UnsupportedFormatError
from nemo_patch.engine.plan import OutputTensor, TensorSpec, plan_outputs, plan_shards

Producer = Callable[[TensorSpec], torch.Tensor]  #: reads the output tensor of a spec


class _AllowlistReader(dcp.FileSystemReader):
    """DCP's file reader, with ``.metadata`` loaded by :func:`.load_dcp_metadata` (its own unpickles unrestricted)."""

    loaded: Metadata

    def read_metadata(self) -> Metadata:
        return self.loaded


class Consolidation:
    """One consolidation of a checkpoint: :meth:`run` locates it, plans its output files, writes them into a staging
    directory and publishes that, each step a method a caller may replace with a function of the same arguments.

    Args:
        checkpoint_dir: the checkpoint directory (``<ckpt>``) or its ``weights/`` directory.
        output_dir: where to publish (default ``<ckpt>/consolidated``).
        max_shard_size: most tensor-data bytes per file, an ``int`` or a size such as ``"5GB"`` (the default).
        overwrite: replace an existing output (only a directory of safetensors and JSON files is replaced).
        locator, reader, stager, writer: replace :func:`.checkpoint_layout.inspect_checkpoint` (called with this
            consolidation), :meth:`open`, :meth:`staged` and :meth:`write`.
    """

    def __init__(
        self,
        checkpoint_dir: Union[str, Path],
        output_dir: Optional[Union[str, Path]] = None,
        *,
        max_shard_size: Union[int, str] = "5GB",
        overwrite: bool = False,
        locator: Optional[Callable[["Consolidation"], CheckpointLocation]] = None,
        reader: Optional[Callable[[CheckpointLocation], Tuple[List[OutputTensor], Producer]]] = None,
        stager: Optional[Callable[[CheckpointLocation], ContextManager[Path]]] = None,
        writer: Optional[Callable[[Path, Dict[str, List[TensorSpec]], Producer], None]] = None,
    ) -> None:
        self.checkpoint_dir, self.output_dir = Path(checkpoint_dir), None if output_dir is None else Path(output_dir)
        self.max_shard_size, self.overwrite = max_shard_size, overwrite
        self.locator = locator or (lambda job: inspect_checkpoint(job.checkpoint_dir))
        self.reader, self.stager, self.writer = reader or self.open, stager or self.staged, writer or self.write
        #: The weights files' name stem, and each output tensor's source by name.
        self.stem, self.sources = "model", cast(Dict[str, OutputTensor], {})

    def run(self) -> List[OutputTensor]:
        """Consolidate, and publish the output (in :attr:`output_dir`); returns the tensors written.

        Raises:
            ConsolidationError: or a subclass naming the cause (not a checkpoint, unfinished, an unsupported format
                or an adapter checkpoint, output exists, a corrupt shard, a layout the plan does not understand);
                nothing is left under the output's name.
            ValueError: ``max_shard_size`` is not a size.
            OSError: the output cannot be written (nothing is left behind).
        """
        location = self.locator(self)
        self.output_dir = self.output_dir or location.checkpoint_dir / CONSOLIDATED_DIRNAME
        outputs, produce = self.reader(location)
        if not outputs:
            raise ConsolidationError(f"{location.weights_dir} holds no model tensors ('module.*' entries)")
        self.sources = {output.spec.name: output for output in outputs}
        files = plan_shards([output.spec for output in outputs], self.max_shard_size, self.stem)
        with self.stager(location) as directory:
            self.writer(directory, files, produce)
            if len(files) > 1:
                weights = {spec.name: name for name, specs in files.items() for spec in specs}
                index = {"metadata": {"total_size": sum(o.spec.nbytes for o in outputs)}, "weight_map": weights}
                (directory / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return outputs

    def open(self, location: CheckpointLocation) -> Tuple[List[OutputTensor], Producer]:
        """The output tensors and the function that reads one (entry by entry, the last kept); raises
        :class:`ConsolidationError` for another format, adapters only, unreadable files or a layout it refuses."""
        if location.backend != "torch_dist":
            raise UnsupportedFormatError(f"{location.checkpoint_dir}: a '{location.backend}' checkpoint")
        if location.adapter:
            raise UnsupportedFormatError(f"{location.checkpoint_dir} holds PEFT adapters only, not a model")
        try:
            metadata = load_dcp_metadata((location.weights_dir / ".metadata").read_bytes())
        except Exception as error:  # OSError, pickle.UnpicklingError
            raise CorruptShardError(f"Cannot read {location.weights_dir / '.metadata'}: {error}") from error
        for info in (metadata.storage_data or {}).values():
            if Path(info.relative_path).name != info.relative_path or info.relative_path in ("", ".", ".."):
                raise CorruptShardError(f"the metadata names {info.relative_path!r}: not a file of weights/")
        reader, outputs = _AllowlistReader(location.weights_dir), plan_outputs(metadata)
        entry: Dict[str, torch.Tensor] = {}
        reader.loaded = metadata

        def produce(spec: TensorSpec) -> torch.Tensor:
            source = self.sources[spec.name]
            if source.key not in entry:
                item = cast(TensorStorageMetadata, metadata.state_dict_metadata[source.key])
                entry.clear()  # one entry in memory at a time
                entry[source.key] = torch.empty(item.size, dtype=item.properties.dtype)
                try:
                    dcp.load(entry, storage_reader=reader, no_dist=True)
                except (Exception, CheckpointException) as error:  # DCP's exception holds the cause of each rank
                    entry.clear()
                    cause = next(iter(getattr(error, "failures", {}).values()), (error,))[0]
                    files = sorted({i.relative_path for x, i in metadata.storage_data.items() if x.fqn == source.key})
                    raise CorruptShardError(f"Cannot read {source.key} from {files}: {cause!r}") from error
            return entry[source.key][source.index] if source.index else entry[source.key]

        return outputs, produce

    @contextlib.contextmanager
    def staged(self, location: CheckpointLocation) -> Iterator[Path]:
        """A temporary directory next to the output, renamed to it when the block ends (removed if it raises);
        :class:`OutputExistsError` if the output exists (``overwrite`` replaces an output) or is the checkpoint."""
        output, checkpoint = Path(os.path.abspath(str(self.output_dir))), location.checkpoint_dir.absolute()
        if output in (checkpoint, *checkpoint.parents) or checkpoint / "weights" in (output, *output.parents):
            raise OutputExistsError(f"{output} would overwrite the checkpoint {checkpoint}")
        if os.path.lexists(output) and not self.overwrite:
            raise OutputExistsError(f"{output} exists")
        output.parent.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=".consolidated.tmp-", dir=output.parent))
        try:
            yield directory
            if os.path.lexists(output):
                if output.is_symlink() or any(p.suffix not in (".safetensors", ".json") for p in output.iterdir()):
                    raise OutputExistsError(f"{output} exists and is not an output of a consolidation")
                shutil.rmtree(output)
            os.rename(directory, output)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def write(self, directory: Path, files: Dict[str, List[TensorSpec]], produce: Producer) -> None:
        """Write each file of ``files`` (name -> its tensors) with ``safetensors``, reading entry by entry."""
        for name, specs in files.items():
            order = sorted(specs, key=lambda spec: (self.sources[spec.name].key, self.sources[spec.name].index))
            save_file({spec.name: produce(spec) for spec in order}, str(directory / name), metadata={"format": "pt"})


def main(argv: Optional[List[str]] = None) -> int:
    """The command line (module docstring); returns 0, or the error's ``exit_code``."""
    parser = argparse.ArgumentParser(prog="python -m " + __spec__.name, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="the checkpoint directory (or its weights/ directory)")
    parser.add_argument("--out", help="the output directory (default: <checkpoint>/consolidated)")
    parser.add_argument("--max-shard-size", default="5GB", type=lambda n: int(n) if n.isdigit() else n, help="bytes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    args = parser.parse_args(argv)
    try:
        job = Consolidation(args.checkpoint, args.out, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
        job.run()
        print(job.output_dir)
    except (ConsolidationError, ValueError) as error:
        print(f"error ({getattr(error, 'summary', 'invalid argument')}): {error}", file=sys.stderr)
        return getattr(error, "exit_code", 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
