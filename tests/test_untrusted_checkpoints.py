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


"""Checkpoints nobody here wrote: crafted metadata, damaged layouts, hostile paths and file kinds, a hostile context.

Every test starts from a real TP=2 checkpoint of a NeMo fit (``tp2_checkpoint``: each attention and MLP weight is
stored as several chunks) and damages a private copy of it. What the consolidation must do with each: exit with a
documented code and one line on stderr, publish nothing, change no file outside its output, run no code.
"""

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from nemo_patch.cli.nemo_consolidate import main as consolidate_main
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.metadata_checks import read_dcp_metadata

# Every test here starts from the real TP=2 fit of the tp2_checkpoint fixture.
pytestmark = pytest.mark.slow

QKV = "module.decoder.layers.self_attention.linear_qkv.weight"
DOCUMENTED_EXIT_CODES = {0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}


@pytest.fixture()
def victim(tp2_checkpoint, tmp_path) -> Path:
    """A private copy of the TP=2 checkpoint, with a file beside it that nothing may touch."""
    copy = tmp_path / "ckpts" / tp2_checkpoint.name
    shutil.copytree(tp2_checkpoint, copy, ignore=shutil.ignore_patterns("consolidated"))
    (tmp_path / "secret.txt").write_text("not a tensor\n" * 1000)
    return copy


def reference(tp2_checkpoint: Path) -> Dict[str, torch.Tensor]:
    return load_file(str(tp2_checkpoint.parents[2] / "reference" / "model.safetensors"))


def tree_state(root: Path, skip: Path) -> Dict[str, Tuple[str, bytes]]:
    """Every entry under ``root`` except ``skip``: kind and content (a link's target, a file's bytes)."""
    state = {}
    for path in sorted(root.rglob("*")):
        if path == skip or skip in path.parents:
            continue
        if path.is_symlink():
            state[str(path)] = ("link", os.readlink(path).encode())
        elif path.is_file():
            state[str(path)] = ("file", path.read_bytes())
        else:
            state[str(path)] = ("other", b"")
    return state


def run_cli(args: List[str], timeout: float = 120) -> Tuple[int, List[str]]:
    """``nemo-consolidate`` in-process with a deadline; returns (exit code, stderr lines)."""
    stderr = io.StringIO()
    result: List[int] = []

    def target() -> None:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            result.append(consolidate_main(args + ["--quiet", "--workers", "1"]))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"nemo-consolidate {args} still runs after {timeout} s (a hang)"
    lines = [line for line in stderr.getvalue().splitlines() if line.strip() and "pynvml" not in line]
    return result[0], lines


def write_metadata(checkpoint: Path, metadata) -> None:
    """Write ``metadata`` as torch's own ``Metadata`` (the stand-in for megatron-core's class pickles by its name)."""
    fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    plain = Metadata(**{name: getattr(metadata, name) for name in fields})
    (checkpoint / "weights" / ".metadata").write_bytes(pickle.dumps(plain))


def assert_refused(checkpoint: Path, code: int, expected_code: int, lines: List[str], *words: str) -> None:
    assert code == expected_code, lines
    assert len(lines) == 1 and lines[0].startswith("nemo-consolidate: error: "), lines
    for word in words:
        assert word in lines[0], lines
    assert not (checkpoint / "consolidated").exists()
    assert not [p for p in checkpoint.iterdir() if p.name.startswith(".consolidated")]


# --- 1. code execution through the metadata -------------------------------------------------------------------------

# Names that an attribute lookup on an allowed module would reach; none of them is a metadata type.
REACHABLE_NAMES = [
    ("torch.distributed.checkpoint.metadata", "os"),
    ("torch.distributed.checkpoint.filesystem", "os"),
    ("torch.distributed.checkpoint.filesystem", "pickle"),
    ("torch.distributed.checkpoint.planner", "abc"),
    ("torch.distributed.checkpoint.metadata", "__builtins__"),
    ("torch", "load"),
    ("torch", "_C"),
    ("torch.serialization", "load"),
    ("builtins", "eval"),
    ("builtins", "getattr"),
    ("collections", "namedtuple"),
    ("posix", "system"),
]


@pytest.mark.parametrize("module,name", REACHABLE_NAMES)
def test_metadata_naming_anything_but_a_metadata_type_is_refused(tmp_path, module, name):
    (tmp_path / ".metadata").write_bytes(f"c{module}\n{name}\n.".encode())  # protocol-0 GLOBAL, then STOP
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        read_dcp_metadata(tmp_path)


