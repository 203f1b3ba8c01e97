"""All-reduce times read off a calibration's measured rows, at the planned message size.

A fit of latency + bytes / bandwidth is pulled by every row it is fitted to (on TCP, a 4 MiB row
that has ramped up to speed makes a 256 kB all-reduce look too fast). So when the calibration holds
rows of the planned algorithm, the plan reads the time off them (names: n the planned bytes, C the
planned cluster, R a cluster of the rows' node shape on the calibrated links, t(R, n) the rows'
time, f(X, n) the closed form of the algorithm on X with the algorithm's own fitted links):

  * n inside the rows' sizes: t(R, n) interpolated log-log between the two nearest sizes;
  * outside: the nearest row scaled by the algorithm's own fit, t(R, edge) x f(R, n) / f(R, edge);
  * rows of the plan's node shape are preferred; otherwise the nearest node count, scaled by the
    closed form's step count on the plan's shape: seconds = t(R, n) x f(C, n) / f(R, n);
  * no rows of the algorithm: the closed form with the overall fit (as before calibration rows).

A plan on other links than the calibrated ones (a named --inter, the bottleneck's free link) keeps
the rows' correction, t(R, n) / f(R, n), and takes f(C, n) on its own links.

nccl-tests logs price `native` (NCCL) with NCCL's fitted cost model f as the shape: at a GPU
count and node shape a log holds, the time is f(C, n) x the rows' measured / fitted ratio,
interpolated log-log between the two nearest sizes (the nearest row's ratio outside them), so
every logged size is returned as measured and between rows the model's own kinks (protocol
switches, the latency floor) carry the curve; at a shape no log holds, the fitted model alone
(rows of another GPU count are not stretched to this one: the model fills the gap).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from ringtree.sim.network import nccl_fit, nccl_model
from ringtree.sim.network.closed_form import check_algorithm, estimate
from ringtree.sim.network.curve import Curve
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.network.nccl_system import NcclTuning

_HUGE = 1e30  # bandwidth of a link with no transfer cost


@dataclass(frozen=True)
class Links:
    """One fit's links and reduction cost."""

    intra: Link
    inter: Link
    gamma: float

    @classmethod
    def from_fit(cls, fit: dict[str, Any]) -> Links:
        """From `Calibration.links_dict()` keys; a one-level fit's link serves both levels."""
        intra = _link("calibrated", fit["alpha_s"], fit["beta_s_per_byte"])
        inter_alpha, inter_beta = fit.get("inter_alpha_s"), fit.get("inter_beta_s_per_byte")
        inter = (
            intra
            if inter_alpha is None or inter_beta is None
            else _link("calibrated-inter", inter_alpha, inter_beta)
        )
        return cls(intra, inter, float(fit["gamma_s_per_byte"]))

    def on(self, cluster: Cluster, nodes: int | None = None, per_node: int | None = None) -> Cluster:
        """`cluster` (reshaped to nodes x per_node if given) on these links."""
        return dataclasses.replace(
            cluster,
            nodes=nodes or cluster.nodes,
            gpus_per_node=per_node or cluster.gpus_per_node,
            intra=self.intra,
            inter=self.inter,
            gamma=self.gamma,
        )


@dataclass(frozen=True)
class Source:
    """Where an all-reduce time came from: the curve used (None: the closed form) and why."""

    curve: Curve | None
    note: str


