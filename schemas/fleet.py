"""Fleet membership that changes while kvmiss runs: the one vocabulary shared by the
membership sources (collectors: a watched file, DNS, publishers that connect out) and the
proof rules that use it (enricher/core: who could have held a block at a lookup time).

A source never says *when* the router stopped choosing a worker; at best it says when it
changed its own answer. A change was made in (``since``, ``at``] on kvmiss's wall clock
(seconds): ``at`` where the source knows it (a fleet file's ctime), else when an answer
showed it (a DNS resolution, a poll); ``since`` the previous answer, which did not show it.
The proof rules treat that interval and a band either side as uncertain (docs/HISTORY.md,
"Fleets that change").
"""

from __future__ import annotations

import enum

import msgspec

from kvmiss.schemas.config import WorkerSpec


class MemberState(str, enum.Enum):
    """A worker's place in the fleet, as `kvmiss_fleet_workers{state}` shows it."""

    FOLLOWING = "following"  # a member whose stream is applied
    JOINING = "joining"  # a member not yet followed (connecting, or replaying its history)
    UNREACHABLE = "unreachable"  # a member whose stream never connected or died: an unresolved holder
    DEPARTED = "departed"  # left the fleet; kept read-only for lookups before it left, then released


class Reach(str, enum.Enum):
    """Whether kvmiss reaches a member's event stream, as /readyz and verdict reasons say it."""

    CONNECTED = "connected"  # its publisher is connected (idle or publishing)
    CONNECTING = "connecting"  # not yet, within the grace after start-up or its join
    NEVER_CONNECTED = "never_connected"  # not once since kvmiss started following it
    DISCONNECTED = "disconnected"  # connected before, not now


class Unreachable(str, enum.Enum):
    """Why a member's stream is not connected (low cardinality: a metric label)."""

    REFUSED = "connection_refused"  # the host answered: nothing listens on that port
    UNRESOLVED = "name_not_resolved"  # the host name does not resolve
    NO_ANSWER = "no_answer"  # no reply to a connection attempt (a firewall, no route, a dead host)
    NO_HANDSHAKE = "no_handshake"  # TCP connects, but no ZeroMQ publisher answers on it
    NOT_OPENED = "socket_not_opened"  # kvmiss could not open its socket (a bad endpoint, a bind in use)
    NO_PUBLISHER = "no_publisher_connected"  # kvmiss binds: no publisher has connected to it
    NO_SUCH_PATH = "no_such_path"  # an ipc:// path that does not exist
    NETWORK_ERROR = "network_error"  # any other socket error


class StreamReach(msgspec.Struct, frozen=True, kw_only=True):
    """A member's reachability at one moment: its state, since when (kvmiss clock), and why."""

    state: Reach
    since: float | None = None
    cause: Unreachable | None = None
    detail: str = ""  # the error as the system said it (never a secret: addresses and errno text)

    @property
    def blind(self) -> bool:
        return self.state in (Reach.NEVER_CONNECTED, Reach.DISCONNECTED)


class FleetChange(msgspec.Struct, frozen=True, kw_only=True):
    """One change of the fleet as one source saw it: workers that joined (their full spec)
    and workers that departed (by id), made by ``at`` and after ``since`` (kvmiss clock,
    seconds; None: exactly at ``at``).

    A spec whose id is already a member with a different endpoint is a departure of the old
    and a join of the new under the same id: a new epoch, nothing carried over.
    """

    at: float
    source: str  # "static", "file", "dns", "topic"
    since: float | None = None
    joined: tuple[WorkerSpec, ...] = ()
    departed: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.joined and not self.departed
