"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B and asynchronous PipeDream, per stage.

Indices, used the same way everywhere: p stages, m micro-batches, j stage, i micro-batch, v weight
version (the number of optimizer steps a stage had taken when the version was current), c model
chunk of a stage and V chunks per stage (interleaved 1F1B: stage j holds virtual stages c p + j).

A schedule is, for every stage, an ordered list of actions: forward of micro-batch i, backward of
micro-batch i, optimizer step. The transfers follow from the actions: the forward of i on stage j
receives i's activation from stage j-1 (unless j = 0) and sends its output to j+1 (unless j is the
last stage); the backward of i receives the gradient from j+1 and sends the input's gradient to
j-1. Sends never block (they are buffered); receives do. `dry_run` plays the schedule with those
rules and raises DeadlockError when no stage can move. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    FORWARD = "F"
    BACKWARD = "B"
    STEP = "S"


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
    virtual_stages: int = 1  # V model chunks per stage (interleaved 1F1B)

    def describe(self, j: int) -> str:
        """Stage j's actions as text, e.g. 'F0 F1 B0 B1 S'."""
        return " ".join(str(a) for a in self.actions[j])

    def virtual(self, j: int, a: Action) -> int:
        """The virtual stage c p + j that action a of stage j runs (j itself without interleaving)."""
        return a.chunk * self.stages + j

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


SCHEDULES: dict[str, Callable[[int, int], PipelineSchedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,  # build(..., virtual_stages=V) picks V (2 by default)
    "pipedream": pipedream,
    "pipedream-vs": lambda p, m: pipedream(p, m, vertical_sync=True),
}
SYNCHRONOUS = ("gpipe", "1f1b", "interleaved")


def build(name: str, p: int, m: int, virtual_stages: int = 1) -> PipelineSchedule:
    """The schedule called `name` for p stages and m micro-batches (V chunks a stage: interleaved)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved(p, m, virtual_stages)
    if virtual_stages != 1:
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


def theoretical_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """GPipe's bubble: (p-1)/(m+p-1) of every stage's time is idle (equal stages, free transfers);
    interleaved with v chunks a stage: each fill step is a chunk, 1/v of a stage, so (p-1)/(v m+p-1)."""
    _check(p, m)
    return (p - 1) / (v * m + p - 1)
