"""Token files: a flat binary file of token ids (nanoGPT's ``train.bin``) with a JSON sidecar
(``dtype``, ``vocab_size``, ``n_tokens``), memory-mapped and read in non-overlapping windows.

Opening checks the file against its sidecar; every window is checked against the vocabulary
before it leaves the host (see :class:`TokenFileDataset`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from gpulens.data.bad_samples import BadSampleError
from gpulens.data.storage import StorageEmulation, pad_read
from gpulens.errors import UsageError

logger = logging.getLogger(__name__)

TOKENS_BIN = "tokens.bin"
TOKENS_JSON = "tokens.json"


def make_tokens_hint(path: Path | str) -> str:
    """How to make a token file at ``path`` (for error messages)."""
    return f"make some with `gpulens data make tokens --out {path} --n 10000000`"


def resolve_token_file(path: str | os.PathLike) -> tuple[Path, dict]:
    """``(tokens.bin path, sidecar dict)`` for a file or a directory holding ``tokens.bin``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"token path {p} does not exist: {make_tokens_hint(p)}")
    if p.is_dir():
        if not (p / TOKENS_BIN).is_file():
            raise UsageError(f"{p} holds no {TOKENS_BIN}: {make_tokens_hint(p)}")
        p = p / TOKENS_BIN
    meta: dict = {}
    sidecar = p.with_suffix(".json")
    if sidecar.is_file():
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read {sidecar} ({exc}): fix or delete it") from None
    else:
        logger.info("no sidecar %s: assuming uint16 token ids", sidecar)
    meta.setdefault("dtype", "uint16")
    try:
        np.dtype(meta["dtype"])
    except TypeError:
        bad = meta["dtype"]
        raise UsageError(f"{sidecar} names an unknown dtype {bad!r}: use uint16") from None
    return p, meta


def check_against_sidecar(path: Path, meta: dict, size_bytes: int, n_tokens: int) -> None:
    """A :class:`UsageError` when the token file is not what its sidecar describes."""
    sidecar = path.with_suffix(".json")
    vocab = meta.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2):
        raise UsageError(f"{sidecar} has vocab_size {vocab!r}, not an integer of 2 or more: fix it")
    itemsize = np.dtype(meta["dtype"]).itemsize
    if size_bytes % itemsize:
        raise UsageError(
            f"{path} is {size_bytes} bytes, not a whole number of {meta['dtype']} ids: the file "
            f"is truncated or {sidecar.name} names the wrong dtype; copy it again or remake it "
            "with `gpulens data make tokens`"
        )
    claimed = meta.get("n_tokens")
    if claimed is None:
        return
    if not isinstance(claimed, int) or isinstance(claimed, bool) or claimed < 0:
        raise UsageError(f"{sidecar} has n_tokens {claimed!r}, not a count: fix or delete it")
    if n_tokens < claimed:
        raise UsageError(
            f"{path} holds {n_tokens} tokens ({size_bytes} bytes) but {sidecar.name} says "
            f"{claimed}: the file is truncated (an interrupted copy or write?); copy it again or "
            f"remake it with `gpulens data make tokens --out {path.parent} --n {claimed} --force`"
        )
    if n_tokens > claimed:
        logger.warning(
            "%s holds %d tokens, more than the %d its sidecar says: reading them all",
            path,
            n_tokens,
            claimed,
        )


