"""Checks of a pipeline schedule as data: a dry run for deadlocks, activations in flight, weight versions.

Indices as in ringtree.schedules.pipeline: p stages, m micro-batches, j stage, i micro-batch, v version.
"""

from __future__ import annotations

from collections import defaultdict, deque

from ringtree.schedules.pipeline import Action, Kind, PipelineSchedule


class DeadlockError(RuntimeError):
    """No stage of a pipeline schedule can make progress: each waits for a transfer never sent."""


def check_actions(s: PipelineSchedule) -> None:
    """Every stage runs the forward and the backward of every micro-batch once per chunk, forward
    first; a schedule that splits the backward also runs every W once, after its B."""
    every = [(c, i) for c in range(s.virtual_stages) for i in range(s.micro_batches)]
    split = s.splits_backward
    for j, actions in enumerate(s.actions):
        forwards = _units(actions, Kind.FORWARD)
        backwards = _units(actions, Kind.BACKWARD)
        if sorted(forwards) != every or sorted(backwards) != every:
            raise ValueError(
                f"stage {j}: forwards {forwards} and backwards {backwards} must each be 0..m-1 once "
                f"for each of the {s.virtual_stages} chunk(s)"
            )
        if split and sorted(_units(actions, Kind.WEIGHT)) != every:
            raise ValueError(
                f"stage {j}: weight gradients {_units(actions, Kind.WEIGHT)} must be 0..m-1 once for "
                f"each of the {s.virtual_stages} chunk(s), one for every B"
            )
        at = {(a.kind, a.chunk, a.micro_batch): k for k, a in enumerate(actions)}
        for c, i in forwards:
            if at[(Kind.BACKWARD, c, i)] < at[(Kind.FORWARD, c, i)]:
                raise ValueError(f"stage {j}: the backward of micro-batch {i} comes before its forward")
            if split and at[(Kind.WEIGHT, c, i)] < at[(Kind.BACKWARD, c, i)]:
                raise ValueError(f"stage {j}: the W of micro-batch {i} comes before its B")


def _units(actions: tuple[Action, ...], kind: Kind) -> list[tuple[int, int]]:
    return [(a.chunk, a.micro_batch) for a in actions if a.kind is kind]


def dry_run(s: PipelineSchedule) -> int:
    """Play the schedule with buffered sends and blocking receives; the rounds it takes.

    Transfers between two stages must be received in the order they were sent (point-to-point
    messages match in order), so an out-of-order receive is an error as well as a deadlock.
    """
    check_actions(s)
    channels: dict[tuple[str, int, int], deque[int]] = defaultdict(deque)
    done = [0] * s.stages
    rounds = 0
    while any(done[j] < len(s.actions[j]) for j in range(s.stages)):
        moved = [_advance(s, j, done, channels) for j in range(s.stages)]
        if not any(moved):
            waiting = {j: str(s.actions[j][done[j]]) for j in range(s.stages) if done[j] < len(s.actions[j])}
            raise DeadlockError(
                f"{s.name} with p={s.stages}, m={s.micro_batches} deadlocks; stages wait at {waiting}"
            )
        rounds += 1
    return rounds


def _advance(
    s: PipelineSchedule, j: int, done: list[int], channels: dict[tuple[str, int, int], deque[int]]
) -> bool:
    """Run stage j's next action if its receive is there; whether it ran."""
    if done[j] == len(s.actions[j]):
        return False
    action = s.actions[j][done[j]]
    need = s.recv_of(j, action)
    if need is not None:
        queue = channels[(need.what, need.src, need.dst)]
        if not queue:
            return False
        if queue[0] != need.micro_batch:
            raise DeadlockError(
                f"{s.name}: stage {j} expects the {need.what} of micro-batch {need.micro_batch} from stage "
                f"{need.src}, but micro-batch {queue[0]} was sent first"
            )
        queue.popleft()
    sent = s.send_of(j, action)
    if sent is not None:
        channels[(sent.what, sent.src, sent.dst)].append(sent.micro_batch)
    done[j] += 1
    return True


def peak_in_flight(s: PipelineSchedule, j: int) -> int:
    """Most micro-batches whose forward stage j has run and whose backward it has not finished
    (activations kept): up to the backward, or up to W when the schedule splits it, since W needs
    the layer inputs too. Several chunks a stage: (chunk, micro-batch) units, each 1/V of a stage's."""
    release = Kind.WEIGHT if s.splits_backward else Kind.BACKWARD
    alive = peak = 0
    for a in s.actions[j]:
        alive += 1 if a.kind is Kind.FORWARD else -1 if a.kind is release else 0
        peak = max(peak, alive)
    return peak


def peak_versions(s: PipelineSchedule, j: int) -> int:
    """Most weight versions stage j holds at once: the current one and those stashed in flight."""
    current, stashed, peak = 0, dict[tuple[int, int], int](), 1
    for a in s.actions[j]:
        if a.kind is Kind.FORWARD:
            stashed[(a.chunk, a.micro_batch)] = a.version
        elif a.kind is Kind.BACKWARD:
            del stashed[(a.chunk, a.micro_batch)]
        elif a.kind is Kind.STEP:
            current = a.version
        peak = max(peak, len({current, *stashed.values()}))
    return peak


def staleness(s: PipelineSchedule, j: int) -> list[int]:
    """For each backward on stage j in order: the steps taken since the version its forward used."""
    current, out = 0, []
    for a in s.actions[j]:
        if a.kind is Kind.STEP:
            current = a.version
        elif a.kind is Kind.BACKWARD:
            out.append(current - a.version)
    return out


def published_peak(s: PipelineSchedule) -> int | None:
    """The most (chunk, micro-batch) activations a stage may keep under the schedule's published
    bound (`peak_bound`), or None where none is published (PipeDream, interleaved)."""
    return peak_bound(s.name, s.stages, s.micro_batches)


def peak_bound(name: str, p: int, m: int) -> int | None:
    """The published bound on a stage's (chunk, micro-batch) activations, counted as `peak_in_flight`
    counts (a split backward's activations until W): GPipe m; 1F1B and ZB-H1 p, 1F1B's first stage
    (Qi et al. 2024, Table 2: p M_B); ZB-H2 2p-1 (their Table 2: (2p-1) M_B); ZB-V 2p chunks, i.e.
    p micro-batches of a whole stage, 1F1B's memory (their section 6); DualPipeV 2p+1 chunks
    (DeepSeek-V3, Table 2: PP+1 for DualPipe's PP stages, here the 2p chunks of the V)."""
    bounds = {"gpipe": m, "1f1b": min(m, p), "zb-h1": min(m, p), "zb-h2": min(m, 2 * p - 1),
              "zb-v": min(2 * m, 2 * p), "dualpipev": min(2 * m, 2 * p + 1)}  # fmt: skip
    return bounds.get(name)


def verify(s: PipelineSchedule) -> int:
    """Every check as data: each stage's F before B before W for every micro-batch and chunk, counts
    equal (`check_actions`), a dry run without deadlock over every transfer, the V's turn on the last
    stage included (`dry_run`), and each stage's peak activations within `published_peak`. Returns
    the dry run's rounds; raises ValueError (or DeadlockError) naming the first failure."""
    rounds = dry_run(s)
    bound = published_peak(s)
    for j in range(s.stages):
        if bound is not None and peak_in_flight(s, j) > bound:
            raise ValueError(
                f"{s.name}: stage {j} keeps {peak_in_flight(s, j)} micro-batches' activations, more than "
                f"the {bound} its bound allows"
            )
    return rounds
