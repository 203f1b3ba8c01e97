"""One ZeRO training step on a clock: which rank holds which shard of parameters, gradients and
optimizer states after every step, and what each step communicates.

A model of `layers` equal layers (one bucket each, as ShardedDataParallel groups them), p data-
parallel ranks. Per layer and kind a rank holds the whole tensor, only its own shard (rank r holds
shard r: 1/p of it), or nothing. Memory is counted in units of one layer's fp32 parameters
(gradients 1, AdamW's two moments 2), so DDP holds 4 x layers units on every rank. The steps
follow ringtree/parallel/sharded.py: zero 1 all-reduces the gradients and keeps block r, zero 2
reduce-scatters each layer's gradients as backward produces them, zero 3 also gathers each
layer's parameters before its forward and its backward and frees them after.
"""

from __future__ import annotations

from dataclasses import dataclass

WHOLE, SHARD, NONE = "whole", "shard", "none"
KINDS = ("params", "grads", "optimizer")
UNITS = {"params": 1.0, "grads": 1.0, "optimizer": 2.0}  # AdamW: exp_avg and exp_avg_sq
ZERO_SHOWS = ("zero1", "zero2", "zero3")


@dataclass(frozen=True)
class ZeroStep:
    """What happens in one step and what every rank holds after it ([kind][layer])."""

    action: str
    comm: str  # the collective, or "" when the step only computes
    holds: dict[str, tuple[str, ...]]

    def units(self, p: int) -> float:
        """Model state held per rank, in units of one layer's parameters."""
        per = {WHOLE: 1.0, SHARD: 1.0 / p, NONE: 0.0}
        return sum(UNITS[k] * per[h] for k, hs in self.holds.items() for h in hs)


def zero_steps(zero: int, layers: int = 4) -> list[ZeroStep]:
    """The steps of one training step (forward, backward, optimizer, gather) at ZeRO `zero`."""
    if zero not in (1, 2, 3):
        raise ValueError(f"zero must be 1, 2 or 3, got {zero}")
    n = range(layers)
    params = [SHARD if zero == 3 else WHOLE for _ in n]
    grads = [NONE for _ in n]
    optimizer = [SHARD for _ in n]
    steps = [ZeroStep("start of the step", "", _snapshot(params, grads, optimizer))]

    def add(action: str, comm: str) -> None:
        steps.append(ZeroStep(action, comm, _snapshot(params, grads, optimizer)))

    for i in n:  # forward, first layer first
        if zero == 3:
            params[i] = WHOLE
            add(f"forward L{i}", f"all-gather params L{i}")
            params[i] = SHARD
        else:
            add(f"forward L{i}", "")
    for i in reversed(n):  # backward, last layer first: what it holds while the layer computes
        if zero == 3:
            params[i] = WHOLE
        grads[i] = WHOLE
        gather = f"all-gather params L{i}, then " if zero == 3 else ""
        add(f"backward L{i}", "" if zero == 1 else f"{gather}reduce-scatter grads L{i}")
        if zero > 1:
            grads[i] = SHARD
        if zero == 3:
            params[i] = SHARD
    if zero == 1:  # the whole gradients stay until the next step's forward
        add("end of backward", "all-reduce grads, step with block r")
    add("optimizer step on shard r", "")
    if zero < 3:
        add("parameters updated", "all-gather params")
    return steps


def _snapshot(params: list[str], grads: list[str], optimizer: list[str]) -> dict[str, tuple[str, ...]]:
    return {"params": tuple(params), "grads": tuple(grads), "optimizer": tuple(optimizer)}


def cell(holds: dict[str, tuple[str, ...]], rank: int) -> str:
    """A rank's holdings in one line: per kind a character per layer (W whole, r its shard (s from
    rank 10 on), . none)."""
    mark = {WHOLE: "W", SHARD: str(rank) if rank < 10 else "s", NONE: "."}
    return " ".join(f"{k[0].upper()} {''.join(mark[h] for h in hs)}" for k, hs in holds.items())


def ddp_units(layers: int) -> float:
    return sum(UNITS.values()) * layers


def plot_zero(steps: list[ZeroStep], zero: int, p: int, path: object) -> None:
    """One panel per kind: layers against steps, dark where whole, light where rank r's shard only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    level = {NONE: 0, SHARD: 1, WHOLE: 2}
    layers = len(steps[0].holds["params"])
    fig, axes = plt.subplots(4, 1, figsize=(max(6.0, 0.55 * len(steps)), 7.5), sharex=True)
    cmap = ListedColormap(["#f4f4f4", "#9ecae1", "#08519c"])
    for ax, kind in zip(axes, KINDS, strict=False):
        grid = [[level[s.holds[kind][i]] for s in steps] for i in range(layers)]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, aspect="auto")
        ax.set_yticks(range(layers), [f"L{i}" for i in range(layers)])
        ax.set_ylabel(kind)
    units = [s.units(p) / ddp_units(layers) for s in steps]
    axes[3].plot(range(len(steps)), units, marker="o")
    axes[3].set_ylim(0, 1.05)
    axes[3].set_ylabel("state / DDP's")
    axes[3].set_xticks(range(len(steps)), [s.action for s in steps], rotation=60, ha="right", fontsize=7)
    axes[0].set_title(
        f"ZeRO-{zero} on {p} ranks: dark = whole, light = rank r's shard only (1/{p}), pale = none",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