def test_a_crafted_metadata_runs_no_command_and_exits_8(victim, tmp_path):
    marker = tmp_path / "pwned"
    # eval reached through an allowed module's globals, as the attack did: module.__builtins__['eval'](code)
    payload = (
        b"ctorch.distributed.checkpoint.metadata\n__builtins__\n"
        + b"(S'eval'\ntR"  # never reached: the first GLOBAL is refused
        + f"(S'__import__(\"os\").system(\"touch {marker}\")'\ntR.".encode()
    )
    (victim / "weights" / ".metadata").write_bytes(payload)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, ".metadata", "refusing to load")
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda m: setattr(m.state_dict_metadata[QKV], "size", "abc"), id="size-a-string"),
        pytest.param(lambda m: setattr(m.state_dict_metadata[QKV], "chunks", None), id="chunks-none"),
        pytest.param(lambda m: m.state_dict_metadata.update({7: m.state_dict_metadata[QKV]}), id="integer-key"),
        pytest.param(lambda m: setattr(m.state_dict_metadata[QKV].properties, "dtype", "float32"), id="dtype-string"),
        pytest.param(lambda m: setattr(m, "storage_data", [1, 2]), id="storage-a-list"),
        pytest.param(
            lambda m: setattr(next(iter(m.storage_data.values())), "offset", -5), id="negative-storage-offset"
        ),
    ],
)
def test_metadata_of_the_right_classes_with_wrong_types_exits_8(victim, damage):
    metadata = read_dcp_metadata(victim / "weights")
    damage(metadata)
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, ".metadata")


# --- 4. layouts: chunks must tile their tensor, records must hold what their chunk declares --------------------------


def _chunks(metadata, key=QKV) -> list:
    return metadata.state_dict_metadata[key].chunks


@pytest.mark.parametrize(
    "damage,words",
    [
        (lambda m: _chunks(m).append(_chunks(m)[0]), ["overlap"]),  # a repeated chunk
        (lambda m: _chunks(m).__setitem__(1, ChunkStorageMetadata(_chunks(m)[0].offsets, _chunks(m)[1].sizes)), [
            "overlap"]),  # two chunks at one place, a hole elsewhere: volumes still add up
        (lambda m: _chunks(m).__setitem__(0, ChunkStorageMetadata(
            torch.Size([0, 150, 0]), _chunks(m)[0].sizes)), ["outside"]),  # sticks out of the tensor
        (lambda m: setattr(m.state_dict_metadata[QKV], "size", torch.Size([2, 192, 65])), ["cover"]),  # a hole
    ],
)  # fmt: skip
def test_chunks_that_do_not_tile_their_tensor_are_refused_naming_it(victim, damage, words):
    metadata = read_dcp_metadata(victim / "weights")
    damage(metadata)
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert code in (8, 11), lines
    assert_refused(victim, code, code, lines, QKV, *words)


def test_a_layer_whose_chunks_are_all_missing_is_refused_not_left_out(victim):
    norm = "module.decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    metadata = read_dcp_metadata(victim / "weights")
    chunks = metadata.state_dict_metadata[norm].chunks
    chunks[:] = [chunk for chunk in chunks if chunk.offsets[0] != 1]  # layer 1 of the stack: no chunk left
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, norm, "belongs to no chunk")


def test_a_record_holding_another_dtype_or_shape_than_declared_exits_8(victim):
    metadata = read_dcp_metadata(victim / "weights")
    item = metadata.state_dict_metadata[QKV]
    item.properties.dtype = torch.float16  # half the bytes: the size bound passes, the record check must not
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, QKV, "torch.float32", "torch.float16")

    metadata = read_dcp_metadata(victim / "weights")
    metadata.state_dict_metadata[QKV].properties.dtype = torch.float32
    item = metadata.state_dict_metadata[QKV]  # narrower: each stored [1, 96, 64] record declared as [1, 96, 32]
    item.size = torch.Size([*item.size[:-1], 32])
    for chunk in item.chunks:
        chunk.sizes = torch.Size([*chunk.sizes[:-1], 32])
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, QKV, "[1, 96, 64]", "[1, 96, 32]")


# --- 5 and 6. paths, file kinds and sizes ---------------------------------------------------------------------------


def _retarget(metadata, name: str) -> None:
    for index, info in metadata.storage_data.items():
        if index.fqn == QKV:
            info.relative_path = name


