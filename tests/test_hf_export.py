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

"""Hugging Face export: a tiny random Llama made with ``transformers``, imported into NeMo with NeMo's own importer,
fine-tuned on CPU with ``ckpt_consolidation_frequency="latest"`` and ``ConsolidationConfig(format="hf")``, loaded back
with ``AutoModelForCausalLM``; the same during training for Qwen2, Qwen3 (tied) and Mixtral, each output checked
against its checkpoint through NeMo's importer (:func:`nemo_patch.export.hf_verify.verify_hf_output`)."""

import filecmp
import json
import shutil
import stat

import pytest
import torch
from conftest import run_fit

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.export.hf import te_layer_norm_names


@pytest.mark.slow
@pytest.mark.matrix
def test_fine_tuned_llama_round_trips_through_transformers(imported_llama, tmp_path, capsys):
    report = run_fit(
        tmp_path / "ft",
        model_from=imported_llama / "nemo",
        frequency="latest",
        format="hf",
        max_steps=4,
        save_every=2,
        probe_hf=True,
    )
    # fp32 on both sides; the kernels differ (megatron-core's local attention, RoPE and RMSNorm vs transformers'), so
    # logits agree to float32 rounding (~1e-7 observed on logits of magnitude ~1), not bit for bit.
    assert report["max_abs_hf_logit_diff"] < 1e-5
    assert report["consolidations"] == 1  # latest: nothing during training, one at the end
    root = tmp_path / "ft" / "tiny_gpt" / "checkpoints"
    newest = root / report["latest"]
    hf_dir = newest / "hf"
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "metadata.json"} <= names
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    meta = json.loads((hf_dir / "metadata.json").read_text())
    assert meta["format"] == "hf" and meta["global_step"] == 4
    assert meta["exporter"] == "nemo.collections.llm.gpt.model.llama.HFLlamaExporter"
    assert not any((p / "consolidated").exists() for p in root.iterdir())

    # The same checkpoint consolidated offline by the CLI gives identical files.
    code = main([str(newest), "--format", "hf", "--trust-context", "--out", str(tmp_path / "offline"), "--verify"])
    assert code == 0, capsys.readouterr().err
    offline = tmp_path / "offline"
    assert sorted(p.name for p in offline.iterdir()) == sorted(names)
    same, different, errors = filecmp.cmpfiles(hf_dir, offline, sorted(names - {"metadata.json"}), shallow=False)
    assert different == [] and errors == []
    offline_meta = json.loads((offline / "metadata.json").read_text())
    # Offline outputs record no training run; the in-training one names the run that wrote it.
    assert "run" not in offline_meta
    assert {
        **offline_meta,
        "global_step": 4,
        "source_checkpoint": meta["source_checkpoint"],
        "run": meta["run"],
    } == meta


def test_import_then_export_gives_back_the_original_weights(imported_llama, tmp_path, capsys):
    from safetensors.torch import load_file

    assert (
        main(
            [
                str(imported_llama / "nemo"),
                "--format",
                "hf",
                "--trust-context",
                "--out",
                str(tmp_path / "hf"),
                "--quiet",
            ]
        )
        == 0
    )
    original = load_file(imported_llama / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[name], exported[name]) for name in original)
    # Every file has the mode a new file gets here (transformers wrote its safetensors file as 0o600).
    (tmp_path / "probe").touch()
    default = stat.S_IMODE((tmp_path / "probe").stat().st_mode)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "hf").iterdir()}
    assert set(modes.values()) == {default}, modes


def test_the_hf_cast_refuses_to_turn_finite_weights_into_inf():
    """The source is cast before NeMo's exporter sees it; a cast to fp16 that overflows is refused (naming the
    tensor), as for the safetensors format, while bf16 holds the same values and 1e-9 becoming 0 is precision."""
    from nemo_patch.engine.casting import DtypeOverflowError
    from nemo_patch.export.hf import cast_floating

    state = {"decoder.final_layernorm.weight": torch.tensor([1e6, -7e4, 1.0, 1e-9]), "step": torch.tensor([3])}
    with pytest.raises(DtypeOverflowError, match=r"decoder\.final_layernorm\.weight: 2 finite value"):
        cast_floating(state, torch.float16)
    cast = cast_floating(state, torch.bfloat16)
    assert torch.equal(cast["decoder.final_layernorm.weight"], state["decoder.final_layernorm.weight"].bfloat16())
    assert cast["step"] is state["step"]  # integers are never cast
    assert cast_floating({"w": torch.tensor([6e4, 1e-9])}, torch.float16)["w"].tolist() == [6e4, 0.0]


