"""The family-independent description of a decoder-only model: what the forward pass, the KV
pools and the loader need, read from a checkpoint's config.json by its family (`families/`).

`window` here is the number of EARLIER tokens a sliding-window query sees: HF `sliding_window
- 1` (Gemma 3's 1024 is a window of 1023); 0 for a model without sliding layers.

KV geometry is described per layer TYPE (`kv_shape`), so a model whose sliding layers have other
KV head counts or head sizes than its full layers ("SWA-compress": Gemma 4, MiMo-V2) gets pools of
their own shapes, and a latent-KV model (MLA: one buffer of kv_lora_rank + rope dims per token)
is one buffer per layer (`KVShape.num_buffers` 1). Tensor-parallel decode divides `num_kv_heads`
per rank (`KVShape.shard`); the model's own facts stay those of the whole checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from decode_worker.device.model.rope import RopeSpec
from decode_worker.errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"
Activation = Literal["silu", "gelu_tanh"]
Routing = Literal["gpt_oss", "softmax_topk"]


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token of one layer stores in a pool: `num_buffers` buffers (2: K then V; 1: a
    latent that K and V are views of) of `num_kv_heads x head_dim` values each."""

    num_kv_heads: int
    head_dim: int
    num_buffers: int = 2

    @property
    def values_per_token(self) -> int:
        return self.num_buffers * self.num_kv_heads * self.head_dim

    def shard(self, tp_size: int) -> KVShape:
        """The heads one of `tp_size` ranks holds (latent KV is replicated on every rank).
        Raises ConfigError when the heads do not divide."""
        if self.num_buffers == 1 or tp_size == 1:
            return self
        if self.num_kv_heads % tp_size:
            raise ConfigError(f"num_key_value_heads={self.num_kv_heads} does not divide over "
                              f"{tp_size} tensor-parallel ranks")
        return replace(self, num_kv_heads=self.num_kv_heads // tp_size)


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Routed experts. `sparse_layers`: the layers whose MLP is the MoE (others are dense
    gated MLPs of `ModelConfig.intermediate_size`)."""

    routing: Routing
    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool = True


class LayerKinds:
    """The layer indices of each attention kind, from a config's `layer_types`."""

    __slots__ = ()
    layer_types: tuple[str, ...]

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)


@dataclass(frozen=True, slots=True)
class ModelConfig(LayerKinds):
    """One checkpoint's architecture facts (build with a family's `read_config`)."""

    family: str
    model_type: str
    vocab_size: int  # embedding rows: input ids are checked against this
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rope: dict[str, RopeSpec]  # layer type -> its RoPE
    sliding_window: int | None = None  # HF meaning: keys a query sees, itself included
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0  # Gemma's norms multiply by (1 + weight)
    attention_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma: post-attention, pre- and post-FFN norms
    query_pre_attn_scalar: float | None = None  # scale = this ** -0.5 (else head_dim)
    activation: Activation = "silu"
    embed_scale: float | None = None  # Gemma: sqrt(hidden), rounded to the model dtype
    final_logit_softcapping: float | None = None
    moe: MoeSpec | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    fp8_block: tuple[int, int] | None = None  # FP8 block-quantized weights: block shape
    kv_shapes: dict[str, KVShape] = field(default_factory=dict)  # overrides per layer type
    # SGLang 0.5.23 lays this model out as an ordinary one (full KV in every layer, the window
    # only a mask: not on its hybrid-SWA list) although it has sliding layers (Gemma 3): its
    # prefills' KV lands in the decode side's landing area first (docs/DEPLOY.md)
    sglang_ordinary: bool = False

    @property
    def window(self) -> int:
        """Earlier tokens a sliding query sees (HF sliding_window - 1); 0 without SWA."""
        if not self.sliding_layers or self.sliding_window is None:
            return 0
        return self.sliding_window - 1

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_shape(self, layer_type: str) -> KVShape:
        """The KV one token of a layer of this type stores (GQA: K and V of every KV head)."""
        return self.kv_shapes.get(layer_type) or KVShape(self.num_key_value_heads, self.head_dim)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    def check(self, source: str) -> None:
        """Raise ConfigError naming the field for an inconsistent description."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"{source}: layer_types has {len(self.layer_types)} entries, "
                              f"num_hidden_layers={self.num_hidden_layers}")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ConfigError(f"{source}: layer_types may hold only {SLIDING!r} and {FULL!r}")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads must be a multiple of "
                              "num_key_value_heads")
        if self.head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even, got {self.head_dim}")
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 2):
            raise ConfigError(f"{source}: sliding_window must be >= 2 for sliding layers, got "
                              f"{self.sliding_window!r}")
        missing = {t for t in self.layer_types} - set(self.rope)
        if missing:
            raise ConfigError(f"{source}: rope_parameters lacks layer types {sorted(missing)}")
        moe = self.moe
        if moe is not None and not 1 <= moe.top_k <= moe.num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok must be in [1, num_experts]")

