"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, asynchronous PipeDream and the
zero-bubble family (ZB-H1, ZB-H2, ZB-V, DualPipeV), per stage.

Indices, used the same way everywhere: p stages, m micro-batches, j stage, i micro-batch, v weight
version (the number of optimizer steps a stage had taken when the version was current), c model
chunk of a stage and V chunks per stage. Placement "loop" (interleaved 1F1B): stage j holds virtual
stages c p + j. Placement "v" (ZB-V, DualPipeV; V = 2): stage j holds virtual stages j and 2p-1-j,
so the last stage runs virtual stages p-1 and p back to back and stage 0 holds the first and the last.

A schedule is, for every stage, an ordered list of actions: forward of micro-batch i, backward of
micro-batch i, optimizer step. Schedules that split the backward (`splits_backward`) have two
actions for it: B (Kind.BACKWARD, the gradient of the chunk's input, which the previous stage
waits for) and W (Kind.WEIGHT, the gradient of the chunk's weights, which nobody waits for); the
others keep Kind.BACKWARD as the whole backward. The transfers follow from the actions: the forward
of i on virtual stage s receives i's activation from s-1 (unless s = 0) and sends its output to
s+1 (unless s is the last); the backward (B) of i receives the gradient from s+1 and sends the
input's gradient to s-1; W moves nothing. Sends never block (they are buffered); receives do.
`dry_run` plays the schedule with those rules and raises DeadlockError when no stage can move.
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or B (input gradient) in a schedule that splits it
    WEIGHT = "W"  # the weight gradient of a split backward
    STEP = "S"


PLACEMENTS = ("loop", "v")  # how a stage's chunks map to virtual stages (module docstring)


@dataclass(frozen=True)
class Action:
    """One thing a stage does: forward or backward of micro-batch i with weight version v, or a step."""

    kind: Kind
    micro_batch: int = -1  # -1 for a step
    version: int = 0  # weights a forward/backward uses; for a step, the version it creates
    chunk: int = 0  # the stage's model chunk c (interleaved 1F1B; 0 otherwise)

    def __str__(self) -> str:
        if self.kind is Kind.STEP:
            return str(self.kind.value)
        chunk = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.micro_batch}{chunk}"


@dataclass(frozen=True)
class Transfer:
    """A tensor that moves between stages: an activation forward or a gradient backward."""

    what: str  # "activation" or "gradient"
    micro_batch: int
    src: int  # virtual stages c p + j (the stage itself without interleaving)
    dst: int


@dataclass(frozen=True)
class PipelineSchedule:
    """The actions of every stage of one pipeline, in order."""

    name: str
    stages: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]  # [stage j][k]
    virtual_stages: int = 1  # V model chunks per stage (interleaved 1F1B; 2 for the V placement)
    placement: str = "loop"  # "loop": chunk c of stage j is c p + j; "v": chunks j and 2p-1-j

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
        if self.placement == "v" and self.virtual_stages != 2:
            raise ValueError(f"the V placement holds 2 chunks a stage, not {self.virtual_stages}")

    @property
    def splits_backward(self) -> bool:
        """Whether the backward is two actions, B (input gradient) then W (weight gradient)."""
        return any(a.kind is Kind.WEIGHT for actions in self.actions for a in actions)

    def describe(self, j: int) -> str:
        """Stage j's actions as text, e.g. 'F0 F1 B0 B1 S'."""
        return " ".join(str(a) for a in self.actions[j])

    def virtual(self, j: int, a: Action) -> int:
        """The virtual stage that action a of stage j runs: c p + j ("loop"; j itself without
        interleaving), or j for chunk 0 and 2p-1-j for chunk 1 ("v")."""
        return self.virtual_of(j, a.chunk)

    def virtual_of(self, j: int, c: int) -> int:
        """The virtual stage of stage j's chunk c."""
        if self.placement == "v" and c == 1:
            return 2 * self.stages - 1 - j
        return c * self.stages + j

    def stage_of(self, s: int) -> tuple[int, int]:
        """(stage j, chunk c) that holds virtual stage s: the inverse of `virtual_of`."""
        p = self.stages
        if self.placement == "v":
            return (s, 0) if s < p else (2 * p - 1 - s, 1)
        return s % p, s // p

    def recv_of(self, j: int, a: Action) -> Transfer | None:
        """What stage j must receive before it can run action a (None: nothing)."""
        s, last = self.virtual(j, a), self.stages * self.virtual_stages - 1
        if a.kind is Kind.FORWARD and s > 0:
            return Transfer("activation", a.micro_batch, s - 1, s)
        if a.kind is Kind.BACKWARD and s < last:
            return Transfer("gradient", a.micro_batch, s + 1, s)
        return None

    def send_of(self, j: int, a: Action) -> Transfer | None:
        """What stage j sends once action a is done (None: nothing)."""
        s, last = self.virtual(j, a), self.stages * self.virtual_stages - 1
        if a.kind is Kind.FORWARD and s < last:
            return Transfer("activation", a.micro_batch, s, s + 1)
        if a.kind is Kind.BACKWARD and s > 0:
            return Transfer("gradient", a.micro_batch, s, s - 1)
        return None


