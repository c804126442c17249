"""A tiny GGUF file written in a test's tmp_path, from a tiny random transformers Qwen2 (another
family than SmolLM2's Llama): nothing downloads.

The file is written with the ``gguf`` package's own writer, as llama.cpp's converter writes a
Qwen2 (tensor names from ``gguf``'s name map, float32 tensors as stored, the tokenizer as a
byte-level BPE vocabulary with its merges), so that loading it back must give the model it was
written from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TEXTS = ["the cat sat on the mat", "When Mary and John went to the store"]


def byte_level_tokenizer() -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` (the GPT-2 / Qwen2 kind) trained on TEXTS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 10, trainer)
    return tok


def qwen2_model(vocab_size: int, layers: int = 2) -> Any:
    """A tiny random transformers Qwen2ForCausalLM in eval mode."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


def write_gguf(path: Path, model: Any, tokenizer: Any, *, block_count: int | None = None) -> Path:
    """Write ``model`` (a Qwen2ForCausalLM) and ``tokenizer`` to ``path`` as GGUF, float32;
    ``block_count`` overrides the layer count the header states (to write a lying header)."""
    import gguf
    import numpy as np

    config = model.config
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_block_count(config.num_hidden_layers if block_count is None else block_count)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for key, value in model.state_dict().items():
        base, suffix = key.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, key
        w.add_tensor(f"{name}.{suffix}", value.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
