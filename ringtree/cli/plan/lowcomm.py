"""`ringtree plan`'s low-communication options (--sync and its words, --sweep bandwidth), as one group.

`sync_options` adds them to the plan command's signature and hands the command one `SyncOptions` as
its `sync` argument; `report` prices the planner's step under every method (ringtree.sim.lowcomm),
prints the table and the recommendation, and puts them in the plan's JSON.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import typer

from ringtree.cli.output import console, print_table

SYNC = "Low-communication training"


@dataclass(frozen=True)
class SyncOptions:
    """The values of the options below, None where not given."""

    sync: str | None = None
    powersgd_rank: int | None = None
    replicas: int | None = None
    inner_steps: int | None = None
    fragments: int | None = None
    overlap_steps: int | None = None
    outer_dtype: str | None = None
    sweep: str | None = None
    powersgd_compute_time: float | None = None  # measured seconds of PowerSGD's own work per step

    def given(self) -> list[str]:
        """The options given, as flags."""
        return [f"--{f.name.replace('_', '-')}" for f in fields(self) if getattr(self, f.name) is not None]

    def method(self, sync: str | None = None) -> Any:
        """The `SyncMethod` these words describe (for `sync`, default the one chosen), refusing a word
        the chosen method would ignore."""
        from ringtree.sim.lowcomm import PERIODIC, SyncMethod

        chosen = self.sync or "ddp"
        ignored = {
            "--powersgd-rank": self.powersgd_rank is not None and chosen != "powersgd",
            "--powersgd-compute-time": self.powersgd_compute_time is not None and chosen != "powersgd",
            "--replicas": self.replicas is not None and chosen not in PERIODIC,
            "--inner-steps": self.inner_steps is not None and chosen not in PERIODIC,
            "--outer-dtype": self.outer_dtype is not None and chosen not in PERIODIC,
            "--fragments": self.fragments is not None and chosen != "streaming-diloco",
            "--overlap-steps": self.overlap_steps is not None and chosen != "streaming-diloco",
        }
        named = [k for k, v in ignored.items() if v]
        if named:
            raise ValueError(f"{', '.join(named)} do not apply with --sync {chosen}: drop them")
        if self.powersgd_compute_time is not None and not self.powersgd_compute_time >= 0:
            raise ValueError(
                f"--powersgd-compute-time {self.powersgd_compute_time}: give the seconds per step of "
                "PowerSGD's own work, 0 or more (a PowerSGD run's powersgd_compute_s)"
            )
        if self.sweep is not None and self.sweep != "bandwidth":
            raise ValueError(f"unknown --sweep {self.sweep!r}; the one sweep is --sweep bandwidth")
        words = {
            f.name: getattr(self, f.name) for f in fields(self)[1:7] if getattr(self, f.name) is not None
        }
        return SyncMethod(sync or chosen, **words)

    def check(self, cluster: Any, model: Any) -> None:
        """Refuse bad words before anything is priced or printed: the method's own, and what the
        model (a `ringtree.sim.lowcomm.Model`) and cluster allow it."""
        from ringtree.sim.lowcomm import check

        check(self.method(), model, cluster)
        if self.sweep is not None and cluster.nodes < 2:
            raise ValueError("--sweep bandwidth varies the link between nodes: pass --nodes 2 or more")

    def methods(self) -> list[Any]:
        """Every method with the given words (those that apply to it), the chosen one's included."""
        from ringtree.sim.lowcomm import PERIODIC, SYNCS, SyncMethod

        chosen = self.method()
        out = []
        for name in SYNCS:
            if name == chosen.sync:
                out.append(chosen)
                continue
            words: dict[str, Any] = {"powersgd_rank": chosen.powersgd_rank} if name == "powersgd" else {}
            if name in PERIODIC:
                words |= {"replicas": chosen.replicas, "inner_steps": chosen.inner_steps,
                          "outer_dtype": chosen.outer_dtype}  # fmt: skip
            if name == "streaming-diloco":
                words |= {"fragments": chosen.fragments, "overlap_steps": chosen.overlap_steps}
            out.append(SyncMethod(name, **words))
        return out


def _option(kind: type, help_text: str) -> tuple[type, Any]:
    return kind | None, typer.Option(None, help=help_text, rich_help_panel=SYNC)  # type: ignore[return-value]


