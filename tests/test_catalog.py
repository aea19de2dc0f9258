"""The bundled GPU catalog: required GPUs, alias matching, user overrides, bad files."""

from __future__ import annotations

import re

import pytest

from gpulens.errors import UsageError
from gpulens.predict.catalog import (
    CATALOG_DATE,
    COLUMNS,
    OPTIONAL_COLUMNS,
    find_gpu,
    gpu_catalog,
)
from gpulens.predict.instances import load_instances

REQUIRED = [
    "T4",
    "V100-SXM2",
    "A10G",
    "L4",
    "A100-40GB",
    "A100-80GB",
    "H100-SXM",
    "H100-PCIe",
    "H200",
]


def test_required_gpus_have_source_and_date():
    df = gpu_catalog()
    assert list(df.columns) == [*COLUMNS, *OPTIONAL_COLUMNS]
    for gpu in REQUIRED:
        row = df[df.gpu == gpu].iloc[0]
        assert row.source.startswith("https://") and row.date
        assert row.mem_bw_gb_s > 0 and row.fp32_tflops > 0
        # the L2 size feeds the L2 rule: a source, or a plain word that it is unverified
        assert row.l2_mb > 0 and (row.l2_source.startswith(("https://", "unverified")))
    assert df.date.max() == CATALOG_DATE


@pytest.mark.parametrize(
    "name,expected",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("h200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("A100", "A100-80GB"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2"),
        ("NVIDIA A10G", "A10G"),
    ],
)
def test_recorded_names_match_longest_alias(name, expected):
    assert find_gpu(name, recorded=True).gpu == expected


@pytest.mark.parametrize(
    "name,expected",
    [
        ("H100", "H100-SXM"),
        ("h100-sxm", "H100-SXM"),
        ("H100 PCIe", "H100-PCIe"),
        ("A100_40GB", "A100-40GB"),
        ("a100", "A100-80GB"),
        ("L4", "L4"),
        ("Tesla T4", "T4"),
        ("V100", "V100-SXM2"),
        ("A10G", "A10G"),
    ],
)
def test_typed_names_match_a_name_or_alias_whole(name, expected):
    assert find_gpu(name).gpu == expected


@pytest.mark.parametrize("typo", ["L40", "A100-40", "GH200", "H100 NVL", "H1000"])
def test_a_typed_name_that_only_contains_an_alias_is_unknown(typo):
    # the substring reading of NVML names would take L40 for an L4, H1000 for an H100
    with pytest.raises(UsageError, match=f"unknown GPU '{typo}'; known: "):
        find_gpu(typo)


def test_user_catalog_adds_and_overrides(tmp_path):
    extra = tmp_path / "mine.csv"
    extra.write_text(
        ",".join(COLUMNS) + "\n"
        "MI300X,mi300x,163.4,653.7,1307.4,1307.4,2614.9,192,5300,896,64,https://amd.com,2026-11-23\n"
        "H200,h200,1,1,1,1,1,141,4800,900,64,https://example.com,2026-11-01\n"
    )
    assert find_gpu("AMD Instinct MI300X", extra, recorded=True).mem_gb == 192
    assert find_gpu("H200", extra).bf16_tflops == 1
    assert find_gpu("H200").bf16_tflops == pytest.approx(989.4)


def test_bad_catalog_and_unknown_gpu_give_usage_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("gpu,mem_gb\nX,1\n")
    with pytest.raises(UsageError, match="lacks columns"):
        gpu_catalog(bad)
    with pytest.raises(UsageError, match="known: .*H100-SXM"):
        find_gpu("Voodoo3")
    with pytest.raises(UsageError, match="cannot read"):
        gpu_catalog(tmp_path / "missing.csv")
    binary = tmp_path / "bin.csv"
    binary.write_bytes(",".join(COLUMNS).encode() + b"\nX,\xff\xfe\n")
    with pytest.raises(UsageError, match=r"GPU catalog .*bin\.csv: not UTF-8"):
        gpu_catalog(binary)


