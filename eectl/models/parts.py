"""The plain data an adapter takes and gives: the explicit KV cache (`KVCache`, which transformers' attention
modules update in place), a model's dimensions (`Dimensions`) and one decoder layer's weights as tensors
(`LayerWeights`, what export builds a graph from).

What this module does not do: run a layer or read a checkpoint (models/adapters.py, models/loading.py); it holds
tensors and knows nothing of model families.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KVCache:
    """Keys and values per decoder layer, each [B, H_kv, S, D]; positions 0..S-1 of the sequence.

    `forward_layers` appends the new positions of the layers it runs. The object also satisfies the one method the
    transformers attention modules call on a cache (`update`), so it is passed to them directly.
    """

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def length(self, layer: int) -> int:
        k = self.keys.get(layer)
        return 0 if k is None else int(k.shape[-2])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.keys:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], dim=-2)
        else:
            self.keys[layer_idx] = key_states
            self.values[layer_idx] = value_states
        return self.keys[layer_idx], self.values[layer_idx]

    def crop(self, length: int) -> None:
        """Drop every position >= length (rolls back rejected draft positions)."""
        for i in list(self.keys):
            self.keys[i] = self.keys[i][..., :length, :]
            self.values[i] = self.values[i][..., :length, :]

    def clone(self) -> KVCache:
        return KVCache({i: k.clone() for i, k in self.keys.items()}, {i: v.clone() for i, v in self.values.items()})


@dataclass(frozen=True)
class Dimensions:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    max_positions: int


@dataclass
class LayerWeights:
    """One decoder layer's parameters and facts, as plain tensors: what export builds a graph from.

    Linear weights are [out, in] (torch layout). Norm weights already include the family's offset (Gemma: 1 + w).
    """

    index: int
    layer_type: str
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_attention_norm: torch.Tensor  # Llama: the pre-MLP norm; Gemma (sandwich): the norm of the attention output
    pre_feedforward_norm: torch.Tensor | None  # sandwich only
    post_feedforward_norm: torch.Tensor | None  # sandwich only
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    activation: str  # "silu" | "gelu_tanh"
    eps: float
    scale: float  # attention softmax scale
    sliding_window: int | None
    softcap: float | None  # attention logit soft-capping
