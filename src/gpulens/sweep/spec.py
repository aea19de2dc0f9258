"""The sweep spec: a small YAML file, validated into a typed dataclass.

Example::

    name: cnn-batch
    command: run                 # run | colocate | stalls
    workload: [resnet18, resnet50]   # colocate: grid: {jobs: [[resnet18, resnet50], ...]}
    grid: {batch_size: [32, 64], precision: [bf16]}
    options: {steps: 20, device: cuda}
    gpus: 1                      # GPUs each cell takes (slots)

or ``cells: [{workload: resnet18, batch_size: 32}, ...]`` instead of ``workload``/``grid``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulens.errors import UsageError

COMMANDS = ("run", "colocate", "stalls")
KEYS = ("name", "command", "workload", "grid", "cells", "options", "gpus")


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep spec. ``grid`` maps an option to its values; ``cells`` is an explicit
    list of option mappings; ``options`` apply to every cell; ``gpus`` is GPUs per cell."""

    name: str
    command: str = "run"
    workload: tuple[str, ...] = ()
    grid: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    cells: tuple[dict[str, Any], ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    gpus: int = 1

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise UsageError(
                f"sweep spec: unknown command {self.command!r}; use one of {', '.join(COMMANDS)}"
            )
        if not self.name or not str(self.name).replace("-", "").replace("_", "").isalnum():
            raise UsageError(f"sweep spec: name {self.name!r} must be letters, digits, - or _")
        for key, values in self.grid.items():
            if len(values) == 0:
                raise UsageError(f"sweep spec: grid.{key} is empty; give at least one value")
        if self.cells and (self.grid or self.workload):
            raise UsageError("sweep spec: give either cells or workload/grid, not both")
        if not self.cells and not self.workload and "jobs" not in self.grid:
            raise UsageError("sweep spec: give workload (one or a list), grid.jobs or cells")
        for i, cell in enumerate(self.cells):
            if not isinstance(cell, dict) or not cell:
                raise UsageError(f"sweep spec: cells[{i}] must be a non-empty mapping")
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise UsageError(f"sweep spec: gpus must be an integer >= 1, not {self.gpus!r}")


def parse_spec(doc: Any, default_name: str = "sweep") -> SweepSpec:
    """A ``SweepSpec`` from a parsed YAML mapping; one UsageError line per mistake."""
    if not isinstance(doc, dict):
        raise UsageError("sweep spec: the file must be a YAML mapping (command:, workload:, ...)")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise UsageError(f"sweep spec: unknown key {unknown[0]!r}; allowed keys: {', '.join(KEYS)}")
    grid = doc.get("grid") or {}
    if "grid" in doc and (not isinstance(grid, dict) or not grid):
        raise UsageError("sweep spec: grid is empty; give option: [values, ...] pairs")
    options = doc.get("options") or {}
    if not isinstance(options, dict):
        raise UsageError("sweep spec: options must be a mapping (steps: 20, device: cuda)")
    cells = doc.get("cells") or []
    if not isinstance(cells, list):
        raise UsageError("sweep spec: cells must be a list of mappings")
    workload = doc.get("workload")
    return SweepSpec(
        name=str(doc.get("name") or default_name),
        command=str(doc.get("command", "run")),
        workload=tuple(str(w) for w in _as_list(workload)) if workload is not None else (),
        grid={str(k): tuple(_as_list(v)) for k, v in grid.items()},
        cells=tuple(cells),
        options=dict(options),
        gpus=doc.get("gpus", 1),
    )


def load_spec(path: Path) -> SweepSpec:
    """Read and validate a spec file."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"sweep spec {path}: cannot read it ({exc.strerror})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        raise UsageError(f"sweep spec {path}: not valid YAML ({first})") from None
    return parse_spec(doc, default_name=Path(path).stem)
