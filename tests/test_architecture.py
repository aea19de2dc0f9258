"""The house rules of DESIGN.md that a machine can check: the folder tree is the architecture."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gpulens"
MAX_LINES = 500
# Files allowed over the limit, at most this long: none left (issue 13). No file may join.
OVER_LIMIT_YET: dict[str, int] = {}
# Private names allowed to cross a module boundary: none left (issue 13).
PRIVATE_IMPORTS_YET: set[str] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(path: Path, module: str, top_level_only: bool):
    """(imported module, names) pairs; relative imports resolved."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base, [a.name for a in node.names]


def test_no_source_file_is_over_500_lines_beyond_the_known_ones():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    grew = {f: n for f, n in long.items() if n > OVER_LIMIT_YET.get(f, MAX_LINES)}
    assert not grew, grew
    fixed = set(OVER_LIMIT_YET) - set(long)
    assert not fixed, f"now under {MAX_LINES} lines: remove {fixed} from OVER_LIMIT_YET"


def test_no_private_name_is_imported_across_modules():
    mods = _modules()
    found = []
    for module, path in mods.items():
        for target, names in _imports(path, module, top_level_only=False):
            if not target.startswith("gpulens"):
                continue
            found += [
                f"{module} imports {target}.{n}"
                for n in names
                if n.startswith("_") and not n.startswith("__")
            ]
    assert set(found) <= PRIVATE_IMPORTS_YET, set(found) - PRIVATE_IMPORTS_YET
    assert set(found) == PRIVATE_IMPORTS_YET, "fixed: shrink PRIVATE_IMPORTS_YET"


def test_no_import_cycle_between_modules_at_import_time():
    mods = _modules()
    graph = {m: set() for m in mods}
    for module, path in mods.items():
        for target, names in _imports(path, module, top_level_only=True):
            for name in [f"{target}.{n}" for n in names] + [target]:
                if name in mods and name != module:
                    graph[module].add(name)
                    break
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_only_probes_nvml_imports_pynvml():
    mods = _modules()
    offenders = [
        m
        for m, path in mods.items()
        if not m.startswith("gpulens.probes.nvml")
        and any(t.split(".")[0] == "pynvml" for t, _ in _imports(path, m, top_level_only=False))
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "modules",
    [
        "gpulens.run, gpulens.run.result",
        "gpulens.stalls, gpulens.stalls.model, gpulens.stalls.refine, gpulens.stalls.read_stall",
        "gpulens.workloads.config, gpulens.workloads.jobspec",
        "gpulens.colocate, gpulens.colocate.metrics, gpulens.colocate.recommend, "
        "gpulens.colocate.plan, gpulens.colocate.experiment",
        "gpulens.stalls.prep_summary, gpulens.record.reader, gpulens.store.mlflow_payload",
        # a command's run and stall breakdown: the command imports torch, gpulens need not
        "gpulens.launch.command, gpulens.stalls.command, gpulens.probes.environment",
    ],
)
def test_analyses_import_without_torch(modules):
    code = f"import sys; sys.modules['torch'] = None\nimport {modules}\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_cli_and_the_sampler_start_without_pandas():
    """`gpulens --help` and each run's sampler process start without importing pandas (0.2-0.4
    s of every command's start); pandas is imported where a DataFrame is built."""
    code = (
        "import sys\nimport gpulens.cli, gpulens.probes.sampler_process, gpulens.store.queries\n"
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
