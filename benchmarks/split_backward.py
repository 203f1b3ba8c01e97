"""One pipeline stage's backward, whole against split into B and W: one process, one thread.

    .venv/bin/python benchmarks/split_backward.py --repeats 200

The stage is the last one of `--model gpt` cut in two (blocks 2 and 3, then the head and the
loss), on one micro-batch of --batch sequences of the sort task. Per repeat it runs a forward then
each of these (in turn first) and times the backward:

- whole: one `torch.autograd.backward`;
- split, direct: `backward_input` (B) then `backward_weight` (W), W computing the linear layers'
  weights as G^T X (the default);
- split, autograd: the same with every weight's gradient by autograd passes (SplitCache(direct=False)),

each split with its own SplitCache (so B's analysis is the cached one, as in a run). The forward is
not timed. Prints the median of each backward's time over the repeats and B + W against whole.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ringtree.parallel.pipeline.split import SplitCache, backward_input, backward_weight
from ringtree.train.gpt import GPT, GPTConfig
from ringtree.train.language import sort_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="sequences in the micro-batch")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig())
    stage = nn.Sequential(*gpt.layers()[3:])  # blocks 2 and 3, the head
    ids, targets = sort_task(args.batch)
    x0 = gpt.embed(ids).detach()  # an activation of the stage's input shape

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        logits = stage(x)
        return x, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    caches = {"direct": SplitCache(), "autograd": SplitCache(direct=False)}
    names = ("whole", "B direct", "W direct", "B autograd", "W autograd")
    times: dict[str, list[float]] = {k: [] for k in names}
    variants = ["whole", *caches]
    for r in range(args.repeats + 5):  # the first five: warm-up
        for name in variants[r % 3 :] + variants[: r % 3]:  # each first in turn
            stage.zero_grad()
            x, loss = forward()
            t0 = time.perf_counter()
            if name == "whole":
                loss.backward()  # type: ignore[no-untyped-call]
                del loss
                t1 = t2 = time.perf_counter()
            else:
                work = backward_input(loss, None, x, cache=caches[name])
                del loss
                t1 = time.perf_counter()
                backward_weight(work)
                t2 = time.perf_counter()
            if r < 5:
                continue
            if name == "whole":
                times["whole"].append(t2 - t0)
            else:
                times[f"B {name}"].append(t1 - t0)
                times[f"W {name}"].append(t2 - t1)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:11s} {v:7.2f} ms")
    for name in caches:
        total = med[f"B {name}"] + med[f"W {name}"]
        print(f"B + W {name:8s} {total:7.2f} ms = {total / med['whole']:.2f} x whole")


if __name__ == "__main__":
    main()
