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

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from gpulens.data.bad_samples import load_rgb
from gpulens.data.storage import StorageEmulation
from gpulens.data.tokens import TOKENS_BIN, TokenFileDataset, resolve_token_file
from gpulens.errors import UsageError
from gpulens.workloads.models import WorkloadSpec

logger = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_SPLIT_NAMES = {"train", "val", "validation", "test"}


def _make_images_hint(path: Path | str) -> str:
    return f"make some with `gpulens data make images --out {path} --n 1000`"


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
        return [resolve_token_file(p)[0]]
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
        bin_path, meta = resolve_token_file(p)
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
