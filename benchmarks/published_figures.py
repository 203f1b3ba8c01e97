"""Predictions against published measurements.

The record: docs/results/collective-model-accuracy.md, "Published figures".

Run: PYTHONPATH=. python benchmarks/published_figures.py  (pure model arithmetic: no GPU, a few seconds)
"""

from __future__ import annotations

import statistics

from ringtree.sim import INTER, INTRA, Cluster, Link, estimate
from ringtree.sim.network.clusters import get
from ringtree.sim.training.layout import Training
from ringtree.sim.training.plan import StepConfig, predict_step
from ringtree.sim.training.predictor import plan
from ringtree.sim.training.transformer import Transformer

# Narayanan et al. 2021, table 1: (params B, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU).
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Narayanan et al. 2021, figures 13-15, read off the plots (marker centres, 0.74 TFLOP/s per pixel:
# +-1 where a marker is whole, +-2 where another series' marker hides part of it; markers hidden
# entirely are left out). 64 A100s (8 DGX A100), micro-batch 1, full recompute, fp16, sequence 2048,
# vocabulary 51,200 (Megatron-LM examples/sc21/run_figure_1[345].sh). TFLOP/s per GPU as table 1.
# figure 13, GPT 162.2B (32 layers, hidden 20480, 128 heads): (batch, pp, tp, TFLOP/s per GPU)
FIGURE_13 = [
    (32, 2, 32, 103), (32, 4, 16, 134), (32, 8, 8, 140), (32, 16, 4, 111), (32, 32, 2, 91),
    (128, 2, 32, 105), (128, 4, 16, 146), (128, 8, 8, 165), (128, 16, 4, 162), (128, 32, 2, 148),
]  # fmt: skip
# figures 14 (pp x dp, tp 1) and 15 (tp x dp, pp 1), GPT 5.9B (32 layers, hidden 3840, 32 heads):
# (batch, tp, pp, TFLOP/s per GPU); figure 15's batch-32 markers at tp 16 and 32 are hidden
FIGURE_14 = [
    (32, 1, 2, 62), (32, 1, 4, 56), (32, 1, 8, 53), (32, 1, 16, 49), (32, 1, 32, 43),
    (512, 1, 2, 148), (512, 1, 4, 141), (512, 1, 8, 129), (512, 1, 16, 114), (512, 1, 32, 90),
]  # fmt: skip
FIGURE_15 = [
    (32, 2, 1, 56), (32, 4, 1, 54), (32, 8, 1, 54),
    (128, 2, 1, 103), (128, 4, 1, 88), (128, 8, 1, 70), (128, 16, 1, 40), (128, 32, 1, 21),
    (512, 2, 1, 127), (512, 4, 1, 104), (512, 8, 1, 75), (512, 16, 1, 39), (512, 32, 1, 21),
]  # fmt: skip
# Sergeev and Del Balso 2018 (Horovod), figure 6: 512 Pascal GPUs, 4 per server, 25 Gbit/s RoCE.
# (model, parameters, images/s of one P100 at batch 64 from tf_cnn_benchmarks, published efficiency)
HOROVOD = [
    ("inception-v3", 23.8e6, 142, 0.90),
    ("resnet-101", 44.5e6, 115, 0.90),
    ("vgg-16", 138e6, 154, 0.68),
]


def megatron() -> list[tuple[str, float, float]]:
    preset = get("dgx-a100")
    out = []
    for size, a, h, layers, t, p, n, batch, published in MEGATRON:
        model = Transformer(layers, h, a, 2048, 51200)
        rows = [
            plan(
                model,
                Training(batch, b, t, p, "fp16", "full", flash_attention=False),
                preset.cluster(n // 8),
                preset.gpu,
            )
            for b in (1, 2, 4, 8)
            if batch % (n // (t * p) * b) == 0
        ]
        best = min(rows, key=lambda r: r.step_s)
        b = best.details["training"]["micro_batch"]
        out.append(
            (
                f"Megatron-LM GPT {size}B, t={t} p={p}, {n} A100s, b={b}",
                best.hardware_tflops_per_gpu,
                published,
            )
        )
    return out


def megatron_figures() -> list[tuple[str, float, float]]:
    """Figures 13-15: the same TFLOP/s per GPU at each (tp, pp) of 64 A100s, TP 16 and 32 across nodes."""
    preset, out = get("dgx-a100"), []
    shapes = {13: Transformer(32, 20480, 128, 2048, 51200), 14: Transformer(32, 3840, 32, 2048, 51200)}
    table = [(13, b, t, p, f) for b, p, t, f in FIGURE_13]
    table += [(n, *row) for n, rows in ((14, FIGURE_14), (15, FIGURE_15)) for row in rows]
    for figure, batch, t, p, published in table:
        model = shapes[min(figure, 14)]
        run = Training(batch, 1, t, p, "fp16", "full", flash_attention=False)
        best = plan(model, run, preset.cluster(8), preset.gpu)
        name = (
            f"Megatron-LM fig. {figure}, GPT {model.params / 1e9:.1f}B, t={t} p={p}, 64 A100s, batch {batch}"
        )
        out.append((name, best.hardware_tflops_per_gpu or 0.0, published))
    return out


def table(rows: list[tuple[str, float, float]]) -> None:
    print("| case | predicted | published | error |\n|---|---|---|---|")
    for name, predicted, published in rows:
        print(f"| {name} | {predicted:.3g} | {published:.3g} | {predicted / published - 1:+.1%} |")
    errors = [abs(p / q - 1) for _, p, q in rows]
    print(f"\nmedian |error| {statistics.median(errors):.1%} over {len(rows)} cases, max {max(errors):.0%}\n")


def horovod() -> list[tuple[str, float, float]]:
    cluster = Cluster(128, 4, INTRA["pcie-gen3"], INTER["eth-25g"])
    one = Cluster(1, 1, INTRA["pcie-gen3"], INTER["eth-25g"])
    out = []
    for name, params, images_per_s, published in HOROVOD:
        config = StepConfig(int(params), 64 / images_per_s, "fp32", overlap=True, bucket_mb=64, batch_size=64)
        many = predict_step(config, cluster, "ring").samples_per_s
        alone = predict_step(config, one, "ring").samples_per_s
        out.append(
            (f"Horovod {name}, 512 GPUs, 25 Gbit/s: scaling efficiency", many / (512 * alone), published)
        )
    return out


def nccl_trees() -> list[tuple[str, float, float]]:
    """NCCL 2.4 blog (the second seed): trees up to 180x lower latency than rings at 24,576 GPUs."""
    summit = Cluster(4096, 6, INTRA["nvlink-v100"], Link("ib-edr", 2e-6, 12.5e9), nics_per_node=2)
    ratio = estimate("ring", summit, 8) / estimate("double_tree", summit, 8)
    return [("NCCL 2.4, 24,576 GPUs, 8 B: ring / tree latency", ratio, 180.0)]


def main() -> None:
    table(megatron() + horovod() + nccl_trees())
    table(megatron_figures())


if __name__ == "__main__":
    main()