@pytest.mark.parametrize("name", ["../../secret.txt", "/etc/passwd", "sub/__0_0.distcp", "..", "", "missing.distcp"])
def test_storage_records_naming_files_outside_weights_are_refused(victim, name):
    metadata = read_dcp_metadata(victim / "weights")
    _retarget(metadata, name)
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines)


def _shard_of_qkv(victim: Path) -> Path:
    metadata = read_dcp_metadata(victim / "weights")
    return victim / "weights" / metadata.storage_data[MetadataIndex(QKV, _chunks(metadata)[0].offsets)].relative_path


@pytest.mark.parametrize("kind", ["symlink-out", "fifo", "directory", "dev-zero"])
def test_shard_files_that_are_not_regular_files_inside_weights_are_refused_without_hanging(victim, tmp_path, kind):
    shard = _shard_of_qkv(victim)
    outside = tmp_path / "outside.distcp"
    shutil.copy(shard, outside)
    shard.unlink()
    if kind == "symlink-out":
        shard.symlink_to(outside)  # the same bytes, but not in weights/
    elif kind == "fifo":
        os.mkfifo(shard)
    elif kind == "directory":
        shard.mkdir()
    else:
        shard.symlink_to("/dev/zero")
    code, lines = run_cli([str(victim)], timeout=60)
    assert_refused(victim, code, 8, lines, shard.name)


def test_a_symlinked_checkpoint_directory_still_works(victim, tmp_path, tp2_checkpoint):
    link = tmp_path / "link-to-checkpoint"
    link.symlink_to(victim)
    code, lines = run_cli([str(link), "--out", str(tmp_path / "out")])
    assert code == 0, lines
    got, want = load_file(str(tmp_path / "out" / "model.safetensors")), reference(tp2_checkpoint)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_side_files_that_are_fifos_or_endless_do_not_hang_or_grow_memory(victim, kind):
    side = victim / "weights" / "metadata.json"
    side.unlink()
    if kind == "fifo":
        os.mkfifo(side)
    else:
        side.symlink_to("/dev/zero")
    code, lines = run_cli([str(victim)], timeout=60)
    # without a readable megatron-core metadata.json the checkpoint is read as plain torch_dist DCP: that is fine
    assert code in DOCUMENTED_EXIT_CODES and (code == 0 or len(lines) == 1), lines


def test_declared_sizes_beyond_the_bytes_held_are_refused_before_allocating(victim):
    metadata = read_dcp_metadata(victim / "weights")
    item = metadata.state_dict_metadata[QKV]
    item.size = torch.Size([2, 192 * 10**9, 64])  # about 100 TB
    item.chunks = [ChunkStorageMetadata(torch.Size([0, 0, 0]), torch.Size([2, 192 * 10**9, 64]))]
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == QKV:
            del metadata.storage_data[index]
    first = next(
        info for index, info in read_dcp_metadata(victim / "weights").storage_data.items() if index.fqn == QKV
    )
    metadata.storage_data[MetadataIndex(QKV, torch.Size([0, 0, 0]))] = first
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, QKV, "declares")


def test_a_stacked_entry_declaring_a_billion_layers_costs_nothing(victim, tp2_checkpoint, tmp_path):
    metadata = read_dcp_metadata(victim / "weights")
    metadata.state_dict_metadata[QKV].size = torch.Size([10**9, 192, 64])
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim), "--out", str(tmp_path / "out")])
    assert code == 0, lines  # layers no chunk covers have no output (as for dense layers among MoE layers)
    got, want = load_file(str(tmp_path / "out" / "model.safetensors")), reference(tp2_checkpoint)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_an_output_header_safetensors_cannot_read_is_refused_before_publishing(tmp_path):
    from nemo_patch.engine.errors import UnknownLayoutError
    from nemo_patch.engine.safetensors_writer import TensorSpec, encode_header

    specs = [TensorSpec(f"module.{i:05d}." + "x" * 5000, torch.float32, (1,)) for i in range(20000)]
    with pytest.raises(UnknownLayoutError, match="safetensors library reads at most 100000000"):
        encode_header(specs, {"format": "pt"})


# --- 2. the context --------------------------------------------------------------------------------------------------


def _hostile_context(victim: Path, marker: Path) -> None:
    io_json = victim / "context" / "io.json"
    text = io_json.read_text()
    text = text.replace(
        '{"type": "pyref", "module": "builtins", "name": "tuple"}',
        '{"type": "pyref", "module": "subprocess", "name": "getoutput"}',
        1,
    )
    io_json.write_text(text.replace("tiny_gpt", f"touch {marker}", 1))


