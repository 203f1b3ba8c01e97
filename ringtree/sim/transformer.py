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
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full", "op", "dots")
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

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.mlp not in MLPS:
            raise ValueError(f"unknown --mlp {self.mlp!r}; choose gelu or swiglu")
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "ffn_hidden", self.ffn_hidden or 4 * self.hidden)
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads {self.kv_heads} must divide --heads {self.heads}")
        if self.ffn_hidden < 1:
            raise ValueError(f"--ffn-hidden must be at least 1, got {self.ffn_hidden}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        """The width of K (and of V): k d."""
        return self.kv_heads * self.head_dim

    @functools.cached_property
    def layer_weights(self) -> int:
        """Matmul weights of one layer: Q and the output h x h, K and V h x k d, the MLP 2 or 3 h x F."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_hidden + (3 if self.mlp == "swiglu" else 2) * h * self.ffn_hidden

    @functools.cached_property
    def layer_params(self) -> int:
        """Weights plus biases and norms: Megatron's 13 h per GPT layer, 2 h (two RMSNorms) for Llama."""
        small = 13 * self.hidden if self.learned_positions else 2 * self.hidden
        return self.layer_weights + small

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
        return self.layers * self.layer_params + self.embedding_params + self.logit_params + final_norm

    def layer_flops(self, tokens: int) -> float:
        """One layer's forward over `tokens` = b s tokens."""
        return 2.0 * tokens * self.layer_weights + self.attention_flops(tokens)

    def attention_flops(self, tokens: int) -> float:
        """Scores Q K^T and their product with V: 4 s h per token (no causal saving, as Megatron counts)."""
        return 4.0 * tokens * self.seq * self.hidden

    def logit_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.vocab

    def matmul_shapes(self) -> list[tuple[int, int]]:
        """The layer's matmuls (input width, output width) in the order its forward runs them, as
        torchtitan's Llama does: Q, K, V, the output projection, then the MLP's up (w1), gate (w3)
        and down (w2), or GeLU's two."""
        h, kv, f = self.hidden, self.kv_hidden, self.ffn_hidden
        mlp = [(h, f), (h, f), (f, h)] if self.mlp == "swiglu" else [(h, f), (f, h)]
        return [(h, h), (h, kv), (h, kv), (h, h), *mlp]

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
        tokens = samples * self.seq
        layers = self.layers * (3 * self.layer_flops(tokens) + self.recompute_flops(tokens, recompute))
        return layers + 3 * self.logit_flops(tokens)

    def model_flops(self, samples: int) -> float:
        """The FLOPs MFU counts: no recompute."""
        return self.step_flops(samples, "none")


def _llama3(layers: int, hidden: int, heads: int, ffn: int) -> Transformer:
    """Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models", table 3): 8 KV heads, SwiGLU,
    vocabulary 128,256, untied output matrix, RoPE, no dropout; pre-training sequence 8,192."""
    return Transformer(layers, hidden, heads, 8192, 128_256, 8, ffn, "swiglu", False, False, False)


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
}


def with_dims(base: Transformer, **dims: int | str | bool) -> Transformer:
    """`base` with the named dimensions replaced (kv heads and MLP width re-derived unless named)."""
    if "hidden" in dims and "ffn_hidden" not in dims and base.ffn_hidden == 4 * base.hidden:
        dims["ffn_hidden"] = 0
    if "heads" in dims and "kv_heads" not in dims and base.kv_heads == base.heads:
        dims["kv_heads"] = 0
    return dataclasses.replace(base, **dims)  # type: ignore[arg-type]
