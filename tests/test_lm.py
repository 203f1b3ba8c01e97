"""The gpt, the sort task, TP plans for any model and sequence parallelism, against plain torch.

Multi-rank cases run in one spawned world of 2 ranks (gloo, hard timeout) and return numbers; the
tests compare here. Tolerances: float32 with a different summation order, 1e-5 on parameters after
5 SGD steps, 1e-4 relative on losses of the first steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.parallel.tensor import ColumnParallelLinear, RowParallelLinear, copy_to_dense
from ringtree.parallel.tensor.plan import check_plan, parallelize
from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer
from ringtree.train.factories import cross_entropy
from ringtree.train.gpt import GPT, GPTConfig
from ringtree.train.language import IGNORE, LENGTH, SEP, baseline_accuracy, sort_task
from ringtree.train.memory import ActivationMeter
from ringtree.train.models import recipe
from ringtree.train.tensor_parallel import model_state
from ringtree.train.trainer import preflight

MLP_PLAN = {"0": "colwise", "2": "rowwise"}
GPT_SMALL = GPTConfig(dim=32, depth=2, heads=4, kv_heads=2, hidden=64)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


# -- single process -----------------------------------------------------------------------------


def test_gpt_is_causal_and_its_shapes_follow_the_tokens() -> None:
    torch.manual_seed(0)
    model = GPT(GPT_SMALL)
    ids = torch.randint(0, GPT_SMALL.vocab, (2, 8))
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % GPT_SMALL.vocab
    out, out2 = model(ids), model(changed)
    assert out.shape == (2, 8, GPT_SMALL.vocab)
    assert torch.equal(out[:, :5], out2[:, :5])  # a later token never changes an earlier prediction
    assert not torch.allclose(out[:, 5:], out2[:, 5:])


def test_gqa_attention_equals_repeated_key_value_heads() -> None:
    torch.manual_seed(0)
    attn = GPT(GPT_SMALL).blocks[0].attn
    x = torch.randn(2, 6, GPT_SMALL.dim)
    from ringtree.train.gpt import rotary

    e = attn.head_dim
    q = rotary(attn.q(x).view(2, 6, -1, e), 1e4).transpose(1, 2)
    k = rotary(attn.k(x).view(2, 6, -1, e), 1e4).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.v(x).view(2, 6, -1, e).transpose(1, 2).repeat_interleave(2, dim=1)
    mask = torch.ones(6, 6).tril().bool()
    scores = (q @ k.transpose(-1, -2) / e**0.5).masked_fill(~mask, float("-inf"))
    ref = attn.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, -1))
    torch.testing.assert_close(attn(x), ref, atol=1e-5, rtol=1e-5)


def test_tied_gpt_shares_its_embedding_with_its_head() -> None:
    tied, untied = GPT(GPTConfig(tied=True)), GPT(GPTConfig())
    assert tied.head.out.weight is tied.embed.tokens.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 20 * 64


def test_sort_task_scores_only_the_sorted_half() -> None:
    x, y = sort_task(5)
    for xs, ys in zip(x, y, strict=True):
        assert int(xs[LENGTH]) == SEP
        assert (ys[:LENGTH] == IGNORE).all()  # the prompt's next tokens are not scored
        assert ys[LENGTH - 1 :][1:].tolist() == sorted(xs[:LENGTH].tolist())  # the answer: sorted prompt
        assert xs[LENGTH + 1 :].tolist() == ys[LENGTH:-1].tolist()  # inputs are targets shifted by one
    assert 0.2 < baseline_accuracy() < 0.35


def test_sequence_cross_entropy_is_torchs_over_the_scored_tokens() -> None:
    out, y = torch.randn(2, 4, 5), torch.tensor([[IGNORE, 1, 2, 3], [IGNORE, IGNORE, 0, 4]])
    ref = F.cross_entropy(out.permute(0, 2, 1), y)  # torch's [b, V, t] layout
    torch.testing.assert_close(cross_entropy(out, y), ref)


def test_plan_naming_a_missing_module_or_an_indivisible_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'fc9' matches no module of Sequential"):
        check_plan(_mlp(), {"fc9": "colwise"}, 2)
    with pytest.raises(ValueError, match=r"2 \(colwise\) splits its 3 output features among tp=2"):
        check_plan(_mlp(), {"2": "colwise"}, 2)
    with pytest.raises(ValueError, match=r"names 1, a ReLU"):
        check_plan(_mlp(), {"1": "colwise"}, 2)
    with pytest.raises(ValueError, match=r"unknown style 'diagonal'"):
        check_plan(_mlp(), {"0": "diagonal"}, 2)
    with pytest.raises(ValueError, match=r"--tp 8 must divide the gpt's heads=4"):
        check_plan(GPT(), GPT.tp_plan, 8)
    assert check_plan(GPT(), GPT.tp_plan, 2)["blocks.3.mlp.down"] == "rowwise"


def test_tied_gpt_refuses_a_pipeline_and_gpt_refuses_digits() -> None:
    with pytest.raises(ValueError, match="cannot share their weight"):
        preflight(TrainConfig(model="gpt-tied", dataset="sort", pp=2))
    with pytest.raises(ValueError, match="reads token sequences, not digits; add dataset=sort"):
        TrainConfig(model="gpt")
    assert recipe("gpt")[1].dataset == "sort" and recipe("mlp")[1].dataset is None


def test_bad_tp_plan_file_exits_2_with_one_sentence(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("layers.9: colwise\n")
    result = CliRunner().invoke(app, ["train", "--model", "mlp", "--tp", "2", "--tp-plan", str(plan)])
    assert result.exit_code == 2
    assert "'layers.9' matches no module of MLP" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, ["train", "--model", "gpt", "--sequence-parallel"])
    assert result.exit_code == 2 and "--sequence-parallel splits tokens among --tp ranks" in result.output


# -- two ranks ----------------------------------------------------------------------------------


def _mlp_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 10, generator=g)
    return TensorDataset(x, (x[:, :3].argmax(dim=1)))


def _train_mlp(tp: int, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    plan = MLP_PLAN if tp > 1 else None
    cfg = TrainConfig(tp=tp, tp_plan=plan, batch_size=batch, epochs=1, progress=False, straggler_every=0)
    return Trainer(_mlp(), _mlp_data(), F.cross_entropy, cfg, test_dataset=_mlp_data()).fit()


def _gpt_steps(sequence_parallel: bool, tp: int, saved: list[int] | None = None) -> list[torch.Tensor]:
    """5 SGD steps of a small gpt, parameters gathered back to dense shapes (saved: activation bytes)."""
    torch.manual_seed(0)
    model = GPT(GPT_SMALL)
    if tp > 1:
        parallelize(model, GPT.tp_plan, None, sequence_parallel=sequence_parallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam would magnify rounding of ~0 gradients
    x, y = sort_task(8, length=4)  # 8 tokens: 4 per rank under SP
    for _ in range(5):
        opt.zero_grad()
        meter = ActivationMeter(model)
        with meter.forward():
            loss = cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        if saved is not None:
            saved.append(meter.peak_bytes)
        opt.step()
    dense = GPT(GPT_SMALL)
    copy_to_dense(model, dense)
    return [p.detach().clone() for p in dense.parameters()]


def _world(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tp2": _train_mlp(2, 32), "tp1": _train_mlp(1, 16)}  # dp 2 x 16 = 32 a step
    saved: dict[bool, list[int]] = {False: [], True: []}
    plain, sp = _gpt_steps(False, 2, saved[False]), _gpt_steps(True, 2, saved[True])
    dense = _gpt_steps(False, 1)
    out["saved"] = {k: max(v) for k, v in saved.items()}
    out["sp_vs_tp"] = max(float((a - b).abs().max()) for a, b in zip(plain, sp, strict=True))
    out["tp_vs_dense"] = max(float((a - b).abs().max()) for a, b in zip(plain, dense, strict=True))
    model = GPT(GPT_SMALL)
    parallelize(model, GPT.tp_plan, None)
    out["layers"] = [
        type(m).__name__ for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    out["q_shape"] = tuple(model.blocks[0].attn.q.weight.shape)
    torch.manual_seed(1)
    sharded, ids = GPT(), sort_task(2)[0]
    parallelize(sharded, GPT.tp_plan, None, sequence_parallel=True)
    dense = GPT()
    names = [(n, tuple(q.shape)) for n, q in dense.named_parameters()]
    dense.load_state_dict(model_state(sharded, names))  # what a checkpoint of `--model gpt --tp 2` holds
    out["saved_dense_vs_tp"] = float((dense(ids) - sharded(ids)).abs().max())
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(_world, 2, timeout_s=120)


def test_a_users_mlp_trains_with_a_tp_plan_to_the_loss_of_tp_1(world: list[dict[str, Any]]) -> None:
    tp2, tp1 = world[0]["tp2"], world[0]["tp1"]
    assert (tp2["tp"], tp2["dp"], tp1["tp"], tp1["dp"]) == (2, 1, 1, 2)
    assert tp2["steps"] == tp1["steps"] == 4
    for key in ("final_loss", "test_loss"):
        assert tp2[key] == pytest.approx(tp1[key], rel=1e-4), key
    assert tp2["accuracy"] == pytest.approx(tp1["accuracy"], abs=1e-9)


def test_the_gpt_carries_its_plan_and_keeps_whole_heads_per_rank(world: list[dict[str, Any]]) -> None:
    layers = world[0]["layers"]
    assert layers.count("ColumnParallelLinear") == 5 * GPT_SMALL.depth  # q, k, v, gate, up
    assert layers.count("RowParallelLinear") == 2 * GPT_SMALL.depth  # o, down
    assert world[0]["q_shape"] == (GPT_SMALL.dim // 2, GPT_SMALL.dim)  # 2 of the 4 query heads


def test_sequence_parallel_parameters_equal_plain_tp_after_5_steps(world: list[dict[str, Any]]) -> None:
    for rank in world:
        assert rank["sp_vs_tp"] <= 1e-5
        assert rank["tp_vs_dense"] <= 1e-5  # and plain TP equals the dense model


def test_a_tp_checkpoint_is_the_dense_gpt(world: list[dict[str, Any]]) -> None:
    assert world[0]["saved_dense_vs_tp"] <= 1e-5


def test_sequence_parallel_saves_fewer_activation_bytes(world: list[dict[str, Any]]) -> None:
    saved = world[0]["saved"]
    assert saved[True] < 0.9 * saved[False], saved  # norms and residuals hold half the tokens (0.86 here)


def _composed(rank: int) -> dict[str, Any]:
    """The gpt with TP 2 x PP 2, sequence parallel, interleaved, against plain DP 4 (8 sequences a step)."""
    x, y = sort_task(24, length=4)
    train, test = TensorDataset(x[:16], y[:16]), TensorDataset(x[16:], y[16:])
    quiet = {"epochs": 1, "progress": False, "straggler_every": 0, "lr": 1e-2}
    layouts = {
        "plain": TrainConfig(batch_size=2, **quiet),
        "composed": TrainConfig(
            tp=2, pp=2, sequence_parallel=True, schedule="interleaved", micro_batches=2, batch_size=4, **quiet
        ),
    }
    out = {}
    for name, cfg in layouts.items():
        torch.manual_seed(0)
        out[name] = Trainer(GPT(GPT_SMALL), train, cross_entropy, cfg, test_dataset=test).fit()
    return out


def test_tp_pp_sequence_parallel_interleaved_trains_as_plain_dp() -> None:
    result = spawn(_composed, 4, timeout_s=180)[0]
    plain, composed = result["plain"], result["composed"]
    assert (composed["tp"], composed["pp"], composed["dp"], plain["dp"]) == (2, 2, 1, 4)
    assert composed["sequence_parallel"] is True and composed["virtual_stages"] == 2
    assert composed["steps"] == plain["steps"] == 2
    for key in ("final_loss", "test_loss"):
        assert composed[key] == pytest.approx(plain[key], rel=1e-4), key
