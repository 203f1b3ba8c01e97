"""Loading that keeps the device busy: a prefetching loader and a stream sharded by rank and worker."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import IterableDataset, get_worker_info

T = TypeVar("T")
_DONE = object()  # the producer's last item: the source is exhausted


class PrefetchLoader:
    """Iterate `loader` with the next batches prepared on a background thread while this one computes.

    On a CUDA device each batch is pinned (page-locked) and copied with non_blocking=True, so the
    copy overlaps compute; elsewhere the batch stays as the loader made it. An exception in the
    thread is re-raised by the iterator; stopping early (break) ends the thread.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str = "cpu", depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1 batch, got {depth}")
        self.loader = loader
        self.device = torch.device(device)
        self.depth = depth

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # as the wrapped loader; TypeError if none

    def __iter__(self) -> Iterator[Any]:
        ready: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(ready, stop), daemon=True)
        worker.start()
        try:
            while (item := ready.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            _drain(ready)
            worker.join(timeout=10.0)

    def _produce(self, ready: queue.Queue[Any], stop: threading.Event) -> None:
        try:
            for batch in self.loader:
                if not _put(ready, self.to_device(batch), stop):
                    return
            _put(ready, _DONE, stop)
        except BaseException as e:  # carried to the consumer, which re-raises it
            _put(ready, e, stop)

    def to_device(self, batch: Any) -> Any:
        """The batch on self.device: tensors pinned and copied asynchronously when it is CUDA."""
        if isinstance(batch, torch.Tensor):
            if self.device.type != "cuda":
                return batch
            return batch.pin_memory().to(self.device, non_blocking=True)
        if isinstance(batch, list | tuple):
            return type(batch)(self.to_device(b) for b in batch)
        return batch


def _put(ready: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put item unless the consumer stopped; False when it did."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _drain(ready: queue.Queue[Any]) -> None:
    while True:
        try:
            ready.get_nowait()
        except queue.Empty:
            return


class ShardedStream(IterableDataset[T], Generic[T]):
    """An iterable data set that shards a stream by rank and by DataLoader worker.

    The stream's sample i goes to shard i mod (world_size x workers), and shard
    rank x workers + worker is the one this process's worker reads: across all ranks and workers
    every sample of an epoch is read exactly once. `source(epoch)` makes the epoch's stream (the same
    order on every rank, e.g. a seeded shuffle); shard counts differ by at most one sample.
    """

    def __init__(self, source: Callable[[int], Iterable[T]], rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration streams (as DistributedSampler.set_epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[T]:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        shards = self.world_size * workers
        mine = self.rank * workers + worker
        for i, sample in enumerate(self.source(self.epoch)):
            if i % shards == mine:
                yield sample
