"""The Ray executor: each cell attempt is a Ray task with ``num_gpus`` (and one CPU), on a running
cluster (``address``) or a local one. A cell that gets no GPU measures the CPU, so it takes every
CPU of a node (the smallest), as the local executor gives a CPU-only machine one slot: two such
cells never share a node's cores. Ray is imported here only (optional extra ``sweep``)."""

from __future__ import annotations

import socket
from collections.abc import Callable

from gpulens.errors import MissingExtraError, RuntimeFailure
from gpulens.launch.cli_child import ChildResult, run_gpulens
from gpulens.sweep.cells import Cell


def attempt_cell(args: list[str]) -> ChildResult:
    """One attempt of a cell on a Ray worker; Ray sets CUDA_VISIBLE_DEVICES for its GPUs."""
    return run_gpulens(args)


def smallest_node_cpus(nodes: list[dict]) -> float:
    """The CPUs of the smallest alive node of ``ray.nodes()`` (1 when none says)."""
    cpus = [n["Resources"]["CPU"] for n in nodes
            if n.get("Alive") and (n.get("Resources") or {}).get("CPU")]  # fmt: skip
    return min(cpus) if cpus else 1


CONNECT_TIMEOUT_S = 3.0  # the probe of --ray-address before Ray's own (minutes of) retries
_ADDRESS_HELP = (
    "start a cluster with `ray start --head` (then --ray-address auto or HEAD_IP:6379, or "
    "ray://HEAD_IP:10001), or leave out --ray-address for a local Ray"
)


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``HOST:PORT`` or ``ray://HOST:PORT``; None for ``auto`` and
    addresses without a port (Ray resolves those itself)."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """One TCP connection to ``address``: where nothing listens Ray's own connect retries for
    over ten minutes (a mistyped --ray-address hung the sweep that long)."""
    target = _host_port(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise RuntimeFailure(
            f"no Ray cluster answers at {address} ({reason.lower()}): {_ADDRESS_HELP}"
        ) from None


class RayExecutor:
    """Submits cells as Ray tasks; retries are resubmitted from the driver."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        try:  # before any state file is written: one line naming the extra
            import ray  # noqa: F401
        except ImportError:
            raise MissingExtraError("ray", "sweep") from None
        if address:
            check_reachable(address)
        self.address = address
        self.num_cpus = num_cpus

    def run(
        self,
        cells: list[Cell],
        on_start: Callable[[Cell], None],
        on_done: Callable[[Cell, ChildResult], bool],
    ) -> None:
        """Run every cell (and its retries); returns when all are finished."""
        import ray

        if not ray.is_initialized():
            if self.address:
                try:
                    ray.init(address=self.address, log_to_driver=False)
                except ConnectionError as exc:  # `auto` with no cluster on this machine
                    reason = str(exc).split(". ")[0].rstrip(".")
                    raise RuntimeFailure(
                        f"no Ray cluster at --ray-address {self.address} ({reason}): "
                        f"{_ADDRESS_HELP}"
                    ) from None
            else:
                # A local cluster for this sweep only: no dashboard (halves ray.init's time).
                ray.init(num_cpus=self.num_cpus, log_to_driver=False, include_dashboard=False)
        remote = ray.remote(attempt_cell)
        gpus_total = ray.cluster_resources().get("GPU", 0)
        node_cpus = smallest_node_cpus(ray.nodes())

        def submit(cell: Cell):
            on_start(cell)
            num_gpus = min(cell.gpus, gpus_total) if gpus_total else 0
            num_cpus = 1 if num_gpus else node_cpus
            return remote.options(num_gpus=num_gpus, num_cpus=num_cpus).remote(cell.argv())

        pending = {submit(c): c for c in cells}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(ready[0])
            if on_done(cell, ray.get(ready[0])):
                pending[submit(cell)] = cell
