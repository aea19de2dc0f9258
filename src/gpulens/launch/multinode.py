"""Runs that span several nodes: where this node stands, and how the nodes meet.

gpulens starts one launcher per node (by hand with ``--nnodes M --node-rank R --master-addr A``,
by ``torchrun --nproc-per-node 1``, or by ``srun --ntasks-per-node 1``); each launcher spawns
its ``--gpus N`` training processes as today, numbered globally ``R * N + local rank``.

The launcher of node 0 serves one TCPStore at ``master_addr:master_port`` (bound to that address
only), unless torchrun's agent already serves one there. Over it the launchers agree on one run
id (node 0's), check that every node runs the same options, and later say where their record
shard lies; the training processes join their process group through the same store. Each node
writes its own shard ``<run_id>.node<R>`` (see :mod:`gpulens.record.join`).

Torch-free at import: ``torch.distributed`` is imported where the store is opened.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpulens.errors import RuntimeFailure, UsageError

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
SOURCES = ("flags", "torchrun", "slurm")
RENDEZVOUS_TIMEOUT_ENV = "GPULENS_RENDEZVOUS_TIMEOUT_S"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0  # nodes of one job may start minutes apart
BYE_WAIT_S = 5.0
NOTICE_AFTER_S = 5.0  # a node still waiting for the others after this says so on stderr
POLL_S = 0.2
# Options every node must run alike (the ranks would deadlock otherwise); data paths and
# storage emulation may differ per node.
SAME_ON_EVERY_NODE = (
    "workload", "gpus", "batch_size", "steps", "duration_s", "warmup_steps", "precision",
    "until_ci_pct", "backend",
)  # fmt: skip
# Distributed runs this launcher made, per topology: every node counts alike (the key prefix).
_runs_made: dict[tuple[str, int, int], int] = {}


@dataclass(frozen=True)
class NodeTopology:
    """This node's place in a run over ``nnodes`` nodes."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT
    source: str = "flags"  # where it came from: one of SOURCES
    agent_store: bool = False  # torchrun's agent already serves the store at the master

    def __post_init__(self) -> None:
        if self.nnodes < 2:
            raise UsageError(f"--nnodes must be 2 or more for a multi-node run, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is not in 0..{self.nnodes - 1}: give each of the "
                f"{self.nnodes} nodes its own --node-rank from 0 to {self.nnodes - 1}"
            )
        if not self.master_addr or not self.master_addr.strip():
            raise UsageError(
                f"--nnodes {self.nnodes} needs --master-addr: the address of node 0, which "
                "every node can reach"
            )
        if not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown topology source {self.source!r}")

    def global_rank(self, local_rank: int, procs_per_node: int) -> int:
        return self.node_rank * procs_per_node + local_rank

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = (env.get(name) or "").strip()
        if raw:
            try:
                return int(raw.split("(")[0])  # SLURM_TASKS_PER_NODE style "2(x3)"
            except ValueError:
                raise UsageError(f"{name}={raw!r} is not an integer: fix the environment") from None
    return None


