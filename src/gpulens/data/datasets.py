"""Datasets for the built-in workloads: in-memory synthetic tensors and real files on disk.

- :class:`SyntheticImages` / :class:`SyntheticTokens`: random tensors, fixed per index
  (``--data synthetic``); no I/O and almost no CPU.
- :func:`image_folder_dataset`: an ImageFolder tree (``ROOT/<class>/*.jpg``) through the usual
  ImageNet training pipeline (PIL decode, RandomResizedCrop, flip, ToTensor, Normalize).
- :class:`TokenFileDataset`: a flat binary file of token ids (nanoGPT's ``train.bin``) with a JSON
  sidecar, memory-mapped.

:func:`build_dataset` picks one for a :class:`~gpulens.workloads.models.WorkloadSpec`. The on-disk
datasets take a :class:`~gpulens.data.storage.StorageEmulation` (slow storage, for real) and
a ``timing_dir`` (per-sample read/decode/augment timing, see
:mod:`gpulens.data.prep_timing`); pass :func:`collate_with_timing` as the DataLoader's
``collate_fn`` to time collation too. :func:`dataset_files` lists the files a dataset reads, for
:mod:`gpulens.data.pagecache`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from gpulens.data.bad_samples import BadSampleError, load_rgb
from gpulens.data.storage import StorageEmulation, pad_read
from gpulens.errors import UsageError
from gpulens.workloads.models import WorkloadSpec

logger = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
TOKENS_BIN = "tokens.bin"
TOKENS_JSON = "tokens.json"
_SPLIT_NAMES = {"train", "val", "validation", "test"}


def _make_images_hint(path: Path | str) -> str:
    return f"make some with `gpulens data make images --out {path} --n 1000`"


def _make_tokens_hint(path: Path | str) -> str:
    return f"make some with `gpulens data make tokens --out {path} --n 10000000`"


# ---------------------------------------------------------------------------------------------
# Synthetic
# ---------------------------------------------------------------------------------------------


def _generator(seed: int, index: int) -> torch.Generator:
    # Distinct, reproducible stream per (seed, index), independent of access order and workers.
    return torch.Generator().manual_seed((seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF)


class SyntheticImages(Dataset):
    """``n`` random images ``float32 input_shape`` with int64 labels, the same for each index."""

    def __init__(self, n: int, input_shape: tuple[int, ...], num_classes: int, seed: int = 0):
        if n <= 0:
            raise UsageError(f"synthetic dataset size must be positive, got {n}")
        self.n = n
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        g = _generator(self.seed, index)
        x = torch.randn(self.input_shape, generator=g)
        y = torch.randint(self.num_classes, (), generator=g)
        return x, y


class SyntheticTokens(Dataset):
    """``n`` random ``(input, target)`` int64 ``(seq_len,)`` pairs, target shifted by one."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0):
        if n <= 0:
            raise UsageError(f"synthetic dataset size must be positive, got {n}")
        self.n = n
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        tokens = torch.randint(
            self.vocab_size, (self.seq_len + 1,), generator=_generator(self.seed, index)
        )
        return tokens[:-1], tokens[1:]


# ---------------------------------------------------------------------------------------------
# Images on disk
# ---------------------------------------------------------------------------------------------


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _subdirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _has_images_below(path: Path) -> bool:
    return any(any(_is_image(f) for f in files) for _, _, files in os.walk(path))


def _resolve_image_root(path: str | os.PathLike, train: bool) -> Path:
    """The ImageFolder root for ``path``, or a :class:`UsageError` naming the fix."""
    root = Path(path).expanduser()
    if not root.exists():
        raise UsageError(f"data path {root} does not exist: {_make_images_hint(root)}")
    if not root.is_dir():
        raise UsageError(
            f"data path {root} is a file, not a folder of class subfolders: pass the folder"
        )
    subdirs = _subdirs(root)
    # An ImageNet-style root holding train/ and val/ splits: descend into the right one.
    names = {d.name for d in subdirs}
    if subdirs and names <= _SPLIT_NAMES:
        wanted = ["train"] if train else ["val", "validation", "test"]
        split = next((root / n for n in wanted if n in names), None)
        if split is None:
            raise UsageError(
                f"{root} holds splits {sorted(names)} but no {wanted[0]!r}: pass a split folder"
            )
        logger.info("using split %s of %s", split.name, root)
        root, subdirs = split, _subdirs(split)
    if not any(_has_images_below(d) for d in subdirs):
        flat = any(_is_image(p.name) for p in root.iterdir() if p.is_file())
        if flat:
            raise UsageError(
                f"{root} holds images but no class subfolders: move them into "
                f"{root}/<class>/ (ImageFolder layout), e.g. {root}/class_000/"
            )
        raise UsageError(f"{root} holds no images: {_make_images_hint(root)}")
    return root


