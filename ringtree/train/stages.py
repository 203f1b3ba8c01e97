"""The digits models as lists of layers that pipeline parallelism can cut into stages."""

from __future__ import annotations

import torch
from torch import nn

from ringtree.train.gpt import GPT
from ringtree.train.models import MLP, ViT


class Tokens(nn.Module):
    """The ViT's front: flat digits [b, 64] to embedded tokens [b, 1 + patches, dim]."""

    def __init__(self, vit: ViT) -> None:
        super().__init__()
        self.patch, self.embed, self.cls, self.pos = vit.patch, vit.embed, vit.cls, vit.pos

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ViT.tokens(self, x)  # type: ignore[arg-type]  # uses only patch, embed, cls and pos


class Head(nn.Module):
    """The ViT's back: the class token's final norm and the classifier, [b, t, dim] to [b, classes]."""

    def __init__(self, vit: ViT) -> None:
        super().__init__()
        self.norm, self.head = vit.norm, vit.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h[:, 0]))  # type: ignore[no-any-return]


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The model as layers applied one after another, sharing the model's parameters."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, MLP):
        return list(model.layers)
    if isinstance(model, ViT):
        return [Tokens(model), *model.blocks, Head(model)]
    if isinstance(model, GPT):
        return model.layers()
    raise TypeError(f"cannot cut a {type(model).__name__} into stages; pass an nn.Sequential, MLP, ViT, GPT")
