"""DiLoCo, Streaming DiLoCo and local SGD against closed forms, torch's DDP and torch's averager.

One spawned world of two ranks (two replicas with different gradients) runs every case and
returns plain tensors; the tests compare them here against the closed form or the reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtree.parallel import DiLoCo, LocalSGD, outer_codec
from ringtree.processes import spawn
from ringtree.schedules.outer import OuterSchedule, OuterSync, split_layers

P = 2  # replicas
ETA = 0.1  # inner SGD lr
Result = dict[str, Any]
GRADS = [[1.0, 2.0], [3.0, -4.0]]  # constant gradient of rank r's layer l


class W(nn.Module):
    """One layer holding one scalar weight, 1 at the start."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))


def scalars(layers: int) -> nn.Sequential:
    return nn.Sequential(*(W() for _ in range(layers)))


def weights(model: nn.Module) -> list[float]:
    return [float(p.detach()) for p in model.parameters()]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(steps)]


def sgd_steps(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], each: Callable[[], None]
) -> None:
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        each()


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


# -- the cases (run on every rank of the spawned world) ----------------------------------------


def case_golden(rank: int, nesterov: bool) -> Result:
    """Constant gradients GRADS[rank], inner SGD, outer SGD lr 0.5, H = 3, 2 syncs."""
    model = scalars(2)
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    momentum = 0.9 if nesterov else 0.0
    outer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum, nesterov=nesterov)
    trace = []
    with DiLoCo(model, inner, outer, sync_every=3):
        for _ in range(6):
            inner.zero_grad()
            sum(g * p.sum() for g, p in zip(GRADS[rank], model.parameters(), strict=True)).backward()
            inner.step()
            trace.append(weights(model))
    return {"trace": trace}


def case_averaging(rank: int) -> Result:
    """Outer SGD lr 1, no momentum, against averaging the parameters by hand every H = 2 steps."""
    model, ref = mlp(), mlp()
    inner, ref_inner = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    data = batches(rank, 6)
    with DiLoCo(model, inner, outer, sync_every=2):
        sgd_steps(model, inner, data, lambda: None)
    count = [0]

    def average() -> None:
        count[0] += 1
        if count[0] % 2 == 0:
            for p in ref.parameters():
                dist.all_reduce(p.data)
                p.data /= P

    sgd_steps(ref, ref_inner, data, average)
    return {"diloco": flat(model.parameters()), "averaged": flat(ref.parameters())}


def case_ddp(rank: int) -> Result:
    """H = 1, inner SGD, outer SGD lr 1 against torch's DistributedDataParallel."""
    model, ref = mlp(), mlp()
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    data = batches(rank, 4)
    with DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), sync_every=1):
        sgd_steps(model, inner, data, lambda: None)
    ddp = nn.parallel.DistributedDataParallel(ref)
    sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=ETA), data, lambda: None)
    return {"diloco": flat(model.parameters()), "ddp": flat(ref.parameters())}


def case_sign(rank: int) -> Result:
    """A quadratic 0.5 |w - c|^2 with c = 1 + rank: the default outer step lowers it."""
    model = scalars(3)
    target = 1.0 + rank
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for p in model.parameters():
        p.data.zero_()
    with DiLoCo(model, inner, outer, sync_every=3) as diloco:
        for _ in range(3):
            inner.zero_grad()
            sum(0.5 * ((p - target) ** 2).sum() for p in model.parameters()).backward()
            inner.step()
        after = flat(b for bs in diloco.buckets for b in bs.globals)
    return {"before": torch.zeros(3), "after": after, "target": 1.5}  # the replicas' mean target


