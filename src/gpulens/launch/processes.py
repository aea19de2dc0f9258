"""How gpulens starts the processes it owns, so that none of them outlives it.

Every child that gpulens starts (the wrapped command, colocate jobs, the sampler, data-parallel
ranks) goes through :func:`spawn` (or calls :func:`set_parent_death_signal` itself when a library
starts it), which gives it three lifelines:

- a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel signals the child when the
  gpulens process dies, even by SIGKILL. The kernel ties it to the *thread* that forked the child,
  so :func:`spawn` always forks from a thread that lives as long as the process (the main thread,
  or one long-lived spawner thread when called from another thread);
- a marker in its environment, ``GPULENS_OWNER=<pid>:<create time>:<serial>``, inherited by
  everything the child starts in turn. :func:`reap` ends a child together with its descendants
  (also those orphaned when the child exited first), found by the marker and by the child's
  process group;
- an owner file (``$TMPDIR/gpulens-owners-<uid>/<pid>-<create time>.json``) listing the work
  directories of the gpulens process. When a gpulens process dies without cleaning up, the next
  one (:func:`cleanup_stale`) ends the processes that still carry the dead owner's marker and
  removes its work directories.

Nothing here touches a process that does not carry a gpulens marker of a dead or current owner.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from gpulens.errors import UsageError

log = logging.getLogger(__name__)

OWNER_ENV = "GPULENS_OWNER"
OWNER_FILE = "gpulens-owner.json"
PR_SET_PDEATHSIG = 1
REAP_GRACE_S = 5.0
WORK_DIR_PREFIXES = ("gpulens-colocate-",)

T = TypeVar("T")


# ----------------------------------------------------------------------------- commands
def check_command(argv: list[str], what: str | None = None) -> None:
    """A usage error, before anything runs (before a run record is opened), when ``argv[0]``
    cannot be started: a name not on PATH, a path that does not exist, or a file that is not
    executable. ``what`` starts the message (``cmd: job a``)."""
    prefix = f"{what}: " if what else ""
    if not argv or not argv[0]:
        raise UsageError(f"{prefix}the command is empty: give a program and its arguments")
    program = argv[0]
    if os.sep in program:
        path = Path(program)
        if not path.exists():
            raise UsageError(f"{prefix}'{program}' does not exist: check the path")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise UsageError(
                f"{prefix}'{program}' is not an executable file: "
                f"run it through its interpreter (e.g. python {program}) or chmod +x it"
            )
        return
    if shutil.which(program) is None:
        here = (
            f"; to run the file {program} here, give ./{program}" if Path(program).is_file() else ""
        )
        raise UsageError(
            f"{prefix}command not found: {program} (is it on PATH? check its spelling, install "
            f"it, or give its full path{here})"
        )


# ------------------------------------------------------------------------------ identity
def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


_own_ids: dict[int, str] = {}


def owner_id(pid: int | None = None) -> str:
    """``<pid>:<create time>`` of a process (this one by default): unique across PID reuse."""
    if pid is not None and pid != os.getpid():
        return f"{pid}:{_create_time(pid) or 0.0:.2f}"
    pid = os.getpid()  # cached per pid: a forked child has its own
    if pid not in _own_ids:
        _own_ids[pid] = f"{pid}:{_create_time(pid) or 0.0:.2f}"
    return _own_ids[pid]


def owner_alive(owner: str) -> bool:
    """Whether the process named by an :func:`owner_id` still runs (and is not a zombie)."""
    try:
        pid_text, ctime_text = owner.split(":")[:2]
        pid, ctime = int(pid_text), float(ctime_text)
    except ValueError:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(proc.create_time() - ctime) < 0.05
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


# --------------------------------------------------------------------- parent-death signal
def _libc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def set_parent_death_signal(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Call it in the child. With ``parent_pid``, a parent that died before the call (the child was
    already re-parented) makes the child send ``sig`` to itself at once. Returns whether the
    signal is armed."""
    if _LIBC is None:
        return False
    if _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def _preexec(sig: int | None, parent_pid: int) -> Callable[[], None] | None:
    """What the forked child runs before exec: nothing that allocates or takes a lock."""
    if sig is None or _LIBC is None:
        return None
    prctl = _LIBC.prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl
            os.kill(os.getpid(), int(sig))

    return arm


