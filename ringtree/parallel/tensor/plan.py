"""Tensor-parallel plans: module names mapped to colwise / rowwise, as torch's parallelize_module takes.

A plan is a mapping such as {"mlp.up": "colwise", "mlp.down": "rowwise"}; a name may hold `*`
for one level of the module tree ("blocks.*.attn.q"), as in torch's plans. `parallelize` replaces
every nn.Linear the plan names, in place, by ringtree's ColumnParallelLinear or RowParallelLinear
holding this rank's shard (the dense layer's parameters, so tp=2 computes what tp=1 does), keeping
the parameters' order, so checkpoints gather and split them by position as for ringtree's vit.
A colwise layer's output stays sharded for the rowwise layer that follows it (Megatron's pairing).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ringtree.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, _ParallelLinear
from ringtree.parallel.tensor.ops import Group
from ringtree.parallel.tensor.sequence import SharedGather, sum_over_sequence

STYLES = ("colwise", "rowwise")
Plan = Mapping[str, str]


def load_plan(path: str | Path) -> dict[str, str]:
    """The plan in a YAML or JSON file of `module name: colwise|rowwise` lines; ValueError if bad."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        raise ValueError(f"cannot read --tp-plan {file}: {e.strerror}; pass an existing YAML file") from None
    try:
        import yaml

        data = yaml.safe_load(text) if file.suffix in (".yaml", ".yml") else json.loads(text)
    except Exception as e:
        raise ValueError(f"--tp-plan {file} is not valid {file.suffix.lstrip('.') or 'JSON'}: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--tp-plan {file} must map module names to colwise or rowwise, e.g. `fc1: colwise`")
    return {str(k): str(v) for k, v in data.items()}


def resolve(model: nn.Module, plan: Plan) -> dict[str, str]:
    """{module name: style} for every module the plan names; ValueError for a name or style that fails."""
    linears = {name: m for name, m in model.named_modules() if name}
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tp plan entry {pattern!r}: unknown style {style!r}; use colwise or rowwise")
        depth = pattern.count(".")
        names = [n for n in linears if n.count(".") == depth and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(
                f"tp plan entry {pattern!r} matches no module of {type(model).__name__}; name one of "
                f"its nn.Linear layers, e.g. {_example(model)}"
            )
        for name in names:
            if not isinstance(linears[name], nn.Linear | _ParallelLinear):
                raise ValueError(
                    f"tp plan entry {pattern!r} names {name}, a {type(linears[name]).__name__}; "
                    "only nn.Linear layers can be colwise or rowwise"
                )
            out[name] = style
    return out


def check_plan(model: nn.Module, plan: Plan, tp: int) -> dict[str, str]:
    """resolve(), then refuse a layer whose split dimension tp does not divide (one sentence)."""
    resolved = resolve(model, plan)
    for name, style in resolved.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, nn.Linear)
        size, what = (layer.out_features, "output") if style == "colwise" else (layer.in_features, "input")
        if size % tp:
            raise ValueError(
                f"tp plan: {name} ({style}) splits its {size} {what} features among tp={tp} ranks, which "
                f"does not divide them; choose --tp among {[d for d in range(1, size + 1) if size % d == 0]}"
            )
    check = getattr(model, "check_tp", None)
    if callable(check):
        check(tp)  # the model's own constraints (a transformer's heads)
    return resolved


def parallelize(
    model: nn.Module, plan: Plan, group: Group, algorithm: str = "ring", sequence_parallel: bool = False
) -> None:
    """Replace the plan's layers by this rank's column/row-parallel shards, in place (no communication).

    sequence_parallel: the model must provide enable_sequence_parallel(group, algorithm) returning
    the module whose residual stream is split along tokens (its replicated parameters' gradients
    are then summed over the group, as each rank saw only its tokens).
    """
    tp = dist.get_world_size(group) if dist.is_initialized() else 1
    shared = SharedGather()  # consecutive colwise layers reading one input gather it once
    for name, style in check_plan(model, plan, tp).items():
        parent, _, leaf = name.rpartition(".")
        dense = model.get_submodule(name)
        assert isinstance(dense, nn.Linear)
        layer: _ParallelLinear
        if style == "colwise":
            layer = ColumnParallelLinear.from_dense(dense, group, algorithm=algorithm)
            layer.shared_gather = shared
        else:
            layer = RowParallelLinear.from_dense(dense, group, algorithm=algorithm)
        layer.sequence_parallel = sequence_parallel
        setattr(model.get_submodule(parent), leaf, layer)
    if sequence_parallel:
        _sequence_parallel(model, group, algorithm)


def _sequence_parallel(model: nn.Module, group: Group, algorithm: str) -> None:
    enable = getattr(model, "enable_sequence_parallel", None)
    if not callable(enable):
        raise ValueError(
            f"--sequence-parallel needs a model that marks where its sequence is split, and "
            f"{type(model).__name__} has no enable_sequence_parallel(); use --model gpt or drop the flag"
        )
    region = enable(group, algorithm)
    sharded = {id(p) for m in region.modules() if isinstance(m, _ParallelLinear) for p in m.parameters()}
    row_biases = [m.bias for m in region.modules() if isinstance(m, RowParallelLinear) and m.bias is not None]
    sharded -= {id(b) for b in row_biases}  # replicated, added after the reduce-scatter: partial gradients
    for p in region.parameters():
        if id(p) not in sharded and p.requires_grad:
            sum_over_sequence(p, group)


def _example(model: nn.Module) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return ", ".join(names[:3]) if names else "(it has none)"