@dataclass(frozen=True)
class MeasuredTimes:
    """A calibration's measured rows and fits, as the planner reads them."""

    overall: Links
    own: tuple[tuple[str, Links], ...]
    curves: tuple[Curve, ...]
    nccl: NcclTuning | None = None  # the fitted NCCL model of nccl-tests logs, for `native`
    nccl_curves: tuple[Curve, ...] = ()  # their rows, one curve per node shape

    @classmethod
    def from_calibration(cls, fitted: Any) -> MeasuredTimes | None:
        """From a `calibrate.Calibration`; None when it kept no measured rows (older files)."""
        section = fitted.nccl
        nccl_curves = curves_from_nccl(section) if section and section.get("table") else ()
        if not fitted.measured and not nccl_curves:
            return None
        overall = Links.from_fit(fitted.links_dict())
        own = tuple((name, Links.from_fit(fit)) for name, fit in sorted(fitted.algorithms.items()))
        rows = [(r["algorithm"], int(r["nodes"]), int(r["ranks_per_node"]), r) for r in fitted.measured]
        curves = _curves(rows)
        tuning = nccl_fit.tuning(section) if nccl_curves else None
        return cls(overall, own, curves, tuning, nccl_curves)

    def links_for(self, algorithm: str) -> Links:
        """The algorithm's own fit, else the overall one."""
        return dict(self.own).get(algorithm, self.overall)

    def source(self, algorithm: str, cluster: Cluster) -> Source:
        """The curve the plan reads for `algorithm` on `cluster` (its node shape, else the nearest)."""
        if algorithm == "native" and self.nccl is not None:
            return self._nccl_source(cluster)
        mine = [c for c in self.curves if c.algorithm == algorithm]
        if not mine:
            have = sorted({c.algorithm for c in self.curves})
            return Source(
                None,
                f"the calibration has no {algorithm} rows (it has {', '.join(have)}): "
                f"{algorithm} is priced by the closed form on the overall fit",
            )
        curve = min(
            mine,
            key=lambda c: (abs(c.nodes - cluster.nodes), abs(c.per_node - cluster.gpus_per_node), -c.nodes),
        )
        shape = f"{curve.nodes} x {curve.per_node}"
        if (curve.nodes, curve.per_node) == (cluster.nodes, cluster.gpus_per_node):
            how = f"read off the calibration's {algorithm} rows on {shape}"
        else:
            how = (
                f"read off the calibration's {algorithm} rows on {shape}, scaled to "
                f"{cluster.nodes} x {cluster.gpus_per_node} by the closed form's steps"
            )
        return Source(curve, how)

    def reads(self, algorithm: str, cluster: Cluster) -> bool:
        """Whether rows of `algorithm` were measured at the cluster's node shape."""
        if algorithm == "native" and self.nccl is not None:
            return self.nccl_curve(cluster) is not None
        shape = (cluster.nodes, cluster.gpus_per_node)
        return any(c.algorithm == algorithm and (c.nodes, c.per_node) == shape for c in self.curves)

    def nccl_curve(self, cluster: Cluster) -> Curve | None:
        """The nccl-tests rows at the cluster's node shape, if a log holds that shape."""
        shape = (cluster.nodes, cluster.gpus_per_node)
        return next((c for c in self.nccl_curves if (c.nodes, c.per_node) == shape), None)

    def nccl_seconds(self, cluster: Cluster, nbytes: int) -> float:
        """`native` from nccl-tests rows: interpolated at a shape a log holds, else the fitted model."""
        assert self.nccl is not None
        tuning = self.nccl

        def model(n: int) -> float:
            return nccl_model.allreduce_seconds(tuning, cluster.ranks, cluster.nodes, n)[0]

        curve = self.nccl_curve(cluster)
        return model(nbytes) if curve is None or cluster.ranks < 2 else curve.corrected(nbytes, model)

    def _nccl_source(self, cluster: Cluster) -> Source:
        shape = f"{cluster.nodes} x {cluster.gpus_per_node}"
        curve = self.nccl_curve(cluster)
        if curve is None:
            return Source(None, f"no nccl-tests log at {shape}: native is priced by the fitted NCCL model")
        return Source(curve, f"read off the nccl-tests rows at {shape} (the fitted NCCL model's shape)")

    def seconds(self, algorithm: str, cluster: Cluster, nbytes: int, itemsize: int = 4) -> float:
        """One all-reduce of nbytes with `algorithm` on `cluster`, from the rows (see module doc)."""
        check_algorithm(algorithm)
        if algorithm == "native" and self.nccl is not None:
            return self.nccl_seconds(cluster, nbytes)
        own = self.links_for(algorithm)
        calibrated = (cluster.intra, cluster.inter) == (self.overall.intra, self.overall.inter)
        planned = own.on(cluster) if calibrated else cluster
        model = estimate(algorithm, planned, nbytes, itemsize)
        curve = self.source(algorithm, cluster).curve
        if curve is None or model == 0:
            return model
        rows = own.on(cluster, curve.nodes, curve.per_node)
        fitted = estimate(algorithm, rows, nbytes, itemsize)
        measured = curve.time(nbytes, lambda n: estimate(algorithm, rows, n, itemsize))
        return measured * model / fitted if fitted > 0 else model

    def residual(self, algorithm: str, cluster: Cluster, nbytes: int) -> float | None:
        """The calibration's |relative residual| at nbytes on the curve the plan reads; None if none."""
        curve = self.source(algorithm, cluster).curve
        return None if curve is None else curve.residual(nbytes)

    def describe(self, algorithm: str, cluster: Cluster, nbytes: int) -> str:
        """One line: where the all-reduce time of nbytes comes from."""
        src = self.source(algorithm, cluster)
        if src.curve is None:
            return src.note
        c = src.curve
        i, j, _ = c.bracket(nbytes)
        where = (
            f"interpolated between {_size(c.sizes[i])} and {_size(c.sizes[j])}"
            if i != j
            else f"outside the measured {_size(c.sizes[0])}-{_size(c.sizes[-1])}: the nearest row "
            f"scaled by {'its own' if algorithm in dict(self.own) else 'the overall'} fit"
        )
        return f"all-reduce of {_size(nbytes)}: {src.note}, {where}"


