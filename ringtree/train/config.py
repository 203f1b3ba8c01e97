"""The training job's configuration, declared once: one typed dataclass, every default visible here.

Each field carries its help text in `metadata["help"]`; the command line (ringtree.cli.train), the
`--config FILE` loader, the summary's echo of the configuration (`effective`) and the options
table of docs/training.md (`options_markdown`) are all derived from the fields, so an option is
written down once. Options that only mean something together with another one (`--schedule`
without `--pp`, `--distill-alpha` without `--teacher`, `--bucket-mb` in the master-rank mode)
default to None: `validate` refuses them when they were given but would have no effect, and
`effective` resolves them to their real default where they do take effect.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ringtree import dtypes
from ringtree.schedules.pipeline import SCHEDULES, SYNCHRONOUS, ZERO_BUBBLE, check_zero_bubble
from ringtree.schedules.ring_attention import COMMS as CP_COMMS

# Nothing here imports torch at module level: the CLI derives its options from this module, and
# `ringtree plan` must start without loading torch.

MODELS = ("mlp", "mlp-tiny", "vit", "gpt", "gpt-tied", "moe")  # or pkg.mod:factory
DATASETS = ("digits", "sort")  # or pkg.mod:factory
LOSSES = ("cross_entropy", "mse")  # or pkg.mod:factory
MODES = ("ddp", "dp", "dp-threads", "dp-threads-balanced")
LANGUAGE_MODELS = ("gpt", "gpt-tied", "moe")  # they read token ids [b, t] and predict every next token
THREAD_MODES = ("dp-threads", "dp-threads-balanced")  # one process, torch's DataParallel (the seeds)
DEVICES = ("auto", "cpu", "cuda")
COMPRESSIONS = ("fp16", "bf16", "powersgd")
BALANCES = ("params", "time")
MASTER_ALGORITHMS = ("native", "ring", "tree", "ps")  # what --mode dp's reduce and broadcast run
SYNCS = ("ddp", "local-sgd", "diloco", "streaming-diloco")  # how the replicas synchronise (--sync)
OUTER_DTYPES = ("fp32", "bf16", "fp8", "int8", "int4")  # the outer all-reduce's wire format

RECIPE_FIELDS = ("lr", "epochs", "batch_size")  # None: from the model's recipe (train.models.REGISTRY)

# The real defaults of the options that default to None (they apply only in some setups).
DEFAULTS: dict[str, Any] = {
    "bucket_mb": 25.0,  # torch DDP's default fusion-bucket cap
    "overlap": True,
    "powersgd_rank": 1,  # torch's PowerSGDState defaults: rank 1, plain all-reduce for 1000 steps
    "powersgd_start_iter": 1000,
    "micro_batches": 4,
    "schedule": "1f1b",
    "virtual_stages": 2,  # interleaved 1F1B: two chunks a stage halve the bubble (Megatron-LM)
    "pp_balance": "params",
    "distill_temperature": 2.0,  # softens the teacher's near one-hot outputs (Hinton et al.: 2 to 5)
    "distill_alpha": 0.5,
    "keep_checkpoints": 2,  # the newest and one before it: a truncated newest still resumes
    "threads": 2,  # CPU copies without GPUs: enough to show device 0's extra load
    "cp_comm": "p2p",  # the ring: K/V move during attention, overlapping it (Megatron's default too)
    # --model moe (ringtree/train/moe.py): DeepSeek-V3 and torchtitan's choices at a small scale
    "experts": 8,
    "top_k": 2,
    "moe_every": 1,
    "shared_experts": 0,
    "router_score": "softmax",
    "router_aux_loss": 0.0,  # 0: balance by the expert bias, no auxiliary loss
    "a2a_algorithm": "auto",
    "profile_steps": "2:5",  # past the first steps' warm-up (allocations, the first sync's checks)
    "moe_shared_expert_overlap": False,  # off as Megatron-Core's; no faster on CPU (docs/moe-overlap.md)
    # --sync local-sgd / diloco / streaming-diloco (ringtree/train/low_comm.py)
    "inner_steps": 100,  # INTELLECT-1's H; DiLoCo's paper found 50-500 about equally good
    "outer_lr": 0.7,  # DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9), "very robust"
    "outer_momentum": 0.9,
    "fragments": 1,
    "overlap_steps": 0,
    "merge_alpha": 0.0,  # torchft's default: a fragment continues from the global value
    "outer_dtype": "fp32",
}
SYNC_OPTIONS = (
    "replicas",
    "inner_steps",
    "outer_lr",
    "outer_momentum",
    "fragments",
    "overlap_steps",
    "merge_alpha",
    "outer_dtype",
)
MOE_OPTIONS = (
    "experts",
    "top_k",
    "moe_every",
    "shared_experts",
    "router_score",
    "router_aux_loss",
    "capacity_factor",
)


class ConfigError(ValueError):
    """A refused configuration. Written once, with the command line's flags (`--pp 2`): `str()` gives
    the library's words (`pp=2`), the ones a TrainConfig caller typed; `.cli` the flags."""

    def __init__(self, cli: str) -> None:
        super().__init__(cli)
        self.cli = cli

    def __str__(self) -> str:
        return _library_words(self.cli)


_FLAG = re.compile(r"--(no-)?([a-z][a-z-]*)( (?:\d[\d.e-]*|[A-Z]+\b|'[^']*'|[a-z0-9_-]+))?")


