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

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ringtree.schedules.pipeline import SCHEDULES, SYNCHRONOUS

# Nothing here imports torch at module level: the CLI derives its options from this module, and
# `ringtree plan` must start without loading torch.

MODELS = ("mlp", "mlp-tiny", "vit", "gpt", "gpt-tied")  # or pkg.mod:factory
DATASETS = ("digits", "sort")  # or pkg.mod:factory
LOSSES = ("cross_entropy", "mse")  # or pkg.mod:factory
MODES = ("ddp", "dp", "dp-threads", "dp-threads-balanced")
LANGUAGE_MODELS = ("gpt", "gpt-tied")  # they read token ids [b, t] and predict every next token
THREAD_MODES = ("dp-threads", "dp-threads-balanced")  # one process, torch's DataParallel (the seeds)
DEVICES = ("auto", "cpu", "cuda")
COMPRESSIONS = ("fp16", "bf16")
BALANCES = ("params", "time")
MASTER_ALGORITHMS = ("native", "ring", "tree", "ps")  # what --mode dp's reduce and broadcast run

# The real defaults of the options that default to None (they apply only in some setups).
DEFAULTS: dict[str, Any] = {
    "bucket_mb": 25.0,  # torch DDP's default fusion-bucket cap
    "overlap": True,
    "micro_batches": 4,
    "schedule": "1f1b",
    "virtual_stages": 2,  # interleaved 1F1B: two chunks a stage halve the bubble (Megatron-LM)
    "pp_balance": "params",
    "distill_temperature": 2.0,  # softens the teacher's near one-hot outputs (Hinton et al.: 2 to 5)
    "distill_alpha": 0.5,
    "keep_checkpoints": 2,  # the newest and one before it: a truncated newest still resumes
    "threads": 2,  # CPU copies without GPUs: enough to show device 0's extra load
}


