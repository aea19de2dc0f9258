"""This node's part of a built-in training run over several nodes: its record shard.

The launchers meet through :class:`gpulens.launch.multinode.NodeRendezvous`: node 0's run id
becomes the run's, every node checks it runs the same options, then writes its shard
``<run_id>.node<R>`` (run.json with a ``shard`` marker, one step series per rank). When the run
has ended each node says where its shard lies; node 0 joins them into ``<run_id>`` right away
when they all lie in its own ``GPULENS_HOME`` (a shared filesystem), else the summary says how
to join them with ``gpulens runs join`` (see :mod:`gpulens.record.join`).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulens.launch.multinode import SAME_ON_EVERY_NODE, NodeRendezvous, NodeTopology, network_env
from gpulens.record import schema
from gpulens.record.join import (
    SHARD_KEY,
    join_if_local,
    rank_doc,
    shard_run_id,
    write_rank_steps,
)
from gpulens.record.writer import RunWriter, new_run_id
from gpulens.run import RunResult
from gpulens.workloads.distributed import GroupPlan
from gpulens.workloads.host_ranks import own_samples

log = logging.getLogger(__name__)


@dataclass
class NodeShard:
    """This node's shard: its rendezvous, its record writer and where its ranks meet."""

    topo: NodeTopology
    rendezvous: NodeRendezvous
    writer: RunWriter
    plan: GroupPlan
    network_env: dict[str, str]
    runs_root: Path

    @classmethod
    def open(
        cls,
        topo: NodeTopology,
        eff,
        runs_root: Path,
        kind: str,
        name: str,
        requested: dict[str, Any],
        role: str | None,
    ) -> NodeShard:
        """Meet the other nodes (blocks until they all arrive), then open this node's shard."""
        local = eff.gpus
        rendezvous = NodeRendezvous(topo, local)
        hostname = socket.gethostname()
        facts = {k: getattr(eff, k) for k in SAME_ON_EVERY_NODE}
        run_id = rendezvous.agree(new_run_id(), {**facts, "hostname": hostname})
        first = topo.global_rank(0, local)
        writer = RunWriter(
            runs_root,
            kind=kind,
            name=f"{name}.node{topo.node_rank}",
            requested_config=requested,
            run_id=shard_run_id(run_id, topo.node_rank),
            role=role,
        )
        writer.update(
            **{
                SHARD_KEY: {
                    "run_id": run_id,
                    "node_rank": topo.node_rank,
                    "nnodes": topo.nnodes,
                    "hostname": hostname,
                    "ranks": list(range(first, first + local)),
                    "source": topo.source,
                    "hosts": rendezvous.hostnames(),
                }
            }
        )
        plan = GroupPlan(
            world=local * topo.nnodes,
            port=topo.master_port,
            addr=topo.master_addr,
            rank_offset=first,
            prefix=rendezvous.group_prefix,
        )
        log.info("node %d of %d: run %s, ranks %d..%d", topo.node_rank, topo.nnodes, run_id,
                 first, first + local - 1)  # fmt: skip
        return cls(topo, rendezvous, writer, plan, network_env(topo.master_addr), Path(runs_root))

    def _doc(self, status: str) -> dict[str, Any]:
        return {
            "of_run": self.writer.meta[SHARD_KEY]["run_id"],
            "run_id": self.writer.run_id,
            "record_dir": str(self.writer.dir.resolve()),
            "hostname": socket.gethostname(),
            "status": status,
        }

    def failed(self, exc: BaseException) -> None:
        """Tell node 0 that this shard ended early, so that it does not wait for it."""
        if self.topo.node_rank == 0:
            return
        self.rendezvous.say_ended_early(self._doc(schema.STATUS_FAILED))

    def end(self, result: RunResult) -> RunResult:
        """Report this shard; node 0 joins the shards it sees. The result's summary gains
        ``join``: the joined run id, and its record or how to join by hand."""
        outcome = self.rendezvous.finish(
            self._doc(result.status), lambda shards: join_if_local(shards, self.runs_root)
        )
        if outcome is None:
            outcome = {"joined": False, "run_id": self.writer.meta[SHARD_KEY]["run_id"],
                       "reason": "node 0 did not say whether it joined the shards"}  # fmt: skip
        if not outcome.get("joined"):  # the caller tells the user (gpulens run: once)
            log.info("this node's shard is %s; %s", result.record_dir,
                     outcome.get("hint") or outcome.get("reason"))  # fmt: skip
        return result.with_summary(join=outcome)


def record_ranks(
    writer: RunWriter,
    plan: GroupPlan,
    eff,
    rank_steps: Mapping[int, tuple[list[dict[str, Any]], float]],
    summary: dict[str, Any],
) -> dict[str, Any]:
    """Each of this node's ranks: its step series, and its figures in the summary's ``ranks``
    (with its node and hostname) for the straggler check of the joined run."""
    marker = writer.meta.get(SHARD_KEY) or {}
    node, host = marker.get("node_rank", 0), marker.get("hostname") or socket.gethostname()
    docs = []
    for rank, (rows, wall_s) in sorted(rank_steps.items()):
        write_rank_steps(writer, rank, own_samples(rows, rank, eff.batch_size))
        local = rank - plan.rank_offset
        docs.append(rank_doc(rank, local, node, host, rows, eff.batch_size, wall_s))
    extra = {"ranks": docs, "world_size": plan.world, "nnodes": marker.get("nnodes"),
             "node_rank": node}  # fmt: skip
    writer.update(summary=extra)
    return {**summary, **extra}