def resolve_topology(
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> NodeTopology | None:
    """This node's topology from the flags, else torchrun's or Slurm's environment; None for a
    run on one node. Bad combinations are a UsageError naming the fix."""
    env = os.environ if env is None else env
    if nnodes is None and (node_rank is not None or master_addr or master_port is not None):
        given = "--node-rank" if node_rank is not None else "--master-addr/--master-port"
        raise UsageError(f"{given} needs --nnodes M (the number of nodes of the run)")
    if nnodes is not None:
        if nnodes < 1:
            raise UsageError(f"--nnodes must be 1 or more, got {nnodes}")
        if nnodes == 1:
            if node_rank:
                raise UsageError(f"--node-rank {node_rank} is not in 0..0 with --nnodes 1")
            return None
        if not master_addr:
            raise UsageError(
                f"--nnodes {nnodes} needs --master-addr: the address of node 0, which every "
                "node can reach"
            )
        if node_rank is None:
            raise UsageError(
                f"--nnodes {nnodes} needs --node-rank R: 0 on the node at --master-addr, "
                f"1..{nnodes - 1} on the others"
            )
        return NodeTopology(nnodes, node_rank, master_addr, master_port or DEFAULT_MASTER_PORT)
    if env.get("TORCHELASTIC_RUN_ID") is not None or env.get("GROUP_RANK") is not None:
        return _from_torchrun(env)
    if env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEPID") is not None:
        return _from_slurm(env)
    return None


def _from_torchrun(env: Mapping[str, str]) -> NodeTopology | None:
    local_world = _int(env, "LOCAL_WORLD_SIZE") or 1
    if local_world > 1:
        raise UsageError(
            f"torchrun started {local_world} gpulens processes on this node: gpulens starts one "
            "process per GPU itself; use torchrun --nproc-per-node 1 ... gpulens run ... --gpus N"
        )
    nnodes = _int(env, "GROUP_WORLD_SIZE", "WORLD_SIZE") or 1
    if nnodes == 1:
        return None
    node_rank = _int(env, "GROUP_RANK", "NODE_RANK", "RANK")
    if node_rank is None or not env.get("MASTER_ADDR"):
        raise UsageError("torchrun set no GROUP_RANK or MASTER_ADDR: give --nnodes, --node-rank "
                         "and --master-addr instead")  # fmt: skip
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    port = _int(env, "MASTER_PORT") or DEFAULT_MASTER_PORT
    return NodeTopology(nnodes, node_rank, env["MASTER_ADDR"], port, "torchrun", agent)


def _from_slurm(env: Mapping[str, str]) -> NodeTopology | None:
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    if nnodes == 1:
        return None
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or nnodes
    if tasks != nnodes:
        raise UsageError(
            f"Slurm started {tasks} gpulens tasks on {nnodes} nodes: gpulens starts one process "
            "per GPU itself; use srun --ntasks-per-node 1 gpulens run ... --gpus N"
        )
    node_rank = _int(env, "SLURM_NODEID", "SLURM_PROCID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    master = env.get("MASTER_ADDR") or first_host(nodelist)
    if node_rank is None or not master:
        raise UsageError("Slurm set no SLURM_NODEID or node list: give --nnodes, --node-rank "
                         "and --master-addr instead")  # fmt: skip
    port = _int(env, "MASTER_PORT")
    if port is None:  # one port per job, so two jobs sharing a node do not meet by mistake
        port = 20000 + (_int(env, "SLURM_JOB_ID") or 0) % 20000
    return NodeTopology(nnodes, node_rank, master, port, "slurm")


def first_host(nodelist: str) -> str | None:
    """The first host of a Slurm node list: ``gpu[07-09,12],cpu1`` gives ``gpu07``."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist or "")
    if not m:
        return None
    prefix, ranges = m.group(1).strip(), m.group(2)
    if not ranges:
        return prefix or None
    return prefix + ranges.split(",")[0].split("-")[0]


# ----------------------------------------------------------------------------- network
def resolve_ipv4(addr: str) -> str:
    try:
        return socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        raise UsageError(
            f"--master-addr {addr} does not resolve: give node 0's IP address"
        ) from None


def loopback_alias(addr: str, ip: str) -> bool:
    """A host name that resolves to the loopback here (Debian's ``127.0.1.1 <hostname>``)
    while the other nodes resolve it to the network: neither bind nor route by it."""
    import ipaddress

    try:
        ipaddress.ip_address(addr)
        return False  # an address given as such means what it says (127.0.0.1: one machine)
    except ValueError:
        return ipaddress.ip_address(ip).is_loopback


def route_interface(master_addr: str) -> str | None:
    """The interface this node reaches the master through ("lo" for 127.0.0.1), or None."""
    import psutil

    ip = resolve_ipv4(master_addr)
    if loopback_alias(master_addr, ip):
        return None  # gloo and NCCL choose as they do by default
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # UDP: picks the route, sends nothing
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


def network_env(master_addr: str) -> dict[str, str]:
    """gloo's and NCCL's socket interface: the one toward the master, unless the user chose."""
    iface = route_interface(master_addr)
    if iface is None:
        return {}
    return {k: iface for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ}


def rendezvous_timeout_s() -> float:
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, "").strip()
    try:
        return max(1.0, float(raw)) if raw else DEFAULT_RENDEZVOUS_TIMEOUT_S
    except ValueError:
        raise UsageError(f"{RENDEZVOUS_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


# ----------------------------------------------------------------------------- rendezvous
class NodeRendezvous:
    """The launchers' store: node 0 serves it (or torchrun's agent does), the others connect.

    ``prefix`` keeps the keys of one distributed run apart from the next one's on a store that
    outlives it (torchrun's agent store, ``gpulens stalls`` making two runs)."""

    def __init__(self, topo: NodeTopology, procs_per_node: int):
        self.topo, self.procs_per_node = topo, procs_per_node
        key = (topo.master_addr, topo.master_port, topo.node_rank)
        self.prefix = f"gpulens/{_runs_made.get(key, 0)}/"
        _runs_made[key] = _runs_made.get(key, 0) + 1
        self.timeout_s = rendezvous_timeout_s()
        self.store = self._open()

    @property
    def serves(self) -> bool:
        return self.topo.node_rank == 0 and not self.topo.agent_store

    @property
    def group_prefix(self) -> str:
        """The prefix of the training processes' process group on this store."""
        return self.prefix + "pg/"

    def _open(self):
        import torch.distributed as dist

        topo = self.topo
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if not self.serves:
            try:
                left_s = self._await_node0()
                left = datetime.timedelta(seconds=max(1.0, left_s))
                return dist.TCPStore(topo.master_addr, topo.master_port, None, False, left)
            except (RuntimeError, dist.DistStoreError, OSError) as exc:
                raise RuntimeFailure(
                    f"node {topo.node_rank} could not reach node 0 at {topo.master_addr}:"
                    f"{topo.master_port} within {self.timeout_s:.0f} s ({_first_line(exc)}); "
                    "start node 0 too, or check --master-addr, --master-port and the firewall"
                ) from None
        ip = resolve_ipv4(topo.master_addr)
        if loopback_alias(topo.master_addr, ip):
            log.warning("gpulens: %s is %s on this node: the rendezvous listens on every "
                        "interface", topo.master_addr, ip)  # fmt: skip
            ip = "0.0.0.0"
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((ip, topo.master_port))
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"port {topo.master_port} on {ip} is in use: give another "
                                 "--master-port (the same on every node)") from None  # fmt: skip
            raise UsageError(
                f"--master-addr {topo.master_addr} ({ip}) is not an address of this machine, "
                "but node 0 serves the rendezvous there: give node 0 its own address"
            ) from None
        listener.listen(128)
        fd = listener.detach()
        return dist.TCPStore(
            ip, topo.master_port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd
        )

    def _say_waiting(self, whom: str) -> None:
        """One line on stderr while a node waits (silent, a mistyped --master-port looked like
        a hang of ten minutes and more)."""
        topo = self.topo
        log.warning(
            "gpulens: node %d: waiting for %s at %s:%d (at most %.0f s, %s)", topo.node_rank,
            whom, topo.master_addr, topo.master_port, self.timeout_s, RENDEZVOUS_TIMEOUT_ENV,
        )  # fmt: skip

    def _await_node0(self) -> float:
        """Wait until node 0's port accepts a connection; the seconds left of the timeout.
        Polled here, not in TCPStore's own connect: that retried for twice the timeout and
        printed c10d's C++ stack frames on the way."""
        topo, t0 = self.topo, time.monotonic()
        said = False
        while True:
            left = self.timeout_s - (time.monotonic() - t0)
            try:
                socket.create_connection(
                    (topo.master_addr, topo.master_port), min(2.0, left)
                ).close()
                return left
            except OSError:
                if time.monotonic() - t0 + POLL_S >= self.timeout_s:
                    raise
            if not said and time.monotonic() - t0 >= NOTICE_AFTER_S:
                self._say_waiting("node 0")
                said = True
            time.sleep(POLL_S)

    # --- key-value exchange ----------------------------------------------------------------
    def _set(self, key: str, doc: Any) -> None:
        self.store.set(self.prefix + key, json.dumps(doc))

    def _get_all(
        self, key: str, timeout_s: float, nodes: range | None = None, notice: bool = False
    ) -> dict[int, Any] | None:
        """``key/<node>`` of every node (or of ``nodes``), or None when one is missing after
        ``timeout_s``; ``notice``: say on stderr which nodes it waits for after a few seconds.
        Polled (``check``), not ``wait``: a wait that times out prints c10d's warnings."""
        nodes = range(self.topo.nnodes) if nodes is None else nodes
        keys = {r: f"{self.prefix}{key}/{r}" for r in nodes}
        t0 = time.monotonic()
        try:
            while not self.store.check(list(keys.values())):
                waited = time.monotonic() - t0
                if waited >= timeout_s:
                    return None
                if notice and waited >= NOTICE_AFTER_S:
                    missing = [str(r) for r, k in keys.items() if not self.store.check([k])]
                    self._say_waiting(f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
                    notice = False
                time.sleep(POLL_S)
            return {r: json.loads(self.store.get(k)) for r, k in keys.items()}
        except Exception as exc:  # a store gone (node 0 ended) or a timeout: nothing more
            log.debug("rendezvous: %s not from every node: %s", key, exc)
            return None

    def agree(self, proposed_run_id: str, facts: Mapping[str, Any]) -> str:
        """Node 0's run id, once every node has said it runs the same options (``facts``:
        ``SAME_ON_EVERY_NODE`` and ``hostname``); a UsageError names the first difference."""
        topo = self.topo
        if topo.node_rank == 0:
            self._set("run_id", proposed_run_id)
        self._set(f"node/{topo.node_rank}", dict(facts))
        nodes = self._get_all("node", self.timeout_s, notice=True)
        if nodes is None:
            raise RuntimeFailure(
                f"not every one of the {topo.nnodes} nodes arrived within {self.timeout_s:.0f} s "
                f"(at {topo.master_addr}:{topo.master_port}): start gpulens on every node with "
                f"the same --nnodes and --master-port, or raise {RENDEZVOUS_TIMEOUT_ENV}"
            )
        for r in sorted(nodes):
            for name in SAME_ON_EVERY_NODE:
                mine, theirs = nodes[0].get(name), nodes[r].get(name)
                if mine != theirs:
                    raise UsageError(
                        f"node {r} runs {name}={theirs} but node 0 {name}={mine}: give every node "
                        "the same options (--data and storage emulation may differ)"
                    )
        self.nodes = nodes
        return json.loads(self.store.get(self.prefix + "run_id"))

    def hostnames(self) -> dict[int, str]:
        return {r: str(doc.get("hostname")) for r, doc in getattr(self, "nodes", {}).items()}

    def finish(self, shard: Mapping[str, Any], join) -> dict[str, Any] | None:
        """Say where this node's shard lies; node 0 waits for every node's (at most
        ``rank_wait_s``), calls ``join(shards by node)`` and tells the others what it made.
        Returns the join's outcome as node 0 reported it (None when unknown)."""
        from gpulens.workloads.tracking_ranks import rank_wait_s

        topo = self.topo
        wait_s = rank_wait_s()
        try:
            self._set(f"done/{topo.node_rank}", dict(shard))
        except Exception as exc:
            log.warning("gpulens: could not tell node 0 where this shard lies: %s", exc)
            return None
        if topo.node_rank != 0:
            outcome = self._get_all("joined", wait_s, range(1))  # only node 0 sets it
            self._safe_set(f"bye/{topo.node_rank}", True)
            return outcome[0] if outcome else None
        shards = self._get_all("done", wait_s)
        outcome = join(shards) if shards is not None else None
        if outcome is None:
            outcome = {"joined": False, "reason": "not every node reported its shard"}
        self._safe_set("joined/0", outcome)
        self._wait_bye()
        return outcome

    def say_ended_early(self, shard: Mapping[str, Any]) -> None:
        """Tell node 0 that this node's shard ended early (failed), so that it does not wait
        for it; never raises (the store may be gone with node 0)."""
        self._safe_set(f"done/{self.topo.node_rank}", dict(shard))

    def _safe_set(self, key: str, doc: Any) -> None:
        try:
            self._set(key, doc)
        except Exception as exc:
            log.debug("rendezvous: could not set %s: %s", key, exc)

    def _wait_bye(self) -> None:
        """Node 0 serves the store: it waits (briefly) until the others have read the end."""
        deadline = time.monotonic() + BYE_WAIT_S
        keys = [f"{self.prefix}bye/{r}" for r in range(1, self.topo.nnodes)]
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return
            except Exception:
                return
            time.sleep(0.05)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(exc).__name__
