"""A tiny BERT directory in Hugging Face's layout, built in a test's tmp_path: nothing downloads.

The weights are random, under Hugging Face's names, shaped by our own model's parameters (not by
the loader's idea of them), and the tokenizer is a word-level WordPiece over a dozen words.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG: dict[str, Any] = {
    "model_type": "bert",
    "vocab_size": 50,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 24,
    "max_position_embeddings": 12,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
}

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat", ".", "a", "dog"]


def hf_tensors(config: dict[str, Any] = CONFIG, prefix: str = "") -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names, shaped by our own model's parameters."""
    from multihead.models.bert import BertModel
    from multihead.pretrained import bert_config_from_dict, hf_to_multihead_names

    model = BertModel(bert_config_from_dict(config))
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    tensors = {}
    for ours, hfs in hf_to_multihead_names(model.config.num_hidden_layers).items():
        rows = shapes[ours][0] // len(hfs)
        for hf in hfs:
            tensors[prefix + hf] = torch.randn(rows, *shapes[ours][1:])
    return tensors


def tokenizer_json() -> str:
    """A BERT-style tokenizer (lower-casing, [CLS] ... [SEP]) over :data:`WORDS`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return tok.to_str()


def write_dir(
    path: Path,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    tokenizer: bool = False,
) -> Path:
    """Write config.json and model.safetensors (and tokenizer.json) into ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    save_file(hf_tensors() if tensors is None else tensors, path / "model.safetensors")
    if tokenizer:
        (path / "tokenizer.json").write_text(tokenizer_json())
    return path
