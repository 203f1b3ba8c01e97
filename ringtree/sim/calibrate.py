"""Calibration: fit alpha, beta and gamma to `ringtree bench --json` rows, and read the fit back.

Each bench row is one all-reduce of `bytes` on `world_size` ranks of one machine. On one level
the closed form is linear in the three unknowns, T = A alpha + B beta + G gamma, so the fit is a
least-squares solve on relative error (every size counts alike), keeping all three >= 0.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringtree.sim.closed_form import check_algorithm, estimate
from ringtree.sim.hardware import Cluster, Link

_HUGE = 1e30  # bandwidth that makes the beta term vanish


@dataclass(frozen=True)
class Calibration:
    """Fitted link and reduction cost, with how well they explain the rows they came from."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    world_size: int
    rows: int
    rms_rel_error: float
    max_rel_error: float

    @property
    def link(self) -> Link:
        return Link("calibrated", self.alpha_s, 1.0 / self.beta_s_per_byte if self.beta_s_per_byte else _HUGE)

    def as_dict(self) -> dict[str, Any]:
        bandwidth = 1.0 / self.beta_s_per_byte if self.beta_s_per_byte else math.inf
        return {**self.__dict__, "bandwidth_Bps": bandwidth}


def coefficients(row: dict[str, Any]) -> tuple[float, float, float]:
    """(A, B, G) of T = A alpha + B beta + G gamma for one bench row, from the closed form."""
    p, nbytes, algorithm = int(row["world_size"]), int(row["bytes"]), str(row["algorithm"])
    itemsize = max(1, nbytes // max(1, int(row["count"])))

    def unit(alpha: float, bandwidth: float, gamma: float) -> float:
        link = Link("unit", alpha, bandwidth)
        return estimate(algorithm, Cluster(1, p, link, link, gamma), nbytes, itemsize)

    return unit(1.0, _HUGE, 0.0), unit(0.0, 1.0, 0.0), unit(0.0, _HUGE, 1.0)


def fit(rows: list[dict[str, Any]]) -> Calibration:
    """Least squares on relative error over all-reduce rows, alpha, beta, gamma >= 0."""
    used = [r for r in rows if r.get("collective") == "all_reduce" and r["bytes"] > 0 and r["time_us"] > 0]
    if not used:
        raise ValueError("no all_reduce rows with bytes > 0: run `ringtree bench --json FILE` first")
    sizes = {int(r["world_size"]) for r in used}
    if len(sizes) != 1:
        raise ValueError(f"rows mix world sizes {sorted(sizes)}: calibrate from one bench run at a time")
    for r in used:
        check_algorithm(str(r["algorithm"]))
    measured = np.array([r["time_us"] * 1e-6 for r in used])
    design = np.array([coefficients(r) for r in used]) / measured[:, None]
    params = _refine(used, measured, _nonnegative_lstsq(design, np.ones(len(used))))
    rel = np.array([_predict(r, params) for r in used]) / measured - 1.0
    return Calibration(
        float(params[0]),
        float(params[1]),
        float(params[2]),
        sizes.pop(),
        len(used),
        float(np.sqrt(np.mean(rel**2))),
        float(np.abs(rel).max()),
    )


def _predict(row: dict[str, Any], params: np.ndarray[Any, Any]) -> float:
    """The closed form's time for one bench row under (alpha, beta, gamma)."""
    alpha, beta, gamma = (float(v) for v in params)
    p, nbytes = int(row["world_size"]), int(row["bytes"])
    link = Link("fit", alpha, 1.0 / beta if beta > 0 else _HUGE)
    itemsize = max(1, nbytes // max(1, int(row["count"])))
    return estimate(str(row["algorithm"]), Cluster(1, p, link, link, gamma), nbytes, itemsize)


def _refine(
    rows: list[dict[str, Any]], measured: np.ndarray[Any, Any], params: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """Gauss-Newton steps from the linear fit: where flows overlap only partly (trees, p not a power
    of two) the time is piecewise linear in alpha, beta, gamma, so the unit coefficients are only a
    first guess. Each step re-linearises at the current fit (finite differences) and solves the
    same non-negative least squares on relative error."""
    for _ in range(6):
        base = np.array([_predict(r, params) for r in rows])
        jac = np.empty((len(rows), 3))
        for j in range(3):
            h = max(abs(params[j]) * 1e-3, (1e-9, 1e-14, 1e-15)[j])
            bumped = params.copy()
            bumped[j] += h
            jac[:, j] = (np.array([_predict(r, bumped) for r in rows]) - base) / h
        offset = base - jac @ params  # T(x') ~ offset + J x'
        new = _nonnegative_lstsq(jac / measured[:, None], 1.0 - offset / measured)
        if np.allclose(new, params, rtol=1e-9, atol=0.0):
            break
        params = new
    return params


def _nonnegative_lstsq(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The best least-squares solution with every entry >= 0, by trying each subset of free entries."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b**2))
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n), k):
            x = np.zeros(n)
            x[list(free)] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            err = float(np.sum((a @ x - b) ** 2))
            if (x >= 0).all() and err < best_err:
                best, best_err = x, err
    return best


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a `ringtree bench --json` file."""
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected the list of rows `ringtree bench --json` writes")
    return data


def load(path: Path) -> Calibration:
    """A calibration written by `ringtree calibrate --out`."""
    data = json.loads(path.read_text())
    try:
        return Calibration(
            float(data["alpha_s"]),
            float(data["beta_s_per_byte"]),
            float(data["gamma_s_per_byte"]),
            int(data["world_size"]),
            int(data["rows"]),
            float(data["rms_rel_error"]),
            float(data["max_rel_error"]),
        )
    except KeyError as e:
        raise ValueError(f"{path} is not a `ringtree calibrate` file: missing {e}") from None