def _library_words(cli: str) -> str:
    """`--micro-batches 4 needs --pp 2` -> `micro_batches=4 needs pp=2`: each TrainConfig flag
    becomes its field (with `=value` when a value follows it); other flags (--nproc) stay."""
    names = {flag(f.name): f.name for f in fields(TrainConfig)}
    values = {*MODELS, *MODES, *SCHEDULES, *DEVICES, *COMPRESSIONS, *BALANCES, *MASTER_ALGORITHMS, *DATASETS}
    values |= set(CP_COMMS)
    values |= {"off", "bf16", "fp16", "double_tree", "halving_doubling", "hierarchical"}
    values |= {"softmax", "sigmoid", "auto", "pairwise", "bruck", "linear"}

    def rename(m: re.Match[str]) -> str:
        name = names.get(f"--{m.group(2)}")
        if name is None:
            return m.group(0)
        if m.group(1):
            return f"{name}=False"
        value = (m.group(3) or "").strip()
        is_value = bool(value) and (
            value[0].isdigit() or value.isupper() or value[0] == "'" or value in values
        )
        return f"{name}={value}" if is_value else f"{name}{m.group(3) or ''}"

    parts = re.sub(r"--([a-z-]+)/--no-\1\b", r"--\1", cli).split("`")
    # a quoted command (`ringtree train --checkpoint-dir DIR`) keeps its flags
    return "`".join(part if i % 2 else _FLAG.sub(rename, part) for i, part in enumerate(parts))


def _speaks_library(check: Callable[..., None]) -> Callable[..., None]:
    """Turn a check's ValueError into a ConfigError: a library caller reads field names, the CLI flags."""

    @functools.wraps(check)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        try:
            check(*args, **kwargs)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None

    return wrapped


def _opt(default: Any, help: str, flag: str | None = None) -> Any:
    """A field with its help text (and, rarely, a flag name that is not the field's)."""
    meta = {"help": help} if flag is None else {"help": help, "flag": flag}
    return field(default=default, metadata=meta)


DTYPE_FIELDS = ("amp", "compression", "outer_dtype")  # options that name a dtype, written either way