def test_a_model_class_without_exporter_exits_10_naming_it(checkpoint_copy, capsys):
    code = main([str(checkpoint_copy), "--format", "hf"])
    err = capsys.readouterr().err
    assert code == 10 and len(err.strip().splitlines()) == 1, err  # NeMo's import-time chatter held back
    assert "NeMo has no Hugging Face exporter for nemo.collections.llm.gpt.model.base.GPTModel" in err
    assert not (checkpoint_copy / "hf").exists()


def test_local_and_te_layer_norm_names_map_to_the_same_export_names():
    te = {
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(1),
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(1),
        "decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(1),
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": torch.full((1,), 2.0),
        "decoder.final_layernorm.weight": torch.full((1,), 3.0),
    }
    local = dict(te)
    local["decoder.layers.0.input_layernorm.weight"] = local.pop(
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )
    local["decoder.layers.0.pre_mlp_layernorm.weight"] = local.pop("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
    assert te_layer_norm_names(local) == te and te_layer_norm_names(te) == te
    # An MoE layer (no fused linear_fc1) keeps its pre-MLP norm, as the TE spec does.
    moe = {
        "decoder.layers.1.pre_mlp_layernorm.weight": torch.ones(1),
        "decoder.layers.1.mlp.router.weight": torch.ones(1),
    }
    assert te_layer_norm_names(moe) == moe


def test_the_state_source_and_the_written_model_read_tensors_by_dotted_names():
    """What NeMo's Llama embedding exporter reads (``source.module.embedding.word_embeddings.weight``) and what
    importers' transforms read of the written model: the state's own tensors; a missing name fails naming it."""
    from nemo_patch.export.hf import _StateSource
    from nemo_patch.export.hf_verify import _MissingTensor, _WrittenModel

    weight, bias = torch.randn(3, 2), torch.randn(3)
    state = {"embedding.word_embeddings.weight": weight, "output_layer.bias": bias}
    module = _StateSource(state, None, torch.float32).module
    assert module.embedding.word_embeddings.weight is weight and module.output_layer.bias is bias
    with pytest.raises(AttributeError, match=r"no tensor embedding\.position_embeddings or"):
        module.embedding.position_embeddings
    assert not hasattr(module, "__len__")
    written = _WrittenModel(None, {"model.embed_tokens.weight": weight})
    assert written.model.embed_tokens.weight is weight
    with pytest.raises(_MissingTensor, match=r"^model\.norm$"):
        written.model.norm.weight


def test_a_config_transformers_does_not_know_is_read_as_its_keys_and_a_fifo_is_refused(tmp_path):
    import os

    from nemo_patch.engine.verify import VerificationError
    from nemo_patch.export.hf_verify import _hf_config

    (tmp_path / "config.json").write_text('{"model_type": "no-such-model", "vocab_size": 50, "hidden_size": 8}')
    config = _hf_config(tmp_path)
    assert (config.vocab_size, config.hidden_size) == (50, 8)
    os.unlink(tmp_path / "config.json")
    os.mkfifo(tmp_path / "config.json")  # never opened for reading: it would block
    with pytest.raises(VerificationError, match="Cannot read .*config.json"):
        _hf_config(tmp_path)


@pytest.fixture(scope="module")
def tied_padded_llama(tmp_path_factory):
    """A tied-embedding tiny Llama whose tokenizer has 50 tokens and whose model has 64 vocabulary rows, as NeMo's
    ``make_vocab_size_divisible_by=64`` pads it; ``nemo/`` is its import with NeMo's importer."""
    from conftest import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("tied"), "--tie-embeddings", "--vocab-size", "50", "--padded-vocab-size", "64"
    )


