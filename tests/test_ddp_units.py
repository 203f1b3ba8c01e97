"""DDP pieces that need no process group: bucket assignment, argument errors, the comm thread."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ringtree.comm import CollectiveError
from ringtree.parallel import DistributedDataParallel, async_reduce, buckets


def params(*sizes: int) -> list[tuple[str, nn.Parameter]]:
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_buckets_reverse_order_with_small_first_bucket() -> None:
    # 4-byte floats: first cap 8 bytes (2 elements), later caps 16 bytes (4 elements)
    groups = buckets.assign(params(1, 3, 1, 1, 2, 1), cap_bytes=16, first_cap_bytes=8)
    assert groups == [[5, 4], [3, 2, 1], [0]]


def test_buckets_never_mix_dtypes() -> None:
    named = [*params(1, 1), ("half", nn.Parameter(torch.zeros(1, dtype=torch.float16)))]
    groups = buckets.assign(named, cap_bytes=1 << 20)
    assert groups == [[2], [1, 0]]


def test_build_skips_frozen_parameters_and_lays_out_views() -> None:
    named = params(2, 3, 4)
    named[1][1].requires_grad_(False)
    (b,) = buckets.build(named, cap_bytes=1 << 20)
    assert b.names == ["p2", "p0"] and b.offsets == [0, 4] and b.buffer.numel() == 6
    b.view(1).fill_(7.0)
    assert b.buffer.tolist() == [0, 0, 0, 0, 7, 7]


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be positive, got 0"),
        ({"compression": "int8"}, ValueError, "unknown compression 'int8'"),
        ({"bogus": 1}, TypeError, "unexpected argument(s) bogus"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        DistributedDataParallel(nn.Linear(2, 2), **kwargs)  # type: ignore[arg-type]


def test_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2))


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="unknown all_reduce algorithm 'rnig'"):
        async_reduce.make_launcher("rnig", None, 1.0)


def test_comm_thread_failure_is_reraised(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise CollectiveError("peer 3 died")

    monkeypatch.setattr(async_reduce.comm, "all_reduce", broken)
    thread = async_reduce.ThreadLauncher("ring", None, timeout_s=5.0)
    thread.launch(0, torch.zeros(4), validate=False)
    with pytest.raises(CollectiveError, match="peer 3 died"):
        thread.wait_all()
    thread.close()


def test_comm_thread_runs_buckets_in_launch_order(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []
    monkeypatch.setattr(async_reduce.comm, "all_reduce", lambda t, *a, **k: seen.append(float(t[0])))
    thread = async_reduce.ThreadLauncher("ring", None, timeout_s=5.0)
    for j in range(5):
        thread.launch(j, torch.full((2,), float(j)), validate=False)
    spans = thread.wait_all()
    thread.close()
    assert seen == [0, 1, 2, 3, 4] and [s.bucket for s in spans] == [0, 1, 2, 3, 4]
    assert all(s.end >= s.start for s in spans)


def test_wait_all_runs_unstarted_buckets_on_the_caller_s_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comm thread holds bucket 0 while the caller waits: buckets 1-2 are taken back and run
    on the caller's thread, after bucket 0, in launch order; a deferred bucket never leaves it."""
    import threading

    seen: list[tuple[float, str]] = []
    hold = threading.Event()

    def reduce(t: torch.Tensor, *a: object, **k: object) -> None:
        if float(t[0]) == 0:
            hold.wait(5.0)
        seen.append((float(t[0]), threading.current_thread().name))

    monkeypatch.setattr(async_reduce.comm, "all_reduce", reduce)
    thread = async_reduce.ThreadLauncher("ring", None, timeout_s=5.0)
    for j in range(3):
        thread.launch(j, torch.full((2,), float(j)), validate=False)
    thread.launch(3, torch.full((2,), 3.0), validate=False, defer=True)
    threading.Timer(0.2, hold.set).start()
    spans = thread.wait_all()
    thread.close()
    caller = threading.current_thread().name
    assert [v for v, _ in seen] == [0, 1, 2, 3] and [s.bucket for s in spans] == [0, 1, 2, 3]
    assert seen[0][1].startswith("ringtree-ddp-comm")
    assert [name for _, name in seen[1:]] == [caller] * 3


def test_taking_back_stops_at_the_first_started_bucket() -> None:
    from concurrent.futures import Future

    started: Future[async_reduce.Span] = Future()
    started.set_running_or_notify_cancel()
    waiting: list[Future[async_reduce.Span]] = [Future(), Future()]
    assert async_reduce._take_back_unstarted([Future(), started, *waiting, None]) == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert all(f.cancelled() for f in waiting)


def test_gradient_as_bucket_view_is_accepted_without_a_warning() -> None:
    from ringtree.parallel import ddp

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gradients are always bucket views: nothing is ignored
        ddp._check_arguments(25.0, None, {"gradient_as_bucket_view": True})
    with pytest.warns(UserWarning, match="ignores static_graph=True"):
        ddp._check_arguments(25.0, None, {"static_graph": True})
