"""gpt-oss's experts in the planner: their biases and clamped activation priced as the passes
Megatron-Core runs unfused (ringtree.sim.training.moe.unfused_s), and nothing else moved."""

from __future__ import annotations

import dataclasses

import pytest

from ringtree.sim.network.clusters import B200
from ringtree.sim.training import compute, moe
from ringtree.sim.training.layout import Training
from ringtree.sim.training.predictor import layer_times
from ringtree.sim.training.transformer import MODELS, Transformer

GPT_OSS = MODELS["gpt-oss-120b"]
RUN = Training(1280, 4, 1, 1, "bf16", "none", ep=8)


def test_the_gpt_oss_preset_carries_its_configs_biases_and_clamp() -> None:
    """config.json: "swiglu_limit": 7.0, and bias tensors on both expert matrices; no other preset."""
    assert GPT_OSS.expert_bias and GPT_OSS.swiglu_limit == 7.0
    others = [m for name, m in MODELS.items() if name != "gpt-oss-120b"]
    assert not any(m.expert_bias or m.swiglu_limit for m in others)


def test_the_passes_are_their_bytes_and_kernels() -> None:
    """4 x 4,096 tokens, 4 copies each: 65,536 rows of F = h = 2,880 on 128 / 8 = 16 local experts."""
    rows, f, h, local = 4 * 4096 * 4, 2880, 2880, 16
    hbm = B200.hbm_GBps * 1e9
    forward = (16 * f + 12 * h) * rows / hbm + (3 + 3 * local + 1) * compute.KERNEL_S
    backward = (12 * f + 12 * h) * rows / hbm + (2 + 4 * local) * compute.KERNEL_S
    assert moe.unfused_s(GPT_OSS, RUN, B200) == pytest.approx((forward, backward))
    clamp_only = dataclasses.replace(GPT_OSS, expert_bias=False)
    assert moe.unfused_s(clamp_only, RUN, B200) == pytest.approx(
        (16 * f * rows / hbm + 3 * compute.KERNEL_S, 12 * f * rows / hbm + 2 * compute.KERNEL_S)
    )


def test_only_the_moe_layers_of_such_experts_pay_them() -> None:
    plain = dataclasses.replace(GPT_OSS, expert_bias=False, swiglu_limit=0.0)
    forward, backward = moe.unfused_s(GPT_OSS, RUN, B200)
    with_passes, without = layer_times(GPT_OSS, RUN, B200, True), layer_times(plain, RUN, B200, True)
    assert with_passes[0] - without[0] == pytest.approx(forward)
    assert with_passes[1] - without[1] == pytest.approx(backward)
    assert layer_times(GPT_OSS, RUN, B200, False) == layer_times(plain, RUN, B200, False)


def test_a_dense_model_cannot_have_them() -> None:
    with pytest.raises(ValueError, match="MoE layers"):
        Transformer(2, 64, 4, 128, 1000, expert_bias=True)
    with pytest.raises(ValueError, match="swiglu_limit"):
        dataclasses.replace(GPT_OSS, swiglu_limit=-1.0)
