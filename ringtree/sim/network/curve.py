"""A measured time curve over message sizes: log-log interpolation and a model's shape between rows.

Pure data (it imports nothing from the simulator), so every cost model may read calibrated rows
through it without an import circle.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Curve:
    """One algorithm's measured times on one node shape: sizes ascending, seconds, fit residuals."""

    algorithm: str
    nodes: int
    per_node: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    residuals: tuple[float, ...]

    def bracket(self, nbytes: int) -> tuple[int, int, float]:
        """(i, j, w): the rows around nbytes and the log-size weight of j (i == j outside the range)."""
        if nbytes <= self.sizes[0]:
            return 0, 0, 0.0
        if nbytes >= self.sizes[-1]:
            last = len(self.sizes) - 1
            return last, last, 0.0
        j = bisect.bisect_left(self.sizes, nbytes)
        i = j - 1
        w = math.log(nbytes / self.sizes[i]) / math.log(self.sizes[j] / self.sizes[i])
        return i, j, w

    def time(self, nbytes: int, fit: Any) -> float:
        """The measured time at nbytes: log-log interpolation inside, `fit(n)`'s shape outside."""
        i, j, w = self.bracket(nbytes)
        if i != j:
            return math.exp((1 - w) * math.log(self.seconds[i]) + w * math.log(self.seconds[j]))
        edge = fit(self.sizes[i])
        return self.seconds[i] * (fit(nbytes) / edge if edge > 0 else 1.0)

    def corrected(self, nbytes: int, fit: Any) -> float:
        """`fit(n)` times the rows' measured / fitted ratio, log-interpolated in size between the
        rows around nbytes (the nearest row's ratio outside them): between rows the model's own
        shape (a latency floor, a protocol switch) carries the curve, at every row the measurement."""
        i, j, w = self.bracket(nbytes)
        ratio_i = math.log(self.seconds[i] / fit(self.sizes[i]))
        ratio_j = math.log(self.seconds[j] / fit(self.sizes[j]))
        return float(fit(nbytes) * math.exp((1 - w) * ratio_i + w * ratio_j))

    def residual(self, nbytes: int) -> float:
        """|relative residual| of the fit at nbytes, interpolated in log size between the nearest rows."""
        i, j, w = self.bracket(nbytes)
        return (1 - w) * abs(self.residuals[i]) + w * abs(self.residuals[j])


__all__ = ["Curve"]
