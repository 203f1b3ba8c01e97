"""--model moe in the trainer: MoE x EP x ZeRO x TP x PP, and MoE x CP x EP (EP over DP x CP), train
to the losses of one process; under PP each stage steps and shards only its own experts."""

from __future__ import annotations

from typing import Any

import pytest

from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer
from tests.moe_data import SMALL, train


@pytest.mark.parametrize("ep", [2])
def test_moe_with_ep_zero_tp_and_pp_trains_to_the_losses_of_one_process(ep: int) -> None:
    plain = train(0, {"batch_size": 64})  # a world of one: the same 64 sequences a step as DP 2 x 32
    composed = {"ep": ep, "zero": 1, "tp": 2, "pp": 2, "micro_batches": 2, "batch_size": 16}
    every = spawn(train, 8, (composed,), timeout_s=240)[0]
    assert (plain["dp"], plain["ep"], every["dp"], every["ep"], every["tp"], every["pp"]) == (
        1,
        1,
        2,
        ep,
        2,
        2,
    )
    assert plain["steps"] == every["steps"] == 4
    for key in ("train_loss", "final_loss", "test_loss"):
        assert every[key] == pytest.approx(plain[key], rel=1e-4), key
    assert every["experts"] == 8 and every["top_k"] == 2 and every["tokens_dropped"] == 0.0
    assert every["a2a_time_s"] > 0.0 and plain["a2a_time_s"] == 0.0
    context = spawn(train, 4, ({"cp": 2, "ep": 4, "batch_size": 32},), timeout_s=240)[0]
    assert (context["dp"], context["cp"], context["ep"]) == (2, 2, 4)  # EP folded over DP x CP
    for key in ("train_loss", "final_loss", "test_loss"):
        assert context[key] == pytest.approx(plain[key], rel=1e-4), key


def test_every_moe_option_trains_in_a_world_of_one() -> None:
    options = {
        "moe_every": 2,
        "shared_experts": 1,
        "router_score": "sigmoid",
        "router_aux_loss": 0.01,
        "capacity_factor": 1.0,
        "batch_size": 64,
    }
    summary = Trainer.from_config(TrainConfig(**SMALL, **options)).fit()
    assert summary["steps"] == 4 and summary["final_loss"] < summary["test_loss"] * 10
    assert 0.0 < summary["tokens_dropped"] < 0.5  # capacity 1.0 drops what exceeds the balanced load
    assert (summary["experts"], summary["ep"], summary["capacity_factor"]) == (8, 1, 1.0)
    assert summary["router_aux_loss"] == 0.01 and summary["moe_every"] == 2


def test_the_expert_bias_moves_toward_the_underloaded_experts_at_the_step() -> None:
    import torch
    import torch.distributed as dist

    from ringtree.parallel import ExpertParallel, MoE

    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layer = MoE(8, 8, 4, top_k=1, bias_rate=0.1)
        parallel = ExpertParallel(1)
        parallel.apply(layer)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
        parallel.register(optimizer)
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
        for _ in range(2):  # accumulation: both micro-batches counted at the one step
            layer(torch.randn(16, 8)).sum().backward()
        assert layer.router.tokens_per_expert.tolist() == [32.0, 0.0, 0.0, 0.0]
        optimizer.step()
        bias = layer.router.expert_bias.tolist()
        assert bias == pytest.approx([4.85, 0.05, 0.05, 0.05])  # -0.1 and +0.1 x 3, centred
        assert parallel.load == 4.0 and layer.router.tokens_per_expert.sum() == 0
    finally:
        dist.destroy_process_group()


def _stage_experts(rank: int) -> dict[str, Any]:
    """EP 2 x PP 2 x ZeRO 1 on 4 ranks, parallelized: which experts this rank steps and shards."""
    import torch
    import torch.nn.functional as F

    from ringtree.parallel import Mesh
    from ringtree.parallel.expert import expert_parameters
    from ringtree.train.loss import TrainingLoss
    from ringtree.train.models import build_model
    from ringtree.train.parallelize import parallelize
    from ringtree.train.techniques import MixedPrecision

    cfg = TrainConfig(**SMALL, ep=2, zero=1, pp=2, micro_batches=2, batch_size=16)
    mesh = Mesh(pp=2)
    net = build_model("moe")
    loss = TrainingLoss(F.cross_entropy, cfg, None, MixedPrecision("off", "cpu"))
    made = parallelize(
        net, cfg, mesh, torch.device("cpu"), loss=loss, sample=lambda: torch.zeros(16, 8).long()
    )
    assert made.pipe is not None and made.experts is not None and made.experts.shards is not None
    names = {id(p): n for n, p in net.named_parameters()}
    stage = made.pipe.stages[mesh.pp_rank]
    return {
        "stage": mesh.pp_rank,
        "own": sorted(names[id(p)] for p in expert_parameters(stage)),
        "all": sorted(names[id(p)] for p in expert_parameters(net)),
        "stepped": sorted(names[id(p)] for p in made.experts.params),
        "sharded": sorted(names[id(p)] for p in made.experts.shards.params),
        "elements": made.experts.shards.numel,
        "own_elements": sum(p.numel() for p in expert_parameters(stage)),
        "shard": made.experts.shards.shard.numel(),
    }


def test_under_pp_a_stage_steps_and_shards_only_its_own_experts() -> None:
    """Another stage's experts get no gradient here: in the shard, weight decay alone would move them."""
    results = spawn(_stage_experts, 4, timeout_s=120)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]  # Megatron's order: pp outermost
    for r in results:
        assert r["own"] and r["own"] != r["all"]  # each stage holds some of the MoE layers
        assert r["stepped"] == r["sharded"] == r["own"]
        assert r["elements"] == r["shard"] == r["own_elements"]  # DP 2 = EP 2: EDP groups of 1
    assert sorted(results[0]["own"] + results[2]["own"]) == results[0]["all"]