def _opt(default: Any, help: str, flag: str | None = None) -> Any:
    """A field with its help text (and, rarely, a flag name that is not the field's)."""
    meta = {"help": help} if flag is None else {"help": help, "flag": flag}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TrainConfig:
    """What `ringtree train` trains and how; the defaults reach >= 95% digits accuracy in about a minute."""

    model: str = _opt("mlp", "mlp, mlp-tiny, vit, gpt, gpt-tied, or pkg.mod:factory returning an nn.Module.")
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
    compression: str | None = _opt(None, "fp16 or bf16: DDP buckets travel in half precision.")
    overlap: bool | None = _opt(None, "Launch DDP buckets during backward (--no-overlap: after) [on].")
    batch_size: int = _opt(32, "Samples per DP rank and micro-batch.")
    epochs: int = _opt(20, "Passes over the training split.")
    lr: float = _opt(3e-3, "AdamW learning rate.")
    weight_decay: float = _opt(1e-4, "AdamW weight decay.")
    seed: int = _opt(0, "Model init and shuffling seed.")
    accumulate: int = _opt(1, "Batches (pipeline runs under --pp) per optimizer step.")
    checkpoint_dir: str | None = _opt(None, "Write checkpoints (DIR/last.pt) here.")
    checkpoint_every: int = _opt(0, "Optimizer steps between checkpoints; 0: every epoch.")
    resume: bool = _opt(False, "Continue from --checkpoint-dir's last checkpoint.")
    keep_checkpoints: int | None = _opt(None, "Checkpoints kept in --checkpoint-dir, newest first [2].")
    max_restarts: int = _opt(0, "Restarts of a failed worker group (elastic agent); needs --checkpoint-dir.")
    straggler_every: int = _opt(20, "Steps between gathers of per-rank work times (stragglers); 0: off.")
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
        None, "gpipe, 1f1b, interleaved, pipedream, pipedream-vs (needs --pp) [1f1b]."
    )
    virtual_stages: int | None = _opt(
        None, "Model chunks per pipeline stage (needs --schedule interleaved) [2]."
    )
    pp_balance: str | None = _opt(None, "Cut stages by params or profiled time (needs --pp) [params].")
    checkpoint_activations: bool = _opt(False, "Recompute activations in backward (less memory).")
    checkpoint_segments: int = _opt(0, "Checkpointed segments; 0: about sqrt(blocks).")
    amp: str = _opt("off", "Mixed precision: off, bf16 (autocast) or fp16 (CUDA, loss scaling).")
    teacher: str | None = _opt(None, "Distil from a --checkpoint-dir checkpoint (file or folder).")
    distill_temperature: float | None = _opt(None, "Distillation softmax temperature [2].")
    distill_alpha: float | None = _opt(None, "Weight of the teacher's soft loss [0.5].")
    prefetch: bool = _opt(False, "Prepare the next batch on a thread while this one computes.")

    def __post_init__(self) -> None:
        validate(self)

    def get(self, name: str) -> Any:
        """The value in effect: the field, or its real default when it is None and has one."""
        value = getattr(self, name)
        if value is None and name == "timeout_s":
            from ringtree import comm

            return comm.DEFAULT_TIMEOUT_S  # one default for every collective in ringtree
        return DEFAULTS.get(name) if value is None else value


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
    if cfg.schedule is not None:
        _choice("pipeline schedule", cfg.schedule, tuple(SCHEDULES))
    if cfg.pp_balance is not None:
        _choice("pp_balance", cfg.pp_balance, BALANCES)
    for name in ("max_restarts", "straggler_every"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be 0 or more, got {getattr(cfg, name)}")
    if cfg.keep_checkpoints is not None and cfg.keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be at least 1, got {cfg.keep_checkpoints}")
    for name in ("batch_size", "epochs", "accumulate", "tp", "pp", "log_every"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("micro_batches", "virtual_stages"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("lr", "bucket_mb", "timeout_s"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if cfg.checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0 (0: every epoch), got {cfg.checkpoint_every}")
    if cfg.checkpoint_segments < 0:
        raise ValueError(
            f"checkpoint_segments must be >= 0 (0: about sqrt(blocks)), got {cfg.checkpoint_segments}"
        )
    check_distill(cfg.get("distill_temperature"), cfg.get("distill_alpha"))
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
)


def _check_combinations(cfg: TrainConfig) -> None:
    present = {
        "pp": cfg.pp > 1,
        "teacher": cfg.teacher is not None,
        "interleaved": cfg.schedule == "interleaved",
    }
    for name, needs, message in _NEEDS:
        if getattr(cfg, name) is not None and not present[needs]:
            raise ValueError(message)
    if cfg.checkpoint_segments and not cfg.checkpoint_activations:
        raise ValueError(
            f"checkpoint_segments={cfg.checkpoint_segments} does nothing without checkpointing; "
            "add --checkpoint-activations"
        )
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("resume needs a checkpoint directory: pass --checkpoint-dir DIR with --resume")
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
    if cfg.mode in THREAD_MODES:
        _check_thread_mode(cfg)
    elif cfg.threads is not None:
        raise ValueError(
            f"--threads {cfg.threads} sets the devices of --mode dp-threads; drop it or add that mode"
        )
    _check_tensor_parallel(cfg)
    if cfg.pp > 1 and cfg.get("schedule") not in SYNCHRONOUS:
        _check_pipedream(cfg)
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
    ]


def _check_master_mode(cfg: TrainConfig) -> None:
    """--mode dp: rank 0 reduces, steps and broadcasts the whole model; no buckets, no mesh."""
    given = [flag for flag, value in _bucket_options(cfg) if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: options of DDP's buckets, which --mode dp does not have; "
            "drop them or use --mode ddp"
        )
    if cfg.tp > 1 or cfg.pp > 1:
        raise ValueError(
            "--mode dp steps the whole model on rank 0, so it cannot hold a tensor- or pipeline-parallel "
            "shard; use --mode ddp with --tp/--pp"
        )
    if cfg.amp == "fp16":
        raise ValueError(
            "--amp fp16 scales the loss on every rank but --mode dp steps on rank 0 alone, so the "
            "scale would not be agreed; use --amp bf16 or --mode ddp"
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
            "in threads (the seeds' DataParallel); drop them or use --mode ddp"
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


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """Raise ValueError when tp x pp does not divide the world (or tp exceeds a node under torchrun)."""
    if world_size < 1:
        raise ValueError(f"--nproc must be at least 1, got {world_size}")
    if cfg.mode in THREAD_MODES and world_size != 1:
        raise ValueError(
            f"--mode {cfg.mode} is one process driving every device with threads; use --nproc 1 "
            f"(not {world_size}) and --threads N for the devices"
        )
    if world_size % (cfg.tp * cfg.pp):
        raise ValueError(
            f"--tp {cfg.tp} x --pp {cfg.pp} = {cfg.tp * cfg.pp} ranks per replica does not divide the "
            f"{world_size} ranks; choose --nproc a multiple of {cfg.tp * cfg.pp}"
        )


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
    dropped: set[str] = set()
    if cfg.mode == "dp":
        dropped |= {"bucket_mb", "compression", "overlap"}
    if cfg.mode in THREAD_MODES:
        dropped |= {"bucket_mb", "compression", "overlap", "algorithm"}
    else:
        dropped.add("threads")
    if cfg.pp == 1:
        dropped |= {"micro_batches", "schedule", "pp_balance"}
    elif cfg.get("schedule") not in SYNCHRONOUS or cfg.schedule == "interleaved":
        out["overlap"] = False  # pipedream and interleaved synchronize their gradients at the step
    if cfg.pp == 1 or cfg.schedule != "interleaved":
        dropped.add("virtual_stages")
    if cfg.teacher is None:
        dropped |= {"distill_temperature", "distill_alpha"}
    if not cfg.checkpoint_activations:
        dropped.add("checkpoint_segments")
    if cfg.checkpoint_dir is None:
        dropped |= {"checkpoint_every", "resume", "keep_checkpoints"}
    if cfg.tp == 1:
        dropped |= {"tp_plan", "sequence_parallel"}
    return {k: v for k, v in out.items() if k not in dropped}


def load_file(path: str | Path) -> dict[str, Any]:
    """The options in a YAML or JSON file (keys: field names, dashes or underscores); ValueError if bad."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        raise ValueError(
            f"cannot read --config {file}: {e.strerror}; pass an existing YAML or JSON file"
        ) from None
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
