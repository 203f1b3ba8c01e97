"""A cluster from the command line's words: link presets or custom links, and a calibration file."""

from __future__ import annotations

import warnings
from pathlib import Path

from ringtree.sim import calibrate
from ringtree.sim.hardware import Cluster, parse_link
from ringtree.sim.presets import INTER, INTRA


def make_cluster(
    nodes: int,
    gpus_per_node: int,
    intra: str | None = None,
    inter: str | None = None,
    calibration: Path | None = None,
    nics_per_node: int = 1,
) -> Cluster:
    """The cluster a command describes; a calibration stands in for any link not named.

    A calibration measured on one machine describes its intra-node link; used for the inter-node
    link too (when no --inter is given) it models a cluster of such machines, with a warning.
    """
    fitted = calibrate.load(calibration) if calibration is not None else None
    if fitted is None and (intra is None or (inter is None and nodes > 1)):
        raise ValueError(
            f"name the links (--intra {'/'.join(INTRA)}; --inter {'/'.join(INTER)}; "
            "or custom 'bw=12.5GB/s,lat=5us') or pass --calibration machine.json"
        )
    if fitted is not None and inter is None and nodes > 1:
        warnings.warn("no --inter given: the calibrated link also models the network", stacklevel=2)
    intra_link = parse_link(intra, INTRA) if intra else fitted.link if fitted else None
    inter_link = parse_link(inter, INTER) if inter else fitted.link if fitted else intra_link
    assert intra_link is not None and inter_link is not None
    gamma = fitted.gamma_s_per_byte if fitted else Cluster.gamma
    return Cluster(nodes, gpus_per_node, intra_link, inter_link, gamma, nics_per_node)
