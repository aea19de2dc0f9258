"""The short label a run goes by in ``runs list`` and reports: its workload, or for a wrapped
command what a user recognises of it (the script or module, not the interpreter's path). The
record, ``--json`` and ``load_runs`` keep the whole command; only the label shown is derived."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

# Python's options that take the next word as their value (-m and -c end the options).
_PYTHON_VALUE_OPTIONS = ("-W", "-X", "-Q")
# Modules that launch a script: the script is the label, not the launcher.
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _is_python(program: str) -> bool:
    return program.startswith(("python", "pypy"))


def _python_label(program: str, args: list[str]) -> str | None:
    """The script or module ``python ARGS`` runs; None for a launcher module (its script is
    found among the later words)."""
    words = iter(args)
    for arg in words:
        if arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = next(words, program) if arg == "-m" else arg[2:]
            return None if module in LAUNCHER_MODULES else module
        if arg.startswith("-c"):
            return f"{program} -c"
        if arg in _PYTHON_VALUE_OPTIONS:
            next(words, None)
        elif not arg.startswith("-"):
            return PurePath(arg).name
    return program


def command_label(command: str | Sequence[str]) -> str:
    """``train_plain.py`` for ``/usr/bin/python3 examples/train_plain.py -b 32``, ``pkg.train``
    for ``python -m pkg.train``, the Python script a launcher runs (``torchrun ... train.py``),
    otherwise the program's name (``nvidia-smi`` for ``/usr/bin/nvidia-smi -q``)."""
    if isinstance(command, str):
        try:
            argv = shlex.split(command)
        except ValueError:  # unbalanced quotes: a label is still owed
            argv = command.split()
    else:
        argv = [str(a) for a in command]
    if not argv:
        return ""
    program = PurePath(argv[0]).name
    if _is_python(program):
        label = _python_label(program, argv[1:])
        if label is not None:
            return label
    script = next((a for a in argv[1:] if a.endswith(".py") and " " not in a), None)
    return PurePath(script).name if script else program


def shown_workload(kind: Any, workload: Any) -> Any:
    """What ``runs list`` shows of a run's ``workload`` (:func:`gpulens.store.queries.run_facts`
    keeps a wrapped command whole there): for a command, :func:`command_label` of it."""
    if kind == "command" and isinstance(workload, str) and workload:
        return command_label(workload)
    return workload


def workload_label(meta: Mapping[str, Any]) -> str | None:
    """The label of the run whose ``run.json`` is ``meta`` (reports): its workload, or for a
    wrapped command (``gpulens run -- CMD``, the runs of ``gpulens stalls -- CMD``)
    :func:`command_label` of it. None when there is neither."""
    summary = meta.get("summary") or {}
    eff = meta.get("effective_config") or {}
    req = meta.get("requested_config") or {}
    for workload in (summary.get("workload"), eff.get("workload"), req.get("workload")):
        if workload:
            return str(workload)
    command = eff.get("command") or req.get("command")
    if not isinstance(command, (str, list, tuple)):
        return None
    return command_label(command) or None