def case_streaming_state(rank: int) -> Result:
    """F = 2, T = 1, alpha 0.5, int8: the global copy and outer state after every sync, per rank."""
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    states: list[torch.Tensor] = []
    diloco = DiLoCo(model, inner, outer, 4, fragments=2, overlap_steps=1, merge_alpha=0.5, outer_dtype="int8")

    def record() -> None:
        if diloco.schedule.ending(diloco.step) is not None:
            momenta = [s["momentum_buffer"] for s in outer.state_dict()["state"].values()]
            states.append(torch.cat([flat(g for b in diloco.buckets for g in b.globals), flat(momenta)]))

    with diloco:
        sgd_steps(model, inner, batches(rank, 8), record)
    return {"states": states, "syncs": diloco.outer_syncs}


def case_fragments(rank: int) -> Result:
    """4 scalar layers, F = 2 strided, H = 4: which fragment syncs after which step, and the calls."""
    model = scalars(4)
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    diloco = DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), 4, fragments=2)
    seen: list[tuple[int, int]] = []
    apply = diloco._apply

    def spy(sync: OuterSync) -> None:
        seen.append((diloco.step, sync.fragment))
        apply(sync)

    diloco._apply = spy  # type: ignore[method-assign]
    trace = []
    with diloco:
        for _ in range(8):
            inner.zero_grad()
            sum((rank + 1.0) * (i + 1) * p.sum() for i, p in enumerate(model.parameters())).backward()
            inner.step()
            trace.append(weights(model))
    tiny = scalars(4)
    tiny_inner = torch.optim.SGD(tiny.parameters(), lr=ETA)
    per_param = DiLoCo(tiny, tiny_inner, torch.optim.SGD(tiny.parameters(), lr=1.0), 1, bucket_cap_mb=1e-9)
    with per_param:
        for _ in range(2):
            sum(p.sum() for p in tiny.parameters()).backward()
            tiny_inner.step()
    bucketed = scalars(4)
    b_inner = torch.optim.SGD(bucketed.parameters(), lr=ETA)
    one_bucket = DiLoCo(bucketed, b_inner, torch.optim.SGD(bucketed.parameters(), lr=1.0), 1)
    with one_bucket:
        for _ in range(2):
            sum(p.sum() for p in bucketed.parameters()).backward()
            b_inner.step()
    return {
        "seen": seen,
        "trace": trace,
        "per_param_calls": per_param.calls / per_param.outer_syncs,
        "bucketed_calls": one_bucket.calls / one_bucket.outer_syncs,
    }


def case_quantised(rank: int) -> Result:
    """Every outer dtype's average of two different vectors, and fp32's, and the bytes each sent."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=g) * torch.logspace(-2, 1, 1000)  # blocks of different scales
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= P
    out: Result = {"exact": exact, "max": float(torch.stack([x.abs().max(), exact.abs().max()]).max())}
    for dtype in outer_codec.OUTER_DTYPES:
        y = x.clone()
        sent = outer_codec.average(y, dtype, None, "ring", 30.0)
        out[dtype] = (y, sent)
    return out


def case_scaler(rank: int) -> Result:
    """fp16-style loss scaling: rank 0's step 2 overflows and is skipped; counted by skip_step()."""
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with DiLoCo(model, inner, outer, sync_every=3) as diloco:
        for k, (x, y) in enumerate(batches(rank, 6)):
            inner.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if rank == 0 and k == 1:
                next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            before = scaler.get_scale()
            scaler.step(inner)
            scaler.update()
            if scaler.get_scale() < before:  # the step was skipped: count it all the same
                diloco.skip_step()
        globals_ = flat(g for b in diloco.buckets for g in b.globals)
    return {"step": diloco.step, "syncs": diloco.outer_syncs, "globals": globals_}