@dataclass(frozen=True)
class TrainConfig:
    """What `ringtree train` trains and how; the defaults reach >= 95% digits accuracy in about a minute."""

    model: str = _opt(
        "mlp", "mlp, mlp-tiny, vit, gpt, gpt-tied, moe, or pkg.mod:factory returning an nn.Module."
    )
    dataset: str = _opt(
        "digits", "digits, sort (token sequences), or pkg.mod:factory returning a Dataset or (train, test)."
    )
    loss: str = _opt("cross_entropy", "cross_entropy, mse, or pkg.mod:factory returning a loss module.")
    device: str = _opt("auto", "auto (CUDA when present), cpu or cuda.")
    mode: str = _opt(
        "ddp",
        "ddp (bucketed all-reduce), dp (rank 0 reduces, steps, broadcasts), dp-threads or "
        "dp-threads-balanced (one process, replicas in threads; loss on device 0 or on each).",
    )
    threads: int | None = _opt(None, "Devices of --mode dp-threads: every GPU, or N CPU copies [2].")
    algorithm: str = _opt("ring", "All-reduce algorithm: native, ring, tree, double_tree, ps, ...")
    bucket_mb: float | None = _opt(None, "DDP fusion bucket cap in MB [25].")
    compression: str | None = _opt(
        None, "fp16 or bf16: DDP buckets travel in half precision; powersgd: as low-rank factors."
    )
    overlap: bool | None = _opt(None, "Launch DDP buckets during backward (--no-overlap: after) [on].")
    powersgd_rank: int | None = _opt(
        None, "Columns of PowerSGD's P and Q (needs --compression powersgd) [1]."
    )
    powersgd_start_iter: int | None = _opt(
        None, "Optimizer steps with a plain all-reduce before PowerSGD compresses (needs it) [1000]."
    )
    batch_size: int | None = _opt(None, "Samples per DP rank and micro-batch [the model's recipe].")
    epochs: int | None = _opt(None, "Passes over the training split [the model's recipe].")
    lr: float | None = _opt(None, "AdamW learning rate [the model's recipe].")
    weight_decay: float = _opt(1e-4, "AdamW weight decay.")
    seed: int = _opt(0, "Model init and shuffling seed.")
    accumulate: int = _opt(1, "Batches (pipeline runs under --pp) per optimizer step.")
    checkpoint_dir: str | None = _opt(None, "Write checkpoints (DIR/last.pt) here.")
    checkpoint_every: int = _opt(0, "Optimizer steps between checkpoints; 0: every epoch.")
    resume: bool = _opt(False, "Continue from --checkpoint-dir's last checkpoint.")
    checkpoint_async: bool = _opt(False, "Write checkpoints while training goes on (DCP's async_save).")
    keep_checkpoints: int | None = _opt(None, "Checkpoints kept in --checkpoint-dir, newest first [2].")
    max_restarts: int = _opt(0, "Restarts of a failed worker group (elastic agent); needs --checkpoint-dir.")
    straggler_every: int = _opt(20, "Steps between gathers of per-rank work times (stragglers); 0: off.")
    profile: str | None = _opt(
        None, "Write a torch.profiler trace per rank (DIR/rank{R}.json.gz) for `ringtree trace DIR`."
    )
    profile_steps: str | None = _opt(None, "Optimizer steps FIRST:LAST that --profile records [2:5].")
    timeout_s: float | None = _opt(None, "Seconds before a stuck collective raises [60].", "--timeout")
    progress: bool = _opt(True, "Show rank 0's progress bar.")
    log_every: int = _opt(10, "Optimizer steps between reads of the loss (one host sync each).")
    tp: int = _opt(1, "Tensor-parallel ranks per model replica; 1: none.")
    tp_plan: Mapping[str, str] | str | None = _opt(
        None,
        "YAML/JSON file (or, in the library, a dict) mapping module names to colwise or rowwise "
        "(needs --tp) [the model's own plan].",
    )
    sequence_parallel: bool = _opt(False, "Split norms' tokens among the TP ranks (needs --tp, --model gpt).")
    pp: int = _opt(1, "Pipeline stages per model replica; 1: no pipeline.")
    micro_batches: int | None = _opt(None, "Micro-batches per pipeline run (needs --pp) [4].")
    schedule: str | None = _opt(
        None,
        "gpipe, 1f1b, interleaved, pipedream, pipedream-vs, or zero-bubble zb-h1, zb-h2, zb-v, "
        "dualpipev (needs --pp) [1f1b].",
    )
    virtual_stages: int | None = _opt(
        None, "Model chunks per pipeline stage (needs --schedule interleaved) [2]."
    )
    pp_balance: str | None = _opt(None, "Cut stages by params or profiled time (needs --pp) [params].")
    cp: int = _opt(1, "Context-parallel ranks per sequence (head-tail chunks, attention over all); 1: none.")
    cp_comm: str | None = _opt(
        None, "p2p (ring attention), all-gather (K/V before attention) or all-to-all (Ulysses) [p2p]."
    )
    checkpoint_activations: bool = _opt(False, "Recompute activations in backward (less memory).")
    checkpoint_segments: int = _opt(0, "Checkpointed segments; 0: about sqrt(blocks).")
    amp: str = _opt("off", "Mixed precision: off, bf16 (autocast) or fp16 (CUDA, loss scaling).")
    teacher: str | None = _opt(None, "Distil from a --checkpoint-dir checkpoint (file or folder).")
    distill_temperature: float | None = _opt(None, "Distillation softmax temperature [2].")
    distill_alpha: float | None = _opt(None, "Weight of the teacher's soft loss [0.5].")
    prefetch: bool = _opt(False, "Prepare the next batch on a thread while this one computes.")
    zero: int = _opt(0, "ZeRO: 0 DDP; 1 shards optimizer states, 2 also gradients, 3 also parameters.")
    ep: int = _opt(1, "Expert-parallel ranks (borrowed from the data-parallel ones) the experts split over.")
    experts: int | None = _opt(None, "Routed experts per MoE layer (--model moe) [8].")
    top_k: int | None = _opt(None, "Experts each token goes to (--model moe) [2].")
    moe_every: int | None = _opt(
        None, "An MoE layer in every K-th block, dense MLPs between (--model moe) [1]."
    )
    shared_experts: int | None = _opt(None, "Shared experts every token goes through (--model moe) [0].")
    router_score: str | None = _opt(
        None, "Router scores: softmax or sigmoid, in fp32 (--model moe) [softmax]."
    )
    router_aux_loss: float | None = _opt(
        None, "Balance by the auxiliary loss with this coefficient, not the expert bias (--model moe) [0]."
    )
    capacity_factor: float | None = _opt(
        None, "Drop token copies past C x an expert's balanced load (--model moe) [dropless]."
    )
    a2a_algorithm: str | None = _opt(
        None,
        "The token dispatch's all-to-all: auto, pairwise, bruck, linear, hierarchical, native "
        "(needs --ep) [auto].",
    )
    moe_shared_expert_overlap: bool | None = _opt(
        None,
        "Compute the shared experts while the token all-to-alls travel (needs --ep and shared "
        "experts) [off].",
    )
    # -- synchronising less: local SGD, DiLoCo, Streaming DiLoCo (ringtree/train/low_comm.py) --
    sync: str = _opt(
        "ddp",
        "ddp (all-reduce every step), local-sgd (average every --inner-steps), diloco (outer Nesterov "
        "step every --inner-steps) or streaming-diloco (one --fragments fragment at a time).",
    )
    replicas: int | None = _opt(
        None,
        "Replica groups, DDP or ZeRO-1/2 inside each, synchronised by --sync (not ddp) "
        "[one per node or DP rank].",
    )
    inner_steps: int | None = _opt(None, "Optimizer steps between synchronisations, H (needs --sync) [100].")
    outer_lr: float | None = _opt(None, "Outer SGD learning rate (--sync diloco, streaming-diloco) [0.7].")
    outer_momentum: float | None = _opt(
        None, "Outer SGD Nesterov momentum; 0: plain SGD (--sync diloco, streaming-diloco) [0.9]."
    )
    fragments: int | None = _opt(
        None, "Layer fragments synchronised in turn, one every H/F steps (--sync streaming-diloco) [1]."
    )
    overlap_steps: int | None = _opt(
        None, "Inner steps a fragment's all-reduce overlaps, T < H/F (--sync streaming-diloco) [0]."
    )
    merge_alpha: float | None = _opt(
        None, "Weight of the local values when a fragment merges, in [0, 1] (--sync streaming-diloco) [0]."
    )
    outer_dtype: str | None = _opt(
        None, "Pseudo-gradients on the wire: fp32, bf16, fp8, int8, int4 (--sync diloco, streaming) [fp32]."
    )

    def __post_init__(self) -> None:
        for name in DTYPE_FIELDS:  # one spelling per dtype: --amp bfloat16 is --amp bf16
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, dtypes.short(getattr(self, name)))
        validate(self)

    def get(self, name: str) -> Any:
        """The value in effect: the field, or its real default when it is None and has one."""
        value = getattr(self, name)
        if value is None and name == "timeout_s":
            from ringtree import comm

            return comm.DEFAULT_TIMEOUT_S  # one default for every collective in ringtree
        if value is None and name in RECIPE_FIELDS:
            from ringtree.train.models import recipe

            return getattr(recipe(self.model)[1], name)
        return DEFAULTS.get(name) if value is None else value

    def recipe(self) -> str:
        """The name of the recipe the run's unset --lr, --epochs and --batch-size come from."""
        from ringtree.train.models import recipe

        return recipe(self.model)[0]


