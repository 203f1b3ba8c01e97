"""The training job's configuration: one typed dataclass, every default visible here."""

from __future__ import annotations

from dataclasses import dataclass

from ringtree import comm
from ringtree.schedules.pipeline import check_pipeline
from ringtree.train.techniques.amp import check_amp
from ringtree.train.techniques.distill import check_distill, teacher_file
from ringtree.train.tensor_parallel import check_tp

MODELS = ("mlp", "mlp-tiny", "vit")
MODES = ("ddp", "dp")
COMPRESSIONS = ("fp16", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    """What `ringtree train` trains and how; the defaults reach >= 95% digits accuracy in about a minute."""

    model: str = "mlp"  # "mlp" or "vit" (the digits as a sequence of 2x2 patches)
    mode: str = "ddp"  # "ddp": bucketed all-reduce; "dp": rank 0 reduces, steps and broadcasts
    algorithm: str = "ring"  # ringtree's own ring by default: the product's collectives, not torch's
    bucket_mb: float = 25.0  # torch DDP's default fusion-bucket cap
    compression: str | None = None  # None, "fp16" or "bf16" for the buckets on the wire
    overlap: bool = True  # launch buckets during backward; False: all after it (to measure overlap)
    batch_size: int = 32  # per rank and micro-batch: 4 ranks x 32 = 128 samples per step
    epochs: int = 20  # about 220 steps at 4 ranks: enough for the MLP to pass 95% on digits
    lr: float = 3e-3  # AdamW; digits are small and clean, a larger rate than usual converges fast
    weight_decay: float = 1e-4
    seed: int = 0  # model init and the sampler's shuffling (the train/test split is fixed)
    accumulate: int = 1  # micro-batches per optimizer step (the first K-1 under no_sync)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: at the end of every epoch
    resume: bool = False  # continue from checkpoint_dir/last.pt when it exists
    timeout_s: float = comm.DEFAULT_TIMEOUT_S  # a collective stuck longer than this raises
    progress: bool = True  # rank 0 shows a progress bar
    # Tensor parallelism (docs/tensor-parallel.md): tp > 1 shards the vit's blocks; world = dp x tp.
    tp: int = 1  # ranks per tensor-parallel group (adjacent ranks, one node); heads and dim must divide
    # Pipeline parallelism (docs/pipeline.md): pp > 1 cuts the model into stages; world = dp x pp.
    pp: int = 1  # pipeline stages; 1: no pipeline
    micro_batches: int = 4  # per optimizer step and pipeline (gpipe, 1f1b): more shrink the bubble
    schedule: str = "1f1b"  # gpipe, 1f1b (same bubble, fewer activations alive), pipedream(-vs)
    pp_balance: str = "params"  # cut stages with equal parameters or, "time", equal profiled time
    # The single-device playbook (docs/playbook.md).
    checkpoint_activations: bool = False  # recompute activations in backward: less memory, more compute
    checkpoint_segments: int = 0  # 0: about sqrt(blocks), where kept + recomputed activations are fewest
    amp: str = "off"  # "bf16": autocast on CPU; "fp16" needs CUDA's loss scaling (this trainer runs on CPU)
    teacher: str | None = None  # distil from this `--checkpoint-dir` checkpoint (its file or its folder)
    distill_temperature: float = 2.0  # softens the teacher's near one-hot outputs (Hinton et al.: 2 to 5)
    distill_alpha: float = 0.5  # weight of the soft (teacher) loss; 1 - alpha weighs the labels
    prefetch: bool = False  # a thread prepares the next batch while this one computes

    def __post_init__(self) -> None:
        _choice("model", self.model, MODELS)
        _choice("mode", self.mode, MODES)
        valid = comm.algorithms() if self.mode == "ddp" else ["native", "ring", "tree", "ps"]
        _choice(f"algorithm (for mode {self.mode!r})", self.algorithm, tuple(valid))
        if self.compression is not None:
            _choice("compression", self.compression, COMPRESSIONS)
            if self.mode == "dp":
                raise ValueError("compression works in mode 'ddp' only; drop --compression or use --mode ddp")
        for name in ("batch_size", "epochs", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("lr", "bucket_mb", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: every epoch), got {self.checkpoint_every}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint directory: pass --checkpoint-dir DIR with --resume")
        self._check_playbook()
        check_pipeline(self.pp, self.micro_batches, self.schedule, self.pp_balance)
        check_tp(self.tp, self.model, self.mode, self.pp)

    def _check_playbook(self) -> None:
        if self.checkpoint_segments < 0:
            raise ValueError(
                f"checkpoint_segments must be >= 0 (0: about sqrt(blocks)), got {self.checkpoint_segments}"
            )
        if self.checkpoint_segments and not self.checkpoint_activations:
            raise ValueError(
                f"checkpoint_segments={self.checkpoint_segments} does nothing without checkpointing; "
                "add --checkpoint-activations"
            )
        check_amp(self.amp, "cpu")  # ringtree train runs on CPU (gloo)
        check_distill(self.distill_temperature, self.distill_alpha)
        if self.teacher is not None:
            teacher_file(self.teacher)  # raises, naming the path, when there is no checkpoint there


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(valid)}")