# ------------------------------------------------------------------- the spawning thread
class _Spawner:
    """One thread that lives as long as the process; forks made from it keep their
    parent-death signal until the process itself dies."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="gpulens-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, done, box = self._jobs.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            done.set()

    def call(self, fn: Callable[[], T]) -> T:
        done, box = threading.Event(), {}
        self._jobs.put((fn, done, box))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def on_lasting_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` (which starts processes) on a thread that lives as long as the process: the
    calling thread when it is the main thread, else the shared spawner thread."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.call(fn)


# ----------------------------------------------------------------------------- children
@dataclass
class _Child:
    popen: subprocess.Popen
    marker: str
    own_group: bool


_children: dict[int, _Child] = {}
_children_lock = threading.Lock()
_serial = 0
_cleaned = False


def spawn(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    death_signal: int | None = signal.SIGKILL,
    own_group: bool = True,
    **popen_kwargs: Any,
) -> subprocess.Popen:
    """``subprocess.Popen(argv, ...)`` for a child that dies with this process.

    ``death_signal`` is what the child gets when this process dies (SIGKILL for gpulens's own
    children; SIGTERM lets a user's command stop its own children); ``own_group`` starts it in a
    new process group (and session), so a terminal's Ctrl-C reaches only this process, which
    decides what to pass on. The child is reaped (with its descendants) by :func:`reap`, and at
    interpreter exit if still alive."""
    global _serial
    _cleanup_once()
    _register_owner()
    with _children_lock:
        _serial += 1
        marker = f"{owner_id()}:{_serial}"
    env = dict(os.environ if env is None else env)
    env[OWNER_ENV] = marker
    preexec = _preexec(death_signal, os.getpid())

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            argv, env=env, preexec_fn=preexec, start_new_session=own_group, **popen_kwargs
        )

    popen = on_lasting_thread(start)
    with _children_lock:
        _children[popen.pid] = _Child(popen, marker, own_group)
    return popen


def marked_processes(prefix: str) -> list[psutil.Process]:
    """Live processes of this user whose ``GPULENS_OWNER`` starts with ``prefix``."""
    me = os.getpid()
    uid = os.getuid() if hasattr(os, "getuid") else None
    out = []
    for proc in psutil.process_iter(["uids"]):
        if proc.pid == me:
            continue
        try:
            uids = proc.info.get("uids")
            if uid is not None and uids is not None and uids.real != uid:
                continue
            marker = proc.environ().get(OWNER_ENV, "")
        except (psutil.Error, OSError):
            continue
        if marker == prefix or marker.startswith(prefix + ":"):
            out.append(proc)
    return out


def _end(procs: Iterable[psutil.Process], grace_s: float) -> None:
    procs = [p for p in procs if p.is_running()]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def reap(popen: subprocess.Popen, grace_s: float = REAP_GRACE_S) -> None:
    """End ``popen`` and everything it started: SIGTERM, then SIGKILL after ``grace_s``.
    Safe to call on a child that has exited (its orphans are still found)."""
    with _children_lock:
        child = _children.pop(popen.pid, None)
    if popen.poll() is None:
        if child is not None and child.own_group:
            with contextlib.suppress(OSError):
                os.killpg(popen.pid, signal.SIGTERM)
        else:
            with contextlib.suppress(OSError):
                popen.terminate()
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                if child is not None and child.own_group:
                    os.killpg(popen.pid, signal.SIGKILL)
                else:
                    popen.kill()
            popen.wait()
    if child is not None:
        if child.own_group:
            with contextlib.suppress(OSError):
                os.killpg(popen.pid, signal.SIGKILL)  # anything left in its group
        _end(marked_processes(child.marker), grace_s)


def forget(popen: subprocess.Popen) -> None:
    """Stop tracking ``popen`` without ending anything (it exited and left nothing behind)."""
    with _children_lock:
        _children.pop(popen.pid, None)


def _reap_all_at_exit() -> None:
    with _children_lock:
        children = list(_children.values())
    for child in children:
        with contextlib.suppress(Exception):
            reap(child.popen, grace_s=1.0)
    with contextlib.suppress(OSError):
        _owner_path().unlink()


atexit.register(_reap_all_at_exit)


# ------------------------------------------------------------------ owner and work dirs
def _owners_dir() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"gpulens-owners-{uid}"


def _owner_path(owner: str | None = None) -> Path:
    return _owners_dir() / ((owner or owner_id()).replace(":", "-") + ".json")


_owner_lock = threading.Lock()
_work_dirs: list[str] = []


def _register_owner() -> None:
    """Write this process's owner file (its work dirs); a later gpulens reads it if we die."""
    with _owner_lock:
        path = _owner_path()
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"owner": owner_id(), "work_dirs": _work_dirs}))
            os.replace(tmp, path)
        except OSError as exc:  # cleanup after a crash is a convenience, never a failure
            log.debug("could not write the owner file %s: %s", path, exc)