@_speaks_library
def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Raise ValueError, in one sentence naming the option and the fix, for a setup that cannot run.

    Runs when a TrainConfig is made and, with the world size, before any worker starts.
    """
    _check_values(cfg)
    _check_combinations(cfg)
    _check_device(cfg)
    if world_size is not None:
        check_world(cfg, world_size)


def _check_values(cfg: TrainConfig) -> None:
    from ringtree import comm
    from ringtree.train.techniques.amp import AMP_MODES
    from ringtree.train.techniques.distill import check_distill, teacher_file

    _named("model", cfg.model, MODELS)
    _named("dataset", cfg.dataset, DATASETS)
    _named("loss", cfg.loss, LOSSES)
    _choice("device", cfg.device, DEVICES)
    _choice("mode", cfg.mode, MODES)
    valid = list(MASTER_ALGORITHMS) if cfg.mode == "dp" else comm.algorithms()
    _choice(f"algorithm (for mode {cfg.mode!r})", cfg.algorithm, tuple(valid))
    _choice("amp", cfg.amp, AMP_MODES)
    if cfg.compression is not None:
        _choice("compression", cfg.compression, COMPRESSIONS)
    _check_powersgd(cfg)
    if cfg.schedule is not None:
        _choice("pipeline schedule", cfg.schedule, tuple(SCHEDULES))
    if cfg.pp_balance is not None:
        _choice("pp_balance", cfg.pp_balance, BALANCES)
    if cfg.cp_comm is not None:
        _choice("--cp-comm", cfg.cp_comm, CP_COMMS)
    for name in ("max_restarts", "straggler_every"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{flag(name)} must be 0 or more, got {getattr(cfg, name)}")
    if cfg.keep_checkpoints is not None and cfg.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be at least 1, got {cfg.keep_checkpoints}")
    for name in ("batch_size", "epochs", "accumulate", "tp", "pp", "cp", "log_every"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{flag(name)} must be at least 1, got {getattr(cfg, name)}")
    for name in ("micro_batches", "virtual_stages"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{flag(name)} must be at least 1, got {getattr(cfg, name)}")
    for name in ("lr", "bucket_mb", "timeout_s"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ValueError(f"{flag(name)} must be positive, got {value}")
    if cfg.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0 (0: every epoch), got {cfg.checkpoint_every}")
    if cfg.checkpoint_segments < 0:
        raise ValueError(
            f"--checkpoint-segments must be >= 0 (0: about sqrt(blocks)), got {cfg.checkpoint_segments}"
        )
    check_distill(cfg.get("distill_temperature"), cfg.get("distill_alpha"))
    _check_moe_values(cfg)
    if cfg.checkpoint_dir is not None:
        _check_folder(Path(cfg.checkpoint_dir))
    if cfg.profile is not None:
        _check_folder(Path(cfg.profile), "--profile")
    if cfg.profile_steps is not None:
        from ringtree.train.profile import parse_steps

        parse_steps(cfg.profile_steps)
    if cfg.teacher is not None:
        teacher_file(cfg.teacher)  # raises, naming the path, when there is no checkpoint there


# Options given without the option that makes them mean something: refused, never silently ignored.
_NEEDS = (
    ("micro_batches", "pp", "--micro-batches needs --pp 2 or more; drop it or add --pp"),
    ("schedule", "pp", "--schedule needs --pp 2 or more; drop it or add --pp"),
    ("pp_balance", "pp", "--pp-balance needs --pp 2 or more; drop it or add --pp"),
    ("virtual_stages", "interleaved", "--virtual-stages needs --schedule interleaved; drop it or add that"),
    ("distill_temperature", "teacher", "--distill-temperature needs --teacher; drop it or add --teacher"),
    ("distill_alpha", "teacher", "--distill-alpha needs --teacher; drop it or add --teacher"),
    ("cp_comm", "cp", "--cp-comm needs --cp 2 or more; drop it or add --cp"),
)


def _check_powersgd(cfg: TrainConfig) -> None:
    """--powersgd-rank >= 1 and --powersgd-start-iter >= 0, each only with --compression powersgd."""
    if cfg.powersgd_rank is not None and cfg.powersgd_rank < 1:
        raise ValueError(
            f"--powersgd-rank must be at least 1 (columns of P and Q), got {cfg.powersgd_rank}; "
            "start from 1 and double it until the accuracy is good enough"
        )
    if cfg.powersgd_start_iter is not None and cfg.powersgd_start_iter < 0:
        raise ValueError(f"--powersgd-start-iter must be 0 or more, got {cfg.powersgd_start_iter}")
    for name in ("powersgd_rank", "powersgd_start_iter"):
        if getattr(cfg, name) is not None and cfg.compression != "powersgd":
            raise ValueError(f"{flag(name)} configures --compression powersgd; add it or drop {flag(name)}")
    if cfg.compression == "powersgd" and cfg.amp == "fp16":
        raise ValueError(
            "--compression powersgd keeps each step's compression error for the next, which --amp "
            "fp16's changing loss scale and skipped overflow steps would corrupt; use --amp bf16"
        )
    if cfg.compression == "powersgd" and cfg.ep > 1:
        raise ValueError(
            f"--compression powersgd compresses DDP's buckets, and --ep {cfg.ep} reduces the experts "
            "outside them; drop one of the two"
        )


def _check_moe_values(cfg: TrainConfig) -> None:
    from ringtree.parallel.moe.alltoall import available
    from ringtree.parallel.moe.router import SCORES

    for name in ("ep", "experts", "top_k", "moe_every"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.shared_experts is not None and cfg.shared_experts < 0:
        raise ValueError(f"--shared-experts must be 0 or more, got {cfg.shared_experts}")
    if cfg.router_aux_loss is not None and cfg.router_aux_loss < 0:
        raise ValueError(f"--router-aux-loss must be 0 or more, got {cfg.router_aux_loss}")
    if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
        raise ValueError(
            f"--capacity-factor must be positive (C x the balanced load), got {cfg.capacity_factor}; "
            "leave it out for dropless routing"
        )
    if cfg.router_score is not None:
        _choice("router_score", cfg.router_score, SCORES)
    if cfg.a2a_algorithm is not None:
        _choice("a2a_algorithm", cfg.a2a_algorithm, available())
    if cfg.get("top_k") > cfg.get("experts"):
        raise ValueError(
            f"--top-k {cfg.get('top_k')} is above --experts {cfg.get('experts')}: a token cannot go to "
            f"more experts than there are; choose --top-k {cfg.get('experts')} or fewer"
        )


def _check_shared_overlap(cfg: TrainConfig) -> None:
    """--(no-)moe-shared-expert-overlap needs all-to-alls (--ep) and shared experts beside them."""
    if cfg.moe_shared_expert_overlap is None:
        return
    if cfg.ep == 1:
        raise ValueError(
            "--moe-shared-expert-overlap/--no-moe-shared-expert-overlap overlaps the all-to-alls of "
            "--ep ranks; add --ep 2 or more, or drop it"
        )
    if cfg.model == "moe" and not cfg.get("shared_experts"):
        raise ValueError(
            "--moe-shared-expert-overlap/--no-moe-shared-expert-overlap overlaps the shared experts, "
            "which --model moe has without --shared-experts 1 or more; add it, or drop the option"
        )


def _check_moe(cfg: TrainConfig) -> None:
    """MoE options need --model moe; --ep splits the experts and needs DDP's data parallelism."""
    given = [flag(name) for name in MOE_OPTIONS if getattr(cfg, name) is not None]
    if given and cfg.model != "moe":
        raise ValueError(f"{given[0]} configures --model moe's layers; drop it or add --model moe")
    if cfg.a2a_algorithm is not None and cfg.ep == 1:
        raise ValueError("--a2a-algorithm dispatches tokens among --ep ranks; add --ep 2 or more, or drop it")
    _check_shared_overlap(cfg)
    if cfg.ep == 1:
        return
    if cfg.model == "moe" and cfg.get("experts") % cfg.ep:
        e = cfg.get("experts")
        raise ValueError(
            f"--ep {cfg.ep} must divide --experts {e} (each rank keeps whole experts); "
            f"choose --ep among {[d for d in range(1, e + 1) if e % d == 0]}"
        )
    if cfg.mode != "ddp":
        raise ValueError(
            f"--ep {cfg.ep} borrows DDP's data-parallel ranks, which --mode {cfg.mode} does not run; "
            "use --mode ddp"
        )
    if cfg.zero and cfg.amp == "fp16":
        raise ValueError(
            f"--amp fp16 unscales the gradients before --ep {cfg.ep} reduces the experts' into their "
            f"--zero {cfg.zero} shards; use --amp bf16"
        )
    if cfg.pp > 1 and cfg.get("schedule") not in SYNCHRONOUS:
        raise ValueError(
            f"--schedule {cfg.schedule} steps stages on stashed weights, which --ep does not shard; "
            "use gpipe or 1f1b"
        )