def _check(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(
            f"a pipeline needs at least 1 stage and 1 micro-batch, got stages={p}, micro_batches={m}"
        )


def gpipe(p: int, m: int) -> PipelineSchedule:
    """Fill-drain: all m forwards, then all m backwards, then one synchronous step."""
    _check(p, m)
    stage = (
        *(Action(Kind.FORWARD, i) for i in range(m)),
        *(Action(Kind.BACKWARD, i) for i in range(m)),
        Action(Kind.STEP, version=1),
    )
    return PipelineSchedule("gpipe", p, m, (stage,) * p)


def warmup(p: int, m: int, j: int) -> int:
    """Forwards stage j runs before its first backward in 1F1B: p - 1 - j, at most m."""
    return min(p - 1 - j, m)


def one_f_one_b_order(p: int, m: int, j: int) -> list[tuple[Kind, int]]:
    """Stage j's 1F1B order: warm-up forwards, then forward i+w / backward i pairs, then the drain."""
    w = warmup(p, m, j)
    order = [(Kind.FORWARD, i) for i in range(w)]
    for i in range(m - w):
        order += [(Kind.FORWARD, i + w), (Kind.BACKWARD, i)]
    return order + [(Kind.BACKWARD, i) for i in range(m - w, m)]


def one_f_one_b(p: int, m: int) -> PipelineSchedule:
    """PipeDream-Flush: 1F1B order and one synchronous step; at most p - j micro-batches in flight."""
    _check(p, m)
    stages = tuple(
        (*(Action(k, i) for k, i in one_f_one_b_order(p, m, j)), Action(Kind.STEP, version=1))
        for j in range(p)
    )
    return PipelineSchedule("1f1b", p, m, stages)


def interleaved(p: int, m: int, v: int = 2) -> PipelineSchedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): stage j holds chunks c = 0..v-1, the
    virtual stages c p + j, so a micro-batch passes every stage v times; one synchronous step.

    Stage j's order over its m v (chunk, micro-batch) units: forwards go by groups of p micro-batches,
    chunk 0 then 1 ... then the next group; backwards the same with the chunks reversed. Warm-up:
    2 (p - 1 - j) + (v - 1) p forwards, then one forward / one backward, then the drain. m must be a
    multiple of p (each group of p micro-batches fills the p stages).
    """
    _check(p, m)
    if v < 1:
        raise ValueError(f"--virtual-stages must be at least 1, got {v}")
    if m % p:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in groups of the {p} stages, and {m} is not a multiple "
            f"of {p}; use --micro-batches {m + p - m % p}"
        )
    stages = tuple((*_interleaved_stage(p, m, v, j), Action(Kind.STEP, version=1)) for j in range(p))
    return PipelineSchedule("interleaved", p, m, stages, virtual_stages=v)


def _interleaved_unit(p: int, v: int, k: int, forward: bool) -> tuple[int, int]:
    """(micro-batch i, chunk c) of stage j's k-th forward (or backward) unit."""
    c = (k // p) % v
    return (k // (p * v)) * p + k % p, c if forward else v - 1 - c


def _interleaved_stage(p: int, m: int, v: int, j: int) -> list[Action]:
    total = m * v
    w = min(2 * (p - 1 - j) + (v - 1) * p if v > 1 else p - 1 - j, total)  # v = 1: plain 1F1B

    def f(k: int) -> Action:
        i, c = _interleaved_unit(p, v, k, True)
        return Action(Kind.FORWARD, i, chunk=c)

    def b(k: int) -> Action:
        i, c = _interleaved_unit(p, v, k, False)
        return Action(Kind.BACKWARD, i, chunk=c)

    actions = [f(k) for k in range(w)]
    for k in range(total - w):
        actions += [f(k + w), b(k)]
    return actions + [b(k) for k in range(total - w, total)]


def pipedream(p: int, m: int, vertical_sync: bool = False) -> PipelineSchedule:
    """Asynchronous 1F1B without a flush: a step after every backward, weights stashed per micro-batch.

    The forward of i on stage j uses the newest weights (version i - (p-1-j) in the steady state) and
    its backward the same, stashed version. With vertical sync every stage uses version i - (p-1),
    the one stage 0 used, so one micro-batch sees the same weight version across the pipeline.
    """
    _check(p, m)
    return PipelineSchedule(
        "pipedream-vs" if vertical_sync else "pipedream",
        p,
        m,
        tuple(_pipedream_stage(p, m, j, vertical_sync) for j in range(p)),
    )


def _pipedream_stage(p: int, m: int, j: int, vertical_sync: bool) -> tuple[Action, ...]:
    actions: list[Action] = []
    steps, used = 0, {}
    for kind, i in one_f_one_b_order(p, m, j):
        if kind is Kind.FORWARD:
            used[i] = max(0, i - (p - 1)) if vertical_sync else steps
            actions.append(Action(kind, i, used[i]))
        else:
            steps += 1
            actions += [Action(kind, i, used[i]), Action(Kind.STEP, version=steps)]
    return tuple(actions)


# --- the split backward: B (input gradient) then W (weight gradient) ------------------------------
#
# Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), and DeepSeek-V3 (arXiv 2412.19437) with
# its DualPipeV. Where torch.distributed.pipelining has the schedule, the per-stage order is the one
# torch generates (ScheduleInterleavedZeroBubble with one chunk a stage = ZB-H1, ScheduleZBVZeroBubble,
# ScheduleDualPipeV); torch's idle slots (None) are dropped, since a stage here waits on its receives.

MIN_MICRO_BATCHES_PER_STAGE = {"zb-h1": 1, "zb-h2": 1, "zb-v": 2, "dualpipev": 2}  # m >= this x p
V_SHAPED = ("zb-v", "dualpipev")  # two chunks a stage in a V: 2p chunks of the model


def check_zero_bubble(name: str, p: int, m: int) -> None:
    """Raise ValueError, naming --micro-batches and the smallest value that works, when m is too few."""
    _check(p, m)
    least = MIN_MICRO_BATCHES_PER_STAGE[name] * p
    if m < least:
        raise ValueError(
            f"--schedule {name} on {p} stages needs at least {least} micro-batches, got {m}; "
            f"use --micro-batches {least}"
        )


def check_layers(name: str, p: int, layers: int, flag: str | None = None) -> None:
    """Raise ValueError when a model of `layers` layers cannot be cut into the chunks `name` needs
    (2p for the V schedules, p otherwise), naming the fix: `flag` (the option that sets the layers,
    where there is one) or a bigger model, or the largest --pp that works."""
    chunks = 2 * p if name in V_SHAPED else p
    if layers < chunks:
        more = f"{flag} {chunks}" if flag else f"a model with at least {chunks} layers"
        raise ValueError(
            f"--schedule {name} on --pp {p} cuts the model into {chunks} chunks, but it has {layers} "
            f"layers; use {more} or --pp {max(1, layers // (chunks // p))}"
        )


def _step(actions: list[Action]) -> tuple[Action, ...]:
    return (*actions, Action(Kind.STEP, version=1))


def zb_h1(p: int, m: int) -> PipelineSchedule:
    """ZB-H1 (Qi et al. Fig. 3): 1F1B's order with B for the backward, and stage j's W delayed by j
    steady rounds, so every stage keeps at most p micro-batches' activations (1F1B's stage 0) and W
    fills the cool-down's bubble: (p-1)(F+B-W) idle instead of 1F1B's (p-1)(F+B+W) (their Table 2).
    Torch's ScheduleInterleavedZeroBubble with one chunk a stage generates the same order."""
    check_zero_bubble("zb-h1", p, m)
    return PipelineSchedule("zb-h1", p, m, tuple(_step(_zb_h1_stage(p, m, j)) for j in range(p)))


def _zb_h1_stage(p: int, m: int, j: int) -> list[Action]:
    w = warmup(p, m, j)
    actions = [Action(Kind.FORWARD, i) for i in range(w)]
    weights = 0
    for k in range(m):  # the k-th backward; the forward of k + w goes before it while there is one
        if k + w < m:
            actions.append(Action(Kind.FORWARD, k + w))
        actions.append(Action(Kind.BACKWARD, k))
        if k >= j:  # W waits j rounds on stage j
            actions.append(Action(Kind.WEIGHT, weights))
            weights += 1
    return actions + [Action(Kind.WEIGHT, i) for i in range(weights, m)]


def zb_h2(p: int, m: int) -> PipelineSchedule:
    """ZB-H2 (Qi et al. Fig. 4): more forwards in the warm-up (stage j runs 2(p-1-j)+1 before its
    first B) and the W of the later stages pushed to the tail, so every stage keeps at most 2p-1
    micro-batches' activations (their Table 2: (2p-1) M_B, stage j holding 2j W's worth). The order
    is the paper's greedy rule played on a clock where F, B and W take one slot each: a stage runs B
    when its gradient is there, else F when its activation is there and fewer than 2p-1 micro-batches
    are alive, else the oldest W. Their bubble (p-1)(F+B-2W) assumes the optimizer step is not
    synchronized across stages (their post-validation); with one synchronous step, as here, the last
    stage cannot start before the first forward reaches it, so the bubble is at least (p-1) F."""
    check_zero_bubble("zb-h2", p, m)
    return PipelineSchedule("zb-h2", p, m, tuple(_step(a) for a in _greedy_orders(p, m, 2 * p - 1)))


def _greedy_orders(p: int, m: int, limit: int) -> list[list[Action]]:
    """Every stage's order under the rule B > F (while fewer than `limit` alive) > W, one slot each."""
    orders: list[list[Action]] = [[] for _ in range(p)]
    forward_end = [[-1] * m for _ in range(p)]  # the slot at whose start the output is there
    backward_end = [[-1] * m for _ in range(p)]
    f, b, w = [0] * p, [0] * p, [0] * p  # forwards, Bs and Ws each stage has run

    def there(ends: list[int], i: int, t: int) -> bool:
        return 0 <= ends[i] <= t

    t = 0
    while any(n < m for n in w):
        for j in range(p):
            gradient = forward_end[j] if j == p - 1 else backward_end[j + 1]
            activation_there = j == 0 or (f[j] < m and there(forward_end[j - 1], f[j], t))
            if b[j] < f[j] and there(gradient, b[j], t):
                orders[j].append(Action(Kind.BACKWARD, b[j]))
                backward_end[j][b[j]], b[j] = t + 1, b[j] + 1
            elif f[j] < m and activation_there and f[j] - w[j] < limit:
                orders[j].append(Action(Kind.FORWARD, f[j]))
                forward_end[j][f[j]], f[j] = t + 1, f[j] + 1
            elif w[j] < b[j]:
                orders[j].append(Action(Kind.WEIGHT, w[j]))
                w[j] += 1
        t += 1
        if t > 3 * m * p + 2 * p:  # every slot some stage moves; more slots than work: a bug
            raise RuntimeError(f"the greedy order of {p} stages, {m} micro-batches, limit {limit} stalls")
    return orders


def zb_v(p: int, m: int) -> PipelineSchedule:
    """ZB-V (Qi et al. section 6): two chunks a stage in a V, stage j holding virtual stages j and
    2p-1-j; warm-up of 2p-1 forwards, groups of F-B-W, then the remaining B with W in the gaps. No
    bubble when F, B and W take equal time, at 1F1B's activation memory (p micro-batches of the
    whole stage, 2p chunk-activations). The order of torch's ScheduleZBVZeroBubble."""
    check_zero_bubble("zb-v", p, m)
    stages = tuple(_step(_zb_v_stage(p, m, j)) for j in range(p))
    return PipelineSchedule("zb-v", p, m, stages, virtual_stages=2, placement="v")


def _zb_v_stage(p: int, m: int, j: int) -> list[Action]:
    out: list[Action] = []
    count = {(kind, c): 0 for kind in Kind for c in (0, 1)}

    def add(kind: Kind, c: int) -> None:
        out.append(Action(kind, count[(kind, c)], chunk=c))
        count[(kind, c)] += 1

    def n(kind: Kind, c: int) -> int:
        return count[(kind, c)]

    F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT
    for _ in range(2 * (p - j) - 1):
        add(F, 0)
    for _ in range(j):
        add(F, 1)
        add(F, 0)
    for _ in range(p - j):
        add(F, 1)
        add(B, 1)
        add(W, 1)
    while n(F, 1) < n(F, 0) or n(F, 0) < m:
        if n(F, 0) < m:
            add(F, 0)
        add(B, 0)
        add(W, 0)
        add(F, 1)
        add(B, 1)
        add(W, 1)
    for _ in range(j):
        add(B, 0)
        add(B, 1)
    for _ in range(p - j):
        add(B, 0)
        add(W, 0)
    while n(W, 1) < n(B, 1):
        add(W, 1)
    while n(W, 0) < n(B, 0):
        add(W, 0)
    return out


def dualpipev(p: int, m: int) -> PipelineSchedule:
    """DualPipeV (DeepSeek's DualPipe cut in half into a V on p stages; DeepSeek-V3 section 3.2.1):
    the V placement of ZB-V, with micro-batches entering chunk 0 while others come back through
    chunk 1, each forward paired with another micro-batch's backward (F then B then W here; an
    overlapping runtime would run the pair at once), and B/W split only where it fills a bubble.
    A whole backward is B immediately followed by its W. The 8 steps of torch's ScheduleDualPipeV."""
    check_zero_bubble("dualpipev", p, m)
    stages = tuple(_step(_dualpipev_stage(p, m, j)) for j in range(p))
    return PipelineSchedule("dualpipev", p, m, stages, virtual_stages=2, placement="v")


def _dualpipev_stage(p: int, m: int, j: int) -> list[Action]:
    out: list[Action] = []
    count = {(kind, c): 0 for kind in Kind for c in (0, 1)}
    pending: list[tuple[int, int]] = []  # (chunk, micro-batch) of B whose W waits, oldest first
    F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT

    def forward(c: int) -> None:
        out.append(Action(F, count[(F, c)], chunk=c))
        count[(F, c)] += 1

    def backward(c: int, split: bool = False) -> None:  # split: W later (zero-bubble); else now
        i = count[(B, c)]
        count[(B, c)] += 1
        out.append(Action(B, i, chunk=c))
        if split:
            pending.append((c, i))
        else:
            out.append(Action(W, i, chunk=c))

    def weight() -> None:
        if pending:
            c, i = pending.pop(0)
            out.append(Action(W, i, chunk=c))

    for _ in range((p - j - 1) * 2):  # 1: F0
        forward(0)
    for _ in range(j + 1):  # 2: F0 F1
        forward(0)
        forward(1)
    for _ in range(p - j - 1):  # 3: B1 W F1
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * p + j + 1):  # 4: F0&B1, F1&B0
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - j - 1):  # 5: B1, F1&B0
        backward(1)
        forward(1)
        backward(0)
    split = False
    for k in range(j + 1):  # 6: B1 B0, split from the middle on
        split = split or (k == (j + 1) // 2 and j % 2 == 1)
        backward(1, split)
        split = split or (k == (j + 1) // 2 and j % 2 == 0)
        backward(0, split)
    for _ in range(p - j - 1):  # 7: W B0
        weight()
        backward(0, split)
    for _ in range(j + 1):  # 8: W
        weight()
    while pending:
        weight()
    return out


SCHEDULES: dict[str, Callable[[int, int], PipelineSchedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,  # build(..., virtual_stages=V) picks V (2 by default)
    "pipedream": pipedream,
    "pipedream-vs": lambda p, m: pipedream(p, m, vertical_sync=True),
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
}
SYNCHRONOUS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zb-v", "dualpipev")  # the split backward: B then W


def build(name: str, p: int, m: int, virtual_stages: int = 1) -> PipelineSchedule:
    """The schedule called `name` for p stages and m micro-batches (V chunks a stage: interleaved)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved(p, m, virtual_stages)
    if virtual_stages != 1 and not (name in V_SHAPED and virtual_stages == 2):
        raise ValueError(
            f"--virtual-stages {virtual_stages} needs --schedule interleaved; drop it or add that"
        )
    return SCHEDULES[name](p, m)


def check_pipeline(p: int, m: int, schedule: str, balance: str) -> None:
    """Raise ValueError, naming the value and the fix, for a pipeline configuration that cannot run."""
    if p < 1 or m < 1:
        raise ValueError(f"--pp and --micro-batches must be at least 1, got pp={p}, micro_batches={m}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if balance not in ("params", "time"):
        raise ValueError(f"unknown --pp-balance {balance!r}; choose params or time")
    if schedule in ZERO_BUBBLE and p > 1:
        check_zero_bubble(schedule, p, m)


def theoretical_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """GPipe's bubble: (p-1)/(m+p-1) of every stage's time is idle (equal stages, free transfers);
    interleaved with v chunks a stage: each fill step is a chunk, 1/v of a stage, so (p-1)/(v m+p-1)."""
    _check(p, m)
    return (p - 1) / (v * m + p - 1)