def case_checkpoint(rank: int) -> Result:
    """Streaming (F = 2, T = 1, int4) saved after step 3 (a fragment in flight), resumed, vs straight."""
    data = batches(rank, 8)

    def build() -> tuple[nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = mlp()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return model, inner, DiLoCo(model, inner, outer, 4, fragments=2, overlap_steps=1, outer_dtype="int4")

    model, inner, diloco = build()
    sgd_steps(model, inner, data[:3], lambda: None)
    saved = copy.deepcopy((model.state_dict(), inner.state_dict(), diloco.state_dict()))
    sgd_steps(model, inner, data[3:], lambda: None)
    diloco.close()
    model2, inner2, resumed = build()
    model2.load_state_dict(saved[0])
    inner2.load_state_dict(saved[1])
    resumed.load_state_dict(saved[2])
    sgd_steps(model2, inner2, data[3:], lambda: None)
    resumed.close()
    return {"straight": flat(model.parameters()), "resumed": flat(model2.parameters())}


def case_local_sgd(rank: int) -> Result:
    """LocalSGD(H = 2, warm-up 1) against torch's PeriodicModelAverager in the same loop."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    model, ref = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=ETA, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=ETA, momentum=0.9)
    data = batches(rank, 6)
    with LocalSGD(model, opt, sync_every=2, warmup_steps=1) as local:
        sgd_steps(model, opt, data, lambda: None)
    averager = PeriodicModelAverager(period=2, warmup_steps=1)
    sgd_steps(ref, ref_opt, data, lambda: averager.average_parameters(ref.parameters()))
    return {"ours": flat(model.parameters()), "torch": flat(ref.parameters()), "syncs": local.outer_syncs}


def case_overlap(rank: int) -> Result:
    """T = 1: the fragment's average runs on DiLoCo's thread while the next inner step runs."""
    import threading

    from ringtree.parallel import diloco as diloco_module

    model = scalars(2)
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    released = threading.Event()
    seen: list[tuple[str, bool]] = []
    average = diloco_module.outer_codec.average

    def waits_for_the_next_step(*args: Any) -> int:
        seen.append((threading.current_thread().name, released.wait(timeout=10)))
        return average(*args)

    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    diloco = DiLoCo(model, inner, outer, 4, fragments=2, overlap_steps=1)  # its warm-up not watched
    diloco_module.outer_codec.average = waits_for_the_next_step  # type: ignore[assignment]
    try:
        with diloco:
            for t in range(1, 5):
                sum(p.sum() for p in model.parameters()).backward()
                inner.step()
                if t in (1, 3):  # the fragment sent after this step is averaging in the background
                    released.set()
                else:
                    released.clear()
    finally:
        diloco_module.outer_codec.average = average
    return {"seen": seen}


def case_synchronize(rank: int) -> Result:
    """Constant gradients, H = 3, 4 steps, then synchronize(): one more outer step on step 4's Delta."""
    model = scalars(2)
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    with DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=0.5), sync_every=3) as diloco:
        for _ in range(4):
            inner.zero_grad()
            sum(g * p.sum() for g, p in zip(GRADS[rank], model.parameters(), strict=True)).backward()
            inner.step()
        diloco.synchronize()
    return {"weights": weights(model), "syncs": diloco.outer_syncs}


def world(rank: int) -> Result:
    out = {
        "synchronize": case_synchronize(rank),
        "overlap": case_overlap(rank),
        "golden_sgd": case_golden(rank, False),
        "golden_nesterov": case_golden(rank, True),
        "averaging": case_averaging(rank),
        "ddp": case_ddp(rank),
        "sign": case_sign(rank),
        "streaming_state": case_streaming_state(rank),
        "fragments": case_fragments(rank),
        "quantised": case_quantised(rank),
        "scaler": case_scaler(rank),
        "checkpoint": case_checkpoint(rank),
        "local_sgd": case_local_sgd(rank),
    }
    dist.barrier()
    return out


_WORLD: list[Result] = []


def results() -> list[Result]:
    if not _WORLD:
        _WORLD.extend(spawn(world, P, timeout_s=120))
    return _WORLD


# -- the tests ---------------------------------------------------------------------------------


