"""Paired cold and cached reading in one run: the loader workers alternate between files kept
in the page cache and files evicted from it (or behind emulated slow storage).

A VM's CPUs change speed by 10% and more from one second to the next (other tenants, turbo),
so two separate runs, one cached and one cold, differ by that much whatever storage does. When
each worker alternates, block after block of samples, between the two halves of the dataset,
both kinds meet the same CPU speed within a second, and the difference of a worker's time per
sample between its cold and its cached blocks is the storage's cost: the wait and the slower
decoding after it. :func:`gpulens.stalls.paired_fetch.paired_fetch` reads it from the
workers' timers.

Half of the files, drawn once from the run's seed (:func:`cold_mask`), are the cold half. Each
cold file is read once: the sampler ends the run when the cold half is used up, rather than
read a file that the run itself has brought back into the page cache. Under emulated slow
storage the delay does not depend on the page cache, and cold files are reused.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

_SPLIT_SEED = 0x5EED  # the split is its own random stream, apart from the shuffle's


def cold_mask(n: int, seed: int = 0) -> np.ndarray:
    """Which of ``n`` samples are in the cold half (``n // 2`` of them), the same for a seed."""
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng([seed, _SPLIT_SEED]).permutation(n)[: n // 2]] = True
    return mask


def is_cold_position(position: int, block_samples: int) -> bool:
    """Whether a worker's ``position``-th sample (counting from 0) falls in a cold block:
    blocks of ``block_samples`` alternate, cached first."""
    return (position // block_samples) % 2 == 1


class PairedColdSampler(torch.utils.data.Sampler):
    """Indices for a DataLoader with ``workers`` workers and ``batch_size``: each worker's
    samples alternate between the cached and the cold half every ``block_samples`` samples.

    The DataLoader hands batch ``j`` to worker ``j % workers`` (round robin, as PyTorch does);
    a worker's ``k``-th batch holds its positions ``k * batch_size`` onwards. Cached indices are
    reshuffled and reused; cold ones are drawn without replacement, and the iteration stops
    before a batch that would need more cold indices than are left, unless ``reuse_cold``
    (emulated storage: a file stays slow however often it is read)."""

    def __init__(
        self,
        cold: np.ndarray,
        batch_size: int,
        workers: int,
        block_samples: int,
        seed: int = 0,
        reuse_cold: bool = False,
    ):
        if block_samples < 1:
            raise ValueError(f"block_samples must be 1 or more, got {block_samples}")
        self.cold = np.asarray(cold, dtype=bool)
        if self.cold.all() or not self.cold.any():
            raise ValueError("the cold half and the cached half must both hold samples")
        self.batch_size = batch_size
        self.workers = max(1, workers)
        self.block_samples = block_samples
        self.seed = seed
        self.reuse_cold = reuse_cold

    def batch_kinds(self, batch_index: int) -> list[bool]:
        """For each sample of global batch ``batch_index``: whether it is cold."""
        first = (batch_index // self.workers) * self.batch_size
        return [is_cold_position(first + i, self.block_samples) for i in range(self.batch_size)]

    def max_batches(self) -> int | None:
        """How many batches the cold half lasts (None: no end, cold files are reused)."""
        if self.reuse_cold:
            return None
        cold_left, j = int(self.cold.sum()), 0
        while (need := sum(self.batch_kinds(j))) <= cold_left:
            cold_left -= need
            j += 1
        return j

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng(self.seed)
        cached_pool, cold_pool = np.flatnonzero(~self.cold), np.flatnonzero(self.cold)
        cold_order, next_cold = rng.permutation(cold_pool), 0
        cached_order, next_cached = rng.permutation(cached_pool), 0
        j = 0
        while True:
            kinds = self.batch_kinds(j)
            if not self.reuse_cold and next_cold + sum(kinds) > cold_order.size:
                return
            for cold in kinds:
                if cold:
                    if next_cold == cold_order.size:  # only when reusing
                        cold_order, next_cold = rng.permutation(cold_pool), 0
                    yield int(cold_order[next_cold])
                    next_cold += 1
                    continue
                if next_cached == cached_order.size:
                    cached_order, next_cached = rng.permutation(cached_pool), 0
                yield int(cached_order[next_cached])
                next_cached += 1
            j += 1


def split_files(data: str, seed: int = 0) -> tuple[list[str], list[str]]:
    """The files of the image folder at ``data`` in the cold half and in the cached half, in
    the order the training's dataset indexes them (so :func:`cold_mask` means the same)."""
    from gpulens.data.datasets import image_folder_dataset

    samples = image_folder_dataset(data, 8).samples
    cold = cold_mask(len(samples), seed)
    return (
        [path for (path, _), c in zip(samples, cold, strict=True) if c],
        [path for (path, _), c in zip(samples, cold, strict=True) if not c],
    )
