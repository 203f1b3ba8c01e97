"""The parameter tensors of the planner's models, by shape: what PowerSGD compresses (or not)."""

from __future__ import annotations

import math

from ringtree.sim.training.transformer import Transformer


def encoder_shapes(params: int, layers: int, hidden: int) -> tuple[tuple[int, ...], ...]:
    """The parameter shapes of a ViT/BERT-style encoder of `layers` x `hidden` (fused QKV, output
    projection, 4h MLP, their biases, two LayerNorms per layer) with the rest of `params` as one
    embedding matrix of `hidden` columns, in the order the forward uses them."""
    h = hidden
    layer = [
        (3 * h, h),
        (3 * h,),
        (h, h),
        (h,),
        (4 * h, h),
        (4 * h,),
        (h, 4 * h),
        (h,),
        (h,),
        (h,),
        (h,),
        (h,),
    ]
    rest = params - layers * sum(math.prod(s) for s in layer)
    embedding = [(rest // h, h)] if rest >= h else []
    return tuple([*embedding, *[s for _ in range(layers) for s in layer]])


def transformer_shapes(model: Transformer) -> tuple[tuple[int, ...], ...]:
    """The parameter shapes of `ringtree.sim.training.transformer`'s model, in forward order: the
    embedding (and positions), per layer the attention's matrices, the MLP's (or the router's and
    each expert's), the layer's biases and norms as one vector, then the untied logits."""
    h = model.hidden
    out: list[tuple[int, ...]] = [(model.vocab, h)]
    out += [(model.seq, h)] if model.learned_positions else []
    for i in range(model.layers):
        out += [(n, k) for k, n, _ in model.attention_matmuls()]
        if model.is_moe_layer(i):
            f = model.moe_ffn_hidden
            experts = (model.experts + model.shared_experts) * (model.gated - 1)
            out += (
                [(model.experts, h)] + [(f, h)] * experts + [(h, f)] * (model.experts + model.shared_experts)
            )
        else:
            out += [(model.ffn_hidden, h)] * (model.gated - 1) + [(h, model.ffn_hidden)]
        out.append((model.small_params,))
    out += [] if model.learned_positions else [(h,)]  # Llama's final RMSNorm
    return tuple(out + ([(model.vocab, h)] if model.logit_params else []))
