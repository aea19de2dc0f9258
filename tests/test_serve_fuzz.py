"""A schemathesis run against `gpulens serve`'s own OpenAPI description: no 5xx, every status,
content type and body as documented, a 405 names its Allow header.

``positive_data_acceptance`` is left out: the schema cannot say that ``data`` must hold
prod(shape) numbers of the model's shape, so most schema-valid bodies rightly get a 400."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("schemathesis")

from serve_server import ServeThread  # noqa: E402


@pytest.mark.slow
def test_schemathesis_finds_nothing_against_the_openapi_description(tmp_path):
    cli = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    with ServeThread(tmp_path / "runs", models=("identity", "tiny_cnn"), max_body_mb=1) as srv:
        out = subprocess.run(
            [cli, "run", f"{srv.url}/v2/openapi.json", "--checks", "all",
             "--exclude-checks", "positive_data_acceptance", "--max-examples", "25",
             "--max-time", "20", "--seed", "1", "--report-dir", str(tmp_path / "report")],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert srv.get("/v2/health/live")[0] == 200  # still serving after the fuzzing
        row = {"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}
        assert srv.infer("identity", {"inputs": [row]})[0] == 200
    assert out.returncode == 0, out.stdout[-4000:]
    assert "generated" in out.stdout
    assert srv.outcome.summary["failures"] > 0  # it did send bad requests that were refused
