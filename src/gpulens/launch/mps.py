"""A private MPS daemon for one experiment, shut down on every exit path.

:class:`PrivateMps` starts ``nvidia-cuda-mps-control -d`` with its own pipe and log directories
(under a fresh temporary directory) and ``CUDA_VISIBLE_DEVICES`` set to the experiment's GPU only;
clients get :meth:`PrivateMps.client_env` (the pipe directory, an optional
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, and no
``CUDA_VISIBLE_DEVICES``, as NVIDIA's MPS guide asks).

Shutdown (``echo quit | nvidia-cuda-mps-control``, then SIGTERM/SIGKILL to whatever of ours is
still alive, then the directories removed) runs on: leaving the ``with`` block normally or by an
exception, Ctrl-C, SIGTERM (turned into an exception while the daemon is up), interpreter exit
(atexit), and the parent's death by SIGKILL: a small guard process holds a pipe to the parent and
cleans up when it breaks.

A daemon started by someone else (an ``nvidia-cuda-mps-control``/``-server`` process that is not
ours, or a control socket in the default pipe directory ``/tmp/nvidia-mps``) is detected and
reported by :func:`find_foreign_daemons`; gpulens never reuses or stops it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gpulens.errors import RuntimeFailure, UsageError

log = logging.getLogger(__name__)

CONTROL_BIN = "nvidia-cuda-mps-control"
MPS_NAMES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
DEFAULT_PIPE_DIR = Path("/tmp/nvidia-mps")
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
THREAD_PCT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEM_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
START_TIMEOUT_S = 15.0
QUIT_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 5.0


class ShutdownSignal(BaseException):
    """Raised in the main thread when SIGTERM arrives while a private daemon is up."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class ForeignDaemon:
    """An MPS daemon gpulens did not start: a process, or a control socket in a pipe directory."""

    pid: int | None
    what: str

    def describe(self) -> str:
        return f"{self.what} (pid {self.pid})" if self.pid else self.what


def _is_mps_process(proc: psutil.Process) -> bool:
    try:
        names = {proc.name()}
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    names.update(Path(c).name for c in cmd[:2])
    return any(n in MPS_NAMES for n in names)


def _pipe_dir_of(proc: psutil.Process) -> str | None:
    """The process's CUDA_MPS_PIPE_DIRECTORY, '' if unset, None if unreadable."""
    try:
        return proc.environ().get(PIPE_ENV, "")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def _mps_processes() -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        if proc.pid != os.getpid() and _is_mps_process(proc):
            out.append(proc)
    return out


def find_foreign_daemons(
    own_pipe_dirs: Iterable[str | Path] = (), default_pipe_dir: Path = DEFAULT_PIPE_DIR
) -> list[ForeignDaemon]:
    """MPS daemons running now that do not belong to a pipe directory in ``own_pipe_dirs``."""
    own = {str(Path(p)) for p in own_pipe_dirs}
    found: list[ForeignDaemon] = []
    for proc in _mps_processes():
        pipe = _pipe_dir_of(proc)
        if pipe is not None and pipe and str(Path(pipe)) in own:
            continue
        where = f"pipe directory {pipe}" if pipe else "default pipe directory"
        try:
            name = Path(proc.cmdline()[0]).name if proc.cmdline() else proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if name not in MPS_NAMES:
            name = next((n for n in MPS_NAMES if n in " ".join(proc.cmdline())), name)
        found.append(ForeignDaemon(proc.pid, f"{name} with {where}"))
    user_pipe = os.environ.get(PIPE_ENV)
    for pipe_dir in {Path(default_pipe_dir), *([Path(user_pipe)] if user_pipe else [])}:
        if str(pipe_dir) in own:
            continue
        control = pipe_dir / "control"
        if control.exists() and not any(pipe_dir.as_posix() in f.what for f in found):
            found.append(ForeignDaemon(None, f"an MPS control socket at {control}"))
    return found


def foreign_daemon_message(found: list[ForeignDaemon]) -> str:
    listed = "; ".join(f.describe() for f in found)
    return (
        f"an MPS daemon started by someone else is running ({listed}); gpulens never reuses or "
        "stops it: stop it (echo quit | nvidia-cuda-mps-control, with its CUDA_MPS_PIPE_DIRECTORY) "
        "or run where no MPS daemon runs"
    )