def image_transform(image_size: int | tuple[int, int], train: bool = True):
    """The ImageNet pipeline: RandomResizedCrop + flip (train) or Resize + CenterCrop (eval)."""
    from torchvision import transforms as T

    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if train:
        geometry = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
    else:
        geometry = [T.Resize(tuple(round(s * 256 / 224) for s in size)), T.CenterCrop(size)]
    return T.Compose([*geometry, T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def image_folder_dataset(
    path: str | os.PathLike,
    image_size: int | tuple[int, int],
    train: bool = True,
    *,
    storage: StorageEmulation | None = None,
    timing_dir: str | os.PathLike | None = None,
    skip_bad_samples: bool = False,
    skip_log: str | os.PathLike | None = None,
) -> Dataset:
    """A torchvision ImageFolder over ``path`` (``path/<class>/*.jpg``) yielding ``(3, H, W)``.

    A root holding only ``train/``/``val/`` splits is accepted: the split matching ``train`` is
    used. With an active ``storage`` emulation, a ``timing_dir`` or ``skip_bad_samples`` the
    folder is wrapped in an :class:`~gpulens.data.prep_timing.InstrumentedImageFolder`
    (same items and attributes). A file that cannot be decoded raises a
    :class:`~gpulens.data.bad_samples.BadSampleError` naming it, or with
    ``skip_bad_samples`` is replaced by the next readable image (each skip logged to
    ``skip_log``).
    """
    from torchvision.datasets import ImageFolder

    root = _resolve_image_root(path, train)
    try:
        ds = ImageFolder(
            str(root),
            transform=image_transform(image_size, train),
            loader=load_rgb,
            allow_empty=True,
        )
    except (FileNotFoundError, OSError) as exc:
        hint = _make_images_hint(root)
        raise UsageError(f"cannot read images under {root} ({exc}): {hint}") from None
    if len(ds) == 0:
        raise UsageError(f"{root} holds no images: {_make_images_hint(root)}")
    logger.debug("image folder %s: %d images, %d classes", root, len(ds), len(ds.classes))
    if (storage is not None and storage.active) or timing_dir is not None or skip_bad_samples:
        from gpulens.data.prep_timing import InstrumentedImageFolder

        return InstrumentedImageFolder(
            ds,
            storage=storage,
            timing_dir=timing_dir,
            skip_bad_samples=skip_bad_samples,
            skip_log=skip_log,
        )
    return ds


# ---------------------------------------------------------------------------------------------
# Token file
# ---------------------------------------------------------------------------------------------


def _resolve_token_file(path: str | os.PathLike) -> tuple[Path, dict]:
    """``(tokens.bin path, sidecar dict)`` for a file or a directory holding ``tokens.bin``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"token path {p} does not exist: {_make_tokens_hint(p)}")
    if p.is_dir():
        if not (p / TOKENS_BIN).is_file():
            raise UsageError(f"{p} holds no {TOKENS_BIN}: {_make_tokens_hint(p)}")
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


def _check_against_sidecar(path: Path, meta: dict, size_bytes: int, n_tokens: int) -> None:
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
        self.path, meta = _resolve_token_file(path)
        self.seq_len = seq_len
        self.dtype = np.dtype(meta["dtype"])
        self.vocab_size: int | None = meta.get("vocab_size")
        size_bytes = self.path.stat().st_size
        self.n_tokens = size_bytes // self.dtype.itemsize
        _check_against_sidecar(self.path, meta, size_bytes, self.n_tokens)
        if self.n_tokens < seq_len + 1:
            raise UsageError(
                f"{self.path} holds {self.n_tokens} tokens, fewer than one sample of "
                f"{seq_len + 1}: {_make_tokens_hint(self.path.parent)}"
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


# ---------------------------------------------------------------------------------------------
# Choosing and describing
# ---------------------------------------------------------------------------------------------


def build_dataset(
    spec: WorkloadSpec,
    data: str,
    n_synthetic: int,
    image_size: int | tuple[int, int] | None = None,
    *,
    train: bool = True,
    seed: int = 0,
    storage: StorageEmulation | None = None,
    timing_dir: str | os.PathLike | None = None,
    skip_bad_samples: bool = False,
    skip_log: str | os.PathLike | None = None,
) -> Dataset:
    """The dataset for ``spec``: synthetic when ``data == "synthetic"``, else files at ``data``.

    Images are produced at ``image_size`` (default: the spec's input size, e.g. 64x64 for
    tiny_cnn); token windows are ``spec.seq_len`` long. ``storage`` and ``timing_dir`` apply to
    files on disk: emulating storage for synthetic data is refused, timing it is ignored.
    ``skip_bad_samples`` replaces images that cannot be decoded (logged to ``skip_log``); a
    token file's bad ids always stop the run (the file does not match the model).
    """
    if data == "synthetic" and storage is not None and storage.active:
        raise UsageError(
            "storage emulation needs data on disk: pass --data PATH (e.g. made with "
            "`gpulens data make images`) or drop the storage latency/bandwidth"
        )
    if spec.is_language_model:
        if data == "synthetic":
            return SyntheticTokens(n_synthetic, spec.seq_len, spec.vocab_size, seed=seed)
        ds = TokenFileDataset(
            data,
            spec.seq_len,
            vocab_size=spec.vocab_size,
            storage=storage,
            timing_dir=timing_dir,
        )
        if ds.vocab_size is not None and ds.vocab_size > spec.vocab_size:
            raise UsageError(
                f"{ds.path} has vocab_size {ds.vocab_size} but {spec.name} has {spec.vocab_size}: "
                f"make tokens with --vocab-size {spec.vocab_size} or pick a larger model"
            )
        return ds

    size = image_size if image_size is not None else spec.image_size
    if isinstance(size, int):
        size = (size, size)
    if data == "synthetic":
        shape = (spec.input_shape[0], *size)
        return SyntheticImages(n_synthetic, shape, spec.num_classes, seed=seed)
    ds = image_folder_dataset(
        data,
        size,
        train=train,
        storage=storage,
        timing_dir=timing_dir,
        skip_bad_samples=skip_bad_samples,
        skip_log=skip_log,
    )
    if len(ds.classes) > spec.num_classes:
        raise UsageError(
            f"{data} has {len(ds.classes)} classes but {spec.name} predicts {spec.num_classes}: "
            f"use a dataset with at most {spec.num_classes} class folders"
        )
    return ds


def collate_with_timing(timing_dir: str | os.PathLike | None) -> Callable | None:
    """A DataLoader ``collate_fn`` recording each batch's collate time under ``timing_dir``
    (default collation), or None when ``timing_dir`` is None (use the DataLoader's default)."""
    if timing_dir is None:
        return None
    from gpulens.data.prep_timing import TimedCollate

    return TimedCollate(timing_dir)


def _scan_files(root: str, keep: Callable[[str], bool]) -> list[Path]:
    files: list[Path] = []
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    stack.append(entry.path)
                elif keep(entry.name) and entry.is_file():
                    files.append(Path(entry.path))
    files.sort()
    return files


def dataset_files(path: str | os.PathLike, train: bool = True) -> list[Path]:
    """The data files an on-disk dataset reads, for page-cache control: ``tokens.bin`` of a token
    dataset, or every image of an image folder (the ``train``/``val`` split as the dataset picks
    it)."""
    if str(path) == "synthetic":
        return []
    p = Path(path).expanduser()
    if (p.is_file() and p.suffix == ".bin") or (p.is_dir() and (p / TOKENS_BIN).is_file()):
        return [_resolve_token_file(p)[0]]
    root = _resolve_image_root(p, train)
    return [f for d in _subdirs(root) for f in _scan_files(str(d), _is_image)]


def describe_dataset(path: str | os.PathLike) -> dict:
    """What is at ``path``, for a run's effective config.

    Keys: ``path``, ``kind`` ("synthetic", "image_folder", "token_file" or "unknown"),
    ``n_files``, ``total_bytes``, plus ``n_classes`` for images and ``n_tokens``/``vocab_size``
    for tokens.
    """
    if str(path) == "synthetic":
        return {"path": None, "kind": "synthetic", "n_files": 0, "total_bytes": 0}
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise UsageError(f"data path {p} does not exist: pass an existing folder or `synthetic`")
    if (p.is_file() and p.suffix == ".bin") or (p.is_dir() and (p / TOKENS_BIN).is_file()):
        bin_path, meta = _resolve_token_file(p)
        size_bytes = bin_path.stat().st_size
        return {
            "path": str(bin_path),
            "kind": "token_file",
            "n_files": 1,
            "total_bytes": size_bytes,
            "n_tokens": size_bytes // np.dtype(meta["dtype"]).itemsize,
            "vocab_size": meta.get("vocab_size"),
            "dtype": meta["dtype"],
        }
    n_files = total_bytes = unreadable = 0
    classes = set()
    if p.is_dir():
        for dirpath, _, files in os.walk(p):
            images = [f for f in files if _is_image(f)]
            if images:
                classes.add(os.path.relpath(dirpath, p).split(os.sep)[0])
            for f in images:
                n_files += 1
                try:
                    total_bytes += os.stat(os.path.join(dirpath, f)).st_size
                except OSError:  # e.g. a dangling link: the loader names it when it gets there
                    unreadable += 1
    classes.discard(".")
    kind = "image_folder" if n_files else "unknown"
    info = {"path": str(p), "kind": kind, "n_files": n_files, "total_bytes": total_bytes}
    if unreadable:
        info["unreadable_files"] = unreadable
    if n_files:
        info["n_classes"] = len(classes)
        info["mean_file_bytes"] = total_bytes // n_files
    return info
