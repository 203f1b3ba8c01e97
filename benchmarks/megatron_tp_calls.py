"""Megatron-LM's 2021 runs (Narayanan et al., table 1 and figures 13-15) against the planner, with and
without a fixed cost per tensor-parallel collective call (docs/accuracy.md, "Small GPT models with
tensor parallelism on A100: where the time goes").

A what-if on the planner's prediction, not a planner option: each row's step plus `calls x cost`,
calls = 6 TP all-reduces (2 forward, 2 in the full recompute, 2 backward) x the stage's layers x the
rank's micro-batches. Table 1's rows run at the micro-batches of Megatron-LM's
`examples/sc21/run_table_1.sh`; the figures' at 1 (`run_figure_1[345].sh`).

    PYTHONPATH=. python benchmarks/megatron_tp_calls.py [--call-ms 0.28]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path
from types import ModuleType

from ringtree.sim.clusters import get
from ringtree.sim.layout import Training
from ringtree.sim.predictor import plan
from ringtree.sim.transformer import Transformer

CALLS_PER_LAYER = 6  # Megatron-LM's TP all-reduces per layer and micro-batch with full recompute
# examples/sc21/run_table_1.sh: MBS of the 1.7B .. 145.6B rows (the larger ones are not small models)
TABLE_1_MICRO_BATCH = {1.7: 16, 3.6: 16, 7.5: 16, 18.4: 8, 39.1: 4, 76.1: 2, 145.6: 2}


def _figures() -> ModuleType:
    """benchmarks/published_figures.py, whose tables of the same paper this reuses."""
    spec = importlib.util.spec_from_file_location(
        "published_figures", Path(__file__).with_name("published_figures.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows() -> list[tuple[str, Transformer, int, int, int, int, int, float]]:
    """(name, model, global batch, micro-batch, TP, PP, GPUs, published TFLOP/s per GPU)."""
    f = _figures()
    out = []
    for size, heads, hidden, layers, t, p, gpus, batch, published in f.MEGATRON:
        if size in TABLE_1_MICRO_BATCH:
            model = Transformer(layers, hidden, heads, 2048, 51200)
            out.append((f"table 1, {size}B", model, batch, TABLE_1_MICRO_BATCH[size], t, p, gpus, published))
    big, small = Transformer(32, 20480, 128, 2048, 51200), Transformer(32, 3840, 32, 2048, 51200)
    out += [(f"figure 13, batch {b}, TP {t}", big, b, 1, t, p, 64, v) for b, p, t, v in f.FIGURE_13]
    out += [(f"figure 14, batch {b}, PP {p}", small, b, 1, t, p, 64, v) for b, t, p, v in f.FIGURE_14]
    out += [(f"figure 15, batch {b}, TP {t}", small, b, 1, t, p, 64, v) for b, t, p, v in f.FIGURE_15]
    return out


def errors(call_s: float) -> list[tuple[str, float, float]]:
    """Each row's throughput error (predicted / published TFLOP/s - 1) without and with the call cost."""
    preset, out = get("dgx-a100"), []
    for name, model, batch, b, t, p, gpus, published in rows():
        run = Training(batch, b, t, p, "fp16", "full", flash_attention=False)
        r = plan(model, run, preset.cluster(gpus // 8), preset.gpu)
        tflops = r.hardware_tflops_per_gpu or 0.0
        calls = CALLS_PER_LAYER * -(-model.layers // p) * r.micro_batches if t > 1 else 0
        with_calls = tflops * r.step_s / (r.step_s + calls * call_s)
        out.append((name, tflops / published - 1, with_calls / published - 1))
    return out


def missing_ms() -> list[tuple[str, float]]:
    """Figure 15's rows: the time the planner is missing (published step - predicted step, the published
    step being the predicted one x predicted / published TFLOP/s) per layer per micro-batch of a rank."""
    preset, out = get("dgx-a100"), []
    for name, model, batch, b, t, p, _gpus, published in rows():
        if name.startswith("figure 15"):
            r = plan(
                model,
                Training(batch, b, t, p, "fp16", "full", flash_attention=False),
                preset.cluster(8),
                preset.gpu,
            )
            step = r.step_s * (r.hardware_tflops_per_gpu or 0.0) / published
            out.append((name, (step - r.step_s) / (model.layers * r.micro_batches) * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--call-ms", type=float, default=0.28, help="Cost per TP call (default %(default)s).")
    args = parser.parse_args()
    result = errors(args.call_ms * 1e-3)
    print("| row | error | with the call cost |\n|---|---|---|")
    for name, before, after in result:
        print(f"| {name} | {before:+.1%} | {after:+.1%} |")
    medians = [statistics.median(abs(r[i]) for r in result) for i in (1, 2)]
    print(f"\n{len(result)} rows: median |error| {medians[0]:.1%} -> {medians[1]:.1%}\n")
    print("| figure 15 row | missing per layer per micro-batch |\n|---|---|")
    for name, ms in missing_ms():
        print(f"| {name} | {ms:.2f} ms |")


if __name__ == "__main__":
    main()
