"""Calibration: fit link and reduction costs to measured all-reduce times, and read the fit back.

Two kinds of measurements, in any mix (`read_measurements`): `ringtree bench --json` rows (each
an all-reduce of `bytes` on `world_size` ranks, over `nodes` x `ranks_per_node` when the rows
carry them), and nccl-tests all_reduce_perf logs (`nccl_tests`). Bench rows fit alpha, beta and
gamma of the simulator's own closed form (`closed_form.estimate`, the cost sim and plan use): one
link when every row ran on one node, an intra-node and an inter-node link when some ran on
several. nccl-tests logs fit corrections to NCCL's cost model (`nccl_fit`).

The closed form is piecewise linear and homogeneous in theta = (alpha_intra, beta_intra,
[alpha_inter, beta_inter,] gamma): T(theta) = A(theta) . theta, with A the row's exact
coefficients in the current piece. The fit is least squares on relative error (every size counts
alike), theta >= 0, re-solved with A taken at the last solution until the piece stops changing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ringtree import files
from ringtree.sim.network import nccl_tests
from ringtree.sim.network.closed_form import check_algorithm, estimate
from ringtree.sim.network.hardware import Cluster, Link

_HUGE = 1e30  # bandwidth that makes the beta term vanish
_STEP = (1e-6, 1e-11, 1e-6, 1e-11, 1e-12)  # finite-difference scale of each parameter
_ITERATIONS = 12
Matrix = np.ndarray[Any, Any]


@dataclass(frozen=True)
class LevelFit:
    """How well a fit explains the rows of one level (intra: one node; inter: several nodes)."""

    rows: int
    rms_rel_error: float
    max_rel_error: float


@dataclass(frozen=True)
class Calibration:
    """Fitted links and reduction cost, with how well they explain the rows they came from.

    `alpha_s`/`beta_s_per_byte` are the intra-node link (the only one of a one-node fit);
    `inter_*` the inter-node link of a two-level fit. `nccl` holds an nccl-tests fit (`nccl_fit`).
    """

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    world_size: int
    rows: int
    rms_rel_error: float
    max_rel_error: float
    inter_alpha_s: float | None = None
    inter_beta_s_per_byte: float | None = None
    levels: dict[str, LevelFit] = field(default_factory=dict)
    nccl: dict[str, Any] | None = None
    # each algorithm's own fit (`links_dict` keys), and the measured rows (`measured_rows`)
    algorithms: dict[str, dict[str, Any]] = field(default_factory=dict)
    measured: list[dict[str, Any]] = field(default_factory=list)

    @property
    def link(self) -> Link:
        return _link("calibrated", self.alpha_s, self.beta_s_per_byte)

    @property
    def inter_link(self) -> Link | None:
        if self.inter_alpha_s is None or self.inter_beta_s_per_byte is None:
            return None
        return _link("calibrated-inter", self.inter_alpha_s, self.inter_beta_s_per_byte)

    @property
    def theta(self) -> Matrix:
        """The fitted parameters in `model_time`'s order (five with an inter-node link)."""
        inter = [] if self.inter_alpha_s is None else [self.inter_alpha_s, self.inter_beta_s_per_byte]
        return np.array([self.alpha_s, self.beta_s_per_byte, *inter, self.gamma_s_per_byte])

    def links_dict(self) -> dict[str, Any]:
        """The fitted costs and how well they fit, without the rows (one algorithm's own fit)."""
        keys = ("alpha_s", "beta_s_per_byte", "inter_alpha_s", "inter_beta_s_per_byte", "gamma_s_per_byte")
        return {k: getattr(self, k) for k in (*keys, "rows", "rms_rel_error", "max_rel_error")}

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "levels"}
        out["bandwidth_Bps"] = 1.0 / self.beta_s_per_byte
        if self.inter_beta_s_per_byte is not None:
            out["inter_bandwidth_Bps"] = 1.0 / self.inter_beta_s_per_byte
        out["levels"] = {k: v.__dict__ for k, v in self.levels.items()}
        return out


