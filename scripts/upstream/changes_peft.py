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

"""What the earlier stages hold back until the ``peft`` stage lands (see :mod:`upstream.changes`).

The PEFT stage adds: PEFT (LoRA) adapter checkpoints consolidated as their adapters (``adapter_model.safetensors``,
``metadata.json``'s ``"kind": "adapter"`` with the PEFT settings, ``engine/adapter_settings.py``) or as a Hugging Face
PEFT directory (NeMo's ``"hf-peft"`` exporter), the adapters merged into their base model (``merge_adapters``,
``engine/adapter_merge.py``), ``ckpt_consolidation_merge_adapters``, and NeMo's PEFT callback keeping the
consolidation settings when it rebuilds the checkpoint IO. Before it, the engine refuses an adapter checkpoint
(:class:`AdapterCheckpointError`, exit code 12) rather than writing its adapters as a model.
"""

from upstream.transforms import Drop, DropArgument, Edit, Replace

UNTIL = "peft"

ADAPTER_REFUSED_DOC = '''\
class AdapterCheckpointError(ConsolidationError):
    """A PEFT (e.g. LoRA) adapter checkpoint (NeMo's ``weights/adapter_metadata.json``: adapter weights only, not a
    model): it is refused, never written as a model."""'''

ENGINE = [
    # checkpoint_layout.py: an adapter checkpoint is recognised and refused
    Drop(
        "engine/checkpoint_layout.py", ("CheckpointLocation.adapter", "CheckpointLocation.adapter_base"), until=UNTIL
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "        adapter: whether it is a PEFT adapter checkpoint (NeMo's ``weights/adapter_metadata.json``): adapter "
        "weights\n            only, for the base model NeMo recorded.\n"
        "        adapter_base: the base model's checkpoint path NeMo recorded (``model_ckpt_path``), ``None`` if "
        "unreadable.\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "    A PEFT adapter checkpoint (NeMo's ``weights/adapter_metadata.json``) is returned with ``adapter=True``: "
        "its\n    consolidation writes adapters, never a model.\n",
        "    A PEFT adapter checkpoint (NeMo's ``weights/adapter_metadata.json``: adapter weights only) is refused "
        "with\n    :class:`AdapterCheckpointError`: its adapters are never written as a model.\n",
        until=UNTIL,
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "    adapter, base = (weights_dir / ADAPTER_METADATA).is_file(), None\n"
        "    if adapter:\n"
        "        try:\n"
        '            base = read_json_file(weights_dir / ADAPTER_METADATA).get("model_ckpt_path")\n'
        "        except (OSError, ValueError, AttributeError):\n"
        "            base = None\n",
        "    if (weights_dir / ADAPTER_METADATA).is_file():\n"
        "        raise AdapterCheckpointError(\n"
        '            f"{checkpoint_dir} is a PEFT adapter checkpoint (weights/{ADAPTER_METADATA}): it holds the '
        'adapters "\n            "only, not a model, and is not consolidated"\n'
        "        )\n",
        until=UNTIL,
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "    return CheckpointLocation(checkpoint_dir, weights_dir, finished, backend, adapter, base)\n",
        "    return CheckpointLocation(checkpoint_dir, weights_dir, finished, backend)\n",
        until=UNTIL,
    ),
    Edit(
        "engine/checkpoint_layout.py",
        "from nemo_patch.engine.errors import (\n",
        "from nemo_patch.engine.errors import (\n    AdapterCheckpointError,\n",
        until=UNTIL,
    ),
    # errors.py
    Replace(
        "engine/errors.py",
        "AdapterCheckpointError",
        ADAPTER_REFUSED_DOC
        + '\n\n    exit_code = 12\n    summary = "a PEFT adapter checkpoint (its adapters are not consolidated)"',
        until=UNTIL,
    ),
    Drop("engine/errors.py", ("AdapterMergeError",), until=UNTIL),
    # output_layout.py, output_files.py, safetensors_writer.py, digests.py, verify.py: the model stem only
    Drop("engine/output_layout.py", ("ADAPTER_STEM",), until=UNTIL),
    Edit(
        "engine/output_layout.py",
        '    """``model-00001-of-00003.safetensors`` for ``index=0, count=3`` (Hugging Face\'s naming); ``stem`` is\n'
        '    :data:`MODEL_STEM` or :data:`ADAPTER_STEM`."""',
        '    """``model-00001-of-00003.safetensors`` for ``index=0, count=3`` (Hugging Face\'s naming; ``stem``:\n'
        '    :data:`MODEL_STEM`)."""',
        until=UNTIL,
    ),
    Edit(
        "engine/output_layout.py",
        "``model.safetensors`` (or ``adapter_model.safetensors``): the weights",
        "``model.safetensors``: the weights",
        until=UNTIL,
    ),
    Edit(
        "engine/output_layout.py",
        "``model.safetensors.index.json`` (or ``adapter_model.safetensors.index.json``) when",
        "``model.safetensors.index.json`` when",
        until=UNTIL,
    ),
    Edit(
        "engine/output_files.py",
        "a ``model.safetensors.index.json`` (or ``adapter_model.safetensors.index.json``) file.",
        "a ``model.safetensors.index.json`` file.",
        until=UNTIL,
    ),
    Edit(
        "engine/output_files.py",
        '    For each stem in turn (``"model"``, ``"adapter_model"``; '
        ':data:`~nemo_patch.engine.output_layout.MODEL_STEM`,\n'
        "    :data:`~nemo_patch.engine.output_layout.ADAPTER_STEM`), the output's weights",
        "    For each stem in turn (``\"model\"``: :data:`~nemo_patch.engine.output_layout.MODEL_STEM`), the output's "
        "weights",
        until=UNTIL,
    ),
    Edit(
        "engine/safetensors_writer.py",
        "        stem: :data:`~nemo_patch.engine.output_layout.MODEL_STEM` or ``ADAPTER_STEM``.\n",
        "        stem: :data:`~nemo_patch.engine.output_layout.MODEL_STEM`.\n",
        until=UNTIL,
    ),
    Edit("engine/digests.py", "    stems = (MODEL_STEM, ADAPTER_STEM)\n", "    stems = (MODEL_STEM,)\n", until=UNTIL),
    Edit(
        "engine/verify.py",
        '    """Tensor name -> file of a model or adapter output (its index,',
        '    """Tensor name -> file of a model output (its index,',
        until=UNTIL,
    ),
    Edit(
        "engine/verify.py",
        "    return output_weight_map(output_dir, stems=(MODEL_STEM, ADAPTER_STEM))\n",
        "    return output_weight_map(output_dir, stems=(MODEL_STEM,))\n",
        until=UNTIL,
    ),
    Edit(
        "engine/safe_files.py",
        "(``metadata.json``, ``.zarray``, ``adapter_metadata.json``, ...)",
        "(``metadata.json``, ``.zarray``, ...)",
        until=UNTIL,
    ),
    # tensor_sources.py: no merge
    Edit(
        "engine/tensor_sources.py",
        "(and the consolidation's options: a dtype cast, merging LoRA adapters)",
        "(and the consolidation's dtype cast)",
        until=UNTIL,
    ),
    Drop("engine/tensor_sources.py", ("merged_reader", "Sources.merge"), until=UNTIL),
    Edit(
        "engine/tensor_sources.py",
        "        merge: the base model and adapter pairs when LoRA adapters are merged, else ``None``.\n",
        "",
        until=UNTIL,
    ),
    Replace(
        "engine/tensor_sources.py",
        "Sources.model_metadata",
        '@property\ndef model_metadata(self) -> Metadata:\n    """The metadata of the checkpoint the model tensors '
        'come from."""\n    return self.metadata',
        until=UNTIL,
    ),
    Edit(
        "engine/tensor_sources.py",
        "        if self.merge is not None:\n            return merged_reader(self.merge, self.planned, "
        "self.reader)\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "engine/tensor_sources.py",
        "(:func:`tensor_producer`, :func:`merged_reader`)",
        "(:func:`tensor_producer`)",
        until=UNTIL,
    ),
    DropArgument("engine/tensor_sources.py", "open_sources", "merge_adapters", until=UNTIL),
    DropArgument("engine/tensor_sources.py", "open_sources", "base_checkpoint", until=UNTIL),
    Edit(
        "engine/tensor_sources.py",
        "            plan does not understand (naming the key), a missing base checkpoint.\n",
        "            plan does not understand (naming the key).\n",
        until=UNTIL,
    ),
    Edit(
        "engine/tensor_sources.py",
        "    merge = open_lora_merge(location, metadata, base_checkpoint) if merge_adapters and location.adapter else "
        "None\n    planned = merge.base_outputs if merge is not None else plan_outputs(metadata)\n"
        "    return Sources(metadata, reader, merge, planned, cast_outputs(planned, dtype))\n",
        "    planned = plan_outputs(metadata)\n"
        "    return Sources(metadata, reader, planned, cast_outputs(planned, dtype))\n",
        until=UNTIL,
    ),
    # parts.py: a part job reads the checkpoint's own tensors
    Edit("engine/parts.py", "options that change what is read (dtype, merged adapters)", "the dtype", until=UNTIL),
    Drop("engine/parts.py", ("PartJob.merge_adapters", "PartJob.base_checkpoint"), until=UNTIL),
    Edit(
        "engine/parts.py",
        "        merge_adapters: merge a LoRA adapter checkpoint's adapters into its base model.\n"
        "        base_checkpoint: with ``merge_adapters``, the base model's checkpoint if not where NeMo recorded "
        "it.\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "engine/parts.py",
        "    return open_sources(location, dtype, job.merge_adapters, job.base_checkpoint)\n",
        "    return open_sources(location, dtype)\n",
        until=UNTIL,
    ),
    # consolidate.py: model checkpoints only
    Edit(
        "engine/consolidate.py",
        "A PEFT adapter checkpoint (NeMo's ``weights/adapter_metadata.json``; LoRA fine-tuning saves only the "
        "adapters) gives\n``adapter_model.safetensors`` instead (the adapter tensors, TP shards reassembled, layer "
        "stacks split, names as for a\nmodel), never ``model.safetensors``, and ``metadata.json`` says ``\"kind\": "
        "\"adapter\"`` with the ``base_checkpoint``\nNeMo recorded and the PEFT method and settings from the context "
        "(:mod:`nemo_patch.engine.adapter_settings`).\n\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "engine/consolidate.py",
        '        kind: ``"model"``, or ``"adapter"`` for a PEFT adapter checkpoint\'s adapters.\n',
        '        kind: ``"model"`` (a model\'s weights).\n',
        until=UNTIL,
    ),
    Drop("engine/consolidate.py", ("_verify_merged",), until=UNTIL),
    DropArgument("engine/consolidate.py", "read_state_dict", "merge_adapters", until=UNTIL),
    DropArgument("engine/consolidate.py", "read_state_dict", "base_checkpoint", until=UNTIL),
    Edit(
        "engine/consolidate.py",
        "    sources = open_sources(location, None, merge_adapters, base_checkpoint)\n",
        "    sources = open_sources(location, None)\n",
        until=UNTIL,
    ),
    Edit(
        "engine/consolidate.py",
        "        ``(name -> tensor in its stored dtype, the metadata of the checkpoint the model tensors come "
        "from)``.\n",
        "        ``(name -> tensor in its stored dtype, the checkpoint's metadata)``.\n",
        until=UNTIL,
    ),
    DropArgument("engine/consolidate.py", "consolidate_checkpoint", "merge_adapters", until=UNTIL),
    DropArgument("engine/consolidate.py", "consolidate_checkpoint", "base_checkpoint", until=UNTIL),
    Edit(
        "engine/consolidate.py",
        "        sources = open_sources(location, dtype, merge_adapters, base_checkpoint)\n",
        "        sources = open_sources(location, dtype)\n",
        until=UNTIL,
    ),
    Edit(
        "engine/consolidate.py",
        '    kind = "adapter" if location.adapter and sources.merge is None else "model"\n'
        '    stem = ADAPTER_STEM if kind == "adapter" else MODEL_STEM\n',
        '    kind, stem = "model", MODEL_STEM\n',
        until=UNTIL,
    ),
    Edit(
        "engine/consolidate.py",
        "                merge_adapters and sources.merge is not None,\n"
        "                None if base_checkpoint is None else str(base_checkpoint),\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "engine/consolidate.py",
        "        if location.adapter:\n"
        "            manifest.update(base_checkpoint=location.adapter_base, peft=peft_settings(ckpt_dir))\n"
        "        if sources.merge is not None:\n"
        "            manifest.update(merged_adapters=sources.merge.settings)\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "engine/consolidate.py",
        "        if verify and sources.merge is not None:\n"
        "            _verify_merged(tmp_dir, outputs, merged_reader(sources.merge, sources.planned, sources.reader))\n"
        "        elif verify:\n",
        "        if verify:\n",
        until=UNTIL,
    ),
]

# --- export/hf.py and hf_verify.py: model checkpoints only
# ------------------------------------------------------------

HF_CKPT_LOAD = '''\
def ckpt_load(self, path: Any) -> Any:
    self._np_ckpt_loaded = True
    return super().ckpt_load(path)  # type: ignore[misc]'''

HF = [
    Edit(
        "export/hf.py",
        'registered for ``"hf"`` (``io.model_exporter(<class>, "hf")``, e.g. ``HFLlamaExporter`` for ``LlamaModel``;\n'
        '``"hf-peft"`` for an adapter checkpoint). The exporter\'s own ``apply`` runs, so whatever it sets on itself\n'
        "(``trust_remote_code``, ``peft_obj``, ...) and passes",
        'registered for ``"hf"`` (``io.model_exporter(<class>, "hf")``, e.g. ``HFLlamaExporter`` for '
        '``LlamaModel``).\n'
        "The exporter's own ``apply`` runs, so whatever it sets on itself (``trust_remote_code``, ...) and passes",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "engine (:mod:`nemo_patch.export.hf_verify`; only vocabulary padding rows and a tied ``lm_head`` may be "
        "absent). A\nclass without a usable importer, and a PEFT adapter directory, are compared with the exporter's "
        "converted model\ninstead (with a warning for the former).",
        "engine (:mod:`nemo_patch.export.hf_verify`; only vocabulary padding rows and a tied ``lm_head`` may be "
        "absent). A\nclass without a usable importer is compared with the exporter's converted model instead (with a "
        "warning).",
        until=UNTIL,
    ),
    Drop("export/hf.py", ("_is_peft_model", "_OfflineExport._np_merged"), until=UNTIL),
    Edit(
        "export/hf.py",
        "    ``apply`` sets on the exporter (``trust_remote_code``, ``peft_obj``, ...) and whatever",
        "    ``apply`` sets on the exporter (``trust_remote_code``, ...) and whatever",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "    - ``ckpt_load`` (the DeepSeek and Llama 4 exporters read the distributed checkpoint themselves) is "
        "NeMo's, refused\n      for merged adapters (the checkpoint's own weights are not the merged model).\n",
        "    - ``ckpt_load`` (the DeepSeek and Llama 4 exporters read the distributed checkpoint themselves) is "
        "NeMo's.\n",
        until=UNTIL,
    ),
    Replace("export/hf.py", "_OfflineExport.ckpt_load", HF_CKPT_LOAD, until=UNTIL),
    Edit(
        "export/hf.py",
        "        if _is_peft_model(target):  # only the adapters are written, as the PEFT exporters' apply saves "
        "them\n            from peft import get_peft_model_state_dict\n\n"
        '            embedding_layers = kwargs.get("save_embedding_layers", "auto")\n'
        "            state = get_peft_model_state_dict(target, save_embedding_layers=embedding_layers)\n"
        "        else:\n"
        '            if kwargs.get("state_dict") is None and hasattr(target, "tie_weights"):\n'
        "                target.tie_weights()  # an output embedding tied in the config shares the assigned input "
        "embedding\n"
        '            state = kwargs.get("state_dict")\n'
        "            state = target.state_dict() if state is None else state\n"
        "            kwargs.update(max_shard_size=self._np_max_shard_size, safe_serialization=True)\n",
        '        if kwargs.get("state_dict") is None and hasattr(target, "tie_weights"):\n'
        "            target.tie_weights()  # an output embedding tied in the config shares the assigned input "
        "embedding\n"
        '        state = kwargs.get("state_dict")\n'
        "        state = target.state_dict() if state is None else state\n"
        "        kwargs.update(max_shard_size=self._np_max_shard_size, safe_serialization=True)\n",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        '    """The model from ``<checkpoint_dir>/context`` and NeMo\'s registered ``"hf"`` exporter (``"hf-peft"`` '
        'with\n'
        "    ``peft``) for its class, as an instance of that exporter class with :class:`_OfflineExport` mixed in. "
        "With\n    ``peft`` the context's PEFT method is read here already (NeMo's ``apply`` reads it again), so that "
        "an unreadable\n    one is an :class:`AdapterCheckpointError`.\n",
        '    """The model from ``<checkpoint_dir>/context`` and NeMo\'s registered ``"hf"`` exporter for its class, '
        'as an\n'
        "    instance of that exporter class with :class:`_OfflineExport` mixed in.\n",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "        AdapterCheckpointError: with ``peft``, the class has no ``\"hf-peft\"`` exporter or the PEFT method "
        "cannot be\n            read.\n",
        "",
        until=UNTIL,
    ),
    DropArgument("export/hf.py", "_exporter_for", "peft", until=UNTIL),
    Edit(
        "export/hf.py",
        'model_class.exporter("hf-peft" if peft else "hf", str(checkpoint_dir))',
        'model_class.exporter("hf", str(checkpoint_dir))',
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "        if peft:\n"
        "            raise AdapterCheckpointError(\n"
        "                f\"NeMo has no Hugging Face PEFT ('hf-peft') exporter for {name} (the model class of the "
        "adapter \"\n"
        '                f"checkpoint {checkpoint_dir}); merge the adapters (--merge-adapters) or use --format '
        'safetensors"\n'
        "            ) from error\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "    if peft:\n"
        "        try:\n"
        '            exporter.peft_obj = io.load_context(str(checkpoint_dir / "context"), '
        'subpath="model.model_transform")\n'
        "        except Exception as error:\n"
        "            raise AdapterCheckpointError(\n"
        "                f\"Cannot read the PEFT method from {checkpoint_dir / 'context'} (model.model_transform): "
        "{error}\"\n            ) from error\n",
        "",
        until=UNTIL,
    ),
    DropArgument("export/hf.py", "_verify_against_checkpoint", "peft", until=UNTIL),
    DropArgument("export/hf.py", "_verify_against_checkpoint", "base_checkpoint", until=UNTIL),
    Edit(
        "export/hf.py",
        "    before the checkpoint is read again). A PEFT adapter directory, or a class whose importer cannot run "
        "here (a\n    warning says why), is compared with ``saved`` instead (:func:`_verify_hf`).",
        "    before the checkpoint is read again). A class whose importer cannot run here (a warning says why) is "
        "compared\n    with ``saved`` instead (:func:`_verify_hf`).",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "    if peft:  # NeMo registers no importer of Hugging Face PEFT directories\n"
        "        _verify_hf(output_dir, saved)\n"
        "        return\n\n",
        "",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "            merge_adapters=location.adapter,\n            base_checkpoint=base_checkpoint,\n",
        "",
        until=UNTIL,
    ),
    DropArgument("export/hf.py", "export_hf_checkpoint", "merge_adapters", until=UNTIL),
    DropArgument("export/hf.py", "export_hf_checkpoint", "base_checkpoint", until=UNTIL),
    Edit(
        "export/hf.py",
        "            the class (:mod:`nemo_patch.export.hf_verify`; a PEFT directory, or a class without a usable "
        "importer,\n            with the exporter's converted model).",
        "            the class (:mod:`nemo_patch.export.hf_verify`; a class without a usable importer, with the "
        "exporter's\n            converted model).",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "        AdapterCheckpointError: a PEFT adapter checkpoint (without ``merge_adapters``) whose model class has "
        "no\n            ``\"hf-peft\"`` exporter, or whose PEFT method cannot be read (exit code 12; the class is "
        "named).\n        AdapterMergeError: the adapters cannot be merged (exit code 13; e.g. the base checkpoint is "
        "missing).\n",
        "",
        until=UNTIL,
    ),
    Edit("export/hf.py", "    peft = location.adapter and not merge_adapters\n", "", until=UNTIL),
    Edit("export/hf.py", "_exporter_for(ckpt_dir, peft)", "_exporter_for(ckpt_dir)", until=UNTIL),
    Edit(
        "export/hf.py",
        "read_state_dict(location, merge_adapters, progress, base_checkpoint)",
        "read_state_dict(location, progress)",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "    exporter._np_read, exporter._np_dtype, exporter._np_merged = read, dtype, location.adapter and "
        "merge_adapters\n",
        "    exporter._np_read, exporter._np_dtype = read, dtype\n",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        "_verify_against_checkpoint(location, tmp_dir, model, exporter, saved, peft, base_checkpoint)",
        "_verify_against_checkpoint(location, tmp_dir, model, exporter, saved)",
        until=UNTIL,
    ),
    Edit(
        "export/hf.py",
        '            "kind": "adapter" if peft else "model",\n',
        '            "kind": "model",\n',
        until=UNTIL,
    ),  # fmt: skip
    Edit(
        "export/hf.py",
        "        if location.adapter:\n"
        "            manifest.update(base_checkpoint=location.adapter_base, peft=peft_settings(ckpt_dir))\n"
        "        if location.adapter and not peft:  # merged: as the safetensors format records it\n"
        '            manifest.update(merged_adapters=lora_scale(manifest["peft"])[1])\n',
        "",
        until=UNTIL,
    ),
    # hf_verify.py
    DropArgument("export/hf_verify.py", "check_through_importer", "merge_adapters", until=UNTIL),
    DropArgument("export/hf_verify.py", "check_through_importer", "base_checkpoint", until=UNTIL),
    Edit(
        "export/hf_verify.py",
        "        names = checkpoint_names(location, merge_adapters, base_checkpoint)\n",
        "        names = checkpoint_names(location)\n",
        until=UNTIL,
    ),
    Edit(
        "export/hf_verify.py",
        "        oracle = read_checkpoint_tensors(location, merge_adapters, base_checkpoint)\n",
        "        oracle = read_checkpoint_tensors(location)\n",
        until=UNTIL,
    ),
    DropArgument("export/hf_verify.py", "verify_hf_output", "merge_adapters", until=UNTIL),
    DropArgument("export/hf_verify.py", "verify_hf_output", "base_checkpoint", until=UNTIL),
    Edit(
        "export/hf_verify.py",
        "check_through_importer(location, Path(output_dir), model, merge_adapters, base_checkpoint)",
        "check_through_importer(location, Path(output_dir), model)",
        until=UNTIL,
    ),
    DropArgument("export/hf_verify.py", "checkpoint_names", "merge_adapters", until=UNTIL),
    DropArgument("export/hf_verify.py", "checkpoint_names", "base_checkpoint", until=UNTIL),
    Edit(
        "export/hf_verify.py",
        "    outputs = open_sources(location, None, merge_adapters, base_checkpoint).outputs\n",
        "    outputs = open_sources(location, None).outputs\n",
        until=UNTIL,
    ),
    DropArgument("export/hf_verify.py", "read_checkpoint_tensors", "merge_adapters", until=UNTIL),
    DropArgument("export/hf_verify.py", "read_checkpoint_tensors", "base_checkpoint", until=UNTIL),
    Edit(
        "export/hf_verify.py",
        "        state, _ = read_state_dict(location, merge_adapters, None, base_checkpoint)\n",
        "        state, _ = read_state_dict(location)\n",
        until=UNTIL,
    ),
]

# --- the training side --------------------------------------------------------------------------------------------

TRAINING = [
    Edit("training/worker.py", "                merge_adapters=settings.merge_adapters,\n", "", until=UNTIL),
    Drop("training/settings.py", ("ConsolidationSettings.merge_adapters", "validate_flag"), until=UNTIL),
]

PEFT = ENGINE + HF + TRAINING

# --- the knob stage's strategy test: merge_adapters is validated from the PEFT stage on ---------------------------

STRATEGY_TESTS = "tree/tests/lightning/consolidation/test_megatron_strategy_consolidation.py"

PEFT += [
    Edit(STRATEGY_TESTS, '        ({"ckpt_consolidation_merge_adapters": 1}, "True or False"),\n', "", until=UNTIL),
]

# --- the engine stage's docs section ------------------------------------------------------------------------------

PEFT += [
    Edit(
        "docs/01-engine.rst",
        "12 a PEFT adapter checkpoint that cannot be consolidated as asked)",
        "12 a PEFT adapter checkpoint, which holds the adapters only)",
        until=UNTIL,
    ),
]