def mps_available(control_bin: str = CONTROL_BIN) -> str | None:
    """None when the control binary is on PATH, else why MPS cannot be used."""
    if shutil.which(control_bin) is None:
        return (
            f"unavailable: {control_bin} is not on PATH (it ships with the NVIDIA driver's "
            "compute utilities)"
        )
    return None


def parse_mem_limit(limit: str) -> str:
    """Validate ``8G``/``512M`` (the unit MPS accepts); returned unchanged."""
    text = limit.strip().upper()
    if not text or text[-1] not in "GM" or not text[:-1].isdigit() or int(text[:-1]) <= 0:
        raise UsageError(f"MPS memory limit {limit!r}: use a size like 8G or 512M")
    return text


@dataclass
class PrivateMps:
    """A private MPS daemon serving only ``gpu_uuid`` (or the visible GPUs when None).

    Use as a context manager. ``control_bin`` is looked up on PATH (tests put a fake there).
    """

    gpu_uuid: str | None = None
    control_bin: str = CONTROL_BIN
    default_pipe_dir: Path = DEFAULT_PIPE_DIR
    guard: bool = True
    root: Path | None = None
    pipe_dir: Path = field(init=False)
    log_dir: Path = field(init=False)
    _started: bool = field(default=False, init=False)
    _closed: bool = field(default=False, init=False)
    _known_pids: set[int] = field(default_factory=set, init=False)
    _before: set[int] = field(default_factory=set, init=False)
    _guard_proc: subprocess.Popen | None = field(default=None, init=False)
    _old_handlers: dict[int, object] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    # --- environment -----------------------------------------------------------------------
    def daemon_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[PIPE_ENV] = str(self.pipe_dir)
        env[LOG_ENV] = str(self.log_dir)
        if self.gpu_uuid:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_uuid
        return env

    def client_env(
        self, thread_pct: float | None = None, mem_limit: str | None = None
    ) -> dict[str, str]:
        """Environment for a client process (no CUDA_VISIBLE_DEVICES: the daemon decides)."""
        if not self._started:
            raise RuntimeFailure("the private MPS daemon is not running")
        env = {k: v for k, v in os.environ.items() if k not in (THREAD_PCT_ENV, MEM_LIMIT_ENV)}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env[PIPE_ENV] = str(self.pipe_dir)
        env[LOG_ENV] = str(self.log_dir)
        if thread_pct is not None:
            if not 0 < thread_pct <= 100:
                raise UsageError(f"MPS thread percentage must be in (0, 100], got {thread_pct}")
            env[THREAD_PCT_ENV] = f"{thread_pct:g}"
        if mem_limit:
            env[MEM_LIMIT_ENV] = f"0={parse_mem_limit(mem_limit)}"
        return env

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> PrivateMps:
        if self._started:
            return self
        if shutil.which(self.control_bin, path=os.environ.get("PATH")) is None:
            raise RuntimeFailure(mps_available(self.control_bin) or "MPS not available")
        foreign = find_foreign_daemons(default_pipe_dir=self.default_pipe_dir)
        if foreign:
            raise RuntimeFailure(foreign_daemon_message(foreign))
        base = Path(tempfile.mkdtemp(prefix="gpulens-mps-", dir=self.root))
        self.pipe_dir, self.log_dir = base / "pipe", base / "log"
        self.pipe_dir.mkdir()
        self.log_dir.mkdir()
        self._before = {p.pid for p in _mps_processes()}
        # From here on every exit path must clean up.
        self._started = True
        atexit.register(self.shutdown)
        self._install_signal_handlers()
        try:
            if self.guard:
                self._start_guard()
            # Output to a file, not a pipe: the daemon inherits the descriptors and a pipe
            # would never reach end-of-file while it runs.
            start_log = self.log_dir / "gpulens-start.log"
            with open(start_log, "wb") as fh:
                result = subprocess.run(
                    [self.control_bin, "-d"],
                    env=self.daemon_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    timeout=START_TIMEOUT_S,
                )
            if result.returncode != 0:
                output = start_log.read_text(errors="replace").strip()[-300:]
                raise RuntimeFailure(
                    f"{self.control_bin} -d failed with exit code {result.returncode}: "
                    f"{output}; see {self.log_dir}"
                )
            self._wait_for_control()
        except BaseException:
            self.shutdown()
            raise
        log.info("private MPS daemon up: pipe %s, log %s", self.pipe_dir, self.log_dir)
        return self

    def _wait_for_control(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if (self.pipe_dir / "control").exists():
                self._scan_own()
                return
            time.sleep(0.05)
        raise RuntimeFailure(
            f"the MPS control daemon did not create its socket in {self.pipe_dir} within "
            f"{START_TIMEOUT_S:.0f} s; see {self.log_dir}/control.log"
        )

    def _scan_own(self) -> set[int]:
        """PIDs of MPS processes that are ours: our pipe dir in their environment, or started
        after ours (no foreign daemon ran when we started, and an MPS server that the control
        daemon spawns need not carry the pipe directory in its environment)."""
        mine = set()
        for proc in _mps_processes():
            if _pipe_dir_of(proc) == str(self.pipe_dir) or proc.pid not in self._before:
                mine.add(proc.pid)
        self._known_pids |= mine
        return mine

    def own_pids(self) -> set[int]:
        """Live processes of this daemon (control and servers)."""
        if not self._started or self._closed:
            return set()
        self._scan_own()
        return {p for p in self._known_pids if psutil.pid_exists(p) and not _zombie(p)}

    def shutdown(self) -> None:
        """Stop the daemon and its servers and remove the directories; safe to call twice."""
        with self._lock:
            if not self._started or self._closed:
                return
            self._closed = True
        try:
            self._scan_own()
            try:
                subprocess.run(
                    [self.control_bin],
                    input="quit\n",
                    env=self.daemon_env(),
                    capture_output=True,
                    text=True,
                    timeout=QUIT_TIMEOUT_S,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("MPS quit did not answer (%s); killing the daemon", exc)
            _wait_gone(self._known_pids, QUIT_TIMEOUT_S)
            self._scan_own()
            _terminate(self._known_pids)
        finally:
            shutil.rmtree(self.pipe_dir.parent, ignore_errors=True)
            self._stop_guard()
            self._restore_signal_handlers()
            with contextlib.suppress(Exception):
                atexit.unregister(self.shutdown)
            log.info("private MPS daemon stopped")

    # --- SIGTERM/SIGINT ----------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum, _frame):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise ShutdownSignal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, OSError):  # not settable here
                self._old_handlers[sig] = signal.signal(sig, on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)
        self._old_handlers.clear()

    # --- guard for SIGKILL of the parent -----------------------------------------------------
    def _start_guard(self) -> None:
        spec = {
            "control_bin": self.control_bin,
            "env": self.daemon_env(),
            "base_dir": str(self.pipe_dir.parent),
            "pipe_dir": str(self.pipe_dir),
            "before": sorted(self._before),
        }
        self._guard_proc = subprocess.Popen(
            [sys.executable, "-m", "gpulens.launch.mps", "--guard"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert self._guard_proc.stdin is not None
        self._guard_proc.stdin.write(json.dumps(spec) + "\n")
        self._guard_proc.stdin.flush()

    def _stop_guard(self) -> None:
        guard = self._guard_proc
        if guard is None:
            return
        self._guard_proc = None
        try:
            assert guard.stdin is not None
            guard.stdin.write("done\n")
            guard.stdin.flush()
            guard.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            guard.wait(timeout=QUIT_TIMEOUT_S + KILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait()

    def __enter__(self) -> PrivateMps:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _alive(pids: Iterable[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            continue
    return out


def _wait_gone(pids: Iterable[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _terminate(pids: Iterable[int]) -> None:
    procs = _alive(pids)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _wait_gone([p.pid for p in procs], KILL_TIMEOUT_S)
    for proc in _alive([p.pid for p in procs]):
        log.warning("MPS process %d ignored SIGTERM: killing it", proc.pid)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _wait_gone([p.pid for p in procs], KILL_TIMEOUT_S)


def _guard_main() -> int:
    """Wait for the parent's pipe to close; unless told 'done', stop the daemon it started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: stay up
    spec = json.loads(sys.stdin.readline())
    line = sys.stdin.readline()  # blocks until the parent writes 'done' or dies
    if line.strip() == "done":
        return 0
    env = spec["env"]
    pipe_dir = spec["pipe_dir"]
    before = set(spec["before"])
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(
            [spec["control_bin"]],
            input="quit\n",
            env=env,
            capture_output=True,
            text=True,
            timeout=QUIT_TIMEOUT_S,
        )
    ours = [p.pid for p in _mps_processes() if _pipe_dir_of(p) == pipe_dir or p.pid not in before]
    _wait_gone(ours, QUIT_TIMEOUT_S)
    _terminate(ours)
    shutil.rmtree(spec["base_dir"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--guard"]:
        sys.exit(_guard_main())
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'gpulens.launch.mps'} --guard")