def test_a_context_naming_code_outside_nemo_is_never_imported_without_trust(victim, tmp_path):
    from nemo_patch.export.context_trust import check_context_trusted

    def modules(value):  # the "module" of every object of io.json
        if isinstance(value, dict):
            yield from [value["module"]] if isinstance(value.get("module"), str) else []
            value = list(value.values())
        for item in value if isinstance(value, list) else []:
            yield from modules(item)

    marker = tmp_path / "ran"
    found = set(modules(json.loads((victim / "context" / "io.json").read_text())))
    assert found and {module.split(".")[0] for module in found} <= {"builtins", "fiddle", "megatron", "nemo", "torch"}
    _hostile_context(victim, marker)
    with pytest.raises(ConsolidationError, match="subprocess.getoutput"):
        check_context_trusted(victim / "context")
    check_context_trusted(victim / "context", trust=True)  # the opt-in

    # --format hf refuses it (exit 16) before NeMo reads the context; --verify still compares the tensors
    code, lines = run_cli([str(victim), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert code == 16 and len(lines) == 1 and "--trust-context" in lines[0], lines
    assert not (tmp_path / "hf").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch", str(victim), "--verify", "--out", str(tmp_path / "v"), "--workers", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "subprocess.getoutput" in proc.stderr and "verified" in proc.stdout
    assert not marker.exists()


# --- found by attacking the above: pickle structure, compressed records, contexts that evade a name scan -------------


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"\x80\x04Nr\x00\x00\x00\x40.", "memo index"),  # LONG_BINPUT 2**30: a 2**31-slot memo array in CPython
        (b"\x80\x04}" + b")" + b"\x85" * 100_000 + b"K\x01s.", "nesting deeper than"),  # hashing it would segfault
        (
            b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"
            b"N}X\x06\x00\x00\x00__eq__cbuiltins\nslice\ns\x86b.",
            "refusing to set the state of a type",  # BUILD on a class would monkeypatch it for the whole process
        ),
    ],
    ids=["memo-bomb", "deep-nesting", "build-on-a-class"],
)
def test_pickle_structures_that_attack_the_unpickler_itself_are_refused(victim, payload, words):
    (victim / "weights" / ".metadata").write_bytes(payload)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, words)
    assert MetadataIndex("a") != MetadataIndex("b")


def test_a_compressed_record_that_would_inflate_is_refused(victim):
    import zipfile

    raw = io.BytesIO()
    torch.save(torch.zeros(1 << 20)[:64], raw)  # a view of a large storage of zeros: torch.save writes it all
    source, record = zipfile.ZipFile(io.BytesIO(raw.getvalue())), io.BytesIO()
    with zipfile.ZipFile(record, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as deflated:
        for info in source.infolist():
            deflated.writestr(info.filename, source.read(info.filename))
    metadata = read_dcp_metadata(victim / "weights")
    norm = "module.decoder.final_layernorm.weight"
    for index, info in metadata.storage_data.items():
        if index.fqn == norm:
            shard = victim / "weights" / info.relative_path
            info.offset, info.length = shard.stat().st_size, len(record.getvalue())
            with open(shard, "ab") as handle:
                handle.write(record.getvalue())
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, norm, "compressed")


def test_records_sharing_bytes_are_refused(victim):
    metadata = read_dcp_metadata(victim / "weights")
    chunks = _chunks(metadata)
    first = metadata.storage_data[MetadataIndex(QKV, chunks[0].offsets)]
    metadata.storage_data[MetadataIndex(QKV, chunks[1].offsets)] = first  # two chunks read from one record
    write_metadata(victim, metadata)
    code, lines = run_cli([str(victim)])
    assert_refused(victim, code, 8, lines, "overlaps the record")


