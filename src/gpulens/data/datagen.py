"""Generate on-disk datasets: ImageNet-like JPEGs and token files.

Images land in ImageFolder layout, which :func:`gpulens.data.datasets.image_folder_dataset`
reads directly::

    OUT/class_000/img_0000000.jpg
    OUT/class_001/img_0000001.jpg   (image i goes to class i % num_classes)

Each image is smooth low-frequency colour (a bilinear blow-up of a tiny random image, tinted per
class) plus luminance noise whose level varies per image, so that at the default 500x375 and
quality 90 a JPEG is about 90-120 KB, like an ImageNet training image. Image ``i`` depends only on
``(seed, i)``, not on the number of worker processes.

Tokens land as ``OUT/tokens.bin`` (flat little-endian uint16 ids, nanoGPT style) and
``OUT/tokens.json`` (``{"vocab_size", "dtype", "n_tokens", ...}``), Zipf-distributed.

Both write into a hidden temporary sibling of ``OUT`` and rename it into place at the end, so an
error or Ctrl-C leaves nothing half-written. This module imports no torch.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist

import numpy as np

from gpulens.errors import UsageError
from gpulens.probes.environment import usable_cpus

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]  # (done, total)

# Per-image luminance-noise standard deviation (8-bit levels): at 500x375, quality 90 this spans
# ~90-115 KB per JPEG (measured: sigma 16 -> ~91 KB, 24 -> ~104 KB, 30 -> ~113 KB).
_NOISE_SIGMA_RANGE = (16, 32)
_IN_PROCESS_MAX_IMAGES = 64  # below this a process pool costs more than it saves
_CHUNK_IMAGES = 64
_TOKEN_CHUNK = 1 << 24


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(out: Path) -> None:
    """Delete temporary siblings of ``out`` left by a generator that was killed (e.g. SIGKILL)."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            logger.info("removing %s, left by a generator that died", p)
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def _atomic_dir(out: str | os.PathLike, force: bool) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` when the block finishes without error."""
    out = Path(out).expanduser().absolute()
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"{out} exists and is a file: choose another --out")
        if any(out.iterdir()) and not force:
            raise UsageError(f"{out} exists and is not empty: choose another --out or pass --force")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise UsageError(
            f"cannot create {out}: {exc.strerror or exc}; choose an --out you can write to"
        ) from None
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _noise_lut(sigma: int) -> list[int]:
    """Map a uniform byte to 128 + a Gaussian deviate (inverse CDF): fast noise from raw bytes."""
    nd = NormalDist(0.0, float(sigma))
    return [min(255, max(0, 128 + round(nd.inv_cdf((i + 0.5) / 256)))) for i in range(256)]


def _class_tints(num_classes: int) -> np.ndarray:
    return np.random.default_rng(12345).integers(0, 256, size=(num_classes, 3)).astype(np.float32)


def _encode_image(index: int, seed: int, width: int, height: int, quality: int, tint) -> bytes:
    """JPEG bytes of image ``index``: deterministic in ``(seed, index)``."""
    from PIL import Image, ImageChops

    rng = np.random.default_rng([seed, index])
    small = rng.integers(0, 256, size=(6, 8, 3)).astype(np.float32)
    small = (0.65 * small + 0.35 * tint).astype(np.uint8)
    base = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    sigma = int(rng.integers(_NOISE_SIGMA_RANGE[0], _NOISE_SIGMA_RANGE[1] + 1))
    noise = Image.frombytes("L", (width, height), rng.bytes(width * height))
    noise = noise.point(_noise_lut(sigma)).convert("RGB")
    image = ImageChops.add(base, noise, 1.0, -128)  # base + noise - 128, clipped to 0..255
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _image_path(root: Path, index: int, num_classes: int) -> Path:
    return root / f"class_{index % num_classes:03d}" / f"img_{index:07d}.jpg"


def _pool_context():
    """``fork`` where available: workers touch only numpy and PIL (never CUDA or torch), and unlike
    ``spawn`` it does not re-import the caller's ``__main__``, which in a script without an
    ``if __name__ == "__main__"`` guard would recurse."""
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def _ignore_sigint() -> None:
    # Workers leave Ctrl-C to the parent, which terminates the pool and removes the partial output.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _write_images(args: tuple) -> tuple[int, int]:
    """Worker: write images ``start..stop``; returns ``(count, bytes)``."""
    root, start, stop, num_classes, seed, width, height, quality = args
    tints = _class_tints(num_classes)
    total_bytes = 0
    for i in range(start, stop):
        data = _encode_image(i, seed, width, height, quality, tints[i % num_classes])
        _image_path(root, i, num_classes).write_bytes(data)
        total_bytes += len(data)
    return stop - start, total_bytes


def make_images(
    out: str | os.PathLike,
    n: int,
    image_size: tuple[int, int] = (500, 375),
    num_classes: int = 10,
    quality: int = 90,
    seed: int = 0,
    progress: ProgressFn | None = None,
    *,
    force: bool = False,
    workers: int | None = None,
) -> dict:
    """Write ``n`` ImageNet-like JPEGs of ``image_size`` ``(width, height)`` under ``out``.

    Layout ``out/class_XXX/img_XXXXXXX.jpg``; ``workers`` processes (default: all usable CPUs).
    Returns ``{"path", "n", "total_bytes", "mean_file_bytes", "elapsed_s", "images_per_s"}``.
    """
    if n <= 0:
        raise UsageError(f"--n must be positive, got {n}")
    if num_classes <= 0:
        raise UsageError(f"--num-classes must be positive, got {num_classes}")
    if not 1 <= quality <= 100:
        raise UsageError(f"--quality must be within 1..100, got {quality}")
    width, height = image_size
    if width < 8 or height < 8:
        raise UsageError(f"image size must be at least 8x8, got {width}x{height}")
    t0 = time.perf_counter()
    done = total_bytes = 0
    with _atomic_dir(out, force) as tmp:
        for c in range(min(num_classes, n)):
            (tmp / f"class_{c:03d}").mkdir()
        chunks = [
            (tmp, s, min(s + _CHUNK_IMAGES, n), num_classes, seed, width, height, quality)
            for s in range(0, n, _CHUNK_IMAGES)
        ]
        n_workers = min(workers or usable_cpus(), len(chunks))
        if n <= _IN_PROCESS_MAX_IMAGES or n_workers <= 1:
            results: Iterator = map(_write_images, chunks)
            pool = None
        else:
            pool = _pool_context().Pool(n_workers, initializer=_ignore_sigint)
            results = pool.imap_unordered(_write_images, chunks)
        try:
            for count, nbytes in results:
                done += count
                total_bytes += nbytes
                if progress is not None:
                    progress(done, n)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    elapsed_s = time.perf_counter() - t0
    result = {
        "path": str(Path(out).expanduser().absolute()),
        "n": n,
        "total_bytes": total_bytes,
        "mean_file_bytes": total_bytes // n,
        "elapsed_s": elapsed_s,
        "images_per_s": n / elapsed_s if elapsed_s > 0 else None,
    }
    logger.info("wrote %d images (%.1f MB) to %s in %.1f s", n, total_bytes / 1e6, out, elapsed_s)
    return result


# ---------------------------------------------------------------------------------------------
# Tokens
# ---------------------------------------------------------------------------------------------


def _zipf_cdf(vocab_size: int, exponent: float = 1.0, offset: float = 2.7) -> np.ndarray:
    # Zipf-Mandelbrot: p(rank k) ~ 1 / (k + offset)^exponent, the shape of natural-language text.
    weights = 1.0 / np.power(np.arange(vocab_size, dtype=np.float64) + offset, exponent)
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def make_tokens(
    out: str | os.PathLike,
    n_tokens: int,
    vocab_size: int = 50257,
    seed: int = 0,
    progress: ProgressFn | None = None,
    *,
    force: bool = False,
) -> dict:
    """Write ``out/tokens.bin`` (``n_tokens`` Zipf-distributed ids) and ``out/tokens.json``.

    Ids are uint16 when ``vocab_size <= 65536``, else uint32. Returns ``{"path", "n",
    "n_tokens", "vocab_size", "dtype", "total_bytes", "mean_file_bytes", "elapsed_s"}``.
    """
    if n_tokens <= 0:
        raise UsageError(f"--n must be positive, got {n_tokens}")
    if not 2 <= vocab_size <= 2**32:
        raise UsageError(f"--vocab-size must be within 2..2**32, got {vocab_size}")
    dtype = np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")
    dtype_name = "uint16" if dtype.itemsize == 2 else "uint32"
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    cdf = _zipf_cdf(vocab_size)
    with _atomic_dir(out, force) as tmp:
        with open(tmp / "tokens.bin", "wb") as f:
            written = 0
            while written < n_tokens:
                count = min(_TOKEN_CHUNK, n_tokens - written)
                ids = np.searchsorted(cdf, rng.random(count), side="right")
                np.minimum(ids, vocab_size - 1, out=ids)  # guard float round-off at the top
                f.write(ids.astype(dtype).tobytes())
                written += count
                if progress is not None:
                    progress(written, n_tokens)
        meta = {
            "vocab_size": vocab_size,
            "dtype": dtype_name,
            "n_tokens": n_tokens,
            "distribution": "zipf-mandelbrot(exponent=1.0, offset=2.7)",
            "seed": seed,
        }
        (tmp / "tokens.json").write_text(json.dumps(meta, indent=2) + "\n")
        total_bytes = (tmp / "tokens.bin").stat().st_size
    elapsed_s = time.perf_counter() - t0
    logger.info(
        "wrote %d tokens (%.1f MB) to %s in %.1f s", n_tokens, total_bytes / 1e6, out, elapsed_s
    )
    return {
        "path": str(Path(out).expanduser().absolute()),
        "n": 1,
        "n_tokens": n_tokens,
        "vocab_size": vocab_size,
        "dtype": dtype_name,
        "total_bytes": total_bytes,
        "mean_file_bytes": total_bytes,
        "elapsed_s": elapsed_s,
    }
