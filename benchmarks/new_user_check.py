"""Issue 12 on a GPU machine: what a new user meets, checked in one call.

Each case runs a gpulens command the way a user would (a fresh ``GPULENS_HOME``, stderr not a
terminal) and records its exit code, wall time, the first stderr line, whether stdout held exactly
one JSON document when ``--json`` was given, and case-specific facts (children left alive, per-rank
series, skipped samples). A plain PyTorch loop runs beside ``gpulens run`` on the same model in the
same call, interleaved, so the summary's sampler CPU figure can be read against a measured
slowdown.

    python benchmarks/new_user_check.py --out DIR [--only NAME,...] [--quick]

Prints a table last and writes ``DIR/new_user_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def gl(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpulens.cli", *args]


def run_case(name: str, cmd: list[str], env: dict, timeout_s: float = 300, stdin=None) -> dict:
    """Run one command to completion; return what a user would see."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=stdin
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    wall_s = time.perf_counter() - t0
    doc = None
    json_docs = None
    if "--json" in cmd:
        lines = [ln for ln in out.splitlines() if ln.strip()]
        json_docs = 0
        try:
            doc = json.loads(out)
            json_docs = 1
        except ValueError:
            json_docs = len(lines)
    err_lines = [ln for ln in err.splitlines() if ln.strip()]
    return {
        "name": name,
        "command": " ".join(cmd[2:] if cmd[:3] == gl()[:3] else cmd),
        "rc": rc,
        "wall_s": round(wall_s, 2),
        "stderr_first": err_lines[0][:200] if err_lines else "",
        "stderr_last": err_lines[-1][:200] if err_lines else "",
        "traceback": "Traceback (most recent call last)" in err,
        "internal_error": "internal error" in err,
        "json_docs": json_docs,
        "doc": doc,
        "stderr_lines": len(err_lines),
    }


def plain_loop(model_name: str, batch: int, steps: int) -> float:
    """A plain PyTorch loop (no gpulens): resnet bf16 autocast, channels_last, SGD."""
    import torch
    import torchvision

    dev = torch.device("cuda")
    model = getattr(torchvision.models, model_name)().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)
    for i in range(steps + 20):
        if i == 20:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - t0)