def _add_reference(victim: Path, reference: Dict, marker: str = "") -> None:
    io_json = victim / "context" / "io.json"
    data = json.loads(io_json.read_text())
    data["objects"]["zzz_1"] = {"type": reference, "items": [["Attr(name='cmd')", marker]], "metadata": None}
    io_json.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "reference, why",
    [
        ({"type": "pyref", "module": "torch", "name": "os.popen"}, "a dotted name"),
        ({"type": "not-a-pyref", "module": "this", "name": "s"}, "outside NeMo"),  # NeMo's loader locates any type
        ({"type": "pyref", "module": "torch.hub", "name": "load"}, "loads or runs code"),
        ({"type": "pyref", "module": "torch", "name": "os"}, "a module object"),
        ({"type": "pyref", "module": "builtins", "name": "getattr"}, "not a plain builtin type"),
        ({"type": "pyref", "module": "nemo.collections.llm", "name": "train"}, "defined in nemo.collections.llm.api"),
        ({"type": "pyref", "module": "nemo_patch.training.settings", "name": "warn_deprecated"}, "outside NeMo"),
    ],
    ids=["dotted", "any-type-node", "torch-hub", "module-object", "builtin-function", "re-export", "nemo-patch"],
)
def test_context_references_are_resolved_before_trust(victim, reference, why):
    from nemo_patch.export.context_trust import check_context_trusted

    _add_reference(victim, reference)
    with pytest.raises(ConsolidationError, match=why):
        check_context_trusted(victim / "context")


def _embed_call(victim: Path, function, **arguments) -> None:
    """Make the model config's ``moe_extended_tp`` a fiddle ``Config`` of ``function(**arguments)``, serialized by
    fiddle itself: building the model's config (``io.load_context(..., subpath="model")``) calls it."""
    import fiddle as fdl
    from fiddle._src.experimental import serialization

    payload = json.loads(serialization.dump_json(fdl.Config(function, **arguments)))
    stack: List = list(payload["objects"].values())
    while stack:  # rename the payload's keys, in its references too
        value = stack.pop()
        if isinstance(value, dict):
            if value.get("type") == "ref":
                value["key"] = f"payload_{value['key']}"
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    io_json = victim / "context" / "io.json"
    data = json.loads(io_json.read_text())
    for key, obj in payload["objects"].items():
        data["objects"][f"payload_{key}"] = obj
        data.setdefault("refcounts", {})[f"payload_{key}"] = 1
    config = next(obj for obj in data["objects"].values() if "<root>.model.config" in obj.get("paths", []))
    call = {"type": "ref", "key": f"payload_{payload['root']['key']}"}
    items = [item for item in config["items"] if item[0] != "Attr(name='moe_extended_tp')"]
    config["items"] = items + [["Attr(name='moe_extended_tp')", call]]
    io_json.write_text(json.dumps(data))


