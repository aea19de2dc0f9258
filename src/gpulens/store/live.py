"""Live MLflow logging: a run's series reach MLflow while it runs, not only when it ends.

A small process beside the run (``python -m gpulens.store.live``, started by the CLI through
:func:`start_follower`; never a thread of the training process) follows every record that the
CLI process opens, one after another (``gpulens stalls`` opens several). Every ``interval_s``
it reads what each running record has written so far and logs the new GPU, host and step
points (about one per second per series) to that record's MLflow run: a run of its own,
created RUNNING and tagged ``gpulens.live``, or the user's run (``MLFLOW_RUN_ID``), chosen as
the end-of-run logging chooses. How far it got is kept in the record's sidecar
(``mlflow.json``, ``live``); when the run has ended, :func:`gpulens.store.mlflow_sink.log_record`
completes that same MLflow run (params, summary, the rest of the series, the record as
artifacts) instead of making another. A record removed before it ended (a run refused before
it measured anything: :meth:`gpulens.record.writer.RunWriter.discard`) has its live MLflow run
ended and deleted, so that none is left RUNNING for a run that never ran.

``GPULENS_MLFLOW_LIVE_S`` sets the interval (default 10 s, MLflow's own system-metrics period);
``0`` turns live logging off. A store that does not answer within 2 s at the start turns it off
for the run; the record is logged at its end as before.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpulens.record import schema
from gpulens.run.interrupts import set_from_handler

log = logging.getLogger(__name__)

INTERVAL_ENV = "GPULENS_MLFLOW_LIVE_S"
DEFAULT_INTERVAL_S = 10.0
# Series rows reach disk about once a second; leave the newest seconds to the next pass.
SETTLE_S = 2.0
STOP_WAIT_S = 20.0


def live_interval_s() -> float:
    """``$GPULENS_MLFLOW_LIVE_S`` (0: off), else 10 s."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        log.warning("%s=%r is not seconds; using %g", INTERVAL_ENV, raw, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S


def owned_records(runs_root: Path, owner_pid: int, since_unix_s: float) -> list[Path]:
    """Record folders made since ``since_unix_s`` whose ``run.json`` names ``owner_pid``."""
    found = []
    try:
        entries = list(os.scandir(runs_root))
    except OSError:
        return []
    for entry in entries:
        try:
            if not entry.is_dir() or entry.stat().st_ctime < since_unix_s - 2:
                continue
            meta = json.loads(Path(entry.path, schema.RUN_FILE).read_text())
        except (OSError, ValueError):
            continue  # not written yet: next pass
        if meta.get("pid") == owner_pid:
            found.append(Path(entry.path))
    return sorted(found)


class Follower:
    """Logs the new points of each followed record on every :meth:`push`."""

    def __init__(self, tracking_uri: str, experiment: str, interval_s: float):
        from gpulens.store import mlflow_sink

        self.sink = mlflow_sink
        self.uri = tracking_uri
        self.experiment = experiment
        self.max_points = max(1, int(round(interval_s)))  # about 1 point/s per series
        self.done: set[str] = set()
        self.started: set[str] = set()  # records with a live MLflow run
        self.tried: set[str] = set()  # records that may have one (a push began)

    def push(self, record_dir: Path) -> None:
        from gpulens.record.reader import read_record

        if record_dir.name in self.done:
            return
        self.tried.add(record_dir.name)
        record = read_record(record_dir)
        ended = record.status != schema.STATUS_RUNNING
        until = None if ended else time.time() - SETTLE_S
        self.sink.log_live(record, self.uri, self.experiment, until, self.max_points)
        self.started.add(record_dir.name)
        if ended:
            self.done.add(record_dir.name)

    def sweep(self, runs_root: Path, owner_pid: int, since_unix_s: float, last: bool) -> None:
        """One pass: push each record ``owner_pid`` opened, then end the live MLflow runs of
        those removed before they ended. ``last``: records never pushed are left to the
        end-of-run log (a run shorter than one interval: it does it all)."""
        for record_dir in owned_records(runs_root, owner_pid, since_unix_s):
            if last and record_dir.name not in self.started:
                continue
            try:
                self.push(record_dir)
            except Exception as exc:  # live logging is a courtesy; the end-of-run log is not
                if (record_dir / schema.RUN_FILE).exists():  # else: discarded meanwhile
                    log.warning("live MLflow logging of %s: %s", record_dir.name, exc)
        for name in sorted(self.tried - self.done):
            if (runs_root / name / schema.RUN_FILE).exists():
                continue
            self.done.add(name)
            try:
                discard_live(self.uri, self.experiment, name)
            except Exception as exc:
                log.warning("could not end the live MLflow run of discarded %s: %s", name, exc)