def _check_combinations(cfg: TrainConfig) -> None:
    present = {
        "pp": cfg.pp > 1,
        "teacher": cfg.teacher is not None,
        "interleaved": cfg.schedule == "interleaved",
        "cp": cfg.cp > 1,
    }
    for name, needs, message in _NEEDS:
        neutral = name == "micro_batches" and cfg.micro_batches == 1  # one micro-batch: no pipeline
        if getattr(cfg, name) is not None and not present[needs] and not neutral:
            raise ValueError(message)
    if cfg.checkpoint_segments and not cfg.checkpoint_activations:
        raise ValueError(
            f"--checkpoint-segments {cfg.checkpoint_segments} does nothing without checkpointing; "
            "add --checkpoint-activations"
        )
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs a checkpoint directory: pass --checkpoint-dir DIR with --resume")
    if cfg.profile_steps is not None and cfg.profile is None:
        raise ValueError("--profile-steps needs --profile DIR (where the traces go); add it or drop it")
    if cfg.checkpoint_async and not cfg.checkpoint_dir:
        raise ValueError("--checkpoint-async needs --checkpoint-dir DIR (it saves there in the background)")
    if cfg.keep_checkpoints is not None and not cfg.checkpoint_dir:
        raise ValueError(
            "--keep-checkpoints needs --checkpoint-dir DIR (there is nothing to keep without it)"
        )
    if cfg.max_restarts and not cfg.checkpoint_dir:
        raise ValueError(
            f"--max-restarts {cfg.max_restarts} resumes from the newest checkpoint; pass --checkpoint-dir DIR"
        )
    if cfg.mode == "dp":
        _check_master_mode(cfg)
    if cfg.zero:
        _check_zero(cfg)
    if cfg.mode in THREAD_MODES:
        _check_thread_mode(cfg)
    elif cfg.threads is not None:
        raise ValueError(
            f"--threads {cfg.threads} sets the devices of --mode dp-threads; drop it or add that mode"
        )
    _check_tensor_parallel(cfg)
    _check_moe(cfg)
    _check_sync(cfg)
    if cfg.pp > 1 and cfg.get("schedule") not in SYNCHRONOUS:
        _check_pipedream(cfg)
    if cfg.pp > 1 and cfg.get("schedule") in ZERO_BUBBLE:
        check_zero_bubble(cfg.get("schedule"), cfg.pp, cfg.get("micro_batches"))
    if cfg.pp > 1 and cfg.schedule == "interleaved" and cfg.get("micro_batches") % cfg.pp:
        m = cfg.get("micro_batches")
        raise ValueError(
            f"--schedule interleaved runs micro-batches in groups of the {cfg.pp} stages; "
            f"--micro-batches {m} is not a multiple of {cfg.pp}: use {m + cfg.pp - m % cfg.pp}"
        )


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """--tp-plan and --sequence-parallel mean something only with --tp; gpt reads token sequences."""
    if cfg.tp_plan is not None and cfg.tp == 1:
        raise ValueError("--tp-plan shards layers among --tp ranks; add --tp 2 or more, or drop --tp-plan")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ValueError("--sequence-parallel splits tokens among --tp ranks; add --tp 2 or more, or drop it")
    if cfg.tp_plan is not None and not isinstance(cfg.tp_plan, str | Mapping):
        raise ValueError(f"tp_plan must be a file name or a dict, got {type(cfg.tp_plan).__name__}")
    if cfg.model in LANGUAGE_MODELS and cfg.dataset == "digits":
        raise ValueError(f"--model {cfg.model} reads token sequences, not digits; add --dataset sort")