def _link(name: str, alpha: float, beta: float) -> Link:
    return Link(name, alpha, 1.0 / beta if beta > 0 else _HUGE)


def shape(row: dict[str, Any]) -> tuple[int, int]:
    """(nodes, ranks per node) of a row: its own keys, else one node of world_size ranks."""
    p = int(row["world_size"])
    nodes = int(row.get("nodes", 1) or 1)
    per_node = int(row.get("ranks_per_node", p // nodes) or p // nodes)
    if nodes * per_node != p:
        raise ValueError(f"row has world_size {p} but nodes {nodes} x ranks_per_node {per_node}")
    return nodes, per_node


def model_time(row: dict[str, Any], theta: Matrix) -> float:
    """The closed form's seconds for one bench row at theta (1- or 2-level)."""
    nodes, per_node = shape(row)
    intra = _link("fit", theta[0], theta[1])
    inter = _link("fit-inter", theta[2], theta[3]) if len(theta) == 5 else intra
    nbytes = int(row["bytes"])
    itemsize = max(1, nbytes // max(1, int(row["count"])))
    return estimate(
        str(row["algorithm"]), Cluster(nodes, per_node, intra, inter, theta[-1]), nbytes, itemsize
    )


def coefficients(row: dict[str, Any], theta: Matrix) -> Matrix:
    """A(theta): each parameter's coefficient in the row's time, exact inside one linear piece."""
    base = model_time(row, theta)
    out = np.empty(len(theta))
    steps = _STEP if len(theta) == 5 else (_STEP[0], _STEP[1], _STEP[4])
    for j, h in enumerate(steps):
        step = max(h, abs(theta[j]) * 1e-4)
        bumped = theta.copy()
        bumped[j] += step
        out[j] = (model_time(row, bumped) - base) / step
    return out


def fit(rows: list[dict[str, Any]]) -> Calibration:
    """Least squares on relative error over bench all-reduce rows, every parameter >= 0.

    Besides the fit over all rows, each algorithm with rows of its own gets its own fit
    (`algorithms`), and the rows themselves are kept (`measured`, one per algorithm, node shape
    and size) so that a plan can read a time off them at its own message size
    (`ringtree.sim.network.measured`).
    """
    used = [r for r in rows if r.get("collective") == "all_reduce" and r["bytes"] > 0 and r["time_us"] > 0]
    if not used:
        raise ValueError("no all_reduce rows with bytes > 0: run `ringtree bench --json FILE` first")
    for r in used:
        check_algorithm(str(r["algorithm"]))
    overall = _fit_rows(used)
    own: dict[str, Calibration] = {}
    for name in sorted({str(r["algorithm"]) for r in used}):
        try:
            own[name] = _fit_rows([r for r in used if r["algorithm"] == name])
        except ValueError:
            continue  # too few rows of its own: its times are read off the overall fit
    return dataclasses.replace(
        overall,
        algorithms={name: c.links_dict() for name, c in own.items()},
        measured=measured_rows(used, {name: c.theta for name, c in own.items()}, overall.theta),
    )


def levels_seen(rows: list[dict[str, Any]]) -> tuple[bool, bool]:
    """(intra, inter): whether some row moved data inside a node, and some between nodes."""
    shapes = [shape(r) for r in rows]
    return any(per_node > 1 for _, per_node in shapes), any(nodes > 1 for nodes, _ in shapes)


def _fit_rows(used: list[dict[str, Any]]) -> Calibration:
    """The fit of `fit` over these rows only: two levels when both were exercised, else one.

    Rows of several nodes with one rank each exercise only the network: one link is fitted and it
    is the inter-node link (the intra-node link, never used by such rows, is given the same values).
    """
    intra, inter = levels_seen(used)
    two_level = intra and inter
    names = (
        ("alpha", "beta", "alpha_inter", "beta_inter", "gamma") if two_level else ("alpha", "beta", "gamma")
    )
    measured = np.array([r["time_us"] * 1e-6 for r in used])
    theta = np.array([1e-5, 1e-9, 1e-5, 1e-9, 1e-11] if two_level else [1e-5, 1e-9, 1e-11])
    sizes = {int(r["bytes"]) for r in used}
    if len(used) < len(names) or np.linalg.matrix_rank(np.array([coefficients(r, theta) for r in used])) < 2:
        raise ValueError(
            f"{len(used)} all_reduce row(s) of {len(sizes)} size(s) cannot fit {len(names)} parameters "
            f"({', '.join(names)}): give at least {len(names)} rows over at least 2 sizes "
            "(e.g. `ringtree bench --min-bytes 4K --max-bytes 64M --json FILE`)"
        )
    best, best_err = theta, math.inf
    for _ in range(_ITERATIONS):
        design = np.array([coefficients(r, theta) for r in used]) / measured[:, None]
        theta = nonnegative_lstsq(design, np.ones(len(used)), without_gamma(design))
        rel = np.array([model_time(r, theta) for r in used]) / measured - 1.0
        err = float(np.sum(rel**2))
        if err >= best_err * (1 - 1e-9):
            break
        best, best_err = theta, err
    fitted = _calibration(used, best, measured, two_level)
    if inter and not intra:  # the one fitted link is the network's
        fitted = dataclasses.replace(
            fitted, inter_alpha_s=fitted.alpha_s, inter_beta_s_per_byte=fitted.beta_s_per_byte
        )
    return fitted


def _calibration(used: list[dict[str, Any]], theta: Matrix, measured: Matrix, two_level: bool) -> Calibration:
    if theta[1] <= 0 or (two_level and theta[3] <= 0):
        level = "intra-node" if theta[1] <= 0 else "inter-node"
        raise ValueError(
            f"the fit found no {level} bandwidth cost (beta = 0): the rows are all latency-bound; "
            "add larger sizes (e.g. up to --max-bytes 64M) and calibrate again"
        )
    rel = np.array([model_time(r, theta) for r in used]) / measured - 1.0
    return Calibration(
        float(theta[0]),
        float(theta[1]),
        float(theta[-1]),
        max(int(r["world_size"]) for r in used),
        len(used),
        float(np.sqrt(np.mean(rel**2))),
        float(np.abs(rel).max()),
        float(theta[2]) if two_level else None,
        float(theta[3]) if two_level else None,
        level_fits(rel, [shape(r)[0] > 1 for r in used]),
    )


def measured_rows(
    used: list[dict[str, Any]], own: dict[str, Matrix], overall: Matrix
) -> list[dict[str, Any]]:
    """One row per (algorithm, nodes, ranks per node, bytes): the median measured time, and the
    relative residual there of the algorithm's own fit (the overall fit's when it has none)."""
    groups: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}
    for r in used:
        nodes, per_node = shape(r)
        groups.setdefault((str(r["algorithm"]), nodes, per_node, int(r["bytes"])), []).append(r)
    out = []
    for (name, nodes, per_node, nbytes), group in sorted(groups.items()):
        seconds = float(np.median([r["time_us"] for r in group])) * 1e-6
        fitted = float(np.mean([model_time(r, own.get(name, overall)) for r in group]))
        out.append(
            {"algorithm": name, "nodes": nodes, "ranks_per_node": per_node, "bytes": nbytes,
             "time_s": seconds, "fit_rel_error": fitted / seconds - 1.0}
        )  # fmt: skip
    return out


def level_fits(rel: Matrix, inter: list[bool]) -> dict[str, LevelFit]:
    """RMS and max relative error over the one-node rows (intra) and the multi-node rows (inter)."""
    out: dict[str, LevelFit] = {}
    mask = np.array(inter, dtype=bool)
    for name, sel in (("intra", ~mask), ("inter", mask)):
        if sel.any():
            r = rel[sel]
            out[name] = LevelFit(int(sel.sum()), float(np.sqrt(np.mean(r**2))), float(np.abs(r).max()))
    return out


def without_gamma(design: Matrix) -> bool:
    """Whether the reduction cost (last column) is indistinguishable from the others: with one
    rank per node a ring reduces as many bytes as it sends, so gamma and beta cannot be told apart
    and the time is put on the link (gamma = 0)."""
    return _rank(design[:, :-1]) == _rank(design)


def _rank(a: Matrix) -> int:
    """Rank up to the finite differences' noise (singular values 1e-9 of the largest)."""
    values = np.linalg.svd(a, compute_uv=False)
    return int(np.sum(values > values[0] * 1e-9)) if values.size and values[0] > 0 else 0


def nonnegative_lstsq(a: Matrix, b: Matrix, fix_last: bool = False) -> Matrix:
    """The best least-squares solution with every entry >= 0, by trying each subset of free entries
    (the last entry held at 0 when `fix_last`)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b**2))
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n - 1 if fix_last else n), k):
            x = np.zeros(n)
            x[list(free)] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            err = float(np.sum((a @ x - b) ** 2))
            if (x >= 0).all() and err < best_err:
                best, best_err = x, err
    return best


def read_json(path: Path) -> Any:
    """A JSON file, or a ValueError naming the file and where it stops being JSON."""
    return files.read_json(path)


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a `ringtree bench --json` file."""
    data = read_json(path)
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected the list of rows `ringtree bench --json` writes")
    needed = {"collective", "algorithm", "bytes", "count", "world_size", "time_us"}
    for i, r in enumerate(data):
        if not needed <= set(r):
            raise ValueError(
                f"{path}: row {i} lacks {', '.join(sorted(needed - set(r)))}; is it a bench file?"
            )
    return data


def read_measurements(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(bench rows, nccl-tests rows) of one file, told apart by content."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    if text.lstrip()[:1] in ("[", "{"):
        return load_rows(path), []
    if nccl_tests.looks_like_nccl_tests(text):
        runs = nccl_tests.parse_text(text, str(path))
        return [], [m for run in runs for m in run.measurements()]
    raise ValueError(
        f"{path}: line 1: neither `ringtree bench --json` rows nor nccl-tests all_reduce_perf output"
    )


def load(path: Path) -> Calibration:
    """A calibration written by `ringtree calibrate --out`."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a `ringtree calibrate` file: expected a JSON object")
    try:
        levels = {k: LevelFit(**v) for k, v in data.get("levels", {}).items()}
        inter_alpha, inter_beta = data.get("inter_alpha_s"), data.get("inter_beta_s_per_byte")
        return Calibration(
            float(data["alpha_s"]),
            float(data["beta_s_per_byte"]),
            float(data["gamma_s_per_byte"]),
            int(data["world_size"]),
            int(data["rows"]),
            float(data["rms_rel_error"]),
            float(data["max_rel_error"]),
            None if inter_alpha is None else float(inter_alpha),
            None if inter_beta is None else float(inter_beta),
            levels,
            data.get("nccl"),
            dict(data.get("algorithms") or {}),
            list(data.get("measured") or []),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a `ringtree calibrate` file: missing or bad {e}") from None


def check(fitted: Calibration, path: Path) -> Calibration:
    """A loaded calibration whose costs are usable (beta > 0, all finite), else a ValueError."""
    values = [fitted.alpha_s, fitted.beta_s_per_byte, fitted.gamma_s_per_byte]
    if not all(math.isfinite(v) and v >= 0 for v in values) or fitted.beta_s_per_byte <= 0:
        raise ValueError(
            f"{path} holds unusable costs (need finite alpha, gamma >= 0 and beta > 0); "
            "run `ringtree calibrate` again"
        )
    return fitted