OPTIONS: dict[str, tuple[type, Any]] = {
    "sync": _option(
        str,
        "Price the step under ddp (the all-reduce every step), powersgd, local-sgd, diloco or "
        "streaming-diloco, beside the other methods, with a recommendation.",
    ),
    "powersgd_rank": _option(int, "With --sync powersgd: the rank of its P and Q (default 2)."),
    "powersgd_compute_time": _option(
        float,
        "With --sync powersgd: measured seconds per step of its own work (a PowerSGD run's "
        "powersgd_compute_s; default: its passes at the --cluster GPU's memory bandwidth, else 0).",
    ),
    "replicas": _option(
        int, "With local-sgd / diloco: replica groups, DDP inside each (default one per node)."
    ),
    "inner_steps": _option(int, "With local-sgd / diloco: inner steps H between syncs (default 100)."),
    "fragments": _option(
        int, "With streaming-diloco: fragments F, one synchronising every H/F steps (default 1)."
    ),
    "overlap_steps": _option(
        int, "With streaming-diloco: inner steps T a fragment's all-reduce runs behind (default 0)."
    ),
    "outer_dtype": _option(
        str, "With local-sgd / diloco: the outer all-reduce's dtype, fp32 (default), bf16, fp8, int8 or int4."
    ),
    "sweep": _option(
        str,
        "bandwidth: the Gbit/s between nodes each method needs for 50/80/90/95/99% compute utilisation.",
    ),
}


