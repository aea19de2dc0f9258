"""Processes gpulens starts die with it, even when it is killed with SIGKILL, and the next gpulens
command cleans up what a dead one left (real processes, no fakes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from gpulens.launch import processes
from gpulens.launch.processes import (
    OWNER_FILE,
    cleanup_stale,
    make_work_dir,
    reap,
    remove_work_dir,
    spawn,
    wait_gone,
)
from gpulens.record.reader import read_record

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

TIMEOUT_S = 60.0


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """A private temporary directory for this test and the processes it starts."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the parent exited with {proc.returncode}: {out}")
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sleeper(pid_file: Path, grandchild_pid_file: Path | None = None) -> str:
    """A script that writes its pid (and optionally starts a grandchild) and sleeps."""
    grand = ""
    if grandchild_pid_file is not None:
        grand = (
            "import subprocess\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(grandchild_pid_file)!r}, 'w').write(str(g.pid))\n"
        )
    return (
        "import os, sys, time\n"
        + grand
        + f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        + "time.sleep(120)\n"
    )


def start_parent(code: str, tmp: Path) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=TIMEOUT_S)


# ----------------------------------------------------------------------- the command wrapper
def test_kill9_of_the_run_wrapper_ends_the_script_and_the_next_command_its_orphans(
    tmp_path, own_tmp
):
    child_pid_file, grand_pid_file = tmp_path / "child.pid", tmp_path / "grand.pid"
    script = tmp_path / "script.py"
    script.write_text(sleeper(child_pid_file, grand_pid_file))
    runs = tmp_path / "runs"
    wrapper = start_parent(
        f"""
        import sys
        from gpulens.launch.command import run_command
        run_command([sys.executable, {str(script)!r}], __import__('pathlib').Path({str(runs)!r}))
        """,
        own_tmp,
    )
    try:
        child = int(wait_for_file(child_pid_file, wrapper))
        grand = int(wait_for_file(grand_pid_file, wrapper))
        kill9(wrapper)
        # the script gets the parent-death signal
        assert wait_gone(child, 10), "the wrapped script outlived gpulens"
        (record,) = [p for p in runs.iterdir() if p.is_dir()]
        assert read_record(record).status == "killed"
        # its own child, orphaned, is ended by the next gpulens process
        found = cleanup_stale(grace_s=2.0)
        assert found.owners >= 1
        assert wait_gone(grand, 10), "the script's child outlived the cleanup"
    finally:
        for pid_file in (child_pid_file, grand_pid_file):
            if pid_file.exists():
                with_pid = int(pid_file.read_text())
                if alive(with_pid):
                    os.kill(with_pid, signal.SIGKILL)


def test_run_wrapper_ends_what_the_command_left_running(tmp_path, own_tmp):
    """A command that exits and leaves a child behind: the child is ended with the run."""
    from gpulens.launch.command import run_command

    orphan_pid_file = tmp_path / "orphan.pid"
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(orphan_pid_file)!r}, 'w').write(str(p.pid))\n"
    )
    result = run_command([sys.executable, "-c", code], tmp_path / "runs")
    assert result.status == "finished"
    orphan = int(orphan_pid_file.read_text())
    assert wait_gone(orphan, 10)


# ----------------------------------------------------------------------------- colocate
def test_kill9_of_colocate_ends_its_jobs_and_the_next_command_removes_its_work_dir(
    tmp_path, own_tmp
):
    pid_file = tmp_path / "job.pid"
    script = tmp_path / "job.py"
    script.write_text(sleeper(pid_file))
    parent = start_parent(
        f"""
        import sys
        from pathlib import Path
        from gpulens.colocate import ColocateConfig, run_colocate
        from gpulens.workloads.jobspec import parse_job
        jobs = [parse_job(f"cmd:{{sys.executable}} {str(script)!r}"),
                parse_job("cmd:true")]
        config = ColocateConfig(jobs=jobs, mechanisms=("time-slice",), device="cpu",
                                duration_s=1, warmup_s=0)
        run_colocate(config, Path({str(tmp_path / "runs")!r}))
        """,
        own_tmp,
    )
    try:
        job = int(wait_for_file(pid_file, parent))
        (work,) = list(own_tmp.glob("gpulens-colocate-*"))
        owner = json.loads((work / OWNER_FILE).read_text())
        assert owner["pid"] == parent.pid
        kill9(parent)
        assert wait_gone(job, 10), "a colocate job outlived gpulens"
        assert work.exists()
        found = cleanup_stale(grace_s=2.0)
        assert not work.exists() and found.work_dirs >= 1
    finally:
        if pid_file.exists() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_stale_work_dirs_are_removed_only_when_their_owner_is_dead(own_tmp):
    dead = own_tmp / "gpulens-colocate-dead"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(json.dumps({"owner": "999999999:1.00", "pid": 999999999}))
    unknown = own_tmp / "gpulens-colocate-old"  # no owner file: not ours to judge
    unknown.mkdir()
    mine = make_work_dir("gpulens-colocate-")
    try:
        cleanup_stale()
        assert not dead.exists()
        assert unknown.exists() and mine.exists()
    finally:
        remove_work_dir(mine)
    assert not mine.exists()


# ------------------------------------------------------------------------------ mechanism
def test_parent_death_signal_is_kept_when_the_spawning_thread_ends(own_tmp):
    """PR_SET_PDEATHSIG fires when the *thread* that forked the child exits: spawn() forks from
    a thread that lives as long as the process."""
    box: dict[str, subprocess.Popen] = {}

    def start():
        box["p"] = spawn([sys.executable, "-c", "import time; time.sleep(60)"])

    t = threading.Thread(target=start)
    t.start()
    t.join()
    child = box["p"]
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)  # killed at once if the signal were tied to the thread
    finally:
        reap(child, grace_s=1.0)
    assert child.poll() is not None


def test_a_child_arming_the_signal_itself_dies_with_its_parent(tmp_path, own_tmp):
    """What data-parallel ranks do (a library starts them, so no preexec hook)."""
    pid_file = tmp_path / "rank.pid"
    rank_code = (
        "import os, sys, time\n"
        "from gpulens.launch.processes import set_parent_death_signal\n"
        "assert set_parent_death_signal(9, int(sys.argv[1]))\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    parent = start_parent(
        f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {rank_code!r}, str(os.getpid())])
        time.sleep(120)
        """,
        own_tmp,
    )
    try:
        rank = int(wait_for_file(pid_file, parent))
        kill9(parent)
        assert wait_gone(rank, 10)
    finally:
        if parent.poll() is None:
            kill9(parent)


def test_reap_ends_the_process_group_and_marked_descendants(tmp_path, own_tmp):
    pid_file = tmp_path / "grand.pid"
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " start_new_session=True)\n"  # leaves the group: found by its marker
        f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
        "time.sleep(120)\n"
    )
    child = spawn([sys.executable, "-c", code])
    grand = int(wait_for_file(pid_file, child))
    assert psutil.Process(grand).environ()[processes.OWNER_ENV].startswith(processes.owner_id())
    reap(child, grace_s=2.0)
    assert child.poll() is not None
    assert wait_gone(grand, 10)
