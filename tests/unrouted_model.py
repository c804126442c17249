"""A tiny transformers model family whose attention never consults ``AttentionInterface``.

The refusal path for unrouted families is tested on this class, not on a real family: which
real families transformers routes changes from release to release (GPT-J was unrouted until
5.24). Registered with ``AutoConfig``/``AutoModel`` under its own model type, so a directory
saved from it loads through ``AutoModel.from_pretrained`` like any other (no remote code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from transformers.modeling_outputs import BaseModelOutput

MODEL_TYPE = "multihead_test_unrouted"


class UnroutedConfig(transformers.PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 16,
        num_attention_heads: int = 2,
        num_hidden_layers: int = 1,
        max_position_embeddings: int = 64,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


class UnroutedAttention(nn.Module):
    """Softmax attention written out in the module: nothing transformers could route."""

    def __init__(self, config: UnroutedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, t, e))


class UnroutedModel(transformers.PreTrainedModel):
    config_class = UnroutedConfig
    base_model_prefix = "unrouted"

    def __init__(self, config: UnroutedConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            UnroutedAttention(config) for _ in range(config.num_hidden_layers)
        )
        self.post_init()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **_: Any) -> Any:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return BaseModelOutput(last_hidden_state=x)


transformers.AutoConfig.register(MODEL_TYPE, UnroutedConfig, exist_ok=True)
transformers.AutoModel.register(UnroutedConfig, UnroutedModel, exist_ok=True)


def save_unrouted(path: Path, *, vocab_size: int = 64, tokenizer: Any = None) -> Path:
    """A saved :class:`UnroutedModel` directory (with ``tokenizer`` beside it, if given)."""
    torch.manual_seed(0)
    UnroutedModel(UnroutedConfig(vocab_size=vocab_size)).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
