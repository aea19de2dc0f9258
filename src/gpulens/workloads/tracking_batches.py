"""Batches as the tracking API sees them: moving them to a device, counting their samples,
describing the loader they came from."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def to_device(batch: Any, device: Any) -> Any:
    """``batch`` with every tensor in it (nested tuples, lists, dicts) moved to ``device`` with
    ``non_blocking=True``; anything else is returned as it is."""
    import torch

    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:  # a mapping type that cannot be built from a dict
            return moved
    return batch


def length(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):
        return None


def describe_loader(iterable: Any) -> dict[str, Any]:
    """What the tracker can tell about a loader without iterating it (torch DataLoader: workers
    and batch size)."""

    def int_attr(name: str) -> int | None:
        value = getattr(iterable, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return {
        "type": type(iterable).__name__,
        "num_workers": int_attr("num_workers"),
        "batch_size": int_attr("batch_size"),
        "len": length(iterable),
    }


def batch_size(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor-like part."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (int, float, str, bytes)):
            return len(batch)  # a plain list of samples
        return batch_size(first)
    if isinstance(batch, dict) and batch:
        return batch_size(next(iter(batch.values())))
    return None


def repeated_batches(
    iterable: Iterable,
    device: Any,
    cache: dict[int, tuple[Any, list]],
    count: int,
    on_endless: Callable[[int], None],
) -> Iterator:
    """Ingestion-free batches: the first ``count`` from ``iterable`` (taken once per iterable,
    kept in ``cache``, moved to ``device`` when given), repeated ``len(iterable)`` times per
    call, or without end where it has no length (``on_endless(n)`` is told)."""
    entry = cache.get(id(iterable))
    if entry is None or entry[0] is not iterable:
        source = iter(iterable)
        taken = list(itertools.islice(source, count))
        del source  # a DataLoader's workers shut down with their iterator
        if device is not None:
            taken = [to_device(b, device) for b in taken]
        entry = (iterable, taken)
        if not isinstance(iterable, Iterator):  # a one-shot iterator is not seen again
            cache[id(iterable)] = entry
    taken = entry[1]
    if not taken:
        return
    n = length(iterable)
    if n is None:
        on_endless(len(taken))
        yield from itertools.cycle(taken)
        return
    for i in range(n):
        yield taken[i % len(taken)]