def curves_from_nccl(section: dict[str, Any]) -> tuple[Curve, ...]:
    """The rows of an nccl-tests fit (its `table`) as `native` curves, one per node shape."""
    rows = [
        ("native", int(r["nodes"]), int(r["world_size"]) // int(r["nodes"]),
         {"bytes": r["bytes"], "time_s": r["measured_us"] * 1e-6,
          "fit_rel_error": r["fitted_us"] / r["measured_us"] - 1.0})
        for r in section["table"]
    ]  # fmt: skip
    return _curves(rows)


def _curves(rows: list[tuple[str, int, int, dict[str, Any]]]) -> tuple[Curve, ...]:
    """One curve per (algorithm, nodes, ranks per node) of (algorithm, nodes, ranks per node, row)
    tuples whose rows hold bytes, time_s and fit_rel_error: sizes ascending, the median time of
    repeated sizes made non-decreasing, and the fit's residual there."""
    groups: dict[tuple[str, int, int], dict[int, list[dict[str, Any]]]] = {}
    for name, nodes, per_node, r in rows:
        groups.setdefault((name, nodes, per_node), {}).setdefault(int(r["bytes"]), []).append(r)
    curves = []
    for (name, nodes, per_node), by_size in sorted(groups.items()):
        sizes = sorted(by_size)
        times = [statistics.median(float(r["time_s"]) for r in by_size[n]) for n in sizes]
        errors = [statistics.median(float(r.get("fit_rel_error", 0.0)) for r in by_size[n]) for n in sizes]
        curves.append(Curve(name, nodes, per_node, tuple(sizes), nondecreasing(times), tuple(errors)))
    return tuple(curves)


def nondecreasing(values: list[float]) -> tuple[float, ...]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a larger
    all-reduce never takes less time, so a row timed fast by chance is averaged with its neighbours."""
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for v in values:
        blocks.append((v, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, m), (b, n) = blocks[-2], blocks[-1]
            blocks[-2:] = [((a * m + b * n) / (m + n), m + n)]
    return tuple(mean for mean, count in blocks for _ in range(count))


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.3g} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.3g} kB"


def _link(name: str, alpha: float, beta: float) -> Link:
    return Link(name, float(alpha), 1.0 / beta if beta > 0 else _HUGE)


def allreduce_seconds(algorithm: str, cluster: Cluster, nbytes: int, itemsize: int = 4) -> float:
    """The planner's all-reduce time: from the cluster's measured rows when it has them, else the
    closed form."""
    if cluster.measured is not None:
        return cluster.measured.seconds(algorithm, cluster, nbytes, itemsize)
    return estimate(algorithm, cluster, nbytes, itemsize)
