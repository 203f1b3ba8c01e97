"""Megatron-LM's 2021 runs (Narayanan et al., table 1 and figures 13-15) against the planner
(docs/results/planner-accuracy.md, "Small GPT models with tensor parallelism on A100").

Each row is priced as `Training(batch, b, t, p, "fp16", "full", flash_attention=False)` on `dgx-a100`
nodes: table 1's rows at the micro-batches of Megatron-LM's `examples/sc21/run_table_1.sh`, the
figures' at 1 (`run_figure_1[345].sh`). Figure 14 at batch 512 (TP 1) is the set the planner's
per-layer cost of this stack (`ringtree.sim.training.compute.UNFUSED_LAYER_S`) was fitted to; the other rows
are held out.

    PYTHONPATH=. python benchmarks/megatron_2021.py   (model arithmetic, a few seconds)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path
from types import ModuleType

from ringtree.sim.network.clusters import get
from ringtree.sim.training.layout import Training
from ringtree.sim.training.predictor import plan
from ringtree.sim.training.transformer import Transformer

# examples/sc21/run_table_1.sh: MBS of the 1.7B .. 145.6B rows (the larger ones are not small models)
TABLE_1_MICRO_BATCH = {1.7: 16, 3.6: 16, 7.5: 16, 18.4: 8, 39.1: 4, 76.1: 2, 145.6: 2}
FITTED = "figure 14, batch 512"  # the rows UNFUSED_LAYER_S was chosen on


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


def errors() -> list[tuple[str, float]]:
    """Each row's throughput error: predicted / published hardware TFLOP/s per GPU - 1."""
    preset, out = get("dgx-a100"), []
    for name, model, batch, b, t, p, gpus, published in rows():
        run = Training(batch, b, t, p, "fp16", "full", flash_attention=False)
        r = plan(model, run, preset.cluster(gpus // 8), preset.gpu)
        out.append((name, (r.hardware_tflops_per_gpu or 0.0) / published - 1))
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    result = errors()
    print("| row | error | set |\n|---|---|---|")
    for name, error in result:
        print(f"| {name} | {error:+.1%} | {'fitted' if name.startswith(FITTED) else 'held out'} |")
    held = [abs(e) for n, e in result if not n.startswith(FITTED)]
    print(f"\n{len(result)} rows: median |error| {statistics.median(abs(e) for _, e in result):.1%}; "
          f"{len(held)} held out: median {statistics.median(held):.1%}, max {max(held):.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
