"""--model moe in the trainer: MoE x EP x ZeRO x TP x PP trains to the losses of plain data parallelism."""

from __future__ import annotations

from typing import Any

import pytest

from ringtree.launch import spawn
from ringtree.train import TrainConfig, Trainer

SMALL = {
    "model": "moe",
    "dataset": "tests.moe_data:small",
    "epochs": 1,
    "progress": False,
    "straggler_every": 0,
}


def _train(rank: int, options: dict[str, Any]) -> dict[str, Any]:
    return Trainer.from_config(TrainConfig(**SMALL, **options)).fit()


@pytest.mark.parametrize("ep", [2])
def test_moe_with_ep_zero_tp_and_pp_trains_to_the_losses_of_data_parallelism(ep: int) -> None:
    plain = spawn(_train, 2, ({"batch_size": 32},), timeout_s=240)[0]
    composed = {"ep": ep, "zero": 1, "tp": 2, "pp": 2, "micro_batches": 2, "batch_size": 16}
    every = spawn(_train, 8, (composed,), timeout_s=240)[0]
    assert (plain["dp"], plain["ep"], every["dp"], every["ep"], every["tp"], every["pp"]) == (
        2,
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
