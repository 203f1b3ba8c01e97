"""ExpertParallel: a model's MoE experts split over ranks borrowed from data parallelism.

The ranks that hold the same dense shard (one data-parallel group; data x context parallel where
context parallelism runs) are folded, as torchtitan and Megatron-Core's parallel folding do: each
run of `ep` consecutive ones forms an expert-parallel (EP) group, whose rank i keeps experts
i E/ep .. (i+1) E/ep - 1 of every MoE layer; the ranks at the same place i of every EP group form
its expert-data-parallel (EDP) group, which holds the same experts:

    data group [0 1 2 3], ep 2:  EP groups [0 1] [2 3];  EDP groups [0 2] [1 3]

Gradients. Dense parameters are averaged over the data group as before (DDP or ZeRO). An expert's
gradient on its owner already sums the contributions of all tokens of its EP group (the all-to-
all's backward brings them), so it is summed over its EDP group and divided by the data group's
size D: (1/D) sum over all D ranks, what EP = 1 averages. Dividing by the EDP group's size alone
would give ep times the right gradient, the bug more than one framework shipped. Expert
parameters are marked `allreduce = False` (Megatron's mark) so that the data-parallel wrappers
leave them to this module.

ZeRO. With `shard_states()` (the trainer's --zero 1-3) the optimizer steps, instead of the
expert parameters, this rank's 1/k of them flattened (k: the EDP group's size): before the step
the gradients are reduce-scattered over the EDP group (and divided by D), after it the stepped
shards are all-gathered back into the experts. The experts' optimizer states are so sharded over
their EDP group, as ZeRO-1 does; their parameters and gradients stay whole. Under pipeline
parallelism (`restrict(stage)`) a rank reduces, steps and shards only its stage's experts.

Balancing. Before every optimizer step (an optimizer pre-hook, so gradient accumulation works)
each router's token counts of the step are summed over the data group and its expert bias moves
by rate x sign(mean - count), centred (DeepSeek-V3, torchtitan).

Sequence parallelism (Megatron-Core's layout with expert-tensor-parallel size 1). Each TP rank
routes its own t/tp tokens over its EP group (whose ranks share its TP coordinate); the router and
the experts stay replicated over the TP group but see different tokens. The TP plan marks them
(ringtree.parallel.tensor.sequence.sum_over_sequence: the norms' mechanism) so their gradients are
summed over the TP group in backward; the expert slices made here keep that mark, and the step's
counts are summed over the TP group too. The EDP sum and the 1/D above then give EP = 1's
gradient, and every TP rank the same biases.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.parallel.mesh import _new_groups
from ringtree.parallel.moe import AllToAllDispatcher, MoE, Router
from ringtree.parallel.tensor.sequence import sequence_group, sum_over_sequence

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def fold(data_groups: list[list[int]], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, EDP groups) carved from each group of ranks that holds the same dense shard."""
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for ranks in data_groups:
        if ep < 1 or len(ranks) % ep:
            raise ValueError(
                f"--ep {ep} must divide the {len(ranks)} data-parallel ranks it borrows from; "
                f"choose --ep among {[d for d in range(1, len(ranks) + 1) if len(ranks) % d == 0]}"
            )
        ep_groups += [ranks[i : i + ep] for i in range(0, len(ranks), ep)]
        edp_groups += [ranks[i::ep] for i in range(ep)]
    return ep_groups, edp_groups


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters the data-parallel wrappers leave alone (this module reduces them)."""
    return [p for p in model.parameters() if getattr(p, "allreduce", True) is False]


class ExpertParallel:
    """Shard every MoE layer of a model over `ep` ranks; reduce and balance the experts at each step.

    ```python
    ep = ExpertParallel(ep=2)          # collective: every rank, same order
    model = ep.apply(model)            # this rank's experts, all-to-all dispatch
    ep.register(optimizer)             # expert gradients and router biases before each step
    ```
    `params` are the experts this rank reduces and steps: this rank's share of every MoE layer's,
    or, once `restrict(stage)` ran (pipeline parallelism), of its stage's layers only.
    data_groups: the groups of ranks that hold the same dense shard (default: the whole world);
    data_group: this rank's one, if already made (its counts are summed over it).
    overlap: compute shared experts while the dispatch and combine all-to-alls travel
    (`AllToAllDispatcher`); False: each all-to-all blocks first.
    """

    def __init__(
        self,
        ep: int,
        data_groups: list[list[int]] | None = None,
        *,
        data_group: dist.ProcessGroup | None = None,
        algorithm: str = "auto",
        overlap: bool = False,
    ) -> None:
        rank = dist.get_rank()
        groups = data_groups or [list(range(dist.get_world_size()))]
        ep_groups, edp_groups = fold(groups, ep)
        self.ep, self.algorithm, self.overlap = ep, algorithm, overlap
        self.ep_ranks, self.ep_group = _new_groups(ep_groups, rank)
        self.edp_ranks, self.edp_group = _new_groups(edp_groups, rank)
        self.ep_rank = self.ep_ranks.index(rank)
        self.data_ranks = next(g for g in groups if rank in g)
        self.data_group = data_group if data_group is not None else _new_groups(groups, rank)[1]
        self.layers: list[MoE] = []
        self.params: list[nn.Parameter] = []
        self.shards: ExpertShards | None = None  # shard_states(): the experts' states over the EDP group
        self.load = 0.0  # max / mean tokens per expert of the last step's worst layer
        self.copies = torch.zeros(2, dtype=torch.float64)  # [dropped, routed] over the run

    def apply(self, model: nn.Module) -> nn.Module:
        """Keep this rank's experts of every MoE layer and dispatch by all-to-all (in place)."""
        self.layers = moe_layers(model)
        for layer in self.layers:
            if layer.num_experts % self.ep:
                raise ValueError(
                    f"--ep {self.ep} must divide the {layer.num_experts} experts; choose --ep among "
                    f"{[d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]}"
                )
            if self.ep > 1:
                self._shard(layer)
        self.params = expert_parameters(model)
        return model

    def _shard(self, layer: MoE) -> None:
        local = layer.num_experts // self.ep
        first = self.ep_rank * local
        for name in EXPERT_WEIGHTS:
            whole = getattr(layer.experts, name)
            mine = nn.Parameter(whole.detach()[first : first + local].clone())
            mine.allreduce = False  # type: ignore[attr-defined]
            marked, group = sequence_group(whole)
            if marked:  # sequence parallelism: each TP rank's experts saw its own tokens
                sum_over_sequence(mine, group)
            setattr(layer.experts, name, mine)
        layer.dispatcher = AllToAllDispatcher(self.ep_group, self.algorithm, self.overlap)

    def restrict(self, stage: nn.Module) -> None:
        """Reduce, step and shard only the experts `stage` holds (under pipeline parallelism, this
        rank's stage: another stage's experts get no gradient here, and are that stage's ranks' to
        step); before shard_states(). The layers stay all of the model's (their counts, their stats)."""
        mine = {id(p) for p in stage.parameters()}
        self.params = [p for p in self.params if id(p) in mine]

    def shard_states(self, algorithm: str = "ring") -> list[nn.Parameter]:
        """What the optimizer steps for the experts with their states sharded over the EDP group
        (nothing when the experts are not split: the data-parallel wrapper owns them)."""
        if not self.params:
            return []
        group = self.edp_group if len(self.edp_ranks) > 1 else None
        self.shards = ExpertShards(self.params, group, len(self.edp_ranks), len(self.data_ranks), algorithm)
        return [self.shards.shard]

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        """Run before_step() before every optimizer.step() (and, with sharded states, after_step()
        after it)."""

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            self.before_step()

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            if self.shards is not None:
                self.shards.after_step()

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)

    def before_step(self) -> None:
        """Expert gradients summed over the EDP group and scaled by 1/D; router biases updated."""
        if self.shards is not None:
            self.shards.before_step()
        else:
            self.reduce_expert_gradients()
        self.balance()

    @torch.no_grad()
    def reduce_expert_gradients(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if len(self.edp_ranks) > 1:
            dist.all_reduce(flat, group=self.edp_group)
        flat /= len(self.data_ranks)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def balance(self) -> None:
        """Sum the step's counts over the data group; move the biases; record load and drops."""
        routers: list[Router] = [layer.router for layer in self.layers]
        if not routers:
            return
        counts = torch.stack([r.tokens_per_expert for r in routers])  # [layers, E]
        dropped = torch.stack([r.dropped for r in routers]).sum(0)
        both = torch.cat([counts.flatten(), dropped])
        if len(self.data_ranks) > 1:
            dist.all_reduce(both, group=self.data_group)
        marked, tp_group = sequence_group(routers[0].weight)
        if marked:  # sequence parallelism: each TP rank counted its own tokens
            dist.all_reduce(both, group=tp_group)
        counts, dropped = both[: counts.numel()].view_as(counts), both[counts.numel() :]
        loads = []
        for router, count in zip(routers, counts, strict=True):
            router.tokens_per_expert.zero_()
            router.dropped.zero_()
            if count.sum() == 0:
                continue  # a layer of another pipeline stage
            loads.append(float(count.max() / count.mean()))
            router.last_load = loads[-1]
            if router.balances_by_bias:
                delta = router.bias_rate * torch.sign(count.mean() - count)
                router.expert_bias += delta - delta.mean()
        self.load = max(loads, default=0.0)
        self.copies += dropped.cpu().double()

    def dropped_fraction(self) -> float:
        return float(self.copies[0] / self.copies[1]) if self.copies[1] > 0 else 0.0


class ExpertShards:
    """The experts' parameters flattened, and this rank's 1/k of them as the one tensor the optimizer
    steps (ZeRO-1 over the EDP group of k ranks); `divisor`: the data-parallel size D."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup | None,
        k: int,
        divisor: int,
        algorithm: str,
    ) -> None:
        self.params, self.group, self.k, self.divisor, self.algorithm = params, group, k, divisor, algorithm
        self.numel = sum(p.numel() for p in params)
        self.size = math.ceil(self.numel / k)
        self.rank = dist.get_rank(group) if group is not None else 0
        whole = self._flat([p.detach() for p in params])
        device = params[0].device if params else torch.device("cpu")
        self.shard = nn.Parameter(
            whole[self.rank * self.size : (self.rank + 1) * self.size].clone().to(device)
        )

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors as one flat fp32 vector padded to k x size."""
        device = tensors[0].device if tensors else torch.device("cpu")
        flat = torch.zeros(self.size * self.k, dtype=torch.float32, device=device)
        if tensors:
            flat[: self.numel] = torch.cat([t.reshape(-1).float() for t in tensors])
        return flat

    @torch.no_grad()
    def refresh(self) -> None:
        """Take this rank's shard from the experts again (after a checkpoint loaded them)."""
        whole = self._flat([p.detach() for p in self.params])
        self.shard.copy_(whole[self.rank * self.size : (self.rank + 1) * self.size].to(self.shard))

    @torch.no_grad()
    def before_step(self) -> None:
        """Reduce-scatter the gradients (missing ones: zero) into the shard's, divided by D."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads)
        mine = torch.empty(self.size, dtype=torch.float32, device=flat.device)
        if self.group is None:
            mine.copy_(flat)
        else:
            comm.reduce_scatter(mine, flat, "sum", self.algorithm, self.group, validate=False)
        self.shard.grad = (mine / self.divisor).to(self.shard.dtype)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather the stepped shards back into the experts."""
        flat = torch.empty(self.size * self.k, dtype=torch.float32, device=self.shard.device)
        if self.group is None:
            flat.copy_(self.shard.float())
        else:
            comm.all_gather(flat, self.shard.detach().float(), self.algorithm, self.group, validate=False)
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
