"""A decoder-only transformer's shape, parameters and FLOPs: the planner's model spec.

FLOPs follow Narayanan et al. (2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", section 5.1), generalised to grouped-query attention and SwiGLU: a layer's
forward is 2 x (its matmul weights) per token plus 4 s h per token for the attention scores and
their product with V; the logits are 2 h V per token. With multi-head attention and a 4h GeLU MLP
this is their 24 B s h^2 + 4 B s^2 h. A backward is twice its forward; `full` recompute runs every
layer's forward again in the backward, `selective` only the attention core (Korthikanti et al. 2022),
`op` (torchtitan's per-op selective activation checkpointing) every second matmul of the layer and
its elementwise ops, the attention core saved.
Indices: l layers, h hidden, a heads, k kv heads, d = h / a head size, F MLP width, s sequence,
V vocabulary.

Mixture-of-experts layers (`experts` E > 0) replace the MLP by a router (h x E) and E experts of
width F_e (`moe_ffn_hidden`), each token going to `top_k` of them, plus `shared_experts` S experts
every token passes (one MLP of width S F_e); the first `dense_layers` layers keep a dense MLP of
width F, and after them every `moe_every`-th layer is an MoE layer (Llama 4 Maverick's
interleave_moe_layer_step 2). FLOPs count the active parameters: the router, k routed experts and
the shared ones. Attention is grouped-query (`head_dim` may differ from h / a, as Qwen3's and
gpt-oss's) or multi-head latent attention (`attention` "mla", DeepSeek-V2/V3: queries and keys/values
through low-rank projections, q_lora_rank and kv_lora_rank, heads of qk_nope + qk_rope dims for the
scores and v_head_dim for the values); `sliding_window` W makes every other layer attend to its last
W keys (gpt-oss's alternating sliding and full layers).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full", "op", "dots")
ATTENTIONS = ("gqa", "mla")
SEARCHED = RECOMPUTE[:3]  # what `plan --search` tries: Megatron-LM's three
MLPS = ("gelu", "swiglu")


@dataclass(frozen=True)
class Transformer:
    """The shape of a decoder-only transformer (GPT: tied embeddings, learned positions; Llama: not)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    kv_heads: int = 0  # grouped-query attention; 0: as many as heads
    ffn_hidden: int = 0  # the MLP's width; 0: 4 x hidden
    mlp: str = "gelu"  # gelu: two h x F matrices; swiglu: three
    tied_embeddings: bool = True  # GPT ties the logits to the input embedding; Llama 3 does not
    learned_positions: bool = True  # GPT learns s x h position embeddings; Llama uses RoPE
    # dropout after attention and after the MLP (and on the attention probabilities): GPT trains
    # with it (Megatron-LM's --hidden-dropout and --attention-dropout default 0.1), storing its masks
    # for the backward; Llama trains without (a dropout of 0 stores nothing: torch's dropout returns
    # its input when p = 0)
    dropout: bool = True
    # mixture of experts (the module's docstring): 0 experts is a dense model
    experts: int = 0
    top_k: int = 0  # routed experts per token; 0: 1 (with experts)
    moe_ffn_hidden: int = 0  # each expert's width; 0: ffn_hidden
    shared_experts: int = 0
    dense_layers: int = 0  # the first layers keep the dense MLP (DeepSeek-V3's first_k_dense_replace)
    moe_every: int = 1  # after them, every moe_every-th layer is an MoE layer
    head_dim: int = 0  # 0: hidden / heads
    attention: str = "gqa"  # or "mla", multi-head latent attention
    q_lora_rank: int = 0  # MLA: the query's low rank (0: a full-rank query projection)
    kv_lora_rank: int = 0  # MLA: the compressed key/value width
    qk_rope_dim: int = 0  # MLA: the rotary part of each query/key head
    v_head_dim: int = 0  # MLA: each value head's width (0: head_dim)
    sliding_window: int = 0  # every other layer attends to its last W keys; 0: all layers attend fully
    # gpt-oss's experts (config.json): biases on their linear layers, and the gated activation's inputs
    # clamped to +-swiglu_limit ("swiglu_limit": 7.0); 0: not clamped. Megatron-Core runs both as
    # passes of their own (ringtree.sim.training.moe.unfused_s)
    expert_bias: bool = False
    swiglu_limit: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.mlp not in MLPS:
            raise ValueError(f"unknown --mlp {self.mlp!r}; choose gelu or swiglu")
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "ffn_hidden", self.ffn_hidden or 4 * self.hidden)
        if self.hidden % self.heads and not self.head_dim:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        object.__setattr__(self, "head_dim", self.head_dim or self.hidden // self.heads)
        object.__setattr__(self, "v_head_dim", self.v_head_dim or self.head_dim)
        self._check_moe()
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads {self.kv_heads} must divide --heads {self.heads}")
        if self.ffn_hidden < 1:
            raise ValueError(f"--ffn-hidden must be at least 1, got {self.ffn_hidden}")

    def _check_moe(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"unknown --attention {self.attention!r}; choose gqa or mla")
        if self.attention == "mla" and not (self.kv_lora_rank and self.qk_rope_dim):
            raise ValueError("--attention mla needs --kv-lora-rank and --qk-rope-dim (and --q-lora-rank)")
        if self.experts < 0 or self.top_k < 0 or self.shared_experts < 0 or self.dense_layers < 0:
            raise ValueError("--experts, --top-k, --shared-experts and --dense-layers must not be negative")
        if self.swiglu_limit < 0:
            raise ValueError(f"swiglu_limit must not be negative, got {self.swiglu_limit}")
        if not self.experts:
            if self.expert_bias or self.swiglu_limit:
                raise ValueError("expert biases and a clamped expert activation describe MoE layers")
            if self.top_k or self.shared_experts or self.moe_ffn_hidden or self.dense_layers:
                raise ValueError(
                    "--top-k, --shared-experts, --moe-ffn-hidden and --dense-layers describe MoE layers: "
                    "add --experts E"
                )
            return
        object.__setattr__(self, "top_k", self.top_k or 1)
        object.__setattr__(self, "moe_ffn_hidden", self.moe_ffn_hidden or self.ffn_hidden)
        if self.top_k > self.experts:
            raise ValueError(f"--top-k {self.top_k} exceeds --experts {self.experts}; choose at most that")
        if self.moe_every < 1 or self.dense_layers >= self.layers:
            raise ValueError(
                f"--moe-every must be at least 1 and --dense-layers below --layers {self.layers}; "
                f"got {self.moe_every} and {self.dense_layers}"
            )

    @property
    def q_hidden(self) -> int:
        """The width of the queries (and the attention's output): a d."""
        return self.heads * self.head_dim

    @property
    def kv_hidden(self) -> int:
        """The width of K (and of V): k d."""
        return self.kv_heads * self.head_dim

    @property
    def gated(self) -> int:
        """Matrices of one MLP (or expert): 3 under SwiGLU (gate, up, down), 2 under GeLU."""
        return 3 if self.mlp == "swiglu" else 2

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (from 0) is an MoE layer."""
        after = i - self.dense_layers
        return bool(self.experts) and after >= 0 and (after + 1) % self.moe_every == 0

    def moe_layers_in(self, start: int, count: int) -> int:
        """MoE layers among layers start .. start + count - 1."""
        if not self.experts or count < 1:
            return 0
        low, high = max(1, start - self.dense_layers + 1), start + count - self.dense_layers
        return max(0, high // self.moe_every - (low - 1) // self.moe_every) if high >= low else 0

    @functools.cached_property
    def moe_layer_count(self) -> int:
        return self.moe_layers_in(0, self.layers)

    def attention_matmuls(self) -> list[tuple[int, int, str]]:
        """The attention's matmuls (input width, output width, how TP splits them: "col" its output,
        "row" its input, "none" replicated): a fused Q, K, V and the output projection; under MLA
        (DeepSeek-V3's modeling code) the query's down and up projections, the compressed key/value's
        down projection (with the shared rotary key) and up projection, and the output projection."""
        h, a = self.hidden, self.heads
        if self.attention == "gqa":
            return [(h, self.q_hidden + 2 * self.kv_hidden, "col"), (self.q_hidden, h, "row")]
        qk = self.head_dim + self.qk_rope_dim
        query = (
            [(h, self.q_lora_rank, "none"), (self.q_lora_rank, a * qk, "col")]
            if self.q_lora_rank
            else [(h, a * qk, "col")]
        )
        kv = [(h, self.kv_lora_rank + self.qk_rope_dim, "none"),
              (self.kv_lora_rank, a * (self.head_dim + self.v_head_dim), "col")]  # fmt: skip
        return [*query, *kv, (a * self.v_head_dim, h, "row")]

    @functools.cached_property
    def attention_weights(self) -> int:
        return sum(k * n for k, n, _ in self.attention_matmuls())

    @functools.cached_property
    def expert_weights(self) -> int:
        """One MoE layer's routed experts: E experts of gated x h x F_e."""
        return self.experts * self.gated * self.hidden * self.moe_ffn_hidden

    @functools.cached_property
    def moe_dense_weights(self) -> int:
        """One MoE layer's weights that every rank of its TP group holds a slice of: the attention,
        the router and the shared experts."""
        shared = self.gated * self.hidden * self.moe_ffn_hidden * self.shared_experts
        return self.attention_weights + self.hidden * self.experts + shared

    @functools.cached_property
    def moe_active_weights(self) -> int:
        """One MoE layer's weights a token passes through: attention, router, top-k and shared experts."""
        return self.moe_dense_weights + self.top_k * self.expert_weights // max(1, self.experts)

    @functools.cached_property
    def layer_weights(self) -> int:
        """Matmul weights of one dense layer: Q and the output h x a d, K and V h x k d, the MLP 2 or 3
        h x F."""
        return self.attention_weights + self.gated * self.hidden * self.ffn_hidden

    @property
    def small_params(self) -> int:
        """Biases and norms of one layer: Megatron's 13 h per GPT layer, 2 h (two RMSNorms) for Llama."""
        return 13 * self.hidden if self.learned_positions else 2 * self.hidden

    @functools.cached_property
    def layer_params(self) -> int:
        """Weights plus biases and norms of one dense layer."""
        return self.layer_weights + self.small_params

    def layers_params(self, start: int, count: int) -> tuple[int, int]:
        """Parameters of layers start .. start + count - 1: (those split over TP, the routed experts)."""
        moe = self.moe_layers_in(start, count)
        dense = (count - moe) * self.layer_params + moe * (self.moe_dense_weights + self.small_params)
        return dense, moe * self.expert_weights

    @functools.cached_property
    def embedding_params(self) -> int:
        """The input embedding (and its position table); with untied logits, the output matrix too."""
        h = self.hidden
        return self.vocab * h + (self.seq * h if self.learned_positions else 0)

    @property
    def logit_params(self) -> int:
        """The output matrix the last stage holds (shared with the embedding when tied)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @functools.cached_property
    def params(self) -> int:
        """All parameters; for a GPT shape, Narayanan et al. 2021, eq. 2."""
        final_norm = 0 if self.learned_positions else self.hidden  # Llama's final RMSNorm (eq. 2 has none)
        layers = sum(self.layers_params(0, self.layers))
        return layers + self.embedding_params + self.logit_params + final_norm

    @functools.cached_property
    def active_params(self) -> int:
        """The parameters one token passes through: the routed experts' top-k of E only."""
        idle = self.expert_weights - self.top_k * self.expert_weights // max(1, self.experts)
        return self.params - self.moe_layer_count * idle

    def layer_flops(self, tokens: int, moe: bool = False) -> float:
        """One dense (or MoE: its active weights) layer's forward over `tokens` = b s tokens."""
        weights = self.moe_active_weights if moe else self.layer_weights
        return 2.0 * tokens * weights + self.attention_flops(tokens)

    @property
    def keys_per_query(self) -> float:
        """Keys each query attends to, averaged over the layers: s, or min(s, W) on every other layer."""
        if not self.sliding_window:
            return float(self.seq)
        return (self.seq + min(self.seq, self.sliding_window)) / 2

    def attention_flops(self, tokens: int) -> float:
        """Scores Q K^T and their product with V: 2 s a (d_qk + d_v) per token, 4 s h with d = h / a (no
        causal saving, as Megatron counts); a sliding window's layers count its W keys."""
        qk = self.head_dim + (self.qk_rope_dim if self.attention == "mla" else 0)
        return 2.0 * tokens * self.keys_per_query * self.heads * (qk + self.v_head_dim)

    def logit_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.vocab

    def matmul_shapes(self) -> list[tuple[int, int]]:
        """The layer's matmuls (input width, output width) in the order its forward runs them, as
        torchtitan's Llama does: Q, K, V, the output projection, then the MLP's up (w1), gate (w3)
        and down (w2), or GeLU's two."""
        h, q, kv, f = self.hidden, self.q_hidden, self.kv_hidden, self.ffn_hidden
        mlp = [(h, f), (h, f), (f, h)] if self.mlp == "swiglu" else [(h, f), (f, h)]
        return [(h, q), (h, kv), (h, kv), (q, h), *mlp]

    def op_recomputed(self) -> list[tuple[int, int]]:
        """The matmuls torchtitan's per-op selective AC reruns in the backward: "Saves output of all
        compute ops, except every second mm" (its _custom_policy, counting the mm ops of one
        transformer block): the 2nd, 4th and 6th (K, the output projection, w3)."""
        return self.matmul_shapes()[1::2]

    def dots_recomputed(self) -> list[tuple[int, int]]:
        """The matmuls MaxText's `save_dot_except_mlpwi` reruns in the backward: the MLP's input
        projections (its "mlpwi", w1 and w3 under SwiGLU, GeLU's first); every other matmul's output
        is saved (`save_only_these_names("query_proj", "value_proj", "key_proj", "qkv_proj",
        "out_proj", "mlpwo")`, MaxText's get_remat_policy)."""
        shapes = self.matmul_shapes()
        return shapes[4:6] if self.mlp == "swiglu" else shapes[4:5]

    def recompute_flops(self, tokens: int, recompute: str) -> float:
        """Extra forward FLOPs per layer in the backward."""
        if recompute == "full":
            return self.layer_flops(tokens)
        if recompute == "op":
            return 2.0 * tokens * sum(k * n for k, n in self.op_recomputed())
        if recompute == "dots":  # the MLP's input projections and the attention (its output is not saved)
            return 2.0 * tokens * sum(k * n for k, n in self.dots_recomputed()) + self.attention_flops(tokens)
        return self.attention_flops(tokens) if recompute == "selective" else 0.0

    def step_flops(self, samples: int, recompute: str = "none") -> float:
        """Forward + backward (+ recomputed forward) of `samples` sequences, all layers and logits."""
        tokens, moe = samples * self.seq, self.moe_layer_count
        redo = self.recompute_flops(tokens, recompute)
        layers = (self.layers - moe) * (3 * self.layer_flops(tokens) + redo)
        if moe:
            redo = self.layer_flops(tokens, True) if recompute == "full" else redo
            layers += moe * (3 * self.layer_flops(tokens, True) + redo)
        return layers + 3 * self.logit_flops(tokens)

    def model_flops(self, samples: int) -> float:
        """The FLOPs MFU counts: no recompute."""
        return self.step_flops(samples, "none")


def _llama3(layers: int, hidden: int, heads: int, ffn: int) -> Transformer:
    """Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models", table 3): 8 KV heads, SwiGLU,
    vocabulary 128,256, untied output matrix, RoPE, no dropout; pre-training sequence 8,192."""
    return Transformer(layers, hidden, heads, 8192, 128_256, 8, ffn, "swiglu", False, False, False)


def _moe(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    experts: int,
    top_k: int,
    moe_ffn: int,
    **rest: int | str | bool | float,
) -> Transformer:
    """A released mixture-of-experts model's shape from its public config.json (docs/planner-moe.md,
    "The model", cites each file): SwiGLU experts, RoPE, untied output, no dropout; sequence
    4,096 unless a run says otherwise (--seq)."""
    return Transformer(layers, hidden, heads, 4096, vocab, kv_heads, int(rest.pop("ffn", moe_ffn)), "swiglu",
                       False, False, False, experts, top_k, moe_ffn, **rest)  # type: ignore[arg-type]  # fmt: skip


# name: the model's shape, from its paper or released config.
MODELS: dict[str, Transformer] = {
    "gpt-1.3b": Transformer(24, 2048, 16, 2048, 51200),  # GPT-3 paper, table 2.1 (XL)
    "gpt3-175b": Transformer(96, 12288, 96, 2048, 51200),  # GPT-3 paper, table 2.1
    "llama-7b": Transformer(32, 4096, 32, 2048, 32000),  # LLaMA paper, table 2 (SwiGLU as a 4h MLP)
    "llama-13b": Transformer(40, 5120, 40, 2048, 32000),
    "llama-70b": Transformer(80, 8192, 64, 4096, 32000),  # Llama 2 paper (GQA and SwiGLU approximated)
    "megatron-1t": Transformer(128, 25600, 160, 2048, 51200),  # Narayanan et al. 2021, table 1
    "llama3-8b": _llama3(32, 4096, 32, 14336),
    "llama3-70b": _llama3(80, 8192, 64, 28672),
    "llama3-405b": _llama3(126, 16384, 128, 53248),
    # mixture of experts (config.json keys: num_hidden_layers, hidden_size, num_attention_heads,
    # num_key_value_heads, vocab_size, num_local_experts / n_routed_experts / num_experts,
    # num_experts_per_tok, intermediate_size / moe_intermediate_size, and the rest as named)
    "mixtral-8x7b": _moe(32, 4096, 32, 8, 32000, 8, 2, 14336),
    "mixtral-8x22b": _moe(56, 6144, 48, 8, 32000, 8, 2, 16384),
    "deepseek-v3": _moe(
        61,
        7168,
        128,
        128,
        129280,
        256,
        8,
        2048,
        ffn=18432,
        shared_experts=1,
        dense_layers=3,
        head_dim=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_dim=64,
        v_head_dim=128,
    ),
    "qwen3-30b-a3b": _moe(48, 2048, 32, 4, 151936, 128, 8, 768, ffn=6144, head_dim=128),
    "qwen3-235b-a22b": _moe(94, 4096, 64, 4, 151936, 128, 8, 1536, ffn=12288, head_dim=128),
    "gpt-oss-120b": _moe(
        36,
        2880,
        64,
        8,
        201088,
        128,
        4,
        2880,
        head_dim=64,
        sliding_window=128,
        expert_bias=True,
        swiglu_limit=7.0,
    ),
    "llama4-scout": _moe(48, 5120, 40, 8, 202048, 16, 1, 8192, ffn=16384, shared_experts=1, head_dim=128),
    "llama4-maverick": _moe(
        48, 5120, 40, 8, 202048, 128, 1, 8192, ffn=16384, shared_experts=1, moe_every=2, head_dim=128
    ),
    "grok-1": _moe(64, 6144, 48, 8, 131072, 8, 2, 32768),
}


def with_dims(base: Transformer, **dims: int | str | bool) -> Transformer:
    """`base` with the named dimensions replaced (kv heads and MLP width re-derived unless named)."""
    if "hidden" in dims and "ffn_hidden" not in dims and base.ffn_hidden == 4 * base.hidden:
        dims["ffn_hidden"] = 0
    if "heads" in dims and "kv_heads" not in dims and base.kv_heads == base.heads:
        dims["kv_heads"] = 0
    return dataclasses.replace(base, **dims)  # type: ignore[arg-type]
