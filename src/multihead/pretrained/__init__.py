"""Pretrained BERT encoders from Hugging Face style directories, run on multihead's layers.

A directory holds ``config.json`` and ``model.safetensors``, and optionally ``tokenizer.json``
and ``sentence_bert_config.json`` (sentence-transformers' ``max_seq_length``). Weights are read
with safetensors only: pickle checkpoints (``pytorch_model.bin``) are never opened. Hugging
Face's names are mapped to ours here (``config.py`` for the config, ``loader.py`` for the
weights), not in the model:

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
from multihead.pretrained.loader import hf_shapes, hf_to_multihead_names, load_bert, minilm

__all__ = [
    "load_bert",
    "minilm",
    "hf_to_multihead_names",
    "hf_shapes",
    "bert_config_from_dict",
    "read_bert_config",
    "HF_ACTIVATIONS",
]
