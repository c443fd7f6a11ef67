"""What the coordinator needs of a node agent, and what it may raise: the protocol a `NodeAgent`, its Ray
proxy (`ray_actors.RayAgentProxy`) and the fake (`fake.FakeAgent`) all implement. No process, no Ray."""

from __future__ import annotations

from typing import Protocol

from horizon_ray.cluster.messages import AgentJobReport, Launch, NodeInfo, Reservation

# An agent that has not heard from the coordinator for this long stops its engines. Longer than a coordinator
# restart (its actor reloads the job table and polls again within seconds); the coordinator waits this long
# (and the kill grace) after it last heard from a lost node before it starts that node's jobs elsewhere.
ENGINE_LEASE_S = 60.0


class AgentUnavailable(Exception):
    """The agent could not be reached. `definitive`: it is known dead (not merely slow)."""

    def __init__(self, message: str, *, definitive: bool = False):
        super().__init__(message)
        self.definitive = definitive


class ReservationRefused(Exception):
    """The agent's ledger has no room for the job (the coordinator's view was stale), or it is draining."""


class Agent(Protocol):
    """What the coordinator needs from a node agent (a `NodeAgent`, a Ray proxy to one, or a fake)."""

    def info(self) -> NodeInfo: ...

    def start(self, launch: Launch) -> Reservation:
        """Reserve and launch; returns the reservation (with its GPU index and cores)."""
        ...

    def cancel(self, job_id: str) -> None: ...

    def poll(self, offsets: dict[str, int]) -> dict[str, AgentJobReport]: ...

    def forget(self, job_id: str) -> None: ...