class TokenFileDataset(Dataset):
    """Non-overlapping ``seq_len`` windows of a memory-mapped token file.

    Item ``i`` is ``(tokens[i*L : i*L+L], tokens[i*L+1 : i*L+L+1])`` as int64. ``path`` is the
    ``.bin`` file or a directory containing ``tokens.bin``; the sidecar ``<name>.json`` gives
    ``dtype`` (default uint16), ``vocab_size`` and ``n_tokens``.

    Opening checks the file against its sidecar (a file shorter than ``n_tokens`` is
    truncated). Every window is checked on the host, before any copy to a device, against the
    vocabulary (the sidecar's ``vocab_size``, else ``vocab_size`` given, the model's): an id
    outside it is a :class:`~gpulens.data.bad_samples.BadSampleError` naming the file, the
    id and the fix, where the model would raise ``IndexError`` on the CPU and a device-side
    assert on a GPU. The check is per window, not a scan at opening, so that a cold run's file
    stays out of the page cache until the run reads it.

    With an active ``storage`` emulation a window's read lasts at least its emulated delay; with a
    ``timing_dir`` each read is timed (read only: there is no decode or augmentation).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        *,
        vocab_size: int | None = None,
        storage: StorageEmulation | None = None,
        timing_dir: str | os.PathLike | None = None,
    ):
        if seq_len <= 0:
            raise UsageError(f"sequence length must be positive, got {seq_len}")
        self.path, meta = resolve_token_file(path)
        self.seq_len = seq_len
        self.dtype = np.dtype(meta["dtype"])
        self.vocab_size: int | None = meta.get("vocab_size")
        size_bytes = self.path.stat().st_size
        self.n_tokens = size_bytes // self.dtype.itemsize
        check_against_sidecar(self.path, meta, size_bytes, self.n_tokens)
        if self.n_tokens < seq_len + 1:
            raise UsageError(
                f"{self.path} holds {self.n_tokens} tokens, fewer than one sample of "
                f"{seq_len + 1}: {make_tokens_hint(self.path.parent)}"
            )
        # Ids must lie in [0, limit): the sidecar's vocabulary, else the model's.
        self.id_limit = self.vocab_size if self.vocab_size is not None else vocab_size
        self.id_limit_source = (
            f"vocab_size in {self.path.with_suffix('.json').name}"
            if self.vocab_size is not None
            else "the model's vocabulary"
        )
        self._tokens: np.memmap | None = None
        self.storage = storage if storage is not None and storage.active else None
        self.timing_dir = Path(timing_dir) if timing_dir is not None else None

    def _check_ids(self, window: np.ndarray, start: int) -> None:
        """A :class:`BadSampleError` when ``window`` (tokens from ``start``) holds an id outside
        ``[0, id_limit)``."""
        if self.id_limit is None or not window.size:
            return
        high = int(window.max())
        low = int(window.min()) if self.dtype.kind == "i" else 0
        if high < self.id_limit and low >= 0:
            return
        bad = high if high >= self.id_limit else low
        position = start + int(np.argmax(window == bad))
        fix = (
            f"correct vocab_size in {self.path.with_suffix('.json').name}, or remake the tokens "
            f"with `gpulens data make tokens --vocab-size {self.id_limit}`"
            if self.vocab_size is not None
            else f"make the tokens with `gpulens data make tokens --vocab-size {self.id_limit}` "
            "(or the model's tokenizer), or pick a model whose vocabulary covers them"
        )
        raise BadSampleError(
            f"{self.path} holds token id {bad} at token {position}, outside {self.id_limit_source}"
            f" ({self.id_limit} ids): {fix}",
            path=str(self.path),
            reason=f"token id {bad} >= {self.id_limit}",
        )

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def _mmap(self) -> np.memmap:
        if self._tokens is None:  # opened lazily so each DataLoader worker maps its own
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._tokens

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start, stop = index * self.seq_len, index * self.seq_len + self.seq_len + 1
        if self.storage is None and self.timing_dir is None:
            window = self._mmap()[start:stop].astype(np.int64)
            self._check_ids(window, start)
            chunk = torch.from_numpy(window)
            return chunk[:-1], chunk[1:]
        c0, t0 = time.thread_time(), time.perf_counter()
        window = self._mmap()[start:stop].astype(np.int64)
        self._check_ids(window, start)
        nbytes = window.size * self.dtype.itemsize
        pad_read(self.storage, nbytes, t0)
        read_s = time.perf_counter() - t0
        if self.timing_dir is not None:
            from gpulens.data.prep_timing import record_sample

            cpu_s = time.thread_time() - c0
            record_sample(self.timing_dir, read_s, 0.0, 0.0, nbytes, cpu_s)
        chunk = torch.from_numpy(window)
        return chunk[:-1], chunk[1:]