def _bucket_options(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """DDP's bucket options as (flag, value given or None): modes without buckets refuse them."""
    return [
        ("--bucket-mb", cfg.bucket_mb),
        ("--compression", cfg.compression),
        ("--overlap/--no-overlap", cfg.overlap),
        ("--powersgd-rank", cfg.powersgd_rank),
        ("--powersgd-start-iter", cfg.powersgd_start_iter),
    ]


def _check_master_mode(cfg: TrainConfig) -> None:
    """--mode dp: rank 0 reduces, steps and broadcasts the whole model; no buckets, no mesh."""
    given = [flag for flag, value in _bucket_options(cfg) if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: options of DDP's buckets, which --mode dp does not have; "
            "drop them or use --mode ddp"
        )
    if cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1:
        raise ValueError(
            "--mode dp steps the whole model on rank 0, so it cannot hold a tensor- or pipeline-parallel "
            "shard or a context-parallel share of the sequence; use --mode ddp with --tp/--pp/--cp"
        )
    if cfg.amp == "fp16":
        raise ValueError(
            "--amp fp16 scales the loss on every rank but --mode dp steps on rank 0 alone, so the "
            "scale would not be agreed; use --amp bf16 or --mode ddp"
        )


def _check_zero(cfg: TrainConfig) -> None:
    """--zero 1-3: ShardedDataParallel replaces DDP over the DP group (ringtree/parallel/sharded.py)."""
    if cfg.zero not in (1, 2, 3):
        raise ValueError(f"--zero {cfg.zero} is not a ZeRO stage; choose 0 (DDP), 1, 2 or 3")
    if cfg.mode != "ddp":
        raise ValueError(
            f"--zero {cfg.zero} shards DDP's data parallelism, which --mode {cfg.mode} does not run; "
            "drop --zero or use --mode ddp"
        )
    from ringtree.parallel.sharded import zero_algorithms

    if cfg.algorithm not in zero_algorithms():
        raise ValueError(
            f"--algorithm {cfg.algorithm} has no reduce-scatter/all-gather schedule for --zero "
            f"{cfg.zero}; choose one of {', '.join(zero_algorithms())}"
        )
    given = [flag for flag, value in _bucket_options(cfg)[1:] if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: not supported with --zero {cfg.zero} (its buckets are always reduced "
            "during backward, in full precision); drop them or use --zero 0"
        )
    if cfg.pp > 1 and cfg.get("schedule") not in SYNCHRONOUS:
        raise ValueError(
            f"--schedule {cfg.schedule} computes gradients on stashed weight copies, which --zero "
            f"{cfg.zero} does not hold; use --schedule gpipe or 1f1b, or --zero 0"
        )
    if cfg.pp > 1 and cfg.schedule == "interleaved":
        raise ValueError(
            f"--schedule interleaved synchronizes one DDP per chunk, which --zero {cfg.zero} does not "
            "shard yet; use --schedule gpipe or 1f1b with --zero, or --zero 0 with interleaved"
        )


def _check_sync(cfg: TrainConfig) -> None:
    """--sync and its options: each needs the method it configures; values in range."""
    _choice("--sync", cfg.sync, SYNCS)
    given = [name for name in SYNC_OPTIONS if getattr(cfg, name) is not None]
    outer_only = {"outer_lr", "outer_momentum", "outer_dtype"}
    streaming_only = {"fragments", "overlap_steps", "merge_alpha"}
    for name in given:
        if cfg.sync == "ddp":
            raise ValueError(f"{flag(name)} configures --sync local-sgd, diloco or streaming-diloco; add one")
        if name in outer_only and cfg.sync == "local-sgd":
            raise ValueError(f"{flag(name)} configures the outer step of --sync diloco; local-sgd averages")
        if name in streaming_only and cfg.sync != "streaming-diloco":
            raise ValueError(f"{flag(name)} configures --sync streaming-diloco; use it or drop {flag(name)}")
    if cfg.outer_dtype is not None:
        _choice("--outer-dtype", cfg.outer_dtype, OUTER_DTYPES)
    for name in ("replicas", "inner_steps", "fragments"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.outer_lr is not None and cfg.outer_lr <= 0:
        raise ValueError(f"--outer-lr must be positive, got {cfg.outer_lr}")
    if cfg.outer_momentum is not None and not 0 <= cfg.outer_momentum < 1:
        raise ValueError(f"--outer-momentum must be in [0, 1), got {cfg.outer_momentum}")
    if cfg.merge_alpha is not None and not 0 <= cfg.merge_alpha <= 1:
        raise ValueError(f"--merge-alpha must be in [0, 1], got {cfg.merge_alpha}")
    h, f, t = cfg.get("inner_steps"), cfg.get("fragments"), cfg.get("overlap_steps")
    if h % f:
        raise ValueError(
            f"--fragments {f} must divide --inner-steps {h}, so that each fragment syncs every H"
        )
    if t < 0 or t >= h // f:
        raise ValueError(
            f"--overlap-steps {t} must be in [0, H/F) = [0, {h // f}); lower it or raise --inner-steps"
        )
    if cfg.sync == "ddp":
        return
    if cfg.zero == 3:
        raise ValueError(
            f"--sync {cfg.sync} reads and writes each replica's whole parameters, which --zero 3 holds "
            "only as shards; use --zero 1 or 2 inside the replica groups, or --zero 0"
        )
    refused = [
        (cfg.mode != "ddp", f"--mode {cfg.mode}"),
        (cfg.ep > 1, f"--ep {cfg.ep}"),
        (cfg.pp > 1 and cfg.get("schedule") not in SYNCHRONOUS, f"--schedule {cfg.schedule}"),
    ]
    for bad, words in refused:
        if bad:
            raise ValueError(
                f"--sync {cfg.sync} runs over DDP or ZeRO-1/2 replicas; {words} is not supported with it"
            )


def _check_thread_mode(cfg: TrainConfig) -> None:
    """--mode dp-threads: one process drives every device with threads; nothing distributed."""
    given = [
        flag
        for flag, value in (
            *_bucket_options(cfg),
            ("--algorithm", None if cfg.algorithm == "ring" else cfg.algorithm),  # autograd sums the replicas
            ("--tp", cfg.tp > 1 or None),
            ("--pp", cfg.pp > 1 or None),
            ("--cp", cfg.cp > 1 or None),
            ("--accumulate", cfg.accumulate > 1 or None),
            ("--teacher", cfg.teacher),
            ("--amp", cfg.amp != "off" or None),
            ("--checkpoint-activations", cfg.checkpoint_activations or None),
            ("--prefetch", cfg.prefetch or None),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)}: not supported by --mode {cfg.mode}, a single process with replicas "
            "in threads (torch's nn.DataParallel); drop them or use --mode ddp"
        )
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {cfg.threads}")


def _check_pipedream(cfg: TrainConfig) -> None:
    """PipeDream steps after every micro-batch on stashed weights: no accumulation, no overlap."""
    if cfg.accumulate > 1:
        raise ValueError(
            f"--schedule {cfg.schedule} steps after every micro-batch, so --accumulate {cfg.accumulate} "
            "cannot apply; use --schedule gpipe or 1f1b, or drop --accumulate"
        )
    if cfg.overlap:
        raise ValueError(
            f"--schedule {cfg.schedule} computes gradients on stashed weights outside DDP's hooks, so "
            "--overlap cannot apply (buckets start at each step); drop --overlap or use gpipe/1f1b"
        )
    if cfg.checkpoint_activations:
        raise ValueError(
            f"--schedule {cfg.schedule} runs each stage on stashed weights (functional_call), which "
            "--checkpoint-activations does not wrap; use gpipe or 1f1b with --checkpoint-activations"
        )
    if cfg.amp == "fp16":
        raise ValueError(
            f"--schedule {cfg.schedule} steps each stage at its own time, so the stages cannot agree on "
            "fp16's loss scale; use --amp bf16 or --schedule gpipe/1f1b"
        )
    if cfg.checkpoint_every:
        raise ValueError(
            f"--schedule {cfg.schedule} streams a whole epoch as one run, so checkpoints come at the end "
            "of each epoch; drop --checkpoint-every"
        )


def _check_device(cfg: TrainConfig) -> None:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU and this machine has none; use --device cpu or auto")
    if cfg.amp == "fp16" and device_type(cfg) != "cuda":
        raise ValueError(
            "--amp fp16 needs a CUDA device (its loss scaling, GradScaler, is for CUDA) and this run is "
            "on the CPU; use --amp bf16 there"
        )


@_speaks_library
def check_world(cfg: TrainConfig, world_size: int) -> None:
    """Raise ValueError when tp x pp does not divide the world (or tp exceeds a node under torchrun)."""
    if world_size < 1:
        raise ValueError(f"--nproc must be at least 1, got {world_size}")
    if cfg.mode in THREAD_MODES and world_size != 1:
        raise ValueError(
            f"--mode {cfg.mode} is one process driving every device with threads; use --nproc 1 "
            f"(not {world_size}) and --threads N for the devices"
        )
    if cfg.cp > 1 and world_size % (cfg.tp * cfg.pp * cfg.cp):
        n = cfg.tp * cfg.pp * cfg.cp
        raise ValueError(
            f"--tp {cfg.tp} x --pp {cfg.pp} x --cp {cfg.cp} = {n} ranks per replica does not divide the "
            f"{world_size} ranks; choose --nproc a multiple of {n}"
        )
    if world_size % (cfg.tp * cfg.pp):
        raise ValueError(
            f"--tp {cfg.tp} x --pp {cfg.pp} = {cfg.tp * cfg.pp} ranks per replica does not divide the "
            f"{world_size} ranks; choose --nproc a multiple of {cfg.tp * cfg.pp}"
        )
    if cfg.sync != "ddp":
        from ringtree.parallel.mesh import MeshShape
        from ringtree.parallel.outer_groups import layout

        r = replicas_of(cfg, world_size)
        shape = MeshShape(world_size // (cfg.tp * cfg.pp * cfg.cp), cfg.tp, cfg.pp, cfg.cp)
        layout(replace(shape, replicas=r) if shape.dp % r == 0 else shape, r)
    data = world_size // (cfg.tp * cfg.pp)  # the ranks EP borrows: DP x CP
    if data % cfg.ep:
        raise ValueError(
            f"--ep {cfg.ep} must divide the {data} data-parallel ranks it borrows (--nproc {world_size} / "
            f"(--tp {cfg.tp} x --pp {cfg.pp})); choose --ep among "
            f"{[d for d in range(1, data + 1) if data % d == 0]}"
        )


def replicas_of(cfg: TrainConfig, world_size: int) -> int:
    """--replicas, or one replica per node (torchrun's LOCAL_WORLD_SIZE); on one node, one per
    data-parallel rank (a world of one node has no slow link to spare, so every replica is a rank)."""
    if cfg.replicas is not None:
        return cfg.replicas
    import os

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    nodes = world_size // local if local and world_size % local == 0 else 1
    return nodes if nodes > 1 else max(1, world_size // (cfg.tp * cfg.pp * cfg.cp))


def device_type(cfg: TrainConfig) -> str:
    """'cuda' or 'cpu': what --device resolves to on this machine."""
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def effective(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration that took effect: None defaults resolved, options without effect left out."""
    out = {f.name: cfg.get(f.name) for f in fields(cfg)}
    out["device"] = device_type(cfg)
    out = {k: v for key, value in out.items() for k, v in _with_recipe(key, value, cfg)}
    dropped: set[str] = set()
    if cfg.mode == "dp":
        dropped |= {"bucket_mb", "compression", "overlap"}
    if cfg.mode in THREAD_MODES:
        dropped |= {"bucket_mb", "compression", "overlap", "algorithm"}
    else:
        dropped.add("threads")
    if cfg.pp == 1:
        dropped |= {"micro_batches", "schedule", "pp_balance"}
    elif cfg.get("schedule") not in SYNCHRONOUS or cfg.schedule in ("interleaved", *ZERO_BUBBLE):
        out["overlap"] = False  # pipedream, interleaved, zero-bubble: gradients synchronized at the step
    if cfg.pp == 1 or cfg.schedule != "interleaved":
        dropped.add("virtual_stages")
    if cfg.zero:
        dropped |= {"compression", "overlap"}  # refused with --zero: ShardedDataParallel has neither
    if cfg.compression != "powersgd" or cfg.zero or cfg.mode != "ddp":
        dropped |= {"powersgd_rank", "powersgd_start_iter"}
    if cfg.teacher is None:
        dropped |= {"distill_temperature", "distill_alpha"}
    if not cfg.checkpoint_activations:
        dropped.add("checkpoint_segments")
    if cfg.checkpoint_dir is None:
        dropped |= {"checkpoint_every", "resume", "keep_checkpoints", "checkpoint_async"}
    if cfg.profile is None:
        dropped.add("profile_steps")
    if cfg.tp == 1:
        dropped |= {"tp_plan", "sequence_parallel"}
    if cfg.cp == 1:
        dropped.add("cp_comm")
    if cfg.model != "moe":
        dropped |= set(MOE_OPTIONS)
    elif cfg.capacity_factor is None:
        dropped.add("capacity_factor")  # dropless
    if cfg.ep == 1:
        dropped.add("a2a_algorithm")
    if cfg.ep == 1 or (cfg.model == "moe" and not cfg.get("shared_experts")):
        dropped.add("moe_shared_expert_overlap")  # nothing beside the all-to-alls to overlap
    if cfg.sync == "ddp":
        dropped |= set(SYNC_OPTIONS)
    elif cfg.sync == "local-sgd":
        dropped |= {"outer_lr", "outer_momentum", "outer_dtype", "fragments", "overlap_steps", "merge_alpha"}
    elif cfg.sync == "diloco":
        dropped |= {"fragments", "overlap_steps", "merge_alpha"}
    dropped.add("replicas")  # the summary's `replicas` is the number in effect
    return {k: v for k, v in out.items() if k not in dropped}


def _with_recipe(key: str, value: Any, cfg: TrainConfig) -> list[tuple[str, Any]]:
    """The item, and after `model` the recipe its unset --lr/--epochs/--batch-size came from."""
    return [(key, value), ("recipe", cfg.recipe())] if key == "model" else [(key, value)]


def load_file(path: str | Path) -> dict[str, Any]:
    """The options in a YAML or JSON file (keys: field names, dashes or underscores); ValueError if bad."""
    from ringtree import files

    file = Path(path)
    text = files.read_text(file, "--config")
    try:
        if file.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:
        raise ValueError(f"--config {file} is not valid {file.suffix.lstrip('.') or 'JSON'}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {file} must hold a mapping of option names to values")
    names = {f.name for f in fields(TrainConfig)}
    options = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(
            f"--config {file}: unknown option(s) {', '.join(unknown)}; see ringtree train --help"
        )
    return options


def flag(name: str) -> str:
    """The command-line flag of a field."""
    meta = {f.name: f.metadata for f in fields(TrainConfig)}[name]
    return str(meta.get("flag", "--" + name.replace("_", "-")))


def options_markdown() -> str:
    """The options table of docs/training.md, made from the fields."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for f in fields(TrainConfig):
        default = DEFAULTS.get(f.name, f.default) if f.name != "timeout_s" else TrainConfig().get(f.name)
        default = "recipe" if f.name in RECIPE_FIELDS else default
        shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else default
        text = str(f.metadata["help"]).split(" [")[0].rstrip(".") + "."  # the default has its column
        rows.append(f"| `{flag(f.name)}` | {shown} | {text} |")
    return "\n".join(rows)


# The capability table of docs/training.md: each technique in each parallel layout.
LAYOUTS: dict[str, dict[str, Any]] = {
    "DP": {},
    "DP x TP": {"tp": 2, "model": "vit"},
    "DP x PP": {"pp": 2},
    "TP x PP": {"tp": 2, "pp": 2, "model": "vit"},
    "PP pipedream": {"pp": 2, "schedule": "pipedream"},
    "--mode dp": {"mode": "dp"},
    "--mode dp-threads": {"mode": "dp-threads"},
}
TECHNIQUES: dict[str, dict[str, Any]] = {
    "--algorithm tree": {"algorithm": "tree"},
    "--bucket-mb 1": {"bucket_mb": 1.0},
    "--no-overlap": {"overlap": False},
    "--compression bf16": {"compression": "bf16"},
    "--accumulate 2": {"accumulate": 2},
    "--checkpoint-dir, --resume": {"checkpoint_dir": "ck", "resume": True},
    "--checkpoint-every 5": {"checkpoint_dir": "ck", "checkpoint_every": 5},
    "--amp bf16": {"amp": "bf16"},
    "--checkpoint-activations": {"checkpoint_activations": True},
    "--prefetch": {"prefetch": True},
    "--teacher": {"teacher": "ck"},
    "--zero 3": {"zero": 3},
}


def capability(layout: str, technique: str) -> str | None:
    """None when the technique runs in the layout, else the sentence that refuses it."""
    try:
        cfg = object.__new__(TrainConfig)  # skip __post_init__: a cell needs no files or devices
        for f in fields(TrainConfig):
            object.__setattr__(cfg, f.name, f.default)
        for key, value in (LAYOUTS[layout] | TECHNIQUES[technique]).items():
            object.__setattr__(cfg, key, value)
        _check_combinations(cfg)
    except ValueError as e:
        return str(e)
    return None


def capabilities_markdown() -> str:
    """The capability table: `yes`, or `no` with the refusal's number in the list below it."""
    header = "| technique | " + " | ".join(LAYOUTS) + " |"
    rows, refusals = [header, "|---" * (len(LAYOUTS) + 1) + "|"], list[str]()
    for technique in TECHNIQUES:
        cells = []
        for layout in LAYOUTS:
            message = capability(layout, technique)
            if message is None:
                cells.append("yes")
                continue
            if message not in refusals:
                refusals.append(message)
            cells.append(f"no ({refusals.index(message) + 1})")
        rows.append(f"| `{technique}` | " + " | ".join(cells) + " |")
    notes = [f"{i}. {m}" for i, m in enumerate(refusals, 1)]
    return "\n".join(rows) + "\n\nRefused before any process starts (exit code 2):\n\n" + "\n".join(notes)


def _check_folder(folder: Path, option: str = "--checkpoint-dir") -> None:
    """A folder option (--checkpoint-dir, --profile), checked before training, not at the first write."""
    import os

    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{option} {folder}: {existing} is a file, not a folder; choose another path")
    if existing is not None and not os.access(existing, os.W_OK):
        raise ValueError(f"{option} {folder}: cannot write in {existing}; choose a writable folder")


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(valid)}")


def _named(name: str, value: str, builtin: tuple[str, ...]) -> None:
    """A built-in name, or pkg.mod:factory (loaded when the trainer starts)."""
    if value in builtin:
        return
    module, _, attr = value.partition(":")
    if not module or not attr:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(builtin)} or pkg.mod:factory")
