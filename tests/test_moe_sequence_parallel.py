"""MoE with expert parallelism under TP + sequence parallelism (each TP rank routes its own tokens):
EP 2 x TP 2 + SP on 4 ranks against the same run without SP and against EP 1, in losses, every
parameter's gradient and the balancing biases; then the trainer's
`--ep 2 --tp 2 --sequence-parallel --zero 1` against one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ringtree.parallel import DistributedDataParallel, ExpertParallel, Mesh
from ringtree.parallel.expert import EXPERT_WEIGHTS
from ringtree.parallel.tensor.plan import parallelize
from ringtree.processes import spawn
from ringtree.train.gpt import GPTConfig
from ringtree.train.moe import MoEGPT, MoESettings
from tests.moe_data import train

SMALL_GPT = GPTConfig(vocab=20, dim=32, depth=2, heads=4, kv_heads=2, hidden=64, max_len=16)
SEQ, BATCH, STEPS = 8, 4, 2


def _batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    ids = torch.randint(0, SMALL_GPT.vocab, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _run(mesh: Mesh, ep: int, sp: bool) -> dict[str, Any]:
    """Two SGD steps of a 2-layer MoE gpt (layer 0 balanced by the bias, layer 1 by the aux loss)."""
    torch.manual_seed(0)
    net = MoEGPT(SMALL_GPT, MoESettings(experts=4, top_k=2, bias_rate=0.05))
    net.blocks[1].mlp.router.aux_loss = 0.1  # type: ignore[union-attr]
    parallelize(net, net.tp_plan, mesh.tp_group, sequence_parallel=sp)
    experts = ExpertParallel(ep, mesh.shape.dp_cp_groups(), data_group=mesh.dp_cp_group, algorithm="native")
    experts.apply(net)
    model = DistributedDataParallel(net, process_group=mesh.dp_cp_group)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    experts.register(optimizer)
    losses, grads, biases = [], [], []
    for step in range(STEPS):
        ids, labels = _batch(mesh.dp_rank, step)
        loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()  # the pre-hook reduces the experts and moves the biases
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
        biases.append(torch.stack([m.router.expert_bias.clone() for m in experts.layers]))
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "biases": biases, "local": 4 // ep, "ep_rank": experts.ep_rank}


def _errors(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Largest difference of each step's loss, every gradient and the biases (against EP 1: got's
    slice of the experts)."""
    first = got["ep_rank"] * got["local"]
    errors: dict[str, float] = {}
    for step in range(STEPS):
        errors[f"loss{step}"] = abs(got["losses"][step] - want["losses"][step])
        errors[f"bias{step}"] = float((got["biases"][step] - want["biases"][step]).abs().max())
        mine, theirs = got["grads"][step], want["grads"][step]
        errors[f"count{step}"] = float(len(mine) != len(theirs))
        for name, grad in mine.items():
            expected = theirs[name]
            if name.split(".")[-1] in EXPERT_WEIGHTS and expected.shape != grad.shape:  # routed experts
                expected = expected[first : first + got["local"]]
            errors[f"{name}@{step}"] = float((grad - expected).abs().max())
    return errors


def _world(rank: int) -> dict[str, Any]:
    mesh = Mesh(tp=2)  # TP groups {0, 1} {2, 3}; DP groups {0, 2} {1, 3}: EP 2 over each DP group
    sp = _run(mesh, 2, True)
    return {
        "no_sp": _errors(sp, _run(mesh, 2, False)),
        "ep1": _errors(sp, _run(mesh, 1, False)),
        "bias": sp["biases"][-1].tolist(),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_world, 4, timeout_s=120)


@pytest.mark.parametrize("against", ["no_sp", "ep1"])
def test_ep2_tp2_with_sequence_parallel_equals_the_run_without_it_in_losses_gradients_and_biases(
    results: list[dict[str, Any]], against: str
) -> None:
    for r in results:
        bad = {k: v for k, v in r[against].items() if v > 1e-5}
        assert not bad, bad
        assert len(r[against]) > 40  # every parameter of the model compared, at both steps


def test_the_balancing_bias_moved_and_is_the_same_on_every_rank(results: list[dict[str, Any]]) -> None:
    bias = torch.tensor(results[0]["bias"])  # [layer, expert]: layer 1 balances by the aux loss
    assert bias[0].abs().max() > 0.0 and bias[1].abs().max() == 0.0
    assert all(r["bias"] == results[0]["bias"] for r in results)  # the TP ranks counted all tokens


def test_the_trainer_runs_ep_zero_and_sequence_parallel_to_the_losses_and_load_of_one_process() -> None:
    options = {"ep": 2, "tp": 2, "sequence_parallel": True, "zero": 1, "batch_size": 32}
    with_sp = spawn(train, 4, (options,), timeout_s=120)[0]
    plain = train(0, {"batch_size": 64})  # EP 1 in a world of one: the same 64 sequences a step
    assert with_sp["sequence_parallel"] is True and "sequence_parallel" not in plain  # tp 1: no key
    assert (with_sp["ep"], with_sp["tp"], with_sp["dp"], with_sp["steps"]) == (2, 2, 2, plain["steps"])
    for key in ("train_loss", "final_loss", "test_loss", "expert_load"):
        assert with_sp[key] == pytest.approx(plain[key], rel=1e-4), key
