"""The engine registry: registered workers by engine id and TP rank, and their leases.

Plain bookkeeping, no transfer logic: `state.DirectoryState` decides what a removal means for
transfers. A worker lives from `add()` until `remove()`; `lapsed(now)` lists workers whose lease
ran out (the reaper removes them); `extend_all()` moves every lease on after a directory stall.
"""

from __future__ import annotations

import math
import re
import uuid

from kvpush.directory.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvpush.directory.records import Clock, EngineGroup, Limits, Worker, copy_message
from kvpush.directory.validation import same_layout_shape
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

_RANK = re.compile("[0-9]{1,9}")


class EngineRegistry:
    """Workers grouped by engine id, with a lease index."""

    def __init__(self, limits: Limits, clock: Clock) -> None:
        self.limits = limits
        self.clock = clock
        self.groups: dict[str, EngineGroup] = {}
        self.leases: dict[str, Worker] = {}
        # NIXL agent name -> the worker registered under it (agent names are unique among registrations).
        self.agents: dict[str, Worker] = {}
        self.worker_count = 0

    def existing(self, request: dpb.RegisterEngineRequest, now: float) -> Worker | None:
        """The worker now holding the request's engine id and rank (live or lapsed), after consistency checks.

        Raises InvalidArgument when role, tp_size or layout disagree with the engine's other ranks, and
        AlreadyExists when a live lease of another agent holds the rank or another worker holds the agent name.
        """
        holder = self.agents.get(request.agent_name)
        if holder is not None and (holder.engine_id, holder.tp_rank) != (request.engine_id, request.tp_rank) \
                and holder.lease_deadline >= now:
            raise AlreadyExists(f"agent name {request.agent_name!r} is registered by another worker")
        group = self.groups.get(request.engine_id)
        if group is None:
            return None
        if group.role != request.role or group.tp_size != request.tp_size:
            raise InvalidArgument(
                f"engine {request.engine_id!r} is registered with role {tpb.EngineRole.Name(group.role)} "
                f"and tp_size {group.tp_size}; this request says {tpb.EngineRole.Name(request.role)} "
                f"and {request.tp_size}")
        worker = group.workers.get(request.tp_rank)
        if worker is not None and worker.lease_deadline >= now and worker.agent_name != request.agent_name:
            raise AlreadyExists(
                f"engine {request.engine_id!r} rank {request.tp_rank} is registered with agent {worker.agent_name!r}")
        others = [w for rank, w in group.workers.items() if rank != request.tp_rank]
        if others:
            why = same_layout_shape(others[0].layout, request.layout)
            if why:
                raise InvalidArgument(f"ranks of engine {request.engine_id!r} must agree on layout: {why}")
        return worker

    def add(self, request: dpb.RegisterEngineRequest, now: float) -> Worker:
        """Register a new worker with a fresh lease (the rank must be free)."""
        if self.worker_count >= self.limits.max_workers:
            raise ResourceExhausted(f"{self.worker_count} workers registered; the cap is {self.limits.max_workers}")
        group = self.groups.get(request.engine_id)
        if group is None:
            group = self.groups[request.engine_id] = EngineGroup(request.engine_id, request.role, request.tp_size)
        wall = self.clock.wall()
        worker = Worker(
            engine_id=request.engine_id, tp_rank=request.tp_rank, role=request.role, tp_size=request.tp_size,
            agent_name=request.agent_name, agent_metadata=bytes(request.agent_metadata),
            layout=copy_message(request.layout), endpoint=request.endpoint, model=request.model,
            forces_first_token=request.forces_first_token,
            lease_id=uuid.uuid4().hex,
            lease_deadline=now + self.limits.lease_ttl_s, register_wall=wall,
            lease_deadline_wall=wall + self.limits.lease_ttl_s, renewed_at=now,
        )
        group.workers[request.tp_rank] = worker
        self.leases[worker.lease_id] = worker
        self.agents[worker.agent_name] = worker
        self.worker_count += 1
        return worker

    def refresh(self, worker: Worker, request: dpb.RegisterEngineRequest, now: float) -> None:
        """A live worker registered again (same agent): a FRESH lease replaces the old one, which stops working.

        A lease id is handed out once; the registration's metadata, layout and endpoint become the request's.
        """
        self.leases.pop(worker.lease_id, None)
        worker.lease_id = uuid.uuid4().hex
        self.leases[worker.lease_id] = worker
        worker.agent_metadata = bytes(request.agent_metadata)
        worker.layout = copy_message(request.layout)
        worker.endpoint = request.endpoint
        worker.forces_first_token = request.forces_first_token
        self.extend(worker, now)
        self.groups[worker.engine_id].unreachable = None

    def extend(self, worker: Worker, now: float) -> None:
        """Give a worker's lease a whole TTL from now."""
        worker.lease_deadline = now + self.limits.lease_ttl_s
        worker.lease_deadline_wall = self.clock.wall() + self.limits.lease_ttl_s
        if math.isfinite(worker.renewed_at):  # a mirrored registration stays never-late (Worker.renewed_at)
            worker.renewed_at = now

    def extend_all(self, seconds: float) -> None:
        """Move every lease deadline (and last renewal) on by `seconds` (the directory itself could not take
        renewals)."""
        for worker in self.leases.values():
            worker.lease_deadline += seconds
            worker.lease_deadline_wall += seconds
            worker.renewed_at += seconds

    def renew(self, lease_id: str, load: tpb.EngineLoad | None) -> Worker:
        """Renew a live lease and record the load; NotFound for an unknown or lapsed lease.

        A renewal shows the engine is alive again: it clears a standing unreachable report.
        """
        worker = self.leases.get(lease_id)
        now = self.clock.monotonic()
        if worker is None or worker.lease_deadline < now:
            raise NotFound(f"lease {lease_id!r} is unknown or expired")
        self.extend(worker, now)
        self.groups[worker.engine_id].unreachable = None
        if load is not None:
            worker.load = copy_message(load)
        return worker

    def worker(self, engine_id: str, tp_rank: int) -> Worker:
        """A registered worker; NotFound otherwise."""
        group = self.groups.get(engine_id)
        worker = group.workers.get(tp_rank) if group is not None else None
        if worker is None:
            raise NotFound(f"engine {engine_id!r} rank {tp_rank} is not registered")
        return worker

    def remove(self, worker: Worker) -> EngineGroup:
        """Drop a worker and its lease; returns its engine group (gone from the registry if now empty)."""
        group = self.groups[worker.engine_id]
        del group.workers[worker.tp_rank]
        self.leases.pop(worker.lease_id, None)
        if self.agents.get(worker.agent_name) is worker:
            del self.agents[worker.agent_name]
        self.worker_count -= 1
        worker.outbox.clear()
        worker.session_id = 0
        if not group.workers:
            del self.groups[worker.engine_id]
        return group

    def lapsed(self, now: float) -> list[Worker]:
        """Workers whose lease ran out before `now`."""
        return [w for w in self.leases.values() if w.lease_deadline < now]

    def workers_of(self, engine_id: str) -> list[Worker]:
        """Registered workers of one engine in rank order; NotFound when none."""
        group = self.groups.get(engine_id)
        if group is None:
            raise NotFound(f"engine {engine_id!r} is not registered")
        return [group.workers[rank] for rank in sorted(group.workers)]

    def list_workers(self, page_size: int, page_token: str, role: int) -> tuple[list[Worker], str]:
        """One page of workers ordered by (engine id, rank); returns the next page token ("" at the end)."""
        after: tuple[str, int] | None = None
        if page_token:
            rank_text, sep, engine_id = page_token.partition(":")
            if not sep or not _RANK.fullmatch(rank_text):
                raise InvalidArgument("page_token is not a token this server issued")
            after = (engine_id, int(rank_text))
        keys = sorted((w.engine_id, w.tp_rank) for g in self.groups.values() for w in g.workers.values()
                      if role == tpb.ENGINE_ROLE_UNSPECIFIED or g.role == role)
        if after is not None:
            keys = [k for k in keys if k > after]
        page = keys[:page_size]
        next_token = ""
        if len(keys) > page_size:
            last_engine, last_rank = page[-1]
            next_token = self.page_token_after(self.groups[last_engine].workers[last_rank])
        return [self.groups[e].workers[r] for e, r in page], next_token

    @staticmethod
    def page_token_after(worker: Worker) -> str:
        """The page token that continues a listing after `worker`."""
        return f"{worker.tp_rank}:{worker.engine_id}"

    def candidates(self, role: int, pinned: str) -> list[EngineGroup]:
        """Engines of a role with every rank registered: the pinned one (checked), or all of them."""
        name = tpb.EngineRole.Name(role)
        if pinned:
            group = self.groups.get(pinned)
            if group is None:
                raise NotFound(f"engine {pinned!r} is not registered")
            if group.role != role:
                raise FailedPrecondition(f"engine {pinned!r} is not a {name} engine")
            if not group.complete:
                raise FailedPrecondition(
                    f"engine {pinned!r} has {len(group.workers)} of {group.tp_size} ranks registered")
            return [group]
        groups = [g for g in self.groups.values() if g.role == role and g.complete]
        if not groups:
            raise ResourceExhausted(f"no {name} engine is registered with all its ranks")
        # Engines a gateway could not reach are left out, unless every one was reported: a report may be
        # mistaken (a stale pooled connection), and planning a marked engine beats planning none.
        reachable = [g for g in groups if g.unreachable is None]
        return reachable or groups

    def late_since(self, group: EngineGroup, now: float) -> float | None:
        """How long ago the engine's stalest worker last renewed, when that is past the late bound
        (`Limits.late_renewal_fraction` of the lease TTL: a frozen or starved engine); None when on time."""
        since = now - group.last_renewal()
        return since if since > self.limits.lease_ttl_s * self.limits.late_renewal_fraction else None
