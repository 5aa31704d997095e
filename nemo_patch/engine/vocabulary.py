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

"""The vocabulary sizes of a checkpoint, as ``metadata.json`` records them: padded (the model's) and the tokenizer's.

megatron-core pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` (times the TP size), so the
embedding and output layer have more rows than the tokenizer has tokens. Both sizes are read from files only.
"""

from pathlib import Path
from typing import Dict, Optional

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_patch.engine.safe_files import read_json_file

__all__ = ["TOKENIZER_JSON", "padded_vocab_size", "tokenizer_vocab_size", "vocabulary_sizes"]

#: Where NeMo's context keeps a Hugging Face fast tokenizer, relative to the checkpoint directory.
TOKENIZER_JSON = Path("context") / "nemo_tokenizer" / "tokenizer.json"
_EMBEDDING_KEYS = ("module.embedding.word_embeddings.weight", "module.output_layer.weight")


def padded_vocab_size(metadata: Metadata) -> Optional[int]:
    """Rows of the word embedding (or, without one, of the output layer) in a checkpoint's metadata; ``None`` if
    the checkpoint has neither (e.g. a pipeline stage's partial checkpoint is not one: every stage is in it)."""
    for key in _EMBEDDING_KEYS:
        entry = metadata.state_dict_metadata.get(key)
        if isinstance(entry, TensorStorageMetadata) and len(entry.size) == 2:
            return int(entry.size[0])
    return None


def tokenizer_vocab_size(checkpoint_dir: Path) -> Optional[int]:
    """Number of distinct token ids of the Hugging Face tokenizer in ``<checkpoint_dir>/context``, or ``None`` when
    there is none or it is not a ``tokenizer.json`` this function can read (it never raises for those)."""
    try:
        data = read_json_file(Path(checkpoint_dir) / TOKENIZER_JSON)
        vocab = data["model"]["vocab"]
        if isinstance(vocab, dict):
            ids = {int(token_id) for token_id in vocab.values()}
        elif isinstance(vocab, list):  # Unigram: the id is the position
            ids = set(range(len(vocab)))
        else:
            return None
        ids.update(int(token["id"]) for token in data.get("added_tokens") or ())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(ids) or None


def vocabulary_sizes(checkpoint_dir: Path, metadata: Metadata) -> Optional[Dict[str, Optional[int]]]:
    """``{"padded": <embedding rows>, "tokenizer": <tokenizer's size or None>}`` for ``metadata.json``; ``None`` for a
    checkpoint without a word embedding or output layer."""
    padded = padded_vocab_size(metadata)
    return None if padded is None else {"padded": padded, "tokenizer": tokenizer_vocab_size(checkpoint_dir)}
