"""Steps of an unmodified script: what ``gpulens run -- python train.py`` injects.

The launcher puts a ``sitecustomize`` on the child's ``PYTHONPATH`` (:mod:`gpulens.launch.
injection`) that calls :func:`install` at Python's start-up. Nothing is imported then: once the
script imports torch, two hooks go in:

- every iteration over a ``torch.utils.data.DataLoader`` goes through the tracking API's
  ``data()``: the time blocked in the loader's ``__next__`` is the step's data wait, the
  batch's leading dimension its samples (the iterator keeps its type's attributes: it is a
  proxy, not a generator);
- a global optimizer step post-hook ends the step right after ``optimizer.step()``.

A step is therefore one batch: with gradient accumulation, one micro-batch. A script that
already calls ``gpulens.track()`` is left to it. Any failure here is reported once on stderr
and the script runs on untouched: injection never changes what the script computes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

INJECT_ENV = "GPULENS_INJECT"  # "1": the launcher asks for injection; "0" or unset: none
# `gpulens run --steps N -- CMD`: the script ends (as sys.exit(0) would) after N measured steps
MAX_STEPS_ENV = "GPULENS_MAX_STEPS"
# the injected tracker's warm-up steps, not measured (a short script keeps fewer, said in its
# summary; under --steps N exactly these, then N measured)
WARMUP_STEPS = 5
_state: dict[str, Any] = {"tracker": None, "failed": None, "installed": False, "steps": 0,
                          "loader": None, "pending_eval": False, "step_hook": None}  # fmt: skip
_trained: weakref.WeakSet = weakref.WeakSet()  # loaders an optimizer step was taken from


def _note_failure(where: str, exc: BaseException) -> None:
    if _state["failed"] is None:
        _state["failed"] = f"{where}: {type(exc).__name__}: {exc}"
        sys.stderr.write(
            f"gpulens: step timing could not be injected ({_state['failed']}); the script runs "
            "on without it\n"
        )


def _tracker():
    """The injected tracker, made at the first loader iteration; None when the script tracks
    itself or injection failed."""
    if _state["failed"]:
        return None
    if _state["tracker"] is None:
        from gpulens.workloads import tracking

        if tracking.explicit_tracker_active():
            return None
        warmup = WARMUP_STEPS if max_steps() is not None else None  # None: fewer if short
        _state["tracker"] = tracking.Tracker(
            name=None, store=False, injected=True, warmup_steps=warmup
        )
        _state["pid"] = os.getpid()
    return _state["tracker"]


class _TimedLoaderIter:
    """A DataLoader's iterator with its batches timed by the tracker; everything else is the
    real iterator's. ``real`` None: the batches come from ``source`` (ingestion-free replay)."""

    def __init__(self, real: Any, loader: Any, tracker: Any, source: Any = None) -> None:
        self._gpulens_real = real if real is not None else loader
        self._gpulens_tracker = tracker
        self._gpulens_loader = weakref.ref(loader)
        self._gpulens_batches = tracker.data(source or _Once(real), loader=loader)

    def __iter__(self):
        return self

    def __next__(self):
        # A batch that ended with no optimizer step (else the step hook ended it already) from a
        # loader that never saw one, or with autograd off, was evaluation: no training step.
        # (`with torch.no_grad(): for x, y in val_loader`, or Hugging Face's evaluation loop.)
        # With gradient accumulation only the micro-batches before the first optimizer step
        # of the run are left out.
        # The pending batch may also be an evaluation loader's last one, which no later fetch
        # of that loader closed (Lightning stops a sized loader at its length without asking
        # for one more): the next fetch, from any loader, closes it as no training step.
        loader = self._gpulens_loader()
        if _state.get("pending_eval") or _is_eval(loader):
            self._gpulens_tracker.step(skip=True)
        _state["loader"] = self._gpulens_loader
        try:
            batch = next(self._gpulens_batches)
        except StopIteration:
            if _is_eval(loader):  # its last batch
                self._gpulens_tracker.step(skip=True)
            raise
        _state["pending_eval"] = _is_eval(loader)
        return batch

    def __len__(self) -> int:
        return len(self._gpulens_real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpulens_real, name)


def _is_eval(loader: Any) -> bool:
    """A batch from ``loader`` now is evaluation: autograd is off, or the loader never fed an
    optimizer step."""
    return _autograd_off() or loader is None or loader not in _trained


def _autograd_off() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and not torch.is_grad_enabled()


