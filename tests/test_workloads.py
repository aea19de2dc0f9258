"""Built-in workloads, datasets and data generators (CPU only, a few seconds per heavy model)."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gpulens.data import datagen
from gpulens.data.datasets import (
    SyntheticImages,
    SyntheticTokens,
    TokenFileDataset,
    build_dataset,
    describe_dataset,
    image_folder_dataset,
)
from gpulens.errors import UsageError
from gpulens.workloads.models import get_workload, list_workloads

HEAVY = {"vgg16", "vit_b_16", "gpt2"}  # > 1 s each to build and run on two CPU cores
EXPECTED = {
    "tiny_cnn",
    "resnet18",
    "resnet50",
    "mobilenet_v3_small",
    "vgg16",
    "vit_b_16",
    "gpt2",
    "gpt2_tiny",
}


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """40 generated JPEGs at the default ImageNet-like size, 4 classes."""
    out = tmp_path_factory.mktemp("data") / "imgs"
    info = datagen.make_images(out, n=40, num_classes=4, seed=1)
    return out, info


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def test_registry_holds_the_documented_workloads():
    assert {s.name for s in list_workloads()} == EXPECTED
    for spec in list_workloads():
        assert spec.task in ("image_classification", "language_model")
        assert spec.default_batch_size > 0
        if spec.is_language_model:
            assert spec.vocab_size and spec.num_classes is None and len(spec.input_shape) == 1
        else:
            assert spec.num_classes and spec.vocab_size is None and len(spec.input_shape) == 3
    assert get_workload("gpt2").input_shape == (1024,)
    assert get_workload("gpt2").vocab_size == 50257
    assert get_workload("tiny_cnn").input_shape == (3, 64, 64)
    assert get_workload("resnet50").num_classes == 1000


def test_unknown_workload_lists_the_valid_names():
    with pytest.raises(UsageError) as err:
        get_workload("resnet9000")
    msg = str(err.value)
    assert "resnet9000" in msg and "\n" not in msg
    for name in EXPECTED:
        assert name in msg


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in sorted(names)]


@pytest.mark.parametrize("name", _params(EXPECTED))
def test_forward_backward_on_cpu(name):
    spec = get_workload(name)
    torch.manual_seed(0)
    model = spec.build()
    if spec.is_language_model:
        seq = min(32, spec.seq_len)  # any length up to the context works
        x = torch.randint(spec.vocab_size, (2, seq))
        y = torch.randint(spec.vocab_size, (2, seq))
        expected_out = (2, seq, spec.vocab_size)
    else:
        # ViT needs its 224x224 patch grid (batch 1 keeps it fast; it has no BatchNorm);
        # the CNNs pool adaptively, so small inputs are fine.
        side = 224 if name == "vit_b_16" else 64
        batch = 1 if name == "vit_b_16" else 2
        x = torch.randn(batch, 3, side, side)
        y = torch.randint(spec.num_classes, (batch,))
        expected_out = (batch, spec.num_classes)
    model.train()
    out = model(x)
    assert tuple(out.shape) == expected_out
    loss = spec.loss(out, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def _lm_init_loss(name, seq=64):
    spec = get_workload(name)
    torch.manual_seed(0)
    model = spec.build().eval()
    x = torch.randint(spec.vocab_size, (2, seq))
    y = torch.randint(spec.vocab_size, (2, seq))
    with torch.no_grad():
        return spec.loss(model(x), y).item(), math.log(spec.vocab_size)


def test_tiny_lm_loss_at_init_is_ln_vocab():
    loss, expected = _lm_init_loss("gpt2_tiny")
    assert abs(loss - expected) / expected < 0.10


@pytest.mark.slow
def test_gpt2_loss_at_init_is_ln_vocab():
    loss, expected = _lm_init_loss("gpt2", seq=16)
    assert abs(loss - expected) / expected < 0.10


def test_lm_attention_is_causal():
    spec = get_workload("gpt2_tiny")
    torch.manual_seed(0)
    model = spec.build().eval()
    x = torch.randint(spec.vocab_size, (1, 24))
    x2 = x.clone()
    x2[0, 15] = (x[0, 15] + 1) % spec.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-5)
    assert (a[:, 15:] - b[:, 15:]).abs().amax() > 1e-3


def test_lm_head_is_tied_and_context_is_enforced():
    spec = get_workload("gpt2_tiny")
    model = spec.build()
    assert model.lm_head.weight is model.wte.weight
    with pytest.raises(UsageError, match="sequence length"):
        model(torch.zeros(1, spec.seq_len + 1, dtype=torch.long))


def test_replace_changes_what_build_builds():
    from dataclasses import replace

    spec = replace(get_workload("gpt2_tiny"), input_shape=(32,))
    assert spec.build().wpe.num_embeddings == 32


# ---------------------------------------------------------------------------------------------
# Synthetic datasets
# ---------------------------------------------------------------------------------------------


def test_synthetic_images_fixed_per_index():
    ds = SyntheticImages(8, (3, 16, 16), num_classes=5, seed=3)
    x0, y0 = ds[0]
    assert x0.shape == (3, 16, 16) and x0.dtype == torch.float32
    assert y0.dtype == torch.int64 and 0 <= int(y0) < 5
    assert torch.equal(ds[0][0], x0)
    assert not torch.equal(ds[1][0], x0)
    assert not torch.equal(SyntheticImages(8, (3, 16, 16), 5, seed=4)[0][0], x0)
    assert len(ds) == 8
    with pytest.raises(IndexError):
        ds[8]
    xb, yb = next(iter(DataLoader(ds, batch_size=4)))
    assert xb.shape == (4, 3, 16, 16) and yb.shape == (4,)


def test_synthetic_tokens_are_shifted_pairs():
    ds = SyntheticTokens(4, seq_len=10, vocab_size=7, seed=0)
    x, y = ds[2]
    assert x.shape == y.shape == (10,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    assert int(x.max()) < 7
    assert torch.equal(ds[2][0], x)


def test_build_dataset_synthetic_matches_spec():
    ds = build_dataset(get_workload("tiny_cnn"), "synthetic", n_synthetic=5)
    assert len(ds) == 5 and ds[0][0].shape == (3, 64, 64)
    ds = build_dataset(get_workload("resnet18"), "synthetic", 3, image_size=32)
    assert ds[0][0].shape == (3, 32, 32)
    ds = build_dataset(get_workload("gpt2_tiny"), "synthetic", 3)
    assert ds[0][0].shape == (256,)
    assert describe_dataset("synthetic")["kind"] == "synthetic"


# ---------------------------------------------------------------------------------------------
# Generated images
# ---------------------------------------------------------------------------------------------


def test_make_images_count_layout_and_size(image_dir):
    out, info = image_dir
    files = sorted(out.glob("class_*/img_*.jpg"))
    assert len(files) == info["n"] == 40
    assert sorted(p.name for p in out.iterdir()) == [f"class_{c:03d}" for c in range(4)]
    sizes = [p.stat().st_size for p in files]
    assert info["total_bytes"] == sum(sizes)
    assert info["mean_file_bytes"] == sum(sizes) // 40
    # ImageNet-like: ~100 KB each at 500x375, quality 90.
    assert 80_000 <= info["mean_file_bytes"] <= 130_000
    assert min(sizes) >= 60_000 and max(sizes) <= 160_000
    from PIL import Image

    with Image.open(files[0]) as im:
        assert im.size == (500, 375) and im.format == "JPEG" and im.mode == "RGB"
    assert not list(out.parent.glob(".imgs.partial-*"))


def test_make_images_is_deterministic_across_worker_counts(tmp_path):
    a = datagen.make_images(tmp_path / "a", n=70, image_size=(64, 48), seed=5, workers=1)
    b = datagen.make_images(tmp_path / "b", n=70, image_size=(64, 48), seed=5, workers=2)
    assert a["total_bytes"] == b["total_bytes"]
    name = "class_003/img_0000063.jpg"
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_make_images_progress_and_interrupt_leave_nothing_behind(tmp_path):
    seen = []
    datagen.make_images(
        tmp_path / "ok", n=5, image_size=(32, 32), progress=lambda d, t: seen.append((d, t))
    )
    assert seen[-1] == (5, 5)

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        datagen.make_images(
            tmp_path / "cut", n=200, image_size=(32, 32), workers=2, progress=interrupt
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]


def test_make_images_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "imgs"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="--force"):
        datagen.make_images(out, n=2, image_size=(32, 32))
    assert (out / "keep.txt").exists()
    datagen.make_images(out, n=2, image_size=(32, 32), force=True)
    assert not (out / "keep.txt").exists() and len(list(out.glob("*/*.jpg"))) == 2
    (tmp_path / "empty").mkdir()  # an empty directory is fine without --force
    datagen.make_images(tmp_path / "empty", n=1, image_size=(32, 32))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="--out"):
        datagen.make_images(tmp_path / "afile", n=1, force=True)


def test_stale_partial_output_is_cleaned_up(tmp_path):
    stale = tmp_path / ".imgs.partial-999999999"  # no such pid
    stale.mkdir()
    datagen.make_images(tmp_path / "imgs", n=1, image_size=(32, 32))
    assert not stale.exists()


def test_image_folder_dataset_reads_generated_images(image_dir):
    out, _ = image_dir
    ds = build_dataset(get_workload("tiny_cnn"), str(out), n_synthetic=0)
    assert len(ds) == 40 and len(ds.classes) == 4
    x, y = ds[5]
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    assert isinstance(y, int) and 0 <= y < 4
    assert -3.0 < float(x.mean()) < 3.0  # normalized with ImageNet statistics
    ds = image_folder_dataset(out, image_size=224, train=False)
    assert ds[0][0].shape == (3, 224, 224)
    xb, yb = next(iter(DataLoader(ds, batch_size=4)))
    assert xb.shape == (4, 3, 224, 224) and yb.dtype == torch.int64
    info = describe_dataset(out)
    assert info["kind"] == "image_folder" and info["n_files"] == 40 and info["n_classes"] == 4
    assert info["total_bytes"] == sum(p.stat().st_size for p in out.glob("*/*.jpg"))


def test_image_root_with_splits_uses_the_right_one(tmp_path):
    datagen.make_images(tmp_path / "root" / "train", n=4, image_size=(32, 32), num_classes=2)
    datagen.make_images(tmp_path / "root" / "val", n=2, image_size=(32, 32), num_classes=2)
    assert len(image_folder_dataset(tmp_path / "root", 16, train=True)) == 4
    assert len(image_folder_dataset(tmp_path / "root", 16, train=False)) == 2


def test_image_dataset_errors_name_the_fix(tmp_path):
    with pytest.raises(UsageError, match="does not exist.*gpulens data make images --out"):
        image_folder_dataset(tmp_path / "nope", 64)
    (tmp_path / "empty" / "class_a").mkdir(parents=True)
    with pytest.raises(UsageError, match="holds no images.*gpulens data make images --out"):
        image_folder_dataset(tmp_path / "empty", 64)
    flat = tmp_path / "flat"
    flat.mkdir()
    datagen.make_images(tmp_path / "src", n=2, image_size=(32, 32))
    for p in (tmp_path / "src").glob("*/*.jpg"):
        p.rename(flat / p.name)
    with pytest.raises(UsageError, match="no class subfolders.*class_000"):
        image_folder_dataset(flat, 64)
    with pytest.raises(UsageError, match="is a file"):
        image_folder_dataset(flat / "img_0000000.jpg", 64)
    too_many = tmp_path / "many"
    datagen.make_images(too_many, n=12, image_size=(32, 32), num_classes=12)
    with pytest.raises(UsageError, match="at most 10 class folders"):
        build_dataset(get_workload("tiny_cnn"), str(too_many), 0)


# ---------------------------------------------------------------------------------------------
# Token files
# ---------------------------------------------------------------------------------------------


def test_token_file_round_trip(tmp_path):
    out = tmp_path / "tok"
    info = datagen.make_tokens(out, n_tokens=10_000, vocab_size=1000, seed=2)
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["vocab_size"] == 1000 and meta["dtype"] == "uint16"
    raw = np.fromfile(out / "tokens.bin", dtype="<u2")
    assert raw.size == 10_000 == info["n_tokens"] and info["total_bytes"] == 20_000
    assert raw.max() < 1000
    counts = np.bincount(raw, minlength=1000)
    assert counts[0] == counts.max() and counts[:10].sum() > counts[500:].sum() / 4  # Zipf-ish

    for path in (out, out / "tokens.bin"):
        ds = TokenFileDataset(path, seq_len=64)
        assert len(ds) == (10_000 - 1) // 64
        x, y = ds[3]
        assert x.dtype == torch.int64 and x.shape == y.shape == (64,)
        assert np.array_equal(x.numpy(), raw[192:256]) and np.array_equal(y.numpy(), raw[193:257])
    ds[len(ds) - 1]  # the last window fits
    with pytest.raises(IndexError):
        ds[len(ds)]
    clone = pickle.loads(pickle.dumps(ds))  # for DataLoader workers: no mapped data pickled
    assert len(pickle.dumps(ds)) < 2000 and torch.equal(clone[3][0], x)
    desc = describe_dataset(out)
    assert desc["kind"] == "token_file" and desc["n_tokens"] == 10_000
    assert desc["vocab_size"] == 1000


def test_build_dataset_for_lm_reads_tokens(tmp_path):
    from dataclasses import replace

    datagen.make_tokens(tmp_path / "tok", n_tokens=5_000, vocab_size=8192)
    spec = replace(get_workload("gpt2_tiny"), input_shape=(32,))
    ds = build_dataset(spec, str(tmp_path / "tok"), n_synthetic=0)
    assert len(ds) == (5_000 - 1) // 32 and ds[0][0].shape == (32,)
    datagen.make_tokens(tmp_path / "big", n_tokens=100, vocab_size=50257)
    with pytest.raises(UsageError, match="--vocab-size 8192"):
        build_dataset(spec, str(tmp_path / "big"), 0)


def test_token_errors_name_the_fix(tmp_path):
    with pytest.raises(UsageError, match="does not exist.*gpulens data make tokens"):
        TokenFileDataset(tmp_path / "nope", 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no tokens.bin.*gpulens data make tokens"):
        TokenFileDataset(tmp_path / "empty", 16)
    datagen.make_tokens(tmp_path / "short", n_tokens=10, vocab_size=100)
    with pytest.raises(UsageError, match="fewer than one sample.*gpulens data make tokens"):
        TokenFileDataset(tmp_path / "short", 16)
    with pytest.raises(UsageError, match="--force"):
        datagen.make_tokens(tmp_path / "short", n_tokens=10, vocab_size=100)
    with pytest.raises(UsageError, match="--n must be positive"):
        datagen.make_tokens(tmp_path / "zero", n_tokens=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "short"]


def test_collocated_training_uses_the_optimizer_of_gpulens_run():
    """The colocate worker and `gpulens run` had drifted (ViT: SGD vs AdamW)."""
    import torch

    from gpulens.workloads.colocate_job import _Job
    from gpulens.workloads.jobspec import parse_job
    from gpulens.workloads.models import get_workload
    from gpulens.workloads.recipe import optimizer_for

    for name in ("vit_b_16", "tiny_cnn"):
        spec = get_workload(name)
        want = type(optimizer_for(spec, torch.nn.Linear(2, 2)))
        job = _Job(parse_job(f"{name}:batch=1"), torch.device("cpu"), priority=None, seed=0)
        assert type(job.opt) is want, name