def sync_options(command: Callable[..., None]) -> Callable[..., None]:
    """The command with the options above added; it receives them as `sync`."""
    signature = inspect.signature(command)
    kept = [p for p in signature.parameters.values() if p.name != "sync"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        for name, (kind, option) in OPTIONS.items()
    ]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        sync = SyncOptions(**{name: kwargs.pop(name, None) for name in OPTIONS})
        command(*args, sync=sync, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {**command.__annotations__, **{n: k for n, (k, _) in OPTIONS.items()}}
    return wrapper


def report(
    options: SyncOptions,
    model: Any,
    cluster: Any,
    algorithm: str,
    step_for: Callable[[str], Any],
    planner: str,
) -> dict[str, Any]:
    """Every method priced on `cluster` (the chosen one first in the JSON's `sync`), the table, the
    recommendation and, with --sweep bandwidth, the bandwidth each needs; as the plan's JSON keys.
    `step_for(algorithm)` is the planner's DDP step on a cluster, its collectives priced as that.
    Raises ValueError on words the pricing refuses (the caller exits 2)."""
    import dataclasses

    from ringtree.sim.lowcomm import price, recommend, sweep

    if options.powersgd_compute_time is not None:
        model = dataclasses.replace(model, powersgd_work_s=options.powersgd_compute_time)
    step = step_for(algorithm)
    name = options.method().sync
    methods, prices = [], []
    for method in options.methods():
        try:
            prices.append(price(method, model, cluster, algorithm, step))
        except ValueError:
            if method.sync == name:
                raise
            continue  # a method the model cannot take (PowerSGD without shapes, one node's replicas)
        methods.append(method)
    chosen = next(p for p in prices if p.method["sync"] == name)
    ddp = prices[0]
    out: dict[str, Any] = {
        "sync_model": planner,
        "sync": chosen.as_dict(),
        "syncs": [p.as_dict() for p in prices],
        "sync_recommendation": recommend(chosen, ddp),
    }
    if options.sweep is not None:
        # NCCL's cost model (`native`) was fitted at data-centre bandwidths and stops following the
        # NIC far below them: the sweep prices those collectives with the hierarchical closed form
        swept = "hierarchical" if algorithm == "native" else algorithm
        out["sweep_algorithm"] = swept
        out["sweep"] = sweep(methods, model, cluster, swept, step if swept == algorithm else step_for(swept))
    _print(out, cluster)
    return out


def _print(out: dict[str, Any], cluster: Any) -> None:
    print_table(
        f"ringtree plan --sync {out['sync']['sync']} ({out['sync_model']}), {cluster.nodes} x "
        f"{cluster.gpus_per_node}, {cluster.inter.name} between nodes",
        ["sync", "words", "step (s)", "samples/s", "compute util.", "outer sync (s)",
         "bytes/step, slowest link", "peak sync (MB)", "peak Gbit/s"],
        [[r["sync"], _words(r), f"{r['step_s']:.4f}", f"{r['samples_per_s']:.1f}",
          f"{r['compute_utilisation']:.1%}", f"{r['outer_sync_s']:.3f}",
          f"{r['slow_link_bytes_per_step'] / 1e6:.2f} MB", f"{r['peak_sync_bytes'] / 1e6:.1f}",
          f"{r['peak_bandwidth_gbps']:.2f}"] for r in out["syncs"]],
    )  # fmt: skip
    console.print(f"sync: {out['sync_recommendation']}", highlight=False)
    if "sweep" in out:
        print_table(
            f"Gbit/s per NIC between nodes for each compute utilisation ({out['sweep_algorithm']}; -: the "
            "network alone cannot)",
            ["sync", "words", *out["sweep"][0]["gbps"]],
            [[r["sync"], _words(r), *(f"{g:.2f}" if g is not None else "-" for g in r["gbps"].values())]
             for r in out["sweep"]],
        )  # fmt: skip


def _words(row: dict[str, Any]) -> str:
    names = {
        "powersgd_rank": "r",
        "inner_steps": "H",
        "fragments": "F",
        "overlap_steps": "T",
        "outer_dtype": "",
    }
    return " ".join(
        f"{short}{'=' if short else ''}{row[k]}" for k, short in names.items() if row.get(k) is not None
    )


def dp_sync_model(
    config: Any, model: str | None, shape: str | None, hbm_Bps: float = 0.0, module: str | None = None
) -> Any:
    """What --sync needs of the data-parallel planner's model: the step's gradients and, for
    PowerSGD and the fragments, the --module's own tensors and layers, or an encoder of --shape's
    (or the preset's) layers."""
    from ringtree.sim.lowcomm import Model
    from ringtree.sim.training.param_shapes import encoder_shapes
    from ringtree.sim.training.tensor_parallel import SHAPES

    if module is not None:
        from ringtree.cli.modules import parameter_shapes

        tensors, layers = parameter_shapes(module)
        return Model(
            config.params, config.itemsize, config.bucket_mb, tensors, layers=layers, hbm_Bps=hbm_Bps
        )

    try:
        dims = SHAPES.get(model or "") if shape is None else tuple(int(x) for x in shape.split(","))
    except ValueError:
        dims = ()
    if shape is not None and len(dims or ()) != 3:
        raise ValueError(f"--shape {shape!r}: write it as LAYERS,HIDDEN,SEQ, e.g. 12,768,197")
    if not dims:
        return Model(config.params, config.itemsize, config.bucket_mb)
    shapes = encoder_shapes(config.params, dims[0], dims[1])
    return Model(config.params, config.itemsize, config.bucket_mb, shapes, layers=dims[0], hbm_Bps=hbm_Bps)


def dp_sync_report(
    sync: SyncOptions,
    config: Any,
    links: Any,
    algorithm: str,
    model: str | None,
    shape: str | None,
    module: str | None = None,
) -> dict[str, Any]:
    """--sync on the data-parallel planner: each method priced on its step (`predict_step` on the
    world or on one replica group), PowerSGD's passes at the --cluster GPU's memory bandwidth when
    there is one; bad words exit 2."""
    from ringtree.sim.training.plan import predict_step

    hbm = links.gpu().hbm_GBps * 1e9 if links.name is not None else 0.0
    try:
        return report(sync, dp_sync_model(config, model, shape, hbm, module), links.cluster(), algorithm,
                      lambda a: lambda c: predict_step(config, c, a),
                      "data-parallel formula: --params/--model and --compute-time")  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def tf_sync_model(
    shape: Any, tp: int, pp: int, cp: int, zero: int, grad_itemsize: int = 4, bucket_mb: float = 25.0,
    hbm_Bps: float = 0.0,
) -> Any:  # fmt: skip
    """What --sync needs of the transformer: its parameters, tensor shapes and layers, the layout and
    the GPU's memory bandwidth (PowerSGD's passes)."""
    from ringtree.sim.lowcomm import Model
    from ringtree.sim.training.param_shapes import transformer_shapes

    shapes = transformer_shapes(shape)
    return Model(shape.params, grad_itemsize, bucket_mb, shapes, tp, pp, cp, shape.layers, zero, hbm_Bps)


def tf_sync_report(
    sync: SyncOptions, shape: Any, run: Any, cluster: Any, gpu: Any, algorithm: str
) -> dict[str, Any]:
    """--sync on the transformer planner: each method priced on the layout's step (`plan` on the
    world, or on one replica group with its share of the global batch); bad words exit 2."""
    import dataclasses

    from ringtree.sim.training.predictor import plan

    def step_for(algorithm: str) -> Any:
        def step(group: Any) -> Any:
            # the world's batch is a multiple of its dp x micro-batch, so each group's share is whole
            batch = run.global_batch * group.ranks // cluster.ranks
            return plan(shape, dataclasses.replace(run, global_batch=batch), group, gpu, algorithm)

        return step

    model = tf_sync_model(shape, run.tp, run.pp, run.cp, run.zero, run.grad_itemsize, run.bucket_mb,
                          gpu.hbm_GBps * 1e9)  # fmt: skip
    try:
        return report(sync, model, cluster, algorithm, step_for, "transformer: the model's layers on the GPU")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