@pytest.mark.slow
def test_tied_and_padded_vocabulary_exports_the_tokenizers_rows_and_loads_cleanly(tied_padded_llama, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    original = load_file(tied_padded_llama / "hf" / "model.safetensors")["model.embed_tokens.weight"]
    assert original.shape == (64, 64)
    checkpoint = str(tied_padded_llama / "nemo")
    # --verify: through NeMo's importer, the 50 rows written are the checkpoint's first 50 (its tokenizer's size);
    # no lm_head.weight is written and the tied checkpoint holds no output_layer.weight
    assert (
        main([checkpoint, "--format", "hf", "--trust-context", "--out", str(tmp_path / "hf"), "--quiet", "--verify"])
        == 0
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 50 and config["tie_word_embeddings"] is True
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(model.model.embed_tokens.weight, original[:50])  # NeMo's exporter prunes the padded rows
    reference = AutoModelForCausalLM.from_pretrained(str(tied_padded_llama / "hf")).eval()
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens).logits, reference(tokens).logits[..., :50])
    sizes = {"padded": 64, "tokenizer": 50}
    assert json.loads((tmp_path / "hf" / "metadata.json").read_text())["vocab_size"] == sizes

    # Only the padding rows may be missing: an embedding cut to 40 rows (a config saying 40) is not the checkpoint's.
    from safetensors.torch import save_file

    from nemo_patch.engine.verify import VerificationError
    from nemo_patch.export.hf_verify import verify_hf_output

    shutil.copytree(tmp_path / "hf", tmp_path / "cut")
    config["vocab_size"] = 40
    (tmp_path / "cut" / "config.json").write_text(json.dumps(config))
    cut = load_file(tmp_path / "cut" / "model.safetensors")
    cut["model.embed_tokens.weight"] = cut["model.embed_tokens.weight"][:40].clone()
    save_file(cut, tmp_path / "cut" / "model.safetensors", metadata={"format": "pt"})
    message = (
        r"^Tensor model\.embed_tokens\.weight in .*cut/model\.safetensors gives embedding\.word_embeddings\.weight "
        r"through NeMo's HFLlamaImporter with shape \(40, 64\); the checkpoint's is \(64, 64\)$"
    )
    with pytest.raises(VerificationError, match=message):
        verify_hf_output(checkpoint, tmp_path / "cut", trust_context=True)

    # The safetensors format holds the model's state_dict: the padded rows stay, and metadata.json says both sizes.
    assert main([str(tied_padded_llama / "nemo"), "--out", str(tmp_path / "st"), "--quiet"]) == 0
    consolidated = load_file(tmp_path / "st" / "model.safetensors")
    assert torch.equal(consolidated["embedding.word_embeddings.weight"], original)
    assert "output_layer.weight" not in consolidated  # tied: the model has no separate output layer weight
    assert json.loads((tmp_path / "st" / "metadata.json").read_text())["vocab_size"] == sizes


@pytest.mark.slow
def test_a_tp2_checkpoint_of_the_gqa_llama_exports_the_same_files_as_tp1(imported_llama, tmp_path, capsys):
    """A 2-process TP=2 run (gloo) of the GQA Llama (4 query heads, 2 KV groups: one per TP rank) with lr=0 saves
    the imported weights split over two ranks; during training and offline, its export is byte for byte the TP=1
    import's."""
    report = run_fit(
        tmp_path / "tp2",
        model_from=imported_llama / "nemo",
        tp=2,
        lr=0,
        max_steps=1,
        save_every=1,
        frequency="latest",
        format="hf",
    )
    assert report["consolidations"] == 1 and report["consolidation_errors"] == []
    checkpoint = tmp_path / "tp2" / "tiny_gpt" / "checkpoints" / report["latest"]
    assert {p.name for p in (checkpoint / "weights").glob("__1_*.distcp")}  # rank 1 wrote its shards
    assert (
        main(
            [
                str(imported_llama / "nemo"),
                "--format",
                "hf",
                "--trust-context",
                "--out",
                str(tmp_path / "tp1"),
                "--quiet",
            ]
        )
        == 0
    )
    assert (
        main([str(checkpoint), "--format", "hf", "--trust-context", "--out", str(tmp_path / "offline"), "--quiet"])
        == 0
    )
    for name in ("model.safetensors", "config.json"):
        reference = (tmp_path / "tp1" / name).read_bytes()
        assert (checkpoint / "hf" / name).read_bytes() == reference, name
        assert (tmp_path / "offline" / name).read_bytes() == reference, name