class _Source:
    """A loader's own batches, one stable object per loader: under ``gpulens stalls``'s
    ingestion-free run the tracker takes its first batches once and replays them every epoch,
    so no loader iterator (no worker processes, no prefetching) is made per epoch."""

    def __init__(self, loader: Any, original_iter: Callable[[Any], Any]) -> None:
        self.loader, self.original_iter = loader, original_iter

    def __iter__(self):
        return self.original_iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class _Once:
    """An iterable over an existing iterator (``len`` where it has one)."""

    def __init__(self, it: Any) -> None:
        self.it = it

    def __iter__(self):
        return self.it

    def __len__(self) -> int:
        return len(self.it)


def _patch_dataloader(module: Any) -> None:
    loader_cls = module.DataLoader
    if getattr(loader_cls.__iter__, "_gpulens", False):
        return
    original = loader_cls.__iter__

    def __iter__(self):  # noqa: N807 (the method it replaces)
        try:
            tracker = _tracker()
            from gpulens.workloads.tracking import INGESTION_FREE_ENV

            if tracker is not None and os.environ.get(INGESTION_FREE_ENV) == "1":
                source = self.__dict__.setdefault("_gpulens_source", _Source(self, original))
                return _TimedLoaderIter(None, self, tracker, source)
        except Exception as exc:
            _note_failure("DataLoader", exc)
            return original(self)
        real = original(self)
        try:
            return real if tracker is None else _TimedLoaderIter(real, self, tracker)
        except Exception as exc:
            _note_failure("DataLoader", exc)
            return real

    __iter__._gpulens = True  # type: ignore[attr-defined]
    loader_cls.__iter__ = __iter__


def max_steps() -> int | None:
    """``$GPULENS_MAX_STEPS`` (measured steps after which the script ends), or None."""
    raw = os.environ.get(MAX_STEPS_ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _hook_optimizer(module: Any) -> None:
    limit = max_steps()

    def after_step(optimizer, args, kwargs) -> None:
        tracker = _state["tracker"]
        if tracker is None:
            return
        loader = _state["loader"]() if _state.get("loader") else None
        if loader is not None:
            _trained.add(loader)  # a training loader: its batches are steps
        tracker.step()
        _state["steps"] += 1
        if limit is not None and _state["steps"] >= WARMUP_STEPS + limit:
            # the measured window is over: the script ends as sys.exit(0) would (its finally
            # blocks and atexit run; the tracker writes its steps at exit)
            raise SystemExit(0)

    # the handle: benchmarks/overhead_interleaved.py takes the hook out between its chunks
    _state["step_hook"] = module.register_optimizer_step_post_hook(after_step)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` once module ``name`` has been executed."""

    def __init__(self, hooks: dict[str, Callable[[Any], None]]) -> None:
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            del self.hooks[name]
            try:
                hook(module)
            except Exception as exc:
                _note_failure(name, exc)

        loader.exec_module = exec_then_hook
        return spec


HOOKS: dict[str, Callable[[Any], None]] = {
    "torch.utils.data.dataloader": _patch_dataloader,
    "torch.optim.optimizer": _hook_optimizer,
}


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _closing_exit(original: Callable[[int], Any]) -> Callable[[int], Any]:
    """``os._exit`` that first writes the script's steps (it skips atexit, where the tracker
    writes them: a script ending with ``os._exit(0)`` left a run with no steps). Only in the
    process whose tracker it is: a forked loader worker leaves through ``os._exit`` too."""

    def _exit(status: int) -> Any:
        tracker = _state["tracker"]
        if tracker is not None and _state.get("pid") == os.getpid():
            tracker.close()  # never raises
        return original(status)

    _exit._gpulens = True  # type: ignore[attr-defined]
    return _exit


def install() -> bool:
    """Hook the script's loaders and optimizers once torch is imported (or now, if it is).
    SIGTERM, where it would kill the script outright, ends it through ``SystemExit`` instead,
    so that its steps are written at exit (how ``gpulens run --duration`` stops a script whose
    SIGINT is ignored, as in a job started in the background)."""
    if _state["installed"] or os.environ.get(INJECT_ENV) != "1":
        return False
    _state["installed"] = True
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        if not getattr(os._exit, "_gpulens", False):
            os._exit = _closing_exit(os._exit)
        pending = {}
        for name, hook in HOOKS.items():
            if name in sys.modules:
                hook(sys.modules[name])
            else:
                pending[name] = hook
        if pending:
            sys.meta_path.insert(0, _AfterImport(pending))
    except Exception as exc:
        _note_failure("install", exc)
        return False
    return True
