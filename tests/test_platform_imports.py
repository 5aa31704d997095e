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

"""Linux-only code is never imported at module import: ``nemo.lightning`` (with the overlay's edits of NeMo's files)
imports where ``fcntl`` does not exist (Windows) and without our code importing ``ctypes``, and publishing works
there through its portable path (no ``flock`` lock file, two renames instead of ``renameat2``); writing and reading
work without the POSIX-only ``os`` names (``fdatasync``, ``O_NOFOLLOW``, ``O_NONBLOCK``, ``set_blocking``)."""

import json

from conftest import run_python

#: Run in a fresh interpreter: ``fcntl`` is unimportable for everyone (as on Windows; NeMo's dependencies cope), and
#: ``ctypes`` for our code and the NeMo modules the overlay edits (torch itself needs ``ctypes`` on every platform).
_BLOCKED = r'''
import builtins, importlib.abc, json, os, sys, time
from pathlib import Path

OURS = ("nemo_patch", "nemo.lightning.io.pl", "nemo.lightning.pytorch.strategies.megatron_strategy",
        "nemo.lightning.pytorch.callbacks.model_checkpoint")
ours_tried = []
real_import = builtins.__import__


def guarded(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    top = name.partition(".")[0]
    if level == 0 and top in ("fcntl", "ctypes") and (top == "fcntl" or importer.startswith(OURS)):
        if importer.startswith(OURS):
            ours_tried.append(f"{importer} imports {name}")
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return real_import(name, globals, locals, fromlist, level)


class NoFcntl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fcntl":
            raise ModuleNotFoundError("No module named 'fcntl'", name=name)
        return None


sys.modules.pop("fcntl", None)
sys.meta_path.insert(0, NoFcntl())
builtins.__import__ = guarded

import inspect
import nemo.lightning
from nemo.lightning.io.pl import MegatronCheckpointIO
from nemo.lightning.pytorch.strategies import MegatronStrategy
from nemo_patch.engine import parts, process_limits, publish
from nemo_patch.training import integration, isolation, worker

at_import = list(ours_tried)
edited = "consolidation_settings" in inspect.signature(MegatronCheckpointIO.__init__).parameters
edited = edited and "ckpt_consolidation_frequency" in inspect.signature(MegatronStrategy.__init__).parameters

# POSIX-only names our code may use only where they exist (macOS and Windows have no fdatasync, Windows no O_NOFOLLOW,
# O_NONBLOCK or set_blocking): from here on, this process is without them
for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC", "O_DIRECTORY", "set_blocking", "fdatasync"):
    delattr(os, name)

root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(os.environ["PLATFORM_TMP"])
output = root / "consolidated"
published = []
for generation in range(2):
    tmp = publish.make_tmp_dir(root)
    lock_file = (tmp / publish.TMP_LOCK_NAME).exists()
    (tmp / "metadata.json").write_text(json.dumps({"format_version": 2, "generation": generation}))
    publish.publish_dir(tmp, output)
    published.append((lock_file, json.loads((output / "metadata.json").read_text())["generation"]))
fresh = publish.make_tmp_dir(root)
removed = publish.remove_stale_tmp_dirs(root, keep_pid=-1)
entries = sorted(p.name == "consolidated" or p == fresh for p in root.iterdir())

# two writers fill laid-out safetensors files at offsets, with a writeback after every tensor
import torch
from safetensors.torch import load_file
from nemo_patch.engine import part_writer, plan, safe_files, safetensors_writer

part_writer._WRITEBACK_BYTES = 1
values = {f"layer.{i}.weight": torch.randn(64, 8 + i, generator=torch.Generator().manual_seed(i)) for i in range(4)}
specs = {name: safetensors_writer.TensorSpec(name, v.dtype, tuple(v.shape)) for name, v in values.items()}
files = [safetensors_writer.OutputFile(name, safetensors_writer.encode_header(group, {"format": "pt"}), tuple(group))
         for name, group in plan.plan_shards(list(specs.values()), 5000).items()]
written = root / "written"
written.mkdir()
part_writer.create_files(written, files)
for part in part_writer.split_parts(files, 2):
    part_writer.write_part(written, part, specs, lambda spec: values[spec.name])
loaded = {}
for file in files:
    loaded.update(load_file(written / file.name))
print(json.dumps({
    "at_import": at_import,
    "edited": bool(edited),
    "renameat2": publish._libc_renameat2() is not None,
    "published": published,
    "fresh_kept": fresh.is_dir() and removed == [],
    "entries": entries,
    "die_with_parent": process_limits.die_with_parent(),
    "parts_written": len(files) > 1 and loaded.keys() == values.keys() and all(
        torch.equal(loaded[name], value) for name, value in values.items()),
    "read_back": safe_files.read_json_file(output / "metadata.json")["generation"],
    "tried_later": ours_tried[len(at_import):],
}))
'''


def test_nemo_lightning_imports_without_fcntl_and_publishing_falls_back(tmp_path):
    proc = run_python(_BLOCKED, env={"PLATFORM_TMP": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["at_import"] == []  # no module of ours, nor an edited NeMo module, imports fcntl/ctypes at import
    assert result["edited"]  # the overlay's edits were applied: the strategy and checkpoint IO that run are ours
    # publishing without fcntl and ctypes: no lock file (protected by its age), an output replaced by two renames
    assert result["renameat2"] is False and result["published"] == [[False, 0], [False, 1]]
    assert result["fresh_kept"] and result["entries"] == [True, True]  # a new lockless entry is not stale
    assert result["die_with_parent"] is False  # no prctl without ctypes: reported, not raised
    # without fdatasync, O_NOFOLLOW, O_NONBLOCK and set_blocking: parallel writers' files load with safetensors (the
    # values given), a side file is read through the reader's regular-file check
    assert result["parts_written"] is True and result["read_back"] == 1
    assert sorted(set(result["tried_later"])) == [
        "nemo_patch.engine.process_limits imports ctypes",
        "nemo_patch.engine.publish imports ctypes",
        "nemo_patch.engine.publish imports fcntl",
    ]
