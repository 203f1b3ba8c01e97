"""The playbook inside `ringtree train`: one spawned world of 2 ranks, compared with plain runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer
from ringtree.train.models import build_model
from ringtree.train.techniques import ShardedStream

QUICK = TrainConfig(epochs=1, progress=False)  # 2 ranks x 32: 23 steps


def train(cfg: TrainConfig) -> dict[str, Any]:
    return Trainer.from_config(cfg).fit()


def skipped_in_agreement() -> dict[str, Any]:
    """Rank 1 alone reads NaN inputs (a stream sharded by rank, uneven lengths): under amp every rank
    skips every step, and both stop together when rank 1's shorter shard runs out."""
    samples = [(torch.full((64,), float("nan") if i % 2 else 0.5), torch.tensor(i % 10)) for i in range(33)]
    stream = ShardedStream(lambda epoch: samples, 0, 1)  # the trainer re-shards it by DP rank
    torch.manual_seed(0)
    net = build_model("mlp")
    before = [p.detach().clone() for p in net.parameters()]
    cfg = replace(QUICK, mode="dp", algorithm="native", amp="bf16", batch_size=4)
    summary = Trainer(net, stream, config=cfg).fit()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
    return {"skipped": summary["skipped_steps"], "steps": summary["steps"], "unchanged": unchanged}


def weights(folder: str) -> dict[str, torch.Tensor]:
    return dict(torch.load(Path(folder) / "last.pt", weights_only=True)["model"])


def run_world(rank: int, ck: str) -> dict[str, Any]:
    out: dict[str, Any] = {"skip": skipped_in_agreement()}
    for name, changes in {
        "plain": {},
        "micro": {"batch_size": 8, "accumulate": 4},  # the same steps as plain's 32 samples
        "ckpt": {"checkpoint_activations": True},
        "prefetch": {"prefetch": True},
        "vit": {"model": "vit"},
        "vit_ckpt": {"model": "vit", "checkpoint_activations": True, "checkpoint_segments": 2},
        "tiny": {"model": "mlp-tiny"},
        "alpha0": {"model": "mlp-tiny", "teacher": f"{ck}/plain", "distill_alpha": 0.0},
        "distilled": {"model": "mlp-tiny", "teacher": f"{ck}/plain/last.pt"},
    }.items():
        out[name] = train(replace(QUICK, checkpoint_dir=f"{ck}/{name}", **changes))
    out["bf16"] = train(replace(QUICK, epochs=8, amp="bf16"))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    ck = tmp_path_factory.mktemp("playbook")
    return spawn(run_world, 2, (str(ck),), timeout_s=240), ck


def test_accumulating_k_micro_batches_equals_one_k_times_larger_batch(
    world: tuple[list[dict[str, Any]], Path],
) -> None:
    results, ck = world
    assert results[0]["micro"]["steps"] == results[0]["plain"]["steps"] == 23
    plain, micro = weights(f"{ck}/plain"), weights(f"{ck}/micro")
    for name, tensor in plain.items():
        torch.testing.assert_close(micro[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(
    world: tuple[list[dict[str, Any]], Path],
) -> None:
    assert [r["skip"] for r in world[0]] == [{"skipped": 4, "steps": 4, "unchanged": True}] * 2


@pytest.mark.parametrize(("plain", "other"), [("plain", "ckpt"), ("plain", "prefetch"), ("vit", "vit_ckpt")])
def test_checkpointing_and_prefetching_train_the_same_model(
    world: tuple[list[dict[str, Any]], Path], plain: str, other: str
) -> None:
    results, ck = world
    a, b = weights(f"{ck}/{plain}"), weights(f"{ck}/{other}")
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert results[0]["ckpt"]["checkpoint_segments"] == 2  # sqrt(5 layers of the mlp), rounded
    assert (
        results[0]["vit_ckpt"]["checkpoint_segments"] == 2 and results[0]["plain"]["checkpoint_segments"] == 0
    )


def test_distillation_uses_the_teacher_and_alpha_0_is_plain_training(
    world: tuple[list[dict[str, Any]], Path],
) -> None:
    results, ck = world
    tiny, distilled = results[0]["tiny"], results[0]["distilled"]
    assert tiny["parameters"] * 17 < results[0]["plain"]["parameters"]
    assert distilled["distilled_from"] == f"{ck}/plain/last.pt" and tiny["distilled_from"] is None
    for name, tensor in weights(f"{ck}/tiny").items():
        torch.testing.assert_close(weights(f"{ck}/alpha0")[name], tensor, msg=name)
    assert not torch.allclose(
        weights(f"{ck}/distilled")["layers.0.weight"], weights(f"{ck}/tiny")["layers.0.weight"]
    )


def test_bf16_still_reaches_the_accuracy_target(world: tuple[list[dict[str, Any]], Path]) -> None:
    bf16 = world[0][0]["bf16"]
    assert bf16["amp"] == "bf16" and bf16["accuracy"] >= 0.93 and bf16["skipped_steps"] == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs a CUDA device"),
        (["--distill-alpha", "0.2"], "--distill-alpha needs --teacher"),
        (["--amp", "int8"], "unknown amp 'int8'"),
        (["--checkpoint-segments", "3"], "add --checkpoint-activations"),
        (["--teacher", "/nonexistent/ck"], "no teacher checkpoint at /nonexistent/ck;"),
        (["--teacher", "ck", "--distill-alpha", "1.5"], "between 0 and 1"),
    ],
)
def test_cli_rejects_bad_playbook_options(args: list[str], words: str) -> None:
    out = CliRunner().invoke(app, ["train", *args])
    text = " ".join(out.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())  # unwrap rich's box
    assert out.exit_code != 0 and words in text, out.output
