"""Expanding a spec into cells, each identified by the hash of its effective config."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from gpulens.sweep.spec import SweepSpec


def canonical_json(config: dict[str, Any]) -> str:
    """Key-order independent JSON of a cell's config."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict[str, Any], length: int = 12) -> str:
    """A short, stable sha256 of the canonical JSON."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:length]


# Commands that spread one run over several GPUs with --gpus N.
MULTI_GPU_COMMANDS = ("run", "stalls")


@dataclass(frozen=True)
class Cell:
    """One gpulens invocation: ``command``, its options (``workload`` or, for colocate, ``jobs``
    among them) and the GPUs it takes; a colocate cell shares its one GPU between its jobs."""

    config: dict[str, Any]
    gpus: int = 1

    @property
    def cell_id(self) -> str:
        return config_hash(self.config)

    def argv(self) -> list[str]:
        """The gpulens arguments (after ``gpulens``) that run this cell with ``--json``."""
        command = str(self.config["command"])
        args = [command]
        if "workload" in self.config:
            args.append(str(self.config["workload"]))
        jobs = self.config.get("jobs", [])
        args += [str(j) for j in (jobs if isinstance(jobs, list) else str(jobs).split())]
        for key in sorted(self.config):
            if key in ("command", "workload", "jobs", "gpus"):
                continue
            value = self.config[key]
            flag = "--" + key.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is False or value is None:
                continue
            elif isinstance(value, list):  # --mechanisms streams,mps
                args += [flag, ",".join(str(v) for v in value)]
            else:
                args += [flag, str(value)]
        if self.gpus > 1 and command in MULTI_GPU_COMMANDS:
            args += ["--gpus", str(self.gpus)]
        return [*args, "--json"]


def expand(spec: SweepSpec) -> list[Cell]:
    """The spec's cells in a stable order, duplicates (same hash) dropped."""
    rows: list[dict[str, Any]] = []
    if spec.cells:
        rows = [dict(c) for c in spec.cells]
    else:
        keys = list(spec.grid)
        # colocate cells may name their jobs in the grid (grid.jobs) instead of a workload
        for workload in spec.workload or (None,):
            for values in itertools.product(*(spec.grid[k] for k in keys)):
                row = dict(zip(keys, values, strict=True))
                rows.append(row if workload is None else {"workload": workload, **row})
    cells: dict[str, Cell] = {}
    for row in rows:
        # in the spec's order (workload, grid or cell keys, then options), which the summary
        # lists them in; a cell's own value wins over options
        config = {"command": spec.command, **row}
        config.update((k, v) for k, v in spec.options.items() if k not in row)
        gpus = int(config.pop("gpus", spec.gpus))
        if gpus != 1:  # part of the cell's identity: 1 and 2 GPUs are two cells
            config["gpus"] = gpus
        cell = Cell(config=config, gpus=gpus)
        cells.setdefault(cell.cell_id, cell)
    return list(cells.values())


def sweep_id(spec: SweepSpec, cells: list[Cell]) -> str:
    """``<name>-<hash of the cell ids>``: the default sweep directory's name."""
    return f"{spec.name}-{config_hash({'cells': sorted(c.cell_id for c in cells)}, 8)}"
