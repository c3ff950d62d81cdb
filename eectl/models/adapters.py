"""Per-architecture adapters: the ONLY place that touches transformers' decoder internals.

Each adapter exposes the parts every eectl stage needs (embedding, decoder layers, final norm, LM head) and one
layer-range forward, `forward_layers(hidden, positions, lo, hi, cache)`, that runs decoder layers [lo, hi) on hidden
states with an explicit KV cache in and out. Profiling, calibration, head training, export validation and the
runner's reference all call it; nothing else in eectl calls a decoder layer.

What this module does not do: load checkpoints (loading.py), tokenise, or know about exits. The plain data it takes and
gives (the explicit KV cache, the dimensions, one layer's weights) is models/parts.py.

Layer numbering used across eectl: "layer l" (1..L) is the hidden state after l decoder layers; an exit "after
layer l" reads that state. forward_layers(lo, hi) maps the state after `lo` layers to the state after `hi` layers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from eectl.errors import ModelLoadError
from eectl.models.parts import Dimensions, KVCache, LayerWeights

# ---------------------------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Capture:
    """The hidden states `forward_layers` keeps: after each layer l in `after` (the state after l decoder layers,
    i.e. the output of layer index l - 1) and, with `inputs`, that layer's input; each passed through `select`
    (e.g. some positions: [B, S, H] -> [N, H]). Filled in `states` / `layer_inputs`, keyed by l."""

    after: Collection[int]
    inputs: bool = False
    select: Callable[[torch.Tensor], torch.Tensor] = lambda h: h
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)

    def keep(self, layer: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        if layer in self.after:
            self.states[layer] = self.select(h_out)
            if self.inputs:
                self.layer_inputs[layer] = self.select(h_in)


class Adapter:
    """Llama-style decoder: model.model.{embed_tokens, layers, norm, rotary_emb}, model.lm_head.

    Subclasses declare what differs; the layer-range forward is shared by all of them.
    """

    family: ClassVar[str] = "llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama",)
    # Declared architecture facts, read by export to build graphs from the weights.
    norm_weight_offset: ClassVar[float] = 0.0  # Gemma's RMSNorm scales by (1 + w)
    has_qk_norm: ClassVar[bool] = False
    sandwich_norm: ClassVar[bool] = False  # extra post-attention / pre+post-feedforward norms (Gemma 2/3)

    def __init__(self, model: Any) -> None:
        # transformers modules are dynamically typed; `Any` keeps the type checker out of their internals.
        self.model: Any = model
        self.config: Any = model.config
        self.decoder: Any = model.model
        # Every attention call gets an explicit float mask; the "sdpa" and "eager" kernels both take it.
        if getattr(self.config, "_attn_implementation", None) not in ("sdpa", "eager"):
            self.config._attn_implementation = "sdpa"

    # --- parts ----------------------------------------------------------------------------------------------------
    @property
    def embed_tokens(self) -> Any:
        return self.decoder.embed_tokens

    @property
    def layers(self) -> Any:
        return self.decoder.layers

    @property
    def norm(self) -> Any:
        return self.decoder.norm

    @property
    def lm_head(self) -> Any:
        return self.model.lm_head

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dims(self) -> Dimensions:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return Dimensions(
            num_layers=self.num_layers,
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=c.vocab_size,
            intermediate_size=c.intermediate_size,
            max_positions=c.max_position_embeddings,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    def layer_type(self, layer: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return types[layer] if types else "full_attention"

    def sliding_window(self, layer: int) -> int | None:
        """Window of a layer's attention (keys within the last `window` positions), None for full attention."""
        if self.layer_type(layer) == "sliding_attention" or (
            getattr(self.config, "layer_types", None) is None and getattr(self.config, "use_sliding_window", True)
        ):
            return getattr(self.config, "sliding_window", None)
        return None

    def layer_weights(self, i: int, layer: Any = None) -> LayerWeights:
        """Layer i's weights; with `layer`, those of a module of layer i's shape standing in for it (a block exit
        head from `new_block`, run as layer i runs: its rotary kind and attention window)."""
        layer = self.layers[i] if layer is None else layer
        attn, mlp = layer.self_attn, layer.mlp
        off = self.norm_weight_offset

        def norm(module: Any) -> torch.Tensor:
            return module.weight.detach() + off

        def opt_bias(lin: Any) -> torch.Tensor | None:
            return None if lin.bias is None else lin.bias.detach()

        act = getattr(self.config, "hidden_activation", None) or getattr(self.config, "hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"unsupported MLP activation '{act}' in layer {i}")
        return LayerWeights(
            index=i,
            layer_type=self.layer_type(i),
            input_norm=norm(layer.input_layernorm),
            q=attn.q_proj.weight.detach(),
            k=attn.k_proj.weight.detach(),
            v=attn.v_proj.weight.detach(),
            o=attn.o_proj.weight.detach(),
            q_bias=opt_bias(attn.q_proj),
            k_bias=opt_bias(attn.k_proj),
            v_bias=opt_bias(attn.v_proj),
            o_bias=opt_bias(attn.o_proj),
            q_norm=norm(attn.q_norm) if self.has_qk_norm else None,
            k_norm=norm(attn.k_norm) if self.has_qk_norm else None,
            post_attention_norm=norm(layer.post_attention_layernorm),
            pre_feedforward_norm=norm(layer.pre_feedforward_layernorm) if self.sandwich_norm else None,
            post_feedforward_norm=norm(layer.post_feedforward_layernorm) if self.sandwich_norm else None,
            gate=mlp.gate_proj.weight.detach(),
            up=mlp.up_proj.weight.detach(),
            down=mlp.down_proj.weight.detach(),
            activation="silu" if act == "silu" else "gelu_tanh",
            eps=float(getattr(layer.input_layernorm, "eps", None) or layer.input_layernorm.variance_epsilon),
            scale=float(attn.scaling),
            sliding_window=self.sliding_window(i),
            softcap=getattr(self.config, "attn_logit_softcapping", None),
        )

    def rotary_tables(self, max_positions: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type: cos and sin [max_positions, head_dim / 2] (attention scaling included)."""
        positions = torch.arange(max_positions, device=self.device)[None]
        probe = torch.zeros(1, 1, self.dims.hidden_size, dtype=torch.float32, device=self.device)
        tables = {}
        for kind in sorted({self.layer_type(i) for i in range(self.num_layers)}):
            cos, sin = self.rotary(probe, positions, kind)
            half = cos.shape[-1] // 2
            tables[kind] = (cos[0, :, :half].float(), sin[0, :, :half].float())
        return tables

    def embed_scale(self) -> float:
        scale = getattr(self.embed_tokens, "embed_scale", None)
        return 1.0 if scale is None else float(scale)

    def final_norm_weight(self) -> tuple[torch.Tensor, float]:
        eps = getattr(self.norm, "eps", None) or self.norm.variance_epsilon
        return self.norm.weight.detach() + self.norm_weight_offset, float(eps)

    def project_kv(self, hidden: torch.Tensor, positions: torch.Tensor, lo: int, hi: int, cache: KVCache) -> None:
        """The `copy` policy's reference: project one hidden state through each layer's K/V path in [lo, hi).

        Every layer in the range receives the same `hidden` [B, S, H] (CALM-style state copying); the K/V it would
        write are appended to `cache`. Uses each layer's own attention module, so rotary and K-norm match.
        """
        for i in range(lo, hi):
            layer = self.layers[i]
            kind = self.layer_type(i)
            past = cache.length(i)
            mask = causal_mask(hidden.shape[1], past, self.sliding_window(i), None, hidden.dtype, hidden.device)
            layer.self_attn(
                hidden_states=layer.input_layernorm(hidden),
                position_embeddings=self.rotary(hidden, positions, kind),
                attention_mask=mask,
                cache=cache,
            )

    def new_block(self, init_layer: int, identity: bool) -> nn.Module:
        """A trainable decoder layer of the model's own shape: a float32 copy of layer `init_layer` (the block exit
        design). `identity` zeroes its attention output and MLP down projections, so that it starts as the identity
        (its residual stream passes through untouched)."""
        import copy

        block = copy.deepcopy(self.layers[init_layer]).float().requires_grad_(True)
        if identity:
            with torch.no_grad():
                for lin in (block.self_attn.o_proj, block.mlp.down_proj):
                    lin.weight.zero_()
                    if lin.bias is not None:
                        lin.bias.zero_()
        return block

    def block_project_kv(
        self, block: Any, hidden: torch.Tensor, positions: torch.Tensor, init_layer: int, cache: KVCache
    ) -> None:
        """`project_kv` for a block from `new_block` (the `copy` policy's reference for a block exit's own KV):
        `hidden` [B, S, H] through the block's K/V path only, appended to `cache` under its layer index."""
        past = cache.length(init_layer)
        mask = causal_mask(hidden.shape[1], past, self.sliding_window(init_layer), None, hidden.dtype, hidden.device)
        block.self_attn(
            hidden_states=block.input_layernorm(hidden),
            position_embeddings=self.rotary(hidden, positions, self.layer_type(init_layer)),
            attention_mask=mask,
            cache=cache,
        )

    def block_forward(
        self,
        block: nn.Module,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        init_layer: int,
        cache: KVCache | None = None,
        key_padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a block from `new_block` on [B, S, H] at `positions` [B, S], as layer `init_layer` runs (its rotary
        and attention window); `cache` holds the block's own past keys and values under its layer index."""
        kind = self.layer_type(init_layer)
        past = cache.length(init_layer) if cache is not None else 0
        mask = causal_mask(
            hidden.shape[1], past, self.sliding_window(init_layer), key_padding, hidden.dtype, hidden.device
        )
        out = block(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary(hidden, positions, kind),
        )
        return out[0] if isinstance(out, tuple) else out

    # --- pieces of the forward ------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] token ids -> [B, S, H] hidden state before layer 0."""
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """Final norm (unless `normed`) + LM head: the logit lens on any layer's hidden state."""
        x = hidden if normed else self.norm(hidden)
        out = self.lm_head(x)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor, layer_type: str) -> Any:
        return self.decoder.rotary_emb(hidden, positions)

    def _call_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        rope: Any,
        cache: Any,
    ) -> torch.Tensor:
        out = self.layers[layer](
            hidden,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=rope,
        )
        return out[0] if isinstance(out, tuple) else out

    # --- the one layer-range forward -------------------------------------------------------------------------------
    def forward_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        lo: int,
        hi: int,
        cache: KVCache | None = None,
        key_padding: torch.Tensor | None = None,
        on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
        capture: Capture | None = None,
    ) -> torch.Tensor:
        """Run decoder layers [lo, hi) on `hidden` [B, S, H] at absolute `positions` [B, S].

        `cache` holds the past of each layer (its length P may differ per layer: defer/copy policies leave
        some layers behind); the new S positions are appended to it. The queries sit at cache slots P..P+S-1 and
        attend causally to slots <= their own (and inside the sliding window where the layer has one).
        `key_padding` [B, P+S] is True for real slots, False for padding. `capture` keeps the states a caller
        asks for (after which layers, with or without each one's input, which positions); `on_layer(i, h_in,
        h_out)` is the raw per-layer hook underneath. Returns the hidden state after layer hi-1.
        """
        if not 0 <= lo <= hi <= self.num_layers:
            raise ValueError(f"layer range [{lo}, {hi}) outside 0..{self.num_layers}")
        ropes: dict[str, Any] = {}
        masks: dict[tuple[int, int | None], torch.Tensor] = {}
        for i in range(lo, hi):
            kind = self.layer_type(i)
            if kind not in ropes:
                ropes[kind] = self.rotary(hidden, positions, kind)
            past = cache.length(i) if cache is not None else 0
            window = self.sliding_window(i)
            if (past, window) not in masks:
                masks[(past, window)] = causal_mask(
                    hidden.shape[1], past, window, key_padding, hidden.dtype, hidden.device
                )
            out = self._call_layer(i, hidden, masks[(past, window)], positions, ropes[kind], cache)
            if on_layer is not None:
                on_layer(i, hidden, out)
            if capture is not None:
                capture.keep(i + 1, hidden, out)
            hidden = out
        return hidden

    def forward_tokens(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Embedding + all layers + final norm + LM head: full-depth logits [B, S, V] (the reference path)."""
        if positions is None:
            past = cache.length(0) if cache is not None else 0
            positions = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.forward_layers(self.embed(input_ids), positions, 0, self.num_layers, cache)
        return self.logits(hidden)


class MistralAdapter(Adapter):
    family = "mistral"
    model_types = ("mistral",)


class Qwen2Adapter(Adapter):
    family = "qwen2"
    model_types = ("qwen2",)


class Qwen3Adapter(Adapter):
    family = "qwen3"
    model_types = ("qwen3",)
    has_qk_norm = True


class Gemma3Adapter(Adapter):
    family = "gemma3_text"
    model_types = ("gemma3_text",)
    norm_weight_offset = 1.0
    has_qk_norm = True
    sandwich_norm = True

    def sliding_window(self, layer: int) -> int | None:
        return self.config.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor, layer_type: str) -> Any:
        return self.decoder.rotary_emb(hidden, positions, layer_type)


ADAPTERS: dict[str, type[Adapter]] = {
    t: cls for cls in (Adapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter, Gemma3Adapter) for t in cls.model_types
}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model: nn.Module) -> Adapter:
    model_type = getattr(model.config, "model_type", None)
    cls = ADAPTERS.get(str(model_type))
    if cls is None:
        raise ModelLoadError(
            f"unsupported architecture '{model_type}'",
            hint=f"supported model types: {', '.join(supported_model_types())}",
        )
    return cls(model)


def causal_mask(
    q_len: int,
    past: int,
    window: int | None,
    key_padding: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive mask [B or 1, 1, q_len, past + q_len]: 0 where a query may attend, dtype-min elsewhere."""
    q = torch.arange(past, past + q_len, device=device)[:, None]
    k = torch.arange(past + q_len, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    allowed = allowed[None, None]  # [1, 1, q, k]
    if key_padding is not None:
        allowed = allowed & key_padding[:, None, None, -(past + q_len) :].to(torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)