def discard_live(tracking_uri: str, experiment: str, run_id: str) -> list[str]:
    """End (FAILED) and delete the live MLflow runs of record ``run_id`` (its own runs, tagged
    ``gpulens.live``; a user's run it logged into stays theirs); their ids."""
    from gpulens.store.availability import mlflow_http_limits, store_lock
    from gpulens.store.mlflow_sink import import_mlflow

    mlflow = import_mlflow()
    with mlflow_http_limits(), store_lock(tracking_uri):
        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        experiment_ids = {found.experiment_id} if found is not None else set()
        user_run_id = os.environ.get("MLFLOW_RUN_ID", "").strip()
        if user_run_id:  # live runs are its children, in its experiment
            try:
                experiment_ids.add(client.get_run(user_run_id).info.experiment_id)
            except Exception as exc:
                log.debug("MLFLOW_RUN_ID=%s: %s", user_run_id, exc)
        if not experiment_ids:
            return []
        safe = run_id.replace("'", "")
        runs = client.search_runs(
            sorted(experiment_ids),
            filter_string=f"tags.`gpulens.run_id` = '{safe}' AND tags.`gpulens.live` = 'true'",
        )
        for run in runs:
            if run.info.status == "RUNNING":
                client.set_terminated(run.info.run_id, status="FAILED")
            client.delete_run(run.info.run_id)
            log.info("deleted the live MLflow run %s of discarded %s", run.info.run_id, run_id)
        return [run.info.run_id for run in runs]


def follow(
    runs_root: Path, owner_pid: int, since_unix_s: float, interval_s: float, stop: threading.Event
) -> None:
    """Follow ``owner_pid``'s records until ``stop`` is set (then one last pass)."""
    from gpulens.paths import default_tracking_uri
    from gpulens.store.availability import REACHABILITY_TIMEOUT_S, check_store
    from gpulens.store.mlflow_sink import default_experiment

    uri = default_tracking_uri()
    found = check_store(uri, REACHABILITY_TIMEOUT_S)
    if not found.ok:
        log.info("live MLflow logging off for this run: %s", found.detail)
        return
    follower = Follower(uri, default_experiment(), interval_s)
    while True:
        last = stop.wait(interval_s)
        follower.sweep(runs_root, owner_pid, since_unix_s, last)
        if last:
            return


class FollowerProcess:
    """The follower process of this CLI process; :meth:`stop` ends it after a last pass."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def stop(self) -> None:
        from gpulens.launch.processes import forget, reap

        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            self.proc.stdin.close()
            self.proc.wait(timeout=STOP_WAIT_S)
            forget(self.proc)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            log.info("live MLflow logging did not finish in %g s; stopped", STOP_WAIT_S)
            reap(self.proc, grace_s=1.0)


def start_follower(runs_root: Path) -> FollowerProcess | None:
    """Start following this process's records, where the store is on, MLflow installed and
    live logging not turned off; None otherwise."""
    from gpulens.launch.processes import spawn
    from gpulens.store import mlflow_sink
    from gpulens.store.sink import store_enabled

    interval_s = live_interval_s()
    if not interval_s or not store_enabled() or not mlflow_sink.is_available():
        return None
    src_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_root, env.get("PYTHONPATH")]))
    try:
        proc = spawn(
            [sys.executable, "-m", "gpulens.store.live", "--runs-root", str(runs_root),
             "--owner-pid", str(os.getpid()), "--since", repr(time.time()),
             "--interval", str(interval_s)],
            stdin=subprocess.PIPE, text=True, env=env, death_signal=signal.SIGTERM,
            own_group=True,
        )  # fmt: skip
    except (OSError, TypeError) as exc:
        log.info("live MLflow logging not started: %s", exc)
        return None
    return FollowerProcess(proc)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the CLI stops it; Ctrl-C is the CLI's
    import argparse

    ap = argparse.ArgumentParser(prog="gpulens-live")
    ap.add_argument("--runs-root", required=True)
    ap.add_argument("--owner-pid", type=int, required=True)
    ap.add_argument("--since", type=float, required=True)
    ap.add_argument("--interval", type=float, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="gpulens live: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: set_from_handler(stop))

    def watch_stdin() -> None:
        try:
            sys.stdin.readline()  # "stop", or "" when the CLI died
        finally:
            stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    follow(Path(args.runs_root), args.owner_pid, args.since, args.interval, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
