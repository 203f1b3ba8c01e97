"""`ringtree plan`'s cluster and output options, which every planner shares, and the refusal of
options a planner would ignore."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

CLUSTER, OUTPUT = "Cluster", "Output"

NODES = typer.Option(1, help="Nodes.", rich_help_panel=CLUSTER)
GPUS_PER_NODE = typer.Option(
    None, help="Devices per node (default 8, or the --cluster's).", rich_help_panel=CLUSTER
)
INTRA = typer.Option(
    None, help="Intra-node link: a preset, FILE.json or 'bw=..,lat=..'.", rich_help_panel=CLUSTER
)
INTER = typer.Option(
    None, help="Inter-node link: a preset, FILE.json or 'bw=..,lat=..'.", rich_help_panel=CLUSTER
)
NICS_PER_NODE = typer.Option(
    None, help="NICs per node (default 1, or the --cluster's).", rich_help_panel=CLUSTER
)
CLUSTER_NAME = typer.Option(
    None,
    "--cluster",
    help="A cluster preset: dgx-a100, dgx-h100, p4d.24xlarge, eth-10g, ...",
    rich_help_panel=CLUSTER,
)
CALIBRATION = typer.Option(
    None, help="A `ringtree calibrate` file for unnamed links.", rich_help_panel=CLUSTER
)
ALGORITHM = typer.Option(
    "auto", help="The algorithm to report, or auto (the fastest).", rich_help_panel=CLUSTER
)
JSON_PATH = typer.Option(None, "--json", help="Write the plan as JSON here.", rich_help_panel=OUTPUT)
PLOT = typer.Option(
    None,
    help="PNG: a transformer's step per pipeline stage beside each stage's memory (with --search the "
    "top layouts side by side); data parallel, the speedup from 1 to --nodes nodes.",
    rich_help_panel=OUTPUT,
)


@dataclass(frozen=True)
class ClusterOptions:
    """The cluster options of the command line, resolved on demand (a preset, links, a calibration)."""

    nodes: int
    gpus_per_node: int | None
    intra: str | None
    inter: str | None
    nics_per_node: int | None
    name: str | None
    calibration: Path | None

    def cluster(self) -> Any:
        from ringtree.sim import make_cluster
        from ringtree.sim.network.clusters import preset_cluster

        if self.name is None:
            return make_cluster(
                self.nodes,
                self.gpus_per_node or 8,
                self.intra,
                self.inter,
                self.calibration,
                self.nics_per_node,
            )
        if self.calibration is not None:
            raise ValueError(
                f"--cluster {self.name} and --calibration both describe the links: pass one of them"
            )
        c = preset_cluster(self.name, self.nodes, self.gpus_per_node, self.intra, self.inter)
        if self.nics_per_node:
            return dataclasses.replace(c, nics_per_node=self.nics_per_node)
        if self.inter is not None and c.nics_per_node != 1:
            typer.echo(kept_nics_notice(self.name, self.inter, c.nics_per_node), err=True)
        return c

    def gpu(self) -> Any:
        from ringtree.sim.network.clusters import get

        if self.name is None:
            raise ValueError(
                "the transformer model needs the GPU's peak and memory: pass --cluster "
                "(dgx-a100, dgx-h100, p4d.24xlarge, ...)"
            )
        return get(self.name).gpu


def kept_nics_notice(preset: str, inter: str, nics: int) -> str:
    """Said once when --inter replaces a preset's NIC but not how many it has."""
    return (
        f"note: --inter {inter} kept --cluster {preset}'s {nics} NICs per node; "
        f"pass --nics-per-node N for the ports each node really has (one 10 GbE port: --nics-per-node 1)"
    )


def cluster_title(cluster: Any) -> str:
    """The cluster in one line: nodes, and what each has (GPUs, NICs and each NIC's speed)."""
    return f"{cluster.nodes} node(s) of {cluster.per_node()}"


def refuse(options: list[str], what: str) -> None:
    """Exit 2 naming options that would be ignored."""
    if options:
        raise typer.BadParameter(f"{', '.join(options)} do not apply with {what}: drop them")
