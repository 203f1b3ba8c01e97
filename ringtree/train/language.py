"""A synthetic language task built at run time (no download): sort a sequence of digits.

Each sequence is n random symbols from an alphabet of k, a separator, then the same symbols in
ascending order: "7 2 9 2 | 2 2 7 9". The model reads tokens [0, 2n] and predicts tokens
[1, 2n + 1]; only the sorted half is predictable, so the prompt's targets are IGNORE (cross
entropy and accuracy skip them) and accuracy is the next-token accuracy on the sorted half.
The trivial baseline (`baseline_accuracy`) guesses, at each answer position, the symbol most
often found there in the training split, without looking at the prompt.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

IGNORE = -100  # F.cross_entropy's default ignore_index
SYMBOLS = 16  # the alphabet: tokens 0..15
SEP = SYMBOLS  # token 16 separates the prompt from the answer
LENGTH = 12  # symbols per prompt: inputs of 2 x 12 = 24 tokens (divisible by tp = 2, 3, 4)
TRAIN, TEST = 8192, 1024
SPLIT_SEED = 0  # the data never depend on --seed: every run is evaluated on the same sequences


def sort_task(
    n: int = TRAIN + TEST, length: int = LENGTH, seed: int = SPLIT_SEED
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [n, 2 length] int64, targets [n, 2 length] int64 with IGNORE on the prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, SYMBOLS, (n, length), generator=g)  # [n, length]
    sep = torch.full((n, 1), SEP)
    seq = torch.cat([prompt, sep, prompt.sort(dim=1).values], dim=1)  # [n, 2 length + 1]
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()  # next-token pairs: [n, 2 length] each
    y[:, : length - 1] = IGNORE  # the prompt's next tokens are random and the separator is fixed
    y[:, length - 1] = IGNORE
    return x, y


def sort_datasets() -> tuple[TensorDataset, TensorDataset]:
    """(train, test) splits of the sort task."""
    x, y = sort_task()
    return TensorDataset(x[:TRAIN], y[:TRAIN]), TensorDataset(x[TRAIN:], y[TRAIN:])


def baseline_accuracy() -> float:
    """The test split's accuracy of guessing, per answer position, the training split's most common symbol."""
    _, y = sort_task()
    train, test = y[:TRAIN], y[TRAIN:]
    mode = torch.stack(  # [2 length]: the commonest symbol at each answer position (IGNORE elsewhere)
        [c[c != IGNORE].mode().values if (c != IGNORE).any() else torch.tensor(IGNORE) for c in train.T]
    )
    answer = test != IGNORE
    return float((test == mode).logical_and(answer).sum() / answer.sum())
