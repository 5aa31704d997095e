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

"""Hugging Face export of several model families through NeMo's own exporters (``HFQwen2Exporter``,
``HFQwen3Exporter``, ``HFLlamaExporter``, ``HFMistralExporter``, ``HFPhi3Exporter``), driven by their own ``apply``,
and its ``verify``: the written files checked against the checkpoint through NeMo's importer
(:mod:`nemo_patch.export.hf_verify`).

Each family is a tiny random ``transformers`` model whose norms and biases are perturbed (not ones and zeros, so a
tensor dropped or misplaced anywhere in the round trip shows), imported with NeMo's importer on the CPU (all six in
one process, once per module), consolidated offline with ``export_hf_checkpoint`` and loaded with ``transformers``:
every tensor equals the original model's, and so do the logits."""

import json
import logging
import shutil

import pytest
import torch
from conftest import make_tiny_llama

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.verify import VerificationError
from nemo_patch.export import hf_verify
from nemo_patch.export.errors import ExportError
from nemo_patch.export.hf import export_hf_checkpoint
from nemo_patch.export.hf_verify import verify_hf_output

# Every test here starts from Hugging Face models imported with NeMo in a subprocess (about a minute).
pytestmark = pytest.mark.slow

FAMILIES = {  # name -> (architecture, NeMo exporter)
    "qwen2": ("Qwen2ForCausalLM", "nemo.collections.llm.gpt.model.qwen2.HFQwen2Exporter"),
    "qwen3": ("Qwen3ForCausalLM", "nemo.collections.llm.gpt.model.qwen3.HFQwen3Exporter"),
    "qwen3-tied": ("Qwen3ForCausalLM", "nemo.collections.llm.gpt.model.qwen3.HFQwen3Exporter"),
    "llama": ("LlamaForCausalLM", "nemo.collections.llm.gpt.model.llama.HFLlamaExporter"),
    "mistral": ("MistralForCausalLM", "nemo.collections.llm.gpt.model.mistral.HFMistralExporter"),  # no sliding window
    "phi3": ("Phi3ForCausalLM", "nemo.collections.llm.gpt.model.phi3mini.HFPhi3Exporter"),  # fused qkv_proj, gate_up
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """``<root>/<name>/hf`` (the perturbed ``transformers`` model) and ``<root>/<name>/nemo`` (its NeMo import) for
    every name in :data:`FAMILIES`."""
    root = tmp_path_factory.mktemp("families")
    return make_tiny_llama(root, "--families", ",".join([*FAMILIES, "mixtral"]), "--perturb")


def _tokens():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _qkv(q, k, v, groups):
    """NeMo's fused QKV layout (per query group: its query heads, then its key and value head) of ``q``, ``k``,
    ``v`` (first dimension: heads x head size)."""
    q, k, v = (t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_exports_its_source_tensors_and_logits(families, tmp_path, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = families / name
    result = export_hf_checkpoint(source / "nemo", tmp_path / "hf", verify=True)
    original = load_file(source / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(original)  # tied: no lm_head.weight, as transformers saved the original
    different = [key for key in original if not torch.equal(original[key], exported[key])]
    assert different == []
    assert result.tensor_count == len(exported)

    # The norms and biases are perturbed in the source and survived the import (so the equality above is not one of
    # untouched initial values): the NeMo checkpoint holds them, under the TE spec's names.
    norms = [key for key in original if key.endswith("norm.weight")]
    assert len(norms) >= 5 and all(not torch.equal(original[key], torch.ones_like(original[key])) for key in norms)
    consolidate_checkpoint(source / "nemo", tmp_path / "st")
    nemo = load_file(tmp_path / "st" / "model.safetensors")
    assert torch.equal(nemo["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"],
                       original["model.layers.1.input_layernorm.weight"])  # fmt: skip
    assert torch.equal(nemo["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                       original["model.layers.1.post_attention_layernorm.weight"])  # fmt: skip
    assert torch.equal(nemo["decoder.final_layernorm.weight"], original["model.norm.weight"])
    if name.startswith("qwen3"):
        assert torch.equal(nemo["decoder.layers.0.self_attention.q_layernorm.weight"],
                           original["model.layers.0.self_attn.q_norm.weight"])  # fmt: skip
    if name == "qwen2":
        biases = [original[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"]
        assert all(bias.abs().min() > 0 for bias in biases)
        assert torch.equal(nemo["decoder.layers.0.self_attention.linear_qkv.bias"], _qkv(*biases, groups=2))

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    architecture, exporter = FAMILIES[name]
    assert config["architectures"] == [architecture]
    assert config["tie_word_embeddings"] is name.endswith("-tied")
    assert json.loads((tmp_path / "hf" / "metadata.json").read_text())["exporter"] == exporter
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    reference = AutoModelForCausalLM.from_pretrained(str(source / "hf"))
    with torch.no_grad():
        logits, expected = model.eval()(_tokens()).logits, reference.eval()(_tokens()).logits
    assert logits.shape == expected.shape and (logits - expected).abs().max() < 1e-5


@pytest.mark.parametrize("max_shard_size", [5 << 30, 40_000])
@pytest.mark.parametrize("name", [*FAMILIES, "mixtral"])
def test_the_streamed_export_writes_the_files_of_nemos_exporter_on_the_whole_model(
    families, tmp_path, monkeypatch, name, max_shard_size
):
    """Every family (Mixtral: one layer's experts per group; tied and untied embeddings), in one file and sharded:
    the streamed export (the default) writes the same files, byte for byte, as NeMo's exporter converting the whole
    model in memory (``stream=False``); and it never runs NeMo's ``apply_transforms`` on the whole model."""
    from nemo.lightning import io

    calls = []
    nemo_apply = io.apply_transforms

    def counted(*args, **kwargs):
        calls.append(1)
        return nemo_apply(*args, **kwargs)

    monkeypatch.setattr(io, "apply_transforms", counted)
    export_hf_checkpoint(families / name / "nemo", tmp_path / "streamed", max_shard_size=max_shard_size)
    assert calls == []
    export_hf_checkpoint(families / name / "nemo", tmp_path / "whole", max_shard_size=max_shard_size, stream=False)
    assert calls == [1]
    names = sorted(path.name for path in (tmp_path / "whole").iterdir())
    assert sorted(path.name for path in (tmp_path / "streamed").iterdir()) == names
    assert ("model.safetensors.index.json" in names) is (max_shard_size == 40_000)
    for file in names:
        assert (tmp_path / "streamed" / file).read_bytes() == (tmp_path / "whole" / file).read_bytes(), file


@pytest.mark.parametrize("name", ["qwen3-tied", "qwen2"])
def test_two_exports_of_a_checkpoint_are_byte_identical(families, tmp_path, name):
    for out in ("a", "b"):
        export_hf_checkpoint(families / name / "nemo", tmp_path / out)
    for file in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def test_a_bfloat16_export_holds_the_source_tensors_in_bfloat16(families, tmp_path):
    from safetensors.torch import load_file

    export_hf_checkpoint(families / "qwen2" / "nemo", tmp_path / "hf", dtype=torch.bfloat16, verify=True)
    original = load_file(families / "qwen2" / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(exported[key], original[key].to(torch.bfloat16)) for key in original)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-memory"])
def test_a_tensor_the_exporter_leaves_unassigned_fails_the_export_naming_it(families, tmp_path, monkeypatch, stream):
    """The final norm dropped from ``HFQwen2Exporter``'s mapping, in whichever ``io.apply_transforms`` its
    ``convert_state`` calls (the streamed conversion's, or NeMo's on the whole model): the export fails naming it."""
    from nemo.collections.llm.gpt.model.qwen2 import HFQwen2Exporter
    from nemo.lightning import io

    convert_state = HFQwen2Exporter.convert_state

    def without_final_norm(self, *args, **kwargs):
        apply_transforms = io.apply_transforms  # looked up as convert_state looks it up

        def dropping(source, target, mapping, *rest, **options):
            mapping = {key: value for key, value in mapping.items() if value != "model.norm.weight"}
            return apply_transforms(source, target, mapping, *rest, **options)

        io.apply_transforms = dropping
        try:
            return convert_state(self, *args, **kwargs)
        finally:
            io.apply_transforms = apply_transforms

    monkeypatch.setattr(HFQwen2Exporter, "convert_state", without_final_norm)
    with pytest.raises(
        ExportError, match=r"HFQwen2Exporter left 1 tensor\(s\) .* unassigned .*: model\.norm\.weight$"
    ):
        export_hf_checkpoint(families / "qwen2" / "nemo", tmp_path / "hf", stream=stream)
    assert not (tmp_path / "hf").exists()
    assert [path.name for path in tmp_path.iterdir()] == []  # no staging directory left either


def test_an_exporter_that_fails_raises_export_error_with_its_message(families, tmp_path, monkeypatch):
    from nemo.collections.llm.gpt.model.qwen3 import HFQwen3Exporter

    def convert_state(self, source, target):
        raise ValueError("no mapping for this layout")

    monkeypatch.setattr(HFQwen3Exporter, "convert_state", convert_state)
    with pytest.raises(ExportError) as raised:
        export_hf_checkpoint(families / "qwen3" / "nemo", tmp_path / "hf")
    assert str(raised.value) == "NeMo's HFQwen3Exporter failed: ValueError: no mapping for this layout"
    assert raised.value.exit_code == 10
    assert not (tmp_path / "hf").exists()


# --- verify: the written files against the checkpoint, through NeMo's importer ---


def test_verify_catches_an_exporter_that_misplaces_a_tensor_naming_it_and_its_file(
    families, tmp_path, monkeypatch, capsys
):
    """An exporter bug (gate and up projections swapped) writes files that equal the exporter's own model, so only a
    check against the checkpoint finds it: ``--verify`` exits 9 naming the written tensor, its file and the element."""
    from nemo.lightning.io.state import TransformFns

    split_fc1 = TransformFns.split_fc1
    monkeypatch.setattr(TransformFns, "split_fc1", staticmethod(lambda fc1: split_fc1(fc1)[::-1]))
    checkpoint = str(families / "qwen2" / "nemo")
    assert main([checkpoint, "--format", "hf", "--trust-context", "--out", str(tmp_path / "plain"), "--quiet"]) == 0
    out = tmp_path / "verified"
    code = main([checkpoint, "--format", "hf", "--trust-context", "--out", str(out), "--quiet", "--verify"])
    err = capsys.readouterr().err
    assert code == 9, err
    assert (
        f"error: Tensor model.layers.0.mlp.gate_proj.weight in {out / 'model.safetensors'} differs from the "
        "checkpoint at [0, 0]: NeMo's HFQwen2Importer puts that element in decoder.layers.0.mlp.linear_fc1.weight at "
        "[0, 0]"
    ) in err
    assert not out.exists()
    with pytest.raises(VerificationError, match=r"gate_proj\.weight in .*plain/model\.safetensors differs"):
        verify_hf_output(checkpoint, tmp_path / "plain", trust_context=True)


@pytest.fixture(scope="module")
def sharded_qwen2(families, tmp_path_factory):
    """A verified export of the Qwen2 family (QKV biases, GQA) in shards of at most 40 kB with their index."""
    out = tmp_path_factory.mktemp("sharded") / "hf"
    export_hf_checkpoint(families / "qwen2" / "nemo", out, max_shard_size=40_000, verify=True)
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == 27
    assert len(list(out.glob("model-*.safetensors"))) > 2
    return out


def _tampered(sharded, tmp_path, change):
    """A copy of ``sharded`` whose shards and index ``change(tensors by file, weight map)`` edited."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "hf"
    shutil.copytree(sharded, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    files = {name: load_file(copy / name) for name in sorted(set(index["weight_map"].values()))}
    change(files, index["weight_map"])
    for name, tensors in files.items():
        save_file(tensors, copy / name, metadata={"format": "pt"})
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    return copy, index["weight_map"]


def _bias_element(files, weight_map):
    files[weight_map["model.layers.1.self_attn.k_proj.bias"]]["model.layers.1.self_attn.k_proj.bias"][5] += 1e-3


def _layers_swapped(files, weight_map):
    a, b = "model.layers.0.post_attention_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"
    files[weight_map[a]][a], files[weight_map[b]][b] = files[weight_map[b]][b], files[weight_map[a]][a]


def _extra_tensor(files, weight_map):
    file = weight_map["model.norm.weight"]
    files[file]["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    weight_map["model.layers.0.self_attn.rotary_emb.inv_freq"] = file


def _missing_tensor(files, weight_map):
    del files[weight_map["model.norm.weight"]]["model.norm.weight"], weight_map["model.norm.weight"]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            _bias_element,
            r"^Tensor model\.layers\.1\.self_attn\.k_proj\.bias in {k_proj} differs from the checkpoint "
            r"at \[5\]: NeMo's HFQwen2Importer puts that element in decoder\.layers\.1\.self_attention"
            r"\.linear_qkv\.bias at \[37\], where the checkpoint holds ",
        ),
        (
            _layers_swapped,
            r"^Tensor model\.layers\.0\.post_attention_layernorm\.weight in {norm0} differs from the "
            r"checkpoint at \[0\]: .* in decoder\.layers\.0\.mlp\.linear_fc1\.layer_norm_weight at \[0\]",
        ),
        (
            _extra_tensor,
            r"^Tensor model\.layers\.0\.self_attn\.rotary_emb\.inv_freq in {norm} comes from no tensor of "
            r"the checkpoint: NeMo's HFQwen2Importer maps it to none$",
        ),
        (
            _missing_tensor,
            r"^NeMo's HFQwen2Importer cannot map .* back to the checkpoint's names \(its transform "
            r"model\.norm\.weight -> decoder\.final_layernorm\.weight\): ValueError: No matches found "
            r"for source key: model\.norm\.weight",
        ),
    ],
    ids=["element", "layers-swapped", "extra-tensor", "missing-tensor"],
)
def test_verify_names_the_written_tensor_and_its_shard_of_a_mismatch(families, sharded_qwen2, tmp_path, change,
                                                                     message):  # fmt: skip
    import re

    copy, weight_map = _tampered(sharded_qwen2, tmp_path, change)
    files = {
        "k_proj": copy / weight_map["model.layers.1.self_attn.k_proj.bias"],
        "norm0": copy / weight_map["model.layers.0.post_attention_layernorm.weight"],
        "norm": copy / weight_map.get("model.norm.weight", "-"),
    }
    pattern = message.format(**{key: re.escape(str(path)) for key, path in files.items()})
    with pytest.raises(VerificationError, match=pattern) as raised:
        verify_hf_output(families / "qwen2" / "nemo", copy, trust_context=True)
    assert raised.value.exit_code == 9
    assert (
        verify_hf_output(families / "qwen2" / "nemo", sharded_qwen2, trust_context=True) == 27
    )  # the original passes


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-memory"])
def test_verify_without_an_importer_compares_with_the_exporters_model_and_says_so(
    families, tmp_path, monkeypatch, caplog, stream
):
    monkeypatch.setattr(hf_verify, "importer_class", lambda model_class: None)
    with caplog.at_level(logging.WARNING, logger="nemo_patch.export.hf"):
        export_hf_checkpoint(families / "llama" / "nemo", tmp_path / "hf", verify=True, stream=stream)
    assert "against NeMo's exporter's converted model only (not the checkpoint): NeMo has no Hugging Face importer " \
           "for nemo.collections.llm.gpt.model.llama.LlamaModel" in caplog.text  # fmt: skip


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-memory"])
def test_verify_without_an_importer_catches_a_written_tensor_that_differs_from_the_exporters(
    families, tmp_path, monkeypatch, stream
):
    """The written files changed after the export (one element of one tensor): ``verify`` without an importer
    compares every tensor's bytes with the exporter's conversion (the streamed export converts again, one layer at a
    time), so it fails naming the tensor and its file, and publishes nothing."""
    from nemo_patch.export import hf

    monkeypatch.setattr(hf_verify, "importer_class", lambda model_class: None)
    verify = hf._verify_against_checkpoint
    name = "model.layers.1.mlp.up_proj.weight"

    def tampering_first(location, output_dir, *args, **kwargs):
        path = output_dir / "model.safetensors"
        header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        offset = header + json.loads(path.read_bytes()[8:header])[name]["data_offsets"][0]
        with open(path, "r+b") as handle:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0x40]))
        return verify(location, output_dir, *args, **kwargs)

    monkeypatch.setattr(hf, "_verify_against_checkpoint", tampering_first)
    with pytest.raises(VerificationError, match=rf"Tensor {name} in .*/hf/model\.safetensors differs") as raised:
        export_hf_checkpoint(families / "llama" / "nemo", tmp_path / "hf", verify=True, stream=stream)
    assert raised.value.exit_code == 9
    assert not (tmp_path / "hf").exists()