def expected_golden(rank: int, nesterov: bool) -> list[list[float]]:
    """The closed form: Delta = H eta mean_r(g); outer lr mu; with Nesterov momentum b the k-th
    outer step moves by mu Delta (1 + b (1 - b^k) / (1 - b)); inner steps then move by eta g_r."""
    h, mu, b = 3, 0.5, 0.9
    trace = []
    for layer in range(2):
        g_mean = sum(GRADS[r][layer] for r in range(P)) / P
        delta = h * ETA * g_mean
        column, global_ = [], 1.0
        for k in range(1, 3):
            for j in range(1, h):
                column.append(global_ - j * ETA * GRADS[rank][layer])
            factor = 1 + b * (1 - b**k) / (1 - b) if nesterov else 1.0
            global_ -= mu * delta * factor
            column.append(global_)
        trace.append(column)
    return [list(step) for step in zip(*trace, strict=True)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_golden_constant_gradients_follow_the_closed_form(nesterov: bool) -> None:
    name = "golden_nesterov" if nesterov else "golden_sgd"
    for rank, result in enumerate(results()):
        got = [w for step in result[name]["trace"] for w in step]
        want = [w for step in expected_golden(rank, nesterov) for w in step]
        assert got == pytest.approx(want, abs=1e-6)


def test_synchronize_ends_every_replica_on_the_outer_parameters() -> None:
    mean = [sum(GRADS[r][layer] for r in range(P)) / P for layer in range(2)]
    want = [1 - 0.5 * 3 * ETA * g - 0.5 * ETA * g for g in mean]  # the round of H = 3, then step 4's
    for result in results():
        assert result["synchronize"]["weights"] == pytest.approx(want, abs=1e-6)
        assert result["synchronize"]["syncs"] == 2


def test_outer_lr_1_without_momentum_is_parameter_averaging() -> None:
    for result in results():
        torch.testing.assert_close(result["averaging"]["diloco"], result["averaging"]["averaged"])


def test_one_inner_sgd_step_per_sync_equals_ddp() -> None:
    for result in results():
        torch.testing.assert_close(result["ddp"]["diloco"], result["ddp"]["ddp"])


def test_outer_step_lowers_the_loss_of_a_quadratic() -> None:
    for result in results():
        sign = result["sign"]
        before, after = (float(((sign[k] - sign["target"]) ** 2).sum()) for k in ("before", "after"))
        assert after < before
        assert bool((sign["after"] > 0).all()), "the outer step went away from the minimum"


def test_replicas_hold_identical_global_params_and_outer_state_after_every_sync() -> None:
    per_rank = [r["streaming_state"] for r in results()]
    assert per_rank[0]["syncs"] == 4 == len(per_rank[0]["states"])
    for a, b in zip(per_rank[0]["states"], per_rank[1]["states"], strict=True):
        assert torch.equal(a, b)


def test_one_fragment_per_h_over_f_steps_and_the_others_untouched() -> None:
    for rank, result in enumerate(results()):
        frag = result["fragments"]
        assert frag["seen"] == [(2, 0), (4, 1), (6, 0), (8, 1)]
        # after step 2 only fragment 0 (layers 0, 2) synchronised: layers 1, 3 are purely local
        g = [(rank + 1.0) * (i + 1) for i in range(4)]
        assert frag["trace"][1][1] == pytest.approx(1 - 2 * ETA * g[1])
        assert frag["trace"][1][3] == pytest.approx(1 - 2 * ETA * g[3])
        mean = [1.5 * (i + 1) for i in range(4)]  # mean over the ranks of (rank + 1)(i + 1)
        assert frag["trace"][1][0] == pytest.approx(1 - 2 * ETA * mean[0])


def test_bucketed_outer_all_reduce_makes_fewer_calls_than_parameters() -> None:
    frag = results()[0]["fragments"]
    assert frag["bucketed_calls"] == 1 < 4
    assert frag["per_param_calls"] == 4  # a tiny bucket cap: one bucket per parameter


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [("fp32", 0.0), ("bf16", 2**-7), ("fp8", 2**-3), ("int8", 1 / 127), ("int4", 1 / 7)],
)
def test_quantised_pseudo_gradient_error_is_bounded_against_fp32(dtype: str, tolerance: float) -> None:
    for result in results():
        q = result["quantised"]
        got, _ = q[dtype]
        error = float((got - q["exact"]).abs().max())
        assert error <= tolerance * q["max"] + 1e-7
        if dtype in ("int8", "int4"):
            assert error > 0  # it really went through the codec
    sent = {d: results()[0]["quantised"][d][1] for d in outer_codec.OUTER_DTYPES}
    assert sent["int8"] < sent["bf16"] < sent["fp32"] and sent["int4"] < sent["int8"]


