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

"""The PEFT method and settings of an adapter checkpoint, as NeMo recorded them in its context.

NeMo's PEFT callback saves adapter-only checkpoints (``weights/adapter_metadata.json`` names the base model) whose
``context/model.yaml`` holds the model's ``model_transform``, the PEFT object (``_target_:
nemo.collections.llm.peft.lora.LoRA``, ``dim``, ``alpha``, ``dropout``, ``target_modules``). :func:`peft_settings`
reads it with PyYAML (installed with NeMo; without it, or without the file, the settings are unknown: ``None``),
keeping plain values only (not NeMo's ``_call_`` objects). Standard library (and PyYAML when present) and the
engine's bounded file reads only.
"""

import json
from pathlib import Path
from typing import Any, Dict, Optional

from nemo_patch.engine.safe_files import MAX_JSON_BYTES, read_regular_file

__all__ = ["MODEL_YAML", "adapter_base", "peft_settings"]

#: NeMo's human-readable dump of a checkpoint's model, relative to the checkpoint directory.
MODEL_YAML = Path("context") / "model.yaml"
_KEPT = (str, int, float, bool, type(None))


def adapter_base(weights_dir: Path) -> Optional[str]:
    """The base model checkpoint NeMo recorded for an adapter checkpoint (``model_ckpt_path`` in its
    ``weights/adapter_metadata.json``), ``None`` when there is none or the file cannot be read (never raises)."""
    try:
        data = json.loads(read_regular_file(Path(weights_dir) / "adapter_metadata.json", MAX_JSON_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    base = data.get("model_ckpt_path") if isinstance(data, dict) else None
    return base if isinstance(base, str) else None


def peft_settings(checkpoint_dir: Path) -> Optional[Dict[str, Any]]:
    """``{"method": <class path>, "dim": ..., "alpha": ..., ...}`` of the checkpoint's ``model_transform``, or
    ``None`` when it has none or it cannot be read (never raises for that)."""
    try:
        import yaml

        data = yaml.safe_load(read_regular_file(Path(checkpoint_dir) / MODEL_YAML, MAX_JSON_BYTES).decode("utf-8"))
        transform = data.get("model_transform")
    except Exception:  # no PyYAML, no file, not YAML, not a mapping: unknown, not an error
        return None
    if not isinstance(transform, dict) or not isinstance(transform.get("_target_"), str):
        return None
    settings: Dict[str, Any] = {"method": transform["_target_"]}
    for key, value in sorted((key, value) for key, value in transform.items() if isinstance(key, str)):
        plain = isinstance(value, _KEPT) or (isinstance(value, list) and all(isinstance(v, _KEPT) for v in value))
        if not key.startswith("_") and plain:  # not NeMo's own objects
            settings[key] = value
    return settings
