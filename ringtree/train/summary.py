"""The run's summary: one function builds it for every mode; the table and `--json` both show it."""

from __future__ import annotations

from typing import Any

from ringtree.train.config import THREAD_MODES, TrainConfig, effective

# Measured figures first, in this order; then the effective configuration (config.effective).
METRIC_KEYS = (
    "accuracy",  # a fraction of 1 on the test split; null without one or for a non-classification loss
    "test_loss",
    "train_loss",  # mean training loss over the last epoch, all data-parallel replicas
    "final_loss",  # the last optimizer step's training loss, averaged over the replicas
    "samples_per_s",
    "step_time_s",
    "comm_time_s",
    "exposed_comm_time_s",
    "powersgd_compute_s",  # --compression powersgd: seconds per step of its own work, all-reduces excluded
    "predicted_step_time_s",
    "world_size",
    "nodes",
    "dp",
    "tp",
    "pp",
    "cp",  # context-parallel ranks each sequence is split over (the option's key too)
    "ep",  # expert-parallel ranks (1: every rank holds every expert)
    "backend",
    "parameters",  # the whole model's, whatever its TP and PP shards
    "model_state_mb",  # parameters + gradients + optimizer states held by the fullest rank (MiB)
    "peak_memory_mb",  # the fullest rank's peak: CUDA allocator peak on GPU, peak RSS on CPU (MiB)
    "steps",
    "resumed_from_step",
    "restarts",  # times torch's elastic agent restarted the workers (each resumed from a checkpoint)
    "stragglers",  # ranks whose own work was persistently slower than the median rank's
    "skipped_steps",
    "checkpoint_segments",
    "checkpoint_s",  # median seconds the loop waited per checkpoint save (slowest rank); null: none
    "activation_memory_mb",  # the most activation bytes a rank saved for backward at once (MiB)
    "distilled_from",
    # how the replicas synchronised (ringtree/train/low_comm.py), for every --sync
    "sync",
    "replicas",
    "inner_steps",
    "outer_syncs",
    "inter_node_bytes_per_step",
    "outer_comm_exposed_s",
    "outer_sync_wait_s",
)
THREAD_KEYS = (  # --mode dp-threads: the last step's work per device, and max / mean of it
    "devices",
    "device_held_bytes",  # outputs (all of them on device 0 unless balanced), labels and losses held
    "device_imbalance",  # of the held bytes on CPU copies, of the peak memory on GPUs
)
MOE_KEYS = (  # a model with MoE layers
    "experts",  # routed experts per MoE layer (the most of any layer)
    "top_k",
    "expert_load",  # max / mean tokens per expert, the last step's worst layer (1: balanced)
    "tokens_dropped",  # fraction of token copies the capacity dropped over the run
    "a2a_time_s",  # seconds per step in the token dispatch's all-to-alls, slowest rank
    "a2a_exposed_s",  # seconds per step the training thread waited for them, slowest rank
)
PIPELINE_KEYS = (
    "bubble_fraction",
    "theoretical_bubble_fraction",
    "peak_activation_bytes_per_stage",
    "weight_versions_per_stage",
)


def build_summary(metrics: dict[str, Any], cfg: TrainConfig, names: dict[str, str]) -> dict[str, Any]:
    """Metrics (METRIC_KEYS, then PIPELINE_KEYS under --pp), then every option that took effect.

    names: what the model, data set and loss were (the library API passes its own objects).
    """
    missing = [k for k in METRIC_KEYS if k not in metrics]
    if missing:
        raise KeyError(f"summary metrics missing: {', '.join(missing)}")
    out = {k: metrics[k] for k in METRIC_KEYS}
    if cfg.pp > 1:
        out |= {k: metrics[k] for k in PIPELINE_KEYS}
    if cfg.mode in THREAD_MODES:
        out |= {k: metrics[k] for k in THREAD_KEYS}
    if "expert_load" in metrics:
        out |= {k: metrics[k] for k in MOE_KEYS}
    for key, value in (effective(cfg) | names).items():
        out.setdefault(key, value)
    return out


def rows(summary: dict[str, Any]) -> list[list[str]]:
    """[name, value] rows of the summary table (floats to 4 significant digits, None as null)."""
    return [[k, _fmt(v)] for k, v in summary.items()]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "null" if value is None else str(value)
