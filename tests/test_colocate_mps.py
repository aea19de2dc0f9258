"""The private MPS daemon's lifetime, with nvidia-cuda-mps-control faked at the process boundary.

The fake control binary (a Python script on PATH) forks a sleeping "daemon" that creates the
control socket file in $CUDA_MPS_PIPE_DIRECTORY; ``quit`` on stdin stops it (unless the test asks
it to ignore quit). Every test asserts that no daemon process and no pipe directory remain.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from gpulens.errors import RuntimeFailure
from gpulens.launch.mps import PrivateMps, find_foreign_daemons

FAKE = textwrap.dedent(
    """\
    #!{python}
    import os, signal, sys, time
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    pidfile = os.path.join(pipe, "fake-daemon.pid")
    if sys.argv[1:] == ["-d"]:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                if os.environ.get("FAKE_MPS_IGNORE_TERM"):
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                open(pidfile, "w").write(str(os.getpid()))
                open(os.path.join(pipe, "control"), "w").close()
                while True:
                    time.sleep(0.05)
            os._exit(0)
        deadline = time.time() + 5
        while not os.path.exists(os.path.join(pipe, "control")) and time.time() < deadline:
            time.sleep(0.01)
        sys.exit(0)
    for line in sys.stdin:
        if line.strip() == "quit" and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
            try:
                os.kill(int(open(pidfile).read()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    """
)


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ctl = bindir / "nvidia-cuda-mps-control"
    ctl.write_text(FAKE.format(python=sys.executable))
    ctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("FAKE_MPS_IGNORE_QUIT", raising=False)
    default_pipe = tmp_path / "default-nvidia-mps"  # stands in for /tmp/nvidia-mps
    root = tmp_path / "mps-root"
    root.mkdir()
    return {"bin": bindir, "default_pipe": default_pipe, "root": root}


def _daemon_pids(pipe_dir: Path) -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            ours = p.environ().get("CUDA_MPS_PIPE_DIRECTORY") == str(pipe_dir)
            fake = any("nvidia-cuda-mps-control" in c for c in p.cmdline())
            if ours and fake and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return out


def _gone(pids, pipe_dir: Path, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() !=
                 psutil.STATUS_ZOMBIE]  # fmt: skip
        if not alive and not pipe_dir.exists() and not _daemon_pids(pipe_dir):
            return True
        time.sleep(0.05)
    return False


def _mps(fake) -> PrivateMps:
    return PrivateMps(gpu_uuid="GPU-fake", default_pipe_dir=fake["default_pipe"],
                      root=fake["root"])  # fmt: skip


def test_normal_exit_stops_daemon_and_removes_pipe_dir(fake_mps):
    with _mps(fake_mps) as mps:
        pids = mps.own_pids()
        assert pids, "the fake daemon should be seen as ours"
        env = mps.client_env(thread_pct=50, mem_limit="8G")
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(mps.pipe_dir)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G"
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert mps.daemon_env()["CUDA_VISIBLE_DEVICES"] == "GPU-fake"
        pipe = mps.pipe_dir
    assert _gone(pids, pipe)
    assert not list(fake_mps["root"].iterdir())


def test_exception_and_quit_ignored_still_clean_up(fake_mps, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_IGNORE_QUIT", "1")
    with pytest.raises(ZeroDivisionError), _mps(fake_mps) as mps:  # noqa: PT012
        pids, pipe = mps.own_pids(), mps.pipe_dir
        1 / 0  # noqa: B018
    assert _gone(pids, pipe)


def test_crashing_client_does_not_leave_daemon(fake_mps):
    with _mps(fake_mps) as mps:
        pids, pipe = mps.own_pids(), mps.pipe_dir
        client = subprocess.Popen([sys.executable, "-c", "import os; os.abort()"],
                                  env=mps.client_env(25))  # fmt: skip
        assert client.wait() != 0
    assert _gone(pids, pipe)


PARENT = textwrap.dedent(
    """\
    import json, subprocess, sys, time
    from pathlib import Path
    from gpulens.launch.mps import PrivateMps
    point = sys.argv[1]
    default_pipe, root = Path(sys.argv[2]), Path(sys.argv[3])
    mps = PrivateMps(gpu_uuid="GPU-fake", default_pipe_dir=default_pipe, root=root)
    with mps:
        info = {"pids": sorted(mps.own_pids()), "pipe": str(mps.pipe_dir)}
        if point == "client":
            c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env=mps.client_env(50))
            info["client"] = c.pid
        print(json.dumps(info), flush=True)
        if point == "crash":
            raise RuntimeError("boom")
        time.sleep(60)
    """
)


@pytest.mark.parametrize(
    "sig, point",
    [
        (signal.SIGTERM, "idle"), (signal.SIGINT, "idle"), (signal.SIGKILL, "idle"),
        (signal.SIGTERM, "client"), (signal.SIGINT, "client"), (signal.SIGKILL, "client"),
        (None, "crash"),
    ],
)  # fmt: skip
def test_parent_killed_leaves_nothing(fake_mps, tmp_path, sig, point):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), point, str(fake_mps["default_pipe"]), str(fake_mps["root"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    info = json.loads(parent.stdout.readline())
    assert info["pids"], parent.stderr.read() if parent.poll() is not None else "no daemon"
    if sig is not None:
        parent.send_signal(sig)
    parent.wait(timeout=30)
    if "client" in info:  # the client belongs to the test; it must not keep the daemon alive
        os.kill(info["client"], signal.SIGKILL)
    assert _gone(info["pids"], Path(info["pipe"])), f"daemon left behind after {sig} at {point}"
    # the watchdog removes the pipe folder, then the folder holding it: wait for both (under
    # load the second came a moment after the check)
    deadline = time.monotonic() + 15
    while list(fake_mps["root"].iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(fake_mps["root"].iterdir())


def test_foreign_daemon_is_detected_and_never_reused(fake_mps, tmp_path):
    foreign_pipe = tmp_path / "foreign-pipe"
    foreign_pipe.mkdir()
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(foreign_pipe))
    subprocess.run([str(fake_mps["bin"] / "nvidia-cuda-mps-control"), "-d"], env=env, check=True)
    pids = _daemon_pids(foreign_pipe)
    try:
        assert pids
        found = find_foreign_daemons(default_pipe_dir=fake_mps["default_pipe"])
        assert any(f.pid in pids for f in found)
        with pytest.raises(RuntimeFailure, match="someone else"):
            _mps(fake_mps).start()
        assert all(psutil.pid_exists(p) for p in pids)  # not stopped by gpulens
        assert not list(fake_mps["root"].iterdir())
    finally:
        subprocess.run([str(fake_mps["bin"] / "nvidia-cuda-mps-control")], input="quit\n",
                       text=True, env=env)  # fmt: skip
    assert _gone(pids, tmp_path / "never-existed")


def test_default_pipe_dir_socket_is_detected(fake_mps):
    fake_mps["default_pipe"].mkdir()
    (fake_mps["default_pipe"] / "control").touch()
    found = find_foreign_daemons(default_pipe_dir=fake_mps["default_pipe"])
    assert found and "control socket" in found[0].describe()
    with pytest.raises(RuntimeFailure, match="never reuses"):
        _mps(fake_mps).start()