@pytest.mark.slow
@pytest.mark.slow
def test_a_padded_vocabulary_streams_to_the_files_of_nemos_exporter_on_the_whole_model(tied_padded_llama, tmp_path):
    """Padding pruned as NeMo's exporter prunes it, streamed: one file, byte-identical to the whole-model export.
    Sharded, the shards are byte-identical too; only the index's metadata differs, where the whole-model save counts
    the pruned embedding's whole padded storage (``total_size``) and the untied ``lm_head`` it never re-tied
    (``total_parameters``); the streamed index counts what the files hold."""
    from safetensors import safe_open

    from nemo_patch.export.hf import export_hf_checkpoint

    checkpoint = tied_padded_llama / "nemo"
    for shard in (5 << 30, 20_000):
        streamed, whole = tmp_path / f"streamed-{shard}", tmp_path / f"whole-{shard}"
        export_hf_checkpoint(checkpoint, streamed, max_shard_size=shard)
        export_hf_checkpoint(checkpoint, whole, max_shard_size=shard, stream=False)
        names = sorted(path.name for path in whole.iterdir())
        assert sorted(path.name for path in streamed.iterdir()) == names
        for name in names:
            if name != "model.safetensors.index.json":
                assert (streamed / name).read_bytes() == (whole / name).read_bytes(), name
    index = json.loads((tmp_path / "streamed-20000" / "model.safetensors.index.json").read_text())
    other = json.loads((tmp_path / "whole-20000" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == other["weight_map"] and "lm_head.weight" not in index["weight_map"]
    sizes = {}
    for file in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "streamed-20000" / file), "pt") as handle:
            sizes.update({name: handle.get_tensor(name).numel() for name in handle.keys()})
    assert sizes["model.embed_tokens.weight"] == 50 * 64
    assert index["metadata"] == {"total_parameters": sum(sizes.values()), "total_size": 4 * sum(sizes.values())}


def test_fine_tuned_mixtral_round_trips_through_transformers(tmp_path_factory, tmp_path):
    """The MoE family: a tiny random Mixtral (4 experts, top-2, GQA) made with ``transformers``, imported with NeMo's
    ``HFMixtralImporter``, fine-tuned on the CPU with ``"hf"`` consolidation (NeMo's ``HFMixtralExporter``), loaded
    with ``AutoModelForCausalLM``: same logits as the trained NeMo model within float32 rounding."""
    from conftest import make_tiny_llama

    mixtral = make_tiny_llama(tmp_path_factory.mktemp("mixtral"), "--family", "mixtral")
    report = run_fit(
        tmp_path / "ft",
        model_from=mixtral / "nemo",
        frequency="latest",
        format="hf",
        max_steps=2,
        save_every=2,
        probe_hf=True,
    )
    assert report["consolidations"] == 1 and report["consolidation_errors"] == []
    assert report["max_abs_hf_logit_diff"] < 1e-5  # ~2e-7 observed: routing and every expert agree
    hf_dir = tmp_path / "ft" / "tiny_gpt" / "checkpoints" / report["latest"] / "hf"
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    meta = json.loads((hf_dir / "metadata.json").read_text())
    assert meta["exporter"] == "nemo.collections.llm.gpt.model.mixtral.HFMixtralExporter"
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert {f"model.layers.{layer}.block_sparse_moe.experts.{e}.w{w}.weight" for layer in (0, 1) for e in range(4)
            for w in (1, 2, 3)} <= names  # fmt: skip
    # NeMo's Mixtral importer fills the embedding and output layer in place: every tensor is the checkpoint's still.
    from nemo_patch.export.hf_verify import verify_hf_output

    assert verify_hf_output(hf_dir.parent, hf_dir, trust_context=True) == len(names)


