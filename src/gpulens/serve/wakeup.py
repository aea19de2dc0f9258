"""Waking the load generator at a request's due time without spinning.

asyncio's own timers wake late by up to a millisecond on Linux: the loop waits in
``epoll_wait``, whose timeout is whole milliseconds, rounded up. A generator that slept on
them would send every request about half a millisecond late (and flag itself as the limit);
one that slept most of the way and then yield-spun to the due time kept the schedule but
burnt a fifth to a half of a core at a few hundred requests/s, which a CPU server on the
same machine then lacks. On Linux a ``timerfd`` armed at the due time (on CLOCK_MONOTONIC,
``time.perf_counter``'s clock) wakes the loop's ``epoll_wait`` within microseconds of it, and
costs one wake-up per due time; elsewhere the loop's own timers are the fallback.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import sys
import time

log = logging.getLogger(__name__)

CLOCK_MONOTONIC = 1
TFD_TIMER_ABSTIME = 1
TFD_NONBLOCK = os.O_NONBLOCK if hasattr(os, "O_NONBLOCK") else 0o4000
TFD_CLOEXEC = os.O_CLOEXEC if hasattr(os, "O_CLOEXEC") else 0o2000000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class LoopTimer:
    """The fallback: the event loop's own timer (late by up to ~1 ms on Linux)."""

    precise = False

    def __init__(self, clock=time.perf_counter):
        self.clock = clock

    async def wait_until(self, when: float) -> None:
        """Return at ``when`` (in ``clock``'s seconds) or later."""
        delay = when - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)

    def close(self) -> None:
        pass


class TimerFd:
    """A Linux timerfd on CLOCK_MONOTONIC, watched by the running loop: one wake-up per
    ``wait_until``, within microseconds of the time asked for."""

    precise = True

    def __init__(self, loop: asyncio.AbstractEventLoop, libc):
        self.loop = loop
        self.libc = libc
        self.clock = time.perf_counter
        fd = libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        self.waiter: asyncio.Future | None = None
        try:
            loop.add_reader(fd, self._fired)
        except BaseException:
            os.close(fd)
            raise

    def _fired(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait_until(self, when: float) -> None:
        """Return at ``when`` (``time.perf_counter`` seconds) or later."""
        if when <= self.clock():
            return
        sec = int(when)
        spec = _Itimerspec()
        spec.it_value.tv_sec, spec.it_value.tv_nsec = sec, int((when - sec) * 1e9)
        if self.libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            await asyncio.sleep(max(0.0, when - self.clock()))  # not expected: still on time-ish
            return
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        if self.fd < 0:
            return
        self.loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1


@functools.cache
def _libc():
    """The C library's timerfd calls (the process's own symbols: no library search), or None
    off Linux or where ``time.perf_counter`` is not CLOCK_MONOTONIC."""
    if not sys.platform.startswith("linux"):
        return None
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_void_p]  # fmt: skip
    except (OSError, AttributeError):
        return None
    return libc


def due_timer(loop: asyncio.AbstractEventLoop | None = None) -> TimerFd | LoopTimer:
    """The most precise timer this platform offers the running loop: a timerfd on Linux,
    else the loop's own timers. Close it when done."""
    loop = loop or asyncio.get_running_loop()
    libc = _libc()
    if libc is not None:
        try:
            return TimerFd(loop, libc)
        except (OSError, NotImplementedError) as exc:  # e.g. a loop without add_reader
            log.debug("no timerfd (%s): the loop's own timers wake the generator", exc)
    return LoopTimer()