@pytest.mark.parametrize(("dtype", "qmax"), [("int4", 7), ("int8", 127), ("fp8", 16)])
def test_codec_round_trip_is_exact_for_representable_values(dtype: str, qmax: int) -> None:
    x = torch.arange(-qmax, qmax + 1, dtype=torch.float32)
    x = x.repeat(-(-outer_codec.BLOCK // x.numel()))[: outer_codec.BLOCK]
    x[0] = -qmax if dtype != "fp8" else 448.0  # fp8: the block's scale is then 1
    payload, scales = outer_codec.encode(x, dtype)
    assert torch.equal(outer_codec.decode(payload, scales, dtype), x)
    assert payload.numel() == x.numel() // (2 if dtype == "int4" else 1)


def test_a_step_skipped_by_the_loss_scaler_keeps_every_rank_s_schedule() -> None:
    a, b = (r["scaler"] for r in results())
    assert a["step"] == b["step"] == 6
    assert a["syncs"] == b["syncs"] == 2
    assert torch.equal(a["globals"], b["globals"])


def test_checkpoint_round_trip_resumes_bit_identical() -> None:
    for result in results():
        assert torch.equal(result["checkpoint"]["straight"], result["checkpoint"]["resumed"])


def test_local_sgd_matches_torch_s_periodic_model_averager() -> None:
    for result in results():
        torch.testing.assert_close(result["local_sgd"]["ours"], result["local_sgd"]["torch"])
        assert result["local_sgd"]["syncs"] == 3  # after steps k = 1, 3, 5 (warm-up 1, period 2)


def test_an_overlapped_fragment_averages_behind_the_next_inner_step() -> None:
    for result in results():
        seen = result["overlap"]["seen"]
        assert len(seen) == 2  # fragments 0 and 1, one bucket each
        assert all(name.startswith("ringtree-diloco") and released for name, released in seen), seen


def test_outer_schedule_as_data() -> None:
    s = OuterSchedule(8, 4, 1)
    assert s.syncs(8) == [OuterSync(k, k % 4, 2 * k + 1, 2 * k + 2) for k in range(4)]
    assert [s.starting(t) is not None for t in range(1, 9)] == [True, False] * 4
    assert split_layers(6, 2) == [[0, 2, 4], [1, 3, 5]]
    assert split_layers(6, 2, "contiguous") == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"sync_every": 0}, "--inner-steps"),
        ({"sync_every": 4, "fragments": 3}, "--fragments"),
        ({"sync_every": 4, "fragments": 5}, "--fragments"),
        ({"sync_every": 4, "fragments": 2, "overlap_steps": 2}, "--overlap-steps"),
        ({"sync_every": 4, "merge_alpha": 1.5}, "--merge-alpha"),
        ({"sync_every": 4, "outer_dtype": "fp4"}, "--outer-dtype"),
    ],
)
def test_bad_arguments_name_the_option(kwargs: dict[str, Any], flag: str) -> None:
    model = scalars(4)
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    with pytest.raises(ValueError, match=flag):
        DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), **kwargs)