@pytest.fixture(scope="module")
def trained_families(tmp_path_factory):
    """``<name>/hf`` and ``<name>/nemo`` (perturbed norms and biases) for the families fine-tuned below, imported in
    one process."""
    from conftest import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("trained"), "--families", "qwen2,qwen3-tied", "--perturb")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, architecture, exporter",
    [
        ("qwen2", "Qwen2ForCausalLM", "nemo.collections.llm.gpt.model.qwen2.HFQwen2Exporter"),
        ("qwen3-tied", "Qwen3ForCausalLM", "nemo.collections.llm.gpt.model.qwen3.HFQwen3Exporter"),
    ],
)
def test_a_family_fine_tuned_with_hf_consolidation_gives_the_trained_model(
    trained_families, tmp_path, name, architecture, exporter
):
    """Training-time ``"hf"`` consolidation of a model imported with NeMo's importer (Qwen2: QKV biases; Qwen3 with
    tied embeddings: QK norms, no ``lm_head.weight``): the Hugging Face model gives the trained NeMo model's logits,
    and every written tensor is the trained checkpoint's (through NeMo's importer)."""
    from safetensors import safe_open

    from nemo_patch.export.hf_verify import verify_hf_output

    report = run_fit(
        tmp_path / "ft",
        model_from=trained_families / name / "nemo",
        frequency="latest",
        format="hf",
        max_steps=2,
        save_every=2,
        probe_hf=True,
    )
    assert report["consolidations"] == 1 and report["consolidation_errors"] == []
    assert report["max_abs_hf_logit_diff"] < 1e-5
    checkpoint = tmp_path / "ft" / "tiny_gpt" / "checkpoints" / report["latest"]
    hf_dir = checkpoint / "hf"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["tie_word_embeddings"] is name.endswith("-tied")
    assert json.loads((hf_dir / "metadata.json").read_text())["exporter"] == exporter
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert ("lm_head.weight" in names) is not name.endswith("-tied")
    assert verify_hf_output(checkpoint, hf_dir, trust_context=True) == len(names)
    # The weights were trained (not the imported ones): the HF tensors differ from the imported model's.
    with (
        safe_open(str(hf_dir / "model.safetensors"), "pt") as trained,
        safe_open(str(trained_families / name / "hf" / "model.safetensors"), "pt") as imported,
    ):
        assert not torch.equal(trained.get_tensor("model.layers.0.mlp.down_proj.weight"),
                               imported.get_tensor("model.layers.0.mlp.down_proj.weight"))  # fmt: skip


def test_an_export_whose_checkpoint_is_saved_again_while_it_is_read_publishes_nothing(
    imported_llama, tmp_path, monkeypatch
):
    """The streamed export reads the first tensor while the checkpoint is being saved again (forced: the old save's
    ``weights/`` removed, the read made, the new save's files written). The landed export raised "Cannot read the
    weights of ...", a failure a sidecar never retries; it now says the save changed, and publishes nothing."""
    import nemo_patch.export.hf as hf
    from nemo_patch.engine.errors import CorruptShardError
    from nemo_patch.engine.save_identity import is_save_changed

    checkpoint, output = tmp_path / "nemo", tmp_path / "hf"
    shutil.copytree(imported_llama / "nemo", checkpoint)
    open_sources, reads = hf.open_sources, []

    def open_during_a_new_save(*args, **kwargs):
        sources = open_sources(*args, **kwargs)
        producer = sources.producer

        def producer_during_a_new_save(*p_args, **p_kwargs):
            produce = producer(*p_args, **p_kwargs)

            def produce_one(spec):
                if not reads:  # the first tensor: the checkpoint is saved again under its name (new files)
                    reads.append(spec)
                    saved = tmp_path / "new-save"
                    shutil.move(checkpoint / "weights", saved)
                    try:
                        return produce(spec)
                    finally:
                        shutil.copytree(saved, checkpoint / "weights")
                return produce(spec)

            return produce_one

        sources.producer = producer_during_a_new_save
        return sources

    monkeypatch.setattr(hf, "open_sources", open_during_a_new_save)
    with pytest.raises(CorruptShardError, match="saved again while it was read") as info:
        hf.export_hf_checkpoint(checkpoint, output, trust_context=True)
    assert reads and is_save_changed(info.value)
    assert not output.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
