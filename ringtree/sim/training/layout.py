"""A planned run's training settings: batch, parallel layout (TP x CP x PP x DP), precision, recompute.

The same words as the trainer's (tp, cp, pp, virtual stages, sequence parallel, zero, micro-batch,
recompute). `check` refuses, in one sentence naming the values and the fix, a layout whose degrees do
not divide what they split. Interleaving V chunks over p stages needs p V to divide the layers, or
the layers + 2: the embedding counted as the first chunk's layer and the output and loss as the last
chunk's, as Llama 3 balanced its pipeline ("we reduce one Transformer layer each from the first and
the last stages ... the first model chunk on the first stage has only the embedding", Dubey et al.
2024, section 3.3.2; Megatron-Core's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split).

The gradient dtype (`grad_dtype`) is what the backward accumulates gradients into and what the data-
parallel reduction moves. Left unset it is fp32 under bf16, as the field's frameworks run bf16:
Megatron-LM forces it ("bfloat16 requires gradient accumulation and all-reduce to be done in fp32",
megatron/training/arguments.py), torchtitan's FSDP2 reduces in `mixed_precision_reduce = "float32"`,
Apex's DistributedFusedAdam (NeMo's `distributed_fused_adam`) syncs in its fp32 state dtype unless
`grad_sync_dtype` says otherwise, and Llama 3 reduce-scatters in FP32 (Dubey et al. 2024, section
3.3.2); under fp16 it is fp16, Megatron-LM's default there (loss scaling keeps fp16 sums in range).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.schedules.pipeline import MIN_MICRO_BATCHES_PER_STAGE, SCHEDULES, ZERO_BUBBLE, check_layers
from ringtree.sim.training.eager import ELEMENTWISE
from ringtree.sim.training.fp8 import RECIPES
from ringtree.sim.training.plan import Layout
from ringtree.sim.training.stage_layout import Chunk, edges, parse
from ringtree.sim.training.transformer import RECOMPUTE, Transformer

ATTENTION_KERNELS = ("fused", "flash2")
DISPATCHERS = ("alltoall", "allgather", "flex")  # Megatron-Core's --moe-token-dispatcher-type
CP_COMMS = ("p2p", "all-gather")  # Megatron-Core's cp_comm_type "p2p" and "all_gather"
GRAD_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Training:
    """What the planner needs besides the model and the cluster: batch, parallelism, precision."""

    global_batch: int
    micro_batch: int = 1
    tp: int = 1
    pp: int = 1
    dtype: str = "bf16"
    recompute: str = "none"
    overlap: bool = False  # gradient reduction during the last backward (Megatron-LM 2021: after it)
    bucket_mb: float = 25.0
    schedule: str = "1f1b"
    cp: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    flash_attention: bool = True  # False: unfused attention storing its s x s scores (Megatron-LM 2021)
    # which flash attention: "fused", the GPU's own (cuDNN or Transformer Engine's, FlashAttention-3 on
    # Hopper), as Megatron-LM, NeMo and MaxText run it; "flash2", FlashAttention-2 as PyTorch's
    # scaled_dot_product_attention runs it (torchtitan)
    attention_kernel: str = "fused"
    # elementwise work (norms, activation, rotary, residual adds): "fused", as torch.compile and
    # hand-fused kernels run it (Megatron-LM, NeMo, MaxText); "eager", one kernel per PyTorch op
    # through HBM, as torchtitan runs without torch.compile (ringtree.sim.training.eager)
    elementwise: str = "fused"
    # gradient accumulation and data-parallel reduction: fp32, bf16 or fp16; None: fp32 under bf16,
    # fp16 under fp16 (the module's docstring says whose defaults these are)
    grad_dtype: str | None = None
    # context parallelism's K/V exchange: "p2p", a ring overlapped with the attention (Megatron-Core's
    # default, Transformer Engine); "all-gather", gathered before the attention and exposed (Llama 3)
    cp_comm: str = "p2p"
    # data-parallel ranks that shard ZeRO's states, replicated across the rest (HSDP: FSDP's
    # HYBRID_SHARD with one node's ranks, torchtitan's dp_shard x dp_replicate); 0: all of them
    shard_group: int = 0
    # with recompute "full": the layers of each model chunk that recompute, the rest keep their
    # activations (Megatron's --recompute-method block --recompute-num-layers); 0: all of them
    recompute_layers: int = 0
    # expert parallelism (ringtree.sim.training.moe): EP ranks share an MoE layer's experts, each expert's
    # matrices split over ETP ranks; the expert mesh ETP x EP x expert-DP folds over TP x CP x DP
    ep: int = 1
    etp: int = 1
    moe_dispatcher: str = "alltoall"
    expert_imbalance: float = 1.0  # the busiest rank's routed tokens over the mean
    capacity_factor: float = 0.0  # tokens an expert takes, over the mean, the rest dropped; 0: dropless
    # the dispatch and combine all-to-alls run behind another micro-batch's compute (Megatron-Core's
    # --overlap-moe-expert-parallel-comm, DeepSeek-V3's DualPipe); False: on the critical path
    moe_overlap: bool = False
    # --dtype fp8: how the linear layers' matmuls scale their FP8 operands (ringtree.sim.training.fp8)
    fp8_recipe: str = "delayed"
    # an uneven pipeline (ringtree.sim.training.stage_layout): Megatron-Core's layout string, or the
    # first and last stages' layers (0: even, as `memory.stage_layers` splits them)
    pp_layout: str = ""
    first_stage_layers: int = 0
    last_stage_layers: int = 0

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"unknown --recompute {self.recompute!r}; choose one of {', '.join(RECOMPUTE)}")
        if self.dtype not in ("fp16", "bf16", "fp8"):
            raise ValueError(f"unknown --dtype {self.dtype!r}; choose fp16, bf16 or fp8")
        counts = {"--global-batch": self.global_batch, "--micro-batch": self.micro_batch, "--tp": self.tp,
                  "--pp": self.pp, "--cp": self.cp, "--virtual-stages": self.virtual_stages}  # fmt: skip
        for flag, value in counts.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown --schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"unknown --attention-kernel {self.attention_kernel!r}; choose "
                f"{' or '.join(ATTENTION_KERNELS)}"
            )
        if self.attention_kernel != "fused" and not self.flash_attention:
            raise ValueError(
                f"--attention-kernel {self.attention_kernel} picks a flash attention kernel, which "
                "--no-flash-attention turns off: drop one of them"
            )
        if self.elementwise not in ELEMENTWISE:
            raise ValueError(f"unknown --elementwise {self.elementwise!r}; choose {' or '.join(ELEMENTWISE)}")
        if self.grad_dtype is not None and self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"unknown --grad-dtype {self.grad_dtype!r}; choose fp32, bf16 or fp16")
        if self.grad_dtype in ("bf16", "fp16") and self.grad_dtype != self.compute_dtype:
            raise ValueError(
                f"--grad-dtype {self.grad_dtype} does not match --dtype {self.dtype}: 16-bit gradients "
                f"take the training dtype; choose --grad-dtype {self.compute_dtype} or fp32"
            )
        self._check_moe()
        self._check_stages()
        if self.cp_comm not in CP_COMMS:
            raise ValueError(f"unknown --cp-comm {self.cp_comm!r}; choose {' or '.join(CP_COMMS)}")
        if self.cp_comm != "p2p" and self.cp == 1:
            raise ValueError(f"--cp-comm {self.cp_comm} is how CP ranks exchange K and V: add --cp 2 or more")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero {self.zero} is not a ZeRO stage; choose 0, 1, 2 or 3")
        if self.recompute_layers < 0:
            raise ValueError(f"--recompute-layers must be at least 1, got {self.recompute_layers}")
        if self.recompute_layers and self.recompute != "full":
            raise ValueError(
                "--recompute-layers says how many layers of each stage recompute their forward: "
                "add --recompute full"
            )
        if self.shard_group < 0:
            raise ValueError(f"--shard-group must be at least 1, got {self.shard_group}")
        if self.shard_group and not self.zero:
            raise ValueError("--shard-group says how many ranks shard ZeRO's states: add --zero 1, 2 or 3")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel splits activations over the TP group: add --tp 2 or more")
        if self.virtual_stages > 1 and (self.pp == 1 or self.schedule != "1f1b"):
            raise ValueError(
                f"--virtual-stages {self.virtual_stages} interleaves a 1F1B pipeline: add --pp 2 or more "
                "(schedule 1f1b) or drop it"
            )

    def _check_moe(self) -> None:
        if min(self.ep, self.etp) < 1:
            raise ValueError(f"--ep and --etp must be at least 1, got {self.ep} and {self.etp}")
        if self.moe_dispatcher not in DISPATCHERS:
            raise ValueError(
                f"unknown --moe-dispatcher {self.moe_dispatcher!r}; choose alltoall, allgather or flex"
            )
        if self.expert_imbalance < 1.0:
            raise ValueError(
                f"--expert-imbalance is the busiest expert's tokens over the mean: at least 1, got "
                f"{self.expert_imbalance}"
            )
        if self.capacity_factor and self.capacity_factor < 1.0:
            raise ValueError(
                f"--capacity-factor must be at least 1 (or 0: dropless), got {self.capacity_factor}"
            )
        if self.fp8_recipe not in RECIPES:
            raise ValueError(f"unknown --fp8-recipe {self.fp8_recipe!r}; choose one of {', '.join(RECIPES)}")

    def _check_stages(self) -> None:
        if self.pp_layout and (self.first_stage_layers or self.last_stage_layers):
            raise ValueError(
                "--pp-layout places every layer itself: drop --first-stage-layers and --last-stage-layers"
            )
        if (self.pp_layout or self.first_stage_layers or self.last_stage_layers) and self.schedule != "1f1b":
            raise ValueError(f"uneven stages are priced for the 1f1b schedule, not {self.schedule}: drop one")
        if min(self.first_stage_layers, self.last_stage_layers) < 0 or (
            (self.first_stage_layers or self.last_stage_layers) and self.pp < 2
        ):
            raise ValueError(
                "--first-stage-layers and --last-stage-layers must be at least 1 and need --pp 2 or more"
            )

    @property
    def uneven(self) -> bool:
        """Whether the run places its layers itself (--pp-layout, --first/--last-stage-layers)."""
        return bool(self.pp_layout or self.first_stage_layers or self.last_stage_layers)

    def chunks(self, layers: int) -> tuple[Chunk, ...]:
        """The PP x VP model chunks of an uneven run's layout (chunk i on pipeline rank i mod PP)."""
        text = self.pp_layout or edges(
            layers, self.pp, self.virtual_stages, self.first_stage_layers, self.last_stage_layers
        )
        return parse(text, layers, self.pp, self.virtual_stages)

    @property
    def compute_dtype(self) -> str:
        """The 16-bit dtype of everything FP8 does not cover (attention, output layer, activations)."""
        return "bf16" if self.dtype == "fp8" else self.dtype

    @property
    def expert_load(self) -> float:
        """The busiest rank's routed tokens over the mean: the imbalance, capped by the capacity."""
        return min(self.expert_imbalance, self.capacity_factor or self.expert_imbalance)

    @property
    def gradients(self) -> str:
        """The gradient dtype, the default resolved: fp32 under bf16 (and fp8), fp16 under fp16."""
        return self.grad_dtype or ("fp16" if self.dtype == "fp16" else "fp32")

    @property
    def grad_itemsize(self) -> int:
        """Bytes of one gradient element, in the buffers and in the data-parallel reduction."""
        return GRAD_DTYPES[self.gradients]

    @property
    def layout(self) -> Layout:
        return Layout(
            self.tp,
            self.pp,
            self.schedule,
            False,
            self.cp,
            self.virtual_stages,
            self.sequence_parallel,
            self.zero,
            self.shard_group,
        )

    def mode_layers(self, layers: int) -> int:
        """How many of a stage's `layers` run the recompute mode: all of them, but under block
        recompute (`full` with recompute_layers) the first recompute_layers of each of its
        virtual_stages chunks; the others keep all their activations and recompute nothing."""
        if not self.recompute_layers:
            return layers
        chunk = -(-layers // self.virtual_stages)
        return min(layers, min(self.recompute_layers, chunk) * self.virtual_stages)

    def shards(self, dp: int) -> int:
        """The ranks ZeRO shards the states over: the shard group's (all dp by default) x cp."""
        return (self.shard_group or dp) * self.cp

    def micro_batches(self, dp: int) -> int:
        """m = B / (dp b): the micro-batches each pipeline (or each DP rank) runs per step."""
        if self.global_batch % (dp * self.micro_batch):
            raise ValueError(
                f"--global-batch {self.global_batch} must be a multiple of dp {dp} x --micro-batch "
                f"{self.micro_batch}; change one of them or the GPU count"
            )
        return self.global_batch // (dp * self.micro_batch)


def check(model: Transformer, run: Training, ranks: int) -> int:
    """The data-parallel degree of `run` on `ranks` GPUs, or a ValueError naming what does not divide."""
    t, c, p, v = run.tp, run.cp, run.pp, run.virtual_stages
    if model.heads % t or model.hidden % t or model.ffn_hidden % t:
        raise ValueError(
            f"--tp {t} must divide --heads {model.heads}, --hidden {model.hidden} and --ffn-hidden "
            f"{model.ffn_hidden}; choose a TP degree that divides all three"
        )
    if model.seq % (2 * c if c > 1 else 1):
        raise ValueError(
            f"--cp {c} needs --seq {model.seq} to be a multiple of 2 x {c} (each rank takes two chunks "
            "for balance); change --cp or --seq"
        )
    if run.uneven:
        run.chunks(model.layers)  # a ValueError naming what does not hold
    elif v > 1 and model.layers % (p * v) and (model.layers + 2) % (p * v):
        raise ValueError(
            f"--pp {p} x --virtual-stages {v} must divide --layers {model.layers} (or --layers + 2, the "
            "embedding and the loss each counted as a layer); change one of them, or place the layers "
            "with --pp-layout"
        )
    if model.layers < p:
        raise ValueError(f"--pp {p} exceeds the {model.layers} layers; use at most one stage per layer")
    if not run.uneven and not _splits(model.layers, p):
        middle = -(-model.layers // p)
        fitting = _ranges([q for q in range(1, model.layers + 1) if _splits(model.layers, q)])
        raise ValueError(
            f"--pp {p} cannot split the {model.layers} layers: {middle} on each of the {p - 2} middle "
            f"stages is {middle * (p - 2)}; choose --pp among {fitting}, or place the layers with --pp-layout"
        )
    if run.schedule in ZERO_BUBBLE and p > 1:
        check_layers(run.schedule, p, model.layers, "--layers")
    dp = run.layout.dp(ranks)
    if run.shard_group and dp % run.shard_group:
        raise ValueError(
            f"--shard-group {run.shard_group} must divide the data-parallel degree {dp}; choose a divisor "
            "of it (one node's data-parallel ranks is HSDP's usual choice)"
        )
    _check_experts(model, run, dp)
    m = run.micro_batches(dp)
    least = MIN_MICRO_BATCHES_PER_STAGE.get(run.schedule, 0) * p
    if p > 1 and m < least:
        raise ValueError(
            f"--schedule {run.schedule} on --pp {p} needs at least {least} micro-batches per pipeline, got "
            f"{m} (--global-batch {run.global_batch} / (dp {dp} x --micro-batch {run.micro_batch})); use "
            f"--global-batch {least * dp * run.micro_batch}"
        )
    if v > 1 and m % p:
        raise ValueError(
            f"--virtual-stages needs the {m} micro-batches per pipeline to be a multiple of --pp {p}; "
            "change --global-batch or --micro-batch"
        )
    return dp


def _splits(layers: int, p: int) -> bool:
    """Whether `memory.stage_layers` can split the layers over p stages (ceil(l/p) on each middle one)."""
    return layers - (p - 2) * -(-layers // p) >= 0


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 5, 6] -> '1-3, 5-6'."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _check_experts(model: Transformer, run: Training, dp: int) -> None:
    """EP and ETP divide what they split: the experts, the expert's width, and the TP x CP x DP ranks
    the expert mesh folds over (Megatron-Core's parallel folding; torchtitan: "expert_parallel_degree
    must divide dp_shard * cp * tp")."""
    e, x = run.ep, run.etp
    if (e > 1 or x > 1) and not model.experts:
        raise ValueError(
            f"--ep {e} and --etp {x} split the experts of MoE layers: add --experts or drop them"
        )
    if not model.experts:
        return
    if run.recompute in ("op", "dots"):
        raise ValueError(
            f"--recompute {run.recompute} is modelled for dense layers; choose none, selective or full "
            "for an MoE model"
        )
    if model.experts % e:
        raise ValueError(f"--ep {e} must divide --experts {model.experts}; choose a divisor of it")
    if model.moe_ffn_hidden % x:
        raise ValueError(
            f"--etp {x} must divide --moe-ffn-hidden {model.moe_ffn_hidden}; choose a divisor of it"
        )
    folded = dp * run.cp * run.tp
    if folded % (e * x):
        raise ValueError(
            f"--ep {e} x --etp {x} must divide the {folded} ranks of a pipeline stage (dp {dp} x cp {run.cp} "
            f"x tp {run.tp}) the expert mesh folds over; change --ep, --etp or the GPU count"
        )
