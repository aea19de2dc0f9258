"""Bad data: undecodable images, token files that do not fit the model or their sidecar, and
options that cannot work, each a one-line error naming the file and the fix (or skipped and
counted where the user asked for it)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from gpulens.cli import main

RUN = ["--device", "cpu", "--steps", "3", "--batch-size", "4", "--no-store"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def good_images(tmp_path_factory):
    from gpulens.data.datagen import make_images

    out = tmp_path_factory.mktemp("bad") / "good"
    make_images(out, 16, image_size=(64, 48), num_classes=4)
    return out


def _damaged(tmp_path, good, how: str):
    import shutil

    root = tmp_path / how
    shutil.copytree(good, root)
    bad = root / "class_001" / "img_0000005.jpg"
    if how == "empty":
        bad.write_bytes(b"")
    elif how == "truncated":
        bad.write_bytes(bad.read_bytes()[:300])
    elif how == "text":
        bad.write_text("this is not an image\n")
    elif how == "garbage":
        bad.write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(400))
    return root, bad


@pytest.mark.parametrize(
    ("how", "workers"),
    [("empty", "1"), ("truncated", "1"), ("text", "1"), ("garbage", "0")],
)
def test_an_undecodable_image_stops_the_run_with_one_line_naming_it(
    capsys, tmp_path, good_images, how, workers
):
    root, bad = _damaged(tmp_path, good_images, how)
    code = main(["run", "tiny_cnn", "--data", str(root), "--workers", workers, *RUN])
    line = _one_line_error(capsys)
    assert code == 2
    assert str(bad) in line and "--skip-bad-samples" in line and "remove the file" in line


def test_the_error_crosses_the_worker_boundary_as_a_gpulens_error(tmp_path, good_images):
    import torch

    from gpulens.data.bad_samples import BadSampleError
    from gpulens.data.datasets import image_folder_dataset

    root, bad = _damaged(tmp_path, good_images, "truncated")
    ds = image_folder_dataset(root, 32)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=1)
    with pytest.raises(BadSampleError) as info:
        next(iter(loader))
    message = str(info.value)
    assert message.startswith(f"cannot decode image {bad} (")  # PIL's reason in brackets
    assert "\n" not in message and info.value.exit_code == 2


def test_skipping_bad_images_keeps_full_batches_and_counts_them(tmp_path, good_images):
    from gpulens.workloads.config import TrainConfig
    from gpulens.workloads.train import run_training

    root, bad = _damaged(tmp_path, good_images, "empty")
    (root / "class_002" / "img_0000002.jpg").write_text("not an image")
    config = TrainConfig(
        "tiny_cnn", data=str(root), device="cpu", steps=6, warmup_steps=2, batch_size=4,
        workers=1, skip_bad_samples=True, prep_timing=True, loader_probe=True,
    )  # fmt: skip
    result = run_training(config, tmp_path / "runs")
    s = result.summary
    # the loader probe after the run read samples too (bad ones among them): none is counted
    scaling = json.loads((result.record_dir / "run.json").read_text())["loader_scaling"]
    assert scaling["processes"][0] == 1 and min(scaling["samples_per_s_per_process"]) > 0
    # 8 steps of 4 from 16 files: both bad ones met at least once, each replaced
    assert s["skipped_samples"] >= 2
    assert s["skipped_files_total"] == 2
    assert set(s["skipped_files"]) == {str(bad), str(root / "class_002" / "img_0000002.jpg")}
    assert s["measured_steps"] == 6 and s["global_batch_size"] == 4
    low, high = s["throughput_ci95_samples_per_s"]
    assert 0 < low <= s["throughput_samples_per_s"] <= high


def test_without_skipping_the_summary_counts_nothing(tmp_path, good_images):
    from gpulens.workloads.config import TrainConfig
    from gpulens.workloads.train import run_training

    config = TrainConfig("tiny_cnn", data=str(good_images), device="cpu", steps=2,
                         warmup_steps=1, batch_size=4, workers=0)  # fmt: skip
    s = run_training(config, tmp_path / "runs").summary
    assert s["skipped_samples"] is None and s["skipped_files"] is None


def test_a_skipped_sample_is_replaced_from_its_own_half_in_a_paired_run(tmp_path, good_images):
    from gpulens.data.datasets import image_folder_dataset

    root, bad = _damaged(tmp_path, good_images, "text")
    log = tmp_path / "skipped.tsv"
    ds = image_folder_dataset(root, 32, skip_bad_samples=True, skip_log=log)
    index = [p for p, _ in ds.samples].index(str(bad))
    mask = np.zeros(len(ds), dtype=bool)
    mask[index] = mask[(index + 3) % len(ds)] = True  # the next cold sample is 3 further on
    ds.emulate_only(mask)
    x, _ = ds[index]
    assert tuple(x.shape) == (3, 32, 32)
    assert ds._bad == {index}
    ds[index]  # a known bad index is not read again
    assert log.read_text().splitlines() == [f"{bad}\tnot an image PIL can read"]


def test_too_many_bad_images_in_a_row_is_an_error(tmp_path):
    from gpulens.data.bad_samples import BadSampleError
    from gpulens.data.datasets import image_folder_dataset

    for i in range(3):
        (tmp_path / "imgs" / "a").mkdir(parents=True, exist_ok=True)
        (tmp_path / "imgs" / "a" / f"{i}.jpg").write_bytes(b"")
    ds = image_folder_dataset(tmp_path / "imgs", 32, skip_bad_samples=True)
    with pytest.raises(BadSampleError, match="cannot be decoded: the dataset looks damaged"):
        ds[0]


# ------------------------------------------------------------------------------------ tokens
@pytest.fixture()
def tokens(tmp_path):
    from gpulens.data.datagen import make_tokens

    out = tmp_path / "tokens"
    make_tokens(out, 20_000, vocab_size=8192)
    return out


def test_a_token_id_outside_the_vocabulary_names_file_id_and_fix(capsys, tmp_path):
    from gpulens.data.datagen import make_tokens

    tokens = tmp_path / "few"
    make_tokens(tokens, 4 * 256 + 1, vocab_size=8192)  # 4 windows of 256: one batch, all read
    ids = np.memmap(tokens / "tokens.bin", dtype="<u2", mode="r+")
    ids[700] = 9000
    ids.flush()
    del ids
    code = main(["run", "gpt2_tiny", "--data", str(tokens), "--workers", "1", *RUN])
    line = _one_line_error(capsys)
    assert code == 2
    assert f"{tokens / 'tokens.bin'} holds token id 9000 at token 700" in line
    assert "(8192 ids)" in line and "--vocab-size 8192" in line


def test_a_token_file_without_sidecar_is_checked_against_the_model(tokens):
    from gpulens.data.bad_samples import BadSampleError
    from gpulens.data.tokens import TokenFileDataset

    (tokens / "tokens.json").unlink()
    ids = np.memmap(tokens / "tokens.bin", dtype="<u2", mode="r+")
    ids[5] = 60_000
    ids.flush()
    del ids
    ds = TokenFileDataset(tokens, 64, vocab_size=8192)
    with pytest.raises(BadSampleError, match="token id 60000 at token 5, outside the model's"):
        ds[0]
    ds[1]  # the other windows are fine


def test_a_token_file_shorter_than_its_sidecar_says_is_an_error(capsys, tokens):
    data = (tokens / "tokens.bin").read_bytes()
    (tokens / "tokens.bin").write_bytes(data[:30_000])
    code = main(["run", "gpt2_tiny", "--data", str(tokens), *RUN])
    line = _one_line_error(capsys)
    assert code == 2
    assert "holds 15000 tokens (30000 bytes) but tokens.json says 20000" in line
    assert "truncated" in line and "gpulens data make tokens" in line


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_tokens": "many"}, "has n_tokens 'many', not a count"),
        ({"vocab_size": 1}, "has vocab_size 1, not an integer of 2 or more"),
    ],
)
def test_a_sidecar_that_makes_no_sense_is_an_error(tokens, change, message):
    from gpulens.data.tokens import TokenFileDataset
    from gpulens.errors import UsageError

    meta = json.loads((tokens / "tokens.json").read_text())
    (tokens / "tokens.json").write_text(json.dumps({**meta, **change}))
    with pytest.raises(UsageError, match=message):
        TokenFileDataset(tokens, 64)


def test_a_token_file_cut_inside_an_id_is_an_error(tokens):
    from gpulens.data.tokens import TokenFileDataset
    from gpulens.errors import UsageError

    data = (tokens / "tokens.bin").read_bytes()
    (tokens / "tokens.bin").write_bytes(data[:-1])
    with pytest.raises(UsageError, match="not a whole number of uint16 ids"):
        TokenFileDataset(tokens, 64)