def test_a_trusted_package_function_that_runs_a_shell_is_refused_and_would_have_run(victim, tmp_path):
    """``torch.utils.collect_env.run`` runs its argument in a shell: a list of what may not be named missed it. The
    allowlist refuses it (a function defined outside the modules a model's context takes functions from); with
    ``--trust-context`` the same file does run it, so the payload is live."""
    from torch.utils import collect_env

    from nemo_patch.export.context_trust import check_context_trusted

    marker = tmp_path / "ran"
    _embed_call(victim, collect_env.run, command=f"touch {marker}")
    with pytest.raises(ConsolidationError, match=r"torch\.utils\.collect_env\.run \(a function defined in"):
        check_context_trusted(victim / "context")
    code, lines = run_cli([str(victim), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert code == 16 and len(lines) == 1 and "collect_env.run" in lines[0], lines
    verify = [sys.executable, "-m", "nemo_patch", str(victim), "--verify", "--workers", "1"]
    proc = subprocess.run(
        verify + ["--out", str(tmp_path / "v")], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stderr[-3000:]
    assert "collect_env.run" in proc.stderr and not marker.exists()
    trusted = subprocess.run(
        verify + ["--out", str(tmp_path / "t"), "--trust-context"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert marker.exists(), trusted.stderr[-3000:]  # the opt-in loads it: the payload was live


@pytest.mark.parametrize(
    "module, name, why",
    [
        ("torch.utils.collect_env", "run", "a function defined in torch.utils.collect_env"),
        ("torch", "from_file", "a function defined in torch"),  # creates or extends the file it is given
        ("megatron.core.datasets.utils", "compile_helpers", "a part of a trusted package"),  # runs make
        ("nemo.utils.data_utils", "ais_binary", "a function defined in nemo.utils.data_utils"),
        ("torch.utils.tensorboard.writer", "SummaryWriter", "a class defined in torch.utils.tensorboard.writer"),
        ("transformers", "Trainer", "a class defined in transformers.trainer"),
        ("transformers", "LlamaForCausalLM", "a class defined in transformers.models.llama.modeling_llama"),
        # its constructor unpickles the file it is given (a pickle in the checkpoint would run)
        ("nemo.collections.common.tokenizers.tabular_tokenizer", "TabularTokenizer", "a part of a trusted package"),
        ("megatron.core.datasets.gpt_dataset", "GPTDataset", "a part of a trusted package"),
    ],
)
def test_only_what_a_model_context_needs_is_trusted(victim, module, name, why):
    """Trusted packages hold functions that run shells or write files, and classes that write on construction:
    functions and classes are taken only from the modules NeMo's model contexts use."""
    from nemo_patch.export.context_trust import check_context_trusted

    _add_reference(victim, {"type": "pyref", "module": module, "name": name})
    with pytest.raises(ConsolidationError, match=re.escape(f"{module}.{name} ({why}")):
        check_context_trusted(victim / "context")


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.nn.functional", "silu"),
        ("torch.nn.functional", "gelu"),  # a built-in of torch._C._nn
        ("torch", "tanh"),
        ("torch", "bfloat16"),
        ("nemo.collections.llm.fn.activation", "openai_gelu"),
        ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
        ("megatron.core.transformer.enums", "AttnBackend"),
        ("nemo.collections.common.tokenizers.tokenizer_utils", "get_nmt_tokenizer"),
        ("nemo.collections.llm", "LlamaModel"),
        ("nemo.collections.llm", "Qwen2Config"),
        ("transformers", "GenerationConfig"),
        ("transformers", "LlamaConfig"),
        ("transformers", "PreTrainedTokenizerFast"),
        ("nemo.collections.common.tokenizers.huggingface.auto_tokenizer", "AutoTokenizer"),
        # a strategy given ckpt_consolidation=ConsolidationConfig(...) records it (and a user's checkpoint IO its
        # ConsolidationSettings)
        ("nemo_patch.training.config", "ConsolidationConfig"),
        ("nemo_patch.training.settings", "ConsolidationSettings"),
    ],
)
def test_what_model_contexts_name_stays_trusted(victim, module, name):
    from nemo_patch.export.context_trust import check_context_trusted

    _add_reference(victim, {"type": "pyref", "module": module, "name": name})
    check_context_trusted(victim / "context")


def test_a_context_asking_for_remote_code_is_not_trusted(victim):
    from nemo_patch.export.context_trust import check_context_trusted

    _add_reference(victim, {"type": "pyref", "module": "builtins", "name": "dict"}, "trust_remote_code")
    with pytest.raises(ConsolidationError, match="trust_remote_code"):
        check_context_trusted(victim / "context")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "a-list"])
def test_verify_of_an_existing_output_with_a_hostile_metadata_json(victim, kind):
    assert run_cli([str(victim)])[0] == 0
    side = victim / "consolidated" / "metadata.json"
    side.unlink()
    if kind == "fifo":
        os.mkfifo(side)
    elif kind == "dev-zero":
        side.symlink_to("/dev/zero")
    else:
        side.write_text("[1]")
    code, lines = run_cli([str(victim), "--verify"], timeout=60)
    # the tensors are compared with the checkpoint whatever metadata.json holds; its digests are not trusted
    assert code in (0, 9) and (code == 0 or len(lines) == 1), lines


def test_a_weights_directory_linked_out_of_the_checkpoint_is_refused(victim, tp2_checkpoint, tmp_path):
    shutil.rmtree(victim / "weights")
    (victim / "weights").symlink_to(tp2_checkpoint / "weights")  # another checkpoint's weights, read as this one's
    code, lines = run_cli([str(victim)])
    assert code == 8 and len(lines) == 1 and "outside the checkpoint" in lines[0], lines


@pytest.mark.parametrize("checked", [True, False])
def test_a_compressed_member_is_refused_even_with_no_crc_to_check(tmp_path, checked):
    import zipfile

    from nemo_patch.engine.record_checks import open_record

    record = io.BytesIO()
    with zipfile.ZipFile(record, "w", compression=zipfile.ZIP_DEFLATED) as deflated:
        deflated.writestr("archive/data/0", b"\0" * 4096)
    data = bytearray(record.getvalue())
    for signature, at in ((b"PK\x03\x04", 14), (b"PK\x01\x02", 16)):  # a CRC of 0 means "not checked"
        start = data.index(signature)
        data[start + at : start + at + 4] = b"\0\0\0\0"
    (tmp_path / "shard").write_bytes(bytes(data))
    with open(tmp_path / "shard", "rb") as handle, pytest.raises(zipfile.BadZipFile, match="is compressed"):
        open_record(handle, 0, len(data), "shard, record at byte 0", checked)
