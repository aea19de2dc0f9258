"""Issue 15 on a GPU: one loop timed two ways, and the stall breakdown of unmodified scripts.

agreement: examples/train_tracked.py run under `gpulens run --` with its two tracker lines
  (the tracking API) and with --no-track (no gpulens in the script: steps injected), interleaved
  (AB, BA, ...), at each --workers setting. Per pair: injected/tracked throughput (gpulens's
  figure both times) and the data-wait share difference in points; median and 95% interval.
stalls: `gpulens stalls --data DIR -- python examples/train_tracked.py --no-track --data DIR`
  beside the same with the tracker lines, and, where --imagenet-script is given, that public
  script (pytorch/examples imagenet/main.py, unmodified) over a folder of generated JPEGs.
prometheus: `gpulens run resnet50 --precision bf16 -b 256 --duration S` with and without
  --prometheus-port while /metrics is scraped every second, interleaved; the last scrape kept.

    PYTHONPATH=src python benchmarks/unmodified_check.py agreement --pairs 3 --out a.json
    PYTHONPATH=src python benchmarks/unmodified_check.py stalls --imagenet-script main.py
    PYTHONPATH=src python benchmarks/unmodified_check.py prometheus --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPULENS = [sys.executable, "-m", "gpulens.cli"]


def interval95(xs: list[float]) -> list[float] | None:
    from gpulens.stats import t95

    if len(xs) < 2:
        return None
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    h = t95(len(xs) - 1) * sd / len(xs) ** 0.5
    return [round(m - h, 4), round(m + h, 4)]


def gpulens_json(args: list[str], env: dict[str, str], timeout_s: float = 580, cwd=None) -> dict:
    proc = subprocess.run([*GPULENS, *args], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=cwd)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"gpulens {' '.join(args)} exited {proc.returncode}: {proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout)


def make_files(root: Path, n: int, size: int = 4096) -> Path:
    """``n`` files of random bytes in 10 class folders (what train_tracked.py reads)."""
    if root.exists():
        return root
    for i in range(n):
        folder = root / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:06d}.bin").write_bytes(os.urandom(size))
    return root


def make_fake_mnist(data: Path, n_train: int, n_test: int) -> Path:
    """MNIST's four idx files (random pixels and labels) where torchvision looks for them, so
    pytorch/examples mnist/main.py runs unmodified with no download."""
    import numpy as np

    raw = data / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        header = np.array([2051, n, 28, 28], dtype=">i4").tobytes()
        pixels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8).tobytes()
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(header + pixels)
        labels = rng.integers(0, 10, n, dtype=np.uint8).tobytes()
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            np.array([2049, n], ">i4").tobytes() + labels
        )
    return raw


def data_wait_share(doc: dict) -> float | None:
    phases = doc.get("phases_s") or {}
    if not phases.get("step"):
        return None
    return 100.0 * (phases.get("data_wait") or 0.0) / phases["step"]


# --------------------------------------------------------------------------- agreement
AGREEMENT_CASES = {
    # GPU-bound (fp32 8192-wide MLP, ~16 ms of GPU work a step on an H100, far more than the
    # loader's collation of 512 rows): throughput steady to well under 1%
    "gpu_bound": "--width 8192 --depth 4 --batch-size 512 --epochs 20 --workers 0",
    # GPU-bound over the script's own files: 4 loader workers keep ahead of ~13 ms GPU steps
    "files_gpu": "--data {files} --workers 4 --batch-size 512 --width 8192 --depth 4 --epochs 6",
    # loader-bound: the script's file reads in 4 worker processes (data wait most of the step)
    "files_w4": "--data {files} --workers 4 --epochs 6 --batch-size 128",
    "files_w0": "--data {files} --workers 0 --epochs 1 --batch-size 128",
}


def agreement(args, env, out: dict) -> None:
    files = make_files(Path(args.work) / "files", args.files)
    base = [sys.executable, str(ROOT / "examples" / "train_tracked.py")]
    rows = []
    cases = args.agreement_cases
    for case in cases:
        case_args = AGREEMENT_CASES[case].format(files=files).split()
        for pair in range(args.pairs):
            order = ("tracked", "injected") if pair % 2 == 0 else ("injected", "tracked")
            got = {}
            for how in order:
                extra = ["--no-track"] if how == "injected" else []
                cmd = [*base, *case_args, *extra]
                doc = gpulens_json(["run", "--no-store", "--json", "--", *cmd], env)
                got[how] = {
                    "throughput": doc.get("throughput_samples_per_s"),
                    "steps": doc.get("measured_steps"),
                    "data_wait_pct": data_wait_share(doc),
                    "ci95_pct": doc.get("throughput_ci95_pct"),
                }
            ratio = got["injected"]["throughput"] / got["tracked"]["throughput"]
            diff = got["injected"]["data_wait_pct"] - got["tracked"]["data_wait_pct"]
            rows.append({"case": case, "pair": pair, "order": list(order), **got,
                         "ratio": ratio, "data_wait_diff_pp": diff})  # fmt: skip
            waits = (
                f"{got['tracked']['data_wait_pct']:.1f}% vs {got['injected']['data_wait_pct']:.1f}%"
            )
            print(f"agreement {case} pair {pair}: ratio {ratio:.4f}, data wait {waits}, "
                  f"runs {got}", file=sys.stderr, flush=True)  # fmt: skip
            if args.out:  # pairs measured so far survive a time limit
                Path(args.out).write_text(json.dumps({"agreement_pairs": rows}, indent=1))
    summary = {}
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        ratios = [r["ratio"] for r in mine]
        diffs = [r["data_wait_diff_pp"] for r in mine]
        summary[case] = {
            "script_args": AGREEMENT_CASES[case],
            "ratio_median": statistics.median(ratios), "ratio_ci95": interval95(ratios),
            "data_wait_diff_pp_median": statistics.median(diffs),
            "data_wait_diff_pp_ci95": interval95(diffs),
            "data_wait_pct_tracked_median": statistics.median(
                r["tracked"]["data_wait_pct"] for r in mine),
            "run_ci95_pct_median": statistics.median(
                r[h]["ci95_pct"] for r in mine for h in ("tracked", "injected")
                if r[h]["ci95_pct"] is not None),
        }  # fmt: skip
    out["agreement"] = {"script": "examples/train_tracked.py", "pairs": rows, "summary": summary}


# ------------------------------------------------------------------------------ stalls
def stalls(args, env, out: dict) -> None:
    files = make_files(Path(args.work) / "files", args.files)
    script = [sys.executable, str(ROOT / "examples" / "train_tracked.py"), "--data", str(files),
              "--epochs", str(args.epochs), "--workers", "4"]  # fmt: skip
    results = {}
    for how, extra in (("tracked", []), ("injected", ["--no-track"])) * args.train_tracked_stalls:
        t = time.perf_counter()
        doc = gpulens_json(["stalls", "--data", str(files), "--no-store", "--json", "--",
                            *script, *extra], env)  # fmt: skip
        results[f"train_tracked-{how}"] = {"wall_s": time.perf_counter() - t, "result": doc}
        print(f"stalls train_tracked {how}: {doc.get('breakdown_pct')}", file=sys.stderr,
              flush=True)  # fmt: skip
    if args.imagenet_script:
        images = Path(args.work) / "imagenet"
        if not images.exists():
            t = time.perf_counter()
            gpulens_json(["data", "make", "images", "--out", str(images / "train"),
                          "--n", str(args.images), "--json"], env)  # fmt: skip
            (images / "val").symlink_to(images / "train")
            results["imagenet_make_images_s"] = time.perf_counter() - t
        script = str(Path(args.imagenet_script).resolve())
        cmd = [sys.executable, script, str(images), "-a", "resnet50", "-b", "256",
               "--epochs", "2", "--workers", str(args.imagenet_workers),
               "--print-freq", "100000", "--gpu", "0"]  # fmt: skip
        t = time.perf_counter()
        doc = gpulens_json(["stalls", "--data", str(images / "train"), "--no-store", "--json",
                            "--", *cmd], env)  # fmt: skip
        results["imagenet_main"] = {"wall_s": time.perf_counter() - t, "command": cmd[1:],
                                    "result": doc}  # fmt: skip
        print(f"stalls imagenet main.py: {doc.get('breakdown_pct')}", file=sys.stderr, flush=True)
    if args.mnist_script:
        work = Path(args.work) / "mnist"
        raw = make_fake_mnist(work / "data", args.mnist_n, max(1000, args.mnist_n // 6))
        (work / "cwd").mkdir(exist_ok=True)  # the script reads '../data'
        script = str(Path(args.mnist_script).resolve())
        cmd = [sys.executable, script, "--epochs", "1", "--log-interval", "100000"]
        stalls_args = ["stalls", "--data", str(raw), "--no-store", "--json", "--", *cmd]
        for what, gl_args in (
            ("mnist_main-run", ["run", "--no-store", "--json", "--", *cmd]),
            ("mnist_main-stalls", stalls_args),
        ):
            t = time.perf_counter()
            doc = gpulens_json(gl_args, env, cwd=work / "cwd")
            results[what] = {"wall_s": time.perf_counter() - t, "command": cmd[1:], "result": doc}
            figure = doc.get("breakdown_pct") or doc.get("throughput_samples_per_s")
            print(f"{what}: {figure}", file=sys.stderr, flush=True)
    out["stalls"] = results


# -------------------------------------------------------------------------- prometheus
def scrape_until(url: str, stop: threading.Event, kept: dict) -> None:
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                kept["last"] = resp.read().decode()
                kept["scrapes"] = kept.get("scrapes", 0) + 1
        except OSError:
            pass


def prometheus(args, env, out: dict) -> None:
    base = ["run", *args.prom_run.split(), "--duration", str(args.duration), "--no-store",
            "--json"]  # fmt: skip
    rows = []
    for pair in range(args.pairs):
        order = ("off", "on") if pair % 2 == 0 else ("on", "off")
        got = {}
        for how in order:
            kept: dict = {}
            stop = threading.Event()
            extra = []
            if how == "on":
                extra = ["--prometheus-port", "9400"]
                scraper = threading.Thread(
                    target=scrape_until, args=("http://127.0.0.1:9400/metrics", stop, kept)
                )
                scraper.start()
            try:
                doc = gpulens_json([*base, *extra], env)
            finally:
                stop.set()
            got[how] = {"throughput": doc.get("throughput_samples_per_s"),
                        "ci95_pct": doc.get("throughput_ci95_pct"),
                        "scrapes": kept.get("scrapes", 0)}  # fmt: skip
            if how == "on":
                out["prometheus_last_scrape"] = kept.get("last")
        ratio = got["on"]["throughput"] / got["off"]["throughput"]
        rows.append({"pair": pair, "order": list(order), **got, "ratio": ratio})
        out["prometheus"] = {"pairs": rows}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))
        print(f"prometheus pair {pair}: on/off {ratio:.4f} ({got['on']['scrapes']} scrapes)",
              file=sys.stderr, flush=True)  # fmt: skip
    ratios = [r["ratio"] for r in rows]
    out["prometheus"] = {"pairs": rows, "ratio_median": statistics.median(ratios),
                         "ratio_ci95": interval95(ratios)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+", choices=["agreement", "stalls", "prometheus"])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--agreement-cases", nargs="+", default=["gpu_bound", "files_w4"],
                    choices=sorted(AGREEMENT_CASES))  # fmt: skip
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--imagenet-script", default=None)
    ap.add_argument("--images", type=int, default=16000)
    ap.add_argument("--imagenet-workers", type=int, default=15)
    ap.add_argument("--mnist-script", default=None)
    ap.add_argument("--mnist-n", type=int, default=60000)
    ap.add_argument("--no-train-tracked-stalls", dest="train_tracked_stalls", default=1,
                    action="store_const", const=0, help="no train_tracked.py stalls")  # fmt: skip
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--prom-run", default="resnet50 --precision bf16 --batch-size 256",
                    help="the built-in run the prometheus part measures")  # fmt: skip
    ap.add_argument("--work", default=None, help="where the generated data goes [a temp dir]")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="gpulens-unmodified-")
    env = dict(os.environ, GPULENS_HOME=str(Path(args.work) / "home"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    out: dict = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for part in args.parts:
        {"agreement": agreement, "stalls": stalls, "prometheus": prometheus}[part](args, env, out)
        if args.out:  # what has been measured survives a later part's failure
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print("\npart        figure                          value")
    for key, s in (out.get("agreement") or {}).get("summary", {}).items():
        print(
            f"agreement   {key} injected/tracked median   {s['ratio_median']:.4f} {s['ratio_ci95']}"
        )
        print(
            f"agreement   {key} data wait diff (pp)       {s['data_wait_diff_pp_median']:+.2f} "
            f"{s['data_wait_diff_pp_ci95']} (tracked {s['data_wait_pct_tracked_median']:.1f}%)"
        )
    for key, r in (out.get("stalls") or {}).items():
        if isinstance(r, dict):
            doc = r["result"]
            figure = doc.get("breakdown_pct") or {
                k: doc.get(k) for k in ("measured_steps", "throughput_samples_per_s")
            }
            print(f"stalls      {key:32s} {figure}")
    if "prometheus" in out:
        p = out["prometheus"]
        print(
            f"prometheus  on/off throughput median        {p['ratio_median']:.4f} {p['ratio_ci95']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