def make_work_dir(prefix: str) -> Path:
    """A fresh temporary directory owned by this process (its pid is written into it), removed
    by :func:`remove_work_dir`, or by the next gpulens command if this process dies first."""
    _cleanup_once()
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / OWNER_FILE).write_text(json.dumps({"owner": owner_id(), "pid": os.getpid()}))
    with _owner_lock:
        _work_dirs.append(str(path))
    _register_owner()
    return path


def remove_work_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with _owner_lock, contextlib.suppress(ValueError):
        _work_dirs.remove(str(path))
    _register_owner()


@dataclass
class Cleanup:
    """What :func:`cleanup_stale` found of gpulens processes that died without cleaning up."""

    owners: int = 0
    processes: int = 0
    work_dirs: int = 0


def cleanup_stale(grace_s: float = REAP_GRACE_S) -> Cleanup:
    """End the children and remove the work directories that dead gpulens processes left."""
    found = Cleanup()
    owners_dir = _owners_dir()
    for path in sorted(owners_dir.glob("*.json")) if owners_dir.is_dir() else []:
        try:
            data = json.loads(path.read_text())
            owner = str(data["owner"])
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        if owner_alive(owner):
            continue
        found.owners += 1
        procs = marked_processes(owner)
        found.processes += len(procs)
        _end(procs, grace_s)
        for d in data.get("work_dirs") or []:
            if Path(d).is_dir():
                shutil.rmtree(d, ignore_errors=True)
                found.work_dirs += 1
        with contextlib.suppress(OSError):
            path.unlink()
    tmp = Path(tempfile.gettempdir())
    for prefix in WORK_DIR_PREFIXES:
        for d in tmp.glob(prefix + "*"):
            try:
                owner = json.loads((d / OWNER_FILE).read_text())["owner"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not ours to judge (an older gpulens, or being created)
            if not owner_alive(owner):
                shutil.rmtree(d, ignore_errors=True)
                found.work_dirs += 1
    if found.owners or found.work_dirs:
        log.info(
            "cleaned up after %d gpulens process(es) that died: %d process(es) ended, "
            "%d work dir(s) removed",
            found.owners,
            found.processes,
            found.work_dirs,
        )
    return found


def _cleanup_once() -> None:
    global _cleaned
    if _cleaned:
        return
    _cleaned = True
    try:
        cleanup_stale()
    except Exception as exc:  # never let housekeeping stop a measurement
        log.debug("cleanup of stale gpulens processes failed: %s", exc)


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` ended (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