@pytest.mark.parametrize(
    "row,fragment",
    [
        ("X1,x1,10,,20,20,,16,-8000,0,16,https://x,2026-11-26", "mem_bw_gb_s of X1 is '-8000'"),
        ("X1,x1,0,,20,20,,16,500,0,16,https://x,2026-11-26", "fp32_tflops of X1 is '0'"),
        ("X1,x1,10,,20,20,,16,inf,0,16,https://x,2026-11-26", "mem_bw_gb_s of X1 is 'inf'"),
        ("X1,x1,10,,20,20,,16,500,0,16,https://x,notadate", "date of X1 is 'notadate'"),
    ],
)
def test_a_user_catalog_with_a_bad_value_is_a_usage_error(tmp_path, row, fragment):
    user = tmp_path / "gpus.csv"
    user.write_text(",".join(COLUMNS) + "\n" + row + "\n")
    with pytest.raises(UsageError, match=re.escape(f"GPU catalog {user}: {fragment}")):
        gpu_catalog(user)


def test_a_user_catalog_without_the_optional_l2_columns_still_loads(tmp_path):
    user = tmp_path / "gpus.csv"
    user.write_text(
        ",".join(COLUMNS) + "\n" + "X1,x1,10,,20,20,,16,500,0,16,https://x,2026-11-26\n"
    )
    spec = find_gpu("X1", user)
    assert spec.l2_mb is None and spec.mem_bw_gb_s == 500


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_a_catalog_that_is_not_a_csv_is_named_by_its_format(tmp_path, suffix):
    """A YAML catalog was read as a CSV whose header lacked every column: the error listed the
    columns, not the format, as what to fix."""
    path = tmp_path / f"catalog{suffix}"
    path.write_text("- gpu: RTX4090\n  fp32_tflops: 82.6\n")
    with pytest.raises(UsageError, match=f"is a {suffix} file, and --gpu-catalog reads a CSV"):
        gpu_catalog(path)
    with pytest.raises(UsageError, match=f"is a {suffix} file, and --catalog reads a CSV"):
        load_instances(path)


def test_each_catalog_given_to_the_others_option_names_the_right_one(tmp_path):
    """An instance catalog given as a GPU catalog (predict's --catalog is its deprecated
    spelling) listed eleven missing columns; the reverse, two."""
    instances = tmp_path / "instances.csv"
    instances.write_text("provider,instance,gpu,gpus\nlab,box,H100,1\n")
    with pytest.raises(UsageError, match="is an instance catalog .*`gpulens advise --catalog`"):
        gpu_catalog(instances)
    gpus = tmp_path / "gpus.csv"
    gpus.write_text(",".join(COLUMNS) + "\n")
    with pytest.raises(UsageError, match="is a GPU catalog .*give it with --gpu-catalog"):
        load_instances(gpus)


@pytest.mark.parametrize(
    "gpu,aliases,fragment",
    [("RTX4090", "rtx 4090;h100", "'h100' names both H100-SXM and RTX4090"),
     # meant to override the H100-SXM row: another GPU beside it, never found by its name
     ("H100 SXM", "", "'h100sxm' names both H100-SXM and H100 SXM")],
)  # fmt: skip
def test_a_user_gpu_whose_name_or_alias_is_another_gpus_is_an_error(tmp_path, gpu, aliases,
                                                                    fragment):  # fmt: skip
    """--gpu h100 found the bundled H100-SXM first: the user's row went silently unused."""
    path = tmp_path / "gpus.csv"
    row = f"{gpu},{aliases},82,82,165,165,330,24,1008,0,32,https://x,2026-11-20"
    path.write_text(",".join(COLUMNS) + "\n" + row + "\n")
    with pytest.raises(UsageError, match=fragment):
        find_gpu("h100", path)
