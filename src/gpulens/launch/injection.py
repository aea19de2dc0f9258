"""How a wrapped Python command gets its steps timed without a change to it: a
``sitecustomize`` put first on the child's ``PYTHONPATH`` (Python runs it at start-up, before
the script) that calls :func:`gpulens.workloads.inject.install` and then runs whatever
``sitecustomize`` the child would have run without gpulens. Commands that are not Python, or
Python started with ``-S``/``-I``, are untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gpulens
from gpulens.workloads.inject import INJECT_ENV

SITECUSTOMIZE = """\
# Written by gpulens for one run: times the training loop's steps (gpulens.workloads.inject),
# then runs the sitecustomize this Python would have run without gpulens.
def _gpulens_inject():
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    src = {src!r}
    if src not in sys.path:
        sys.path.append(src)  # last: the script's own packages come first
    try:
        from gpulens.workloads import inject

        inject.install()
    except Exception as exc:
        sys.stderr.write(f"gpulens: step timing not injected ({{type(exc).__name__}}: {{exc}})\\n")
    others = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_gpulens_inject()
del _gpulens_inject
"""


@contextmanager
def injected_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with the injecting ``sitecustomize`` first on ``PYTHONPATH`` (removed after)."""
    folder = Path(tempfile.mkdtemp(prefix="gpulens-inject-"))
    try:
        src = str(Path(gpulens.__file__).resolve().parents[1])
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(src=src))
        path = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
        yield {**env, "PYTHONPATH": path, INJECT_ENV: "1"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