def children_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def kill9_wrapper(env: dict, argv: list[str], settle_s: float = 8.0) -> dict:
    """Start a gpulens wrapper, SIGKILL it once its child runs, report whether children died."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(settle_s)
    kids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and children_alive(kids):
        time.sleep(0.2)
    left = children_alive(kids)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {"children_before_kill": len(kids), "children_left_after_10s": len(left)}


def sigint_run(env: dict, argv: list[str], after_s: float) -> dict:
    """Ctrl-C a run after ``after_s``: exit code, traceback on stderr, record status."""
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal sends SIGINT to the whole group
    out, err = proc.communicate(timeout=60)
    return {
        "rc": proc.returncode,
        "traceback": "Traceback" in err,
        "stderr_last": (err.strip().splitlines() or [""])[-1][:200],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--pairs", type=int, default=3, help="plain/gpulens pairs for resnet50")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    home = Path(tempfile.mkdtemp(prefix="gpulens-home-"))
    env = {**os.environ, "GPULENS_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    work = Path(tempfile.mkdtemp(prefix="gpulens-nu-"))
    results: list[dict] = []
    import torch

    n_gpus = torch.cuda.device_count()

    def want(name: str) -> bool:
        return not only or name in only

    def add(case: dict) -> None:
        results.append(case)
        print(
            f"{case['name']:<34} rc={case.get('rc')} {case.get('wall_s', '')}s "
            f"{case.get('stderr_last', '')[:90]}",
            file=sys.stderr,
            flush=True,
        )

    # --- set-up and the CLI -----------------------------------------------------------------
    for name, cmd in [
        ("help", gl("--help")),
        ("version", gl("--version")),
        ("doctor_json", gl("doctor", "--json")),
        ("bogus_flag", gl("run", "resnet18", "--bogus-flag")),
        ("steps_abc", gl("run", "resnet18", "--steps", "abc")),
        ("unknown_command", gl("frobnicate")),
        ("stalls_no_data", gl("stalls", "resnet18")),
        ("bogus_flag_json", gl("run", "resnet18", "--bogus-flag", "--json")),
    ]:
        if want(name):
            add(run_case(name, cmd, env, 120))
    if want("demo"):
        add(run_case("demo", gl("demo", "--json"), env, 300))

    # --- data: corrupt images, tokens ---------------------------------------------------------
    img = work / "img"
    if want("corrupt_images") or want("skip_bad") or want("stalls_gpus_missing"):
        add(
            run_case(
                "data_make_images",
                gl("data", "make", "images", "--out", str(img), "--n", "3000", "--json"),
                env,
                300,
            )
        )
        files = sorted(p for p in img.rglob("*.jpg"))
        files[5].write_bytes(b"")  # zero bytes
        files[50].write_bytes(files[50].read_bytes()[:300])  # truncated
        files[500].write_text("not an image")
    if want("corrupt_images"):
        add(
            run_case(
                "corrupt_images",
                gl(
                    "run",
                    "resnet18",
                    "--data",
                    str(img),
                    "--workers",
                    "4",
                    "--steps",
                    "60",
                    "--no-store",
                    "--json",
                ),
                env,
                300,
            )
        )
    if want("skip_bad"):
        case = run_case(
            "skip_bad",
            gl(
                "run",
                "resnet18",
                "--data",
                str(img),
                "--workers",
                "4",
                "--duration",
                "25",
                "--skip-bad-samples",
                "--no-store",
                "--json",
            ),
            env,
            300,
        )
        doc = case.get("doc") or {}
        case["skipped_samples"] = doc.get("skipped_samples")
        add(case)
    if want("stalls_gpus_missing"):
        add(
            run_case(
                "stalls_gpus_missing",
                gl("stalls", "resnet18", "--data", str(img), "--gpus", str(n_gpus + 1), "--json"),
                env,
                300,
            )
        )
    tok = work / "tok"
    if want("tokens_out_of_vocab"):
        add(
            run_case(
                "data_make_tokens",
                gl(
                    "data",
                    "make",
                    "tokens",
                    "--out",
                    str(tok),
                    "--n",
                    "2000000",
                    "--vocab-size",
                    "60000",
                ),
                env,
                300,
            )
        )
        add(
            run_case(
                "tokens_out_of_vocab",
                gl("run", "gpt2", "--data", str(tok), "--steps", "20", "--no-store", "--json"),
                env,
                300,
            )
        )

    # --- processes -------------------------------------------------------------------------
    if want("kill9_command"):
        facts = kill9_wrapper(
            env, gl("run", "--no-store", "--", sys.executable, "-c", "import time; time.sleep(120)")
        )
        add({"name": "kill9_command", "rc": "-9", **facts})
    if want("ctrl_c_run"):
        facts = sigint_run(env, gl("run", "resnet18", "--duration", "60", "--no-store"), 20)
        add({"name": "ctrl_c_run", **facts})
    if want("colocate_missing_cmd"):
        add(
            run_case(
                "colocate_missing_cmd",
                gl("colocate", "cmd:nonexistent_cmd_xyz", "resnet18", "--json"),
                env,
                120,
            )
        )
    if want("colocate_failing_cmd"):
        add(
            run_case(
                "colocate_failing_cmd",
                gl(
                    "colocate",
                    "cmd:false",
                    "cmd:true",
                    "--mechanisms",
                    "time-slice",
                    "--duration",
                    "5",
                    "--json",
                ),
                env,
                300,
            )
        )

    # --- the tracker under torchrun -----------------------------------------------------------
    if want("torchrun_wrapped") and n_gpus >= 2:
        case = run_case(
            "torchrun_wrapped",
            gl(
                "run",
                "--no-store",
                "--json",
                "--",
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                str(ROOT / "examples/train_tracked.py"),
            ),
            env,
            300,
        )
        doc = case.get("doc") or {}
        case["world_size"] = doc.get("world_size")
        case["ranks_reported"] = len(doc.get("ranks") or [])
        case["stragglers"] = doc.get("stragglers")
        add(case)
    if want("torchrun_standalone") and n_gpus >= 2:
        before = set((home / "runs").glob("*")) if (home / "runs").is_dir() else set()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        case = run_case(
            "torchrun_standalone", [*cmd, str(ROOT / "examples/train_tracked.py")], env, 300
        )
        new = sorted(set((home / "runs").glob("*")) - before)
        case["records"] = len(new)
        if new:
            meta = json.loads((new[-1] / "run.json").read_text())
            case["record_status"] = meta.get("status")
            case["world_size"] = (meta.get("summary") or {}).get("world_size")
        add(case)

    # --- the summary's sampler figure against a measured slowdown ------------------------------
    if want("resnet50_vs_plain"):
        pairs = []
        for _ in range(args.pairs):
            plain = plain_loop("resnet50", 256, 150)
            case = run_case(
                "resnet50_gpulens",
                gl(
                    "run",
                    "resnet50",
                    "--precision",
                    "bf16",
                    "--batch-size",
                    "256",
                    "--steps",
                    "150",
                    "--no-store",
                    "--json",
                ),
                env,
                300,
            )
            doc = case.get("doc") or {}
            pairs.append(
                {
                    "plain_samples_per_s": round(plain, 1),
                    "gpulens_samples_per_s": doc.get("throughput_samples_per_s"),
                    "sampler_cpu_pct_of_core": doc.get("sampler_cpu_pct_of_core"),
                    "tracking_us_per_step": doc.get("tracking_us_per_step"),
                    "rc": case["rc"],
                }
            )
        ratios = [
            p["gpulens_samples_per_s"] / p["plain_samples_per_s"]
            for p in pairs
            if p["gpulens_samples_per_s"]
        ]
        add(
            {
                "name": "resnet50_vs_plain",
                "rc": 0,
                "pairs": pairs,
                "ratio_median": sorted(ratios)[len(ratios) // 2] if ratios else None,
            }
        )

    doc = {
        "command": "python benchmarks/new_user_check.py " + " ".join(sys.argv[1:]),
        "date": date.today().isoformat(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(n_gpus)],
        "torch": torch.__version__,
        "cases": results,
    }
    (args.out / "new_user_check.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"\n{'case':<28} {'rc':>6} {'wall_s':>7}  what the user saw")
    for c in results:
        seen = c.get("stderr_last") or c.get("stderr_first") or ""
        extra = {
            k: c[k]
            for k in (
                "children_left_after_10s",
                "skipped_samples",
                "ratio_median",
                "traceback",
                "json_docs",
                "world_size",
                "ranks_reported",
                "records",
                "record_status",
            )
            if k in c
        }
        print(
            f"{c['name']:<28} {str(c.get('rc')):>6} {str(c.get('wall_s', '')):>7}  "
            f"{seen[:70]} {extra}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
