"""What a stage server does about the requests it refuses: counts them by why (its status), tells
a sender's first refusal of each kind in its events, and bans, for a while, a sender that is to
blame for its bytes (a malformed message or payload: no honest peer sends one) or whose refused
requests cost this peer more CPU than its budget (swarm.transport.hivemind.net.cpu). A banned
sender's next requests are turned away before anything of them is read.

Only what a request itself did counts against its sender: an error another peer replied with (a
stage relays its downstream's) is nobody's fault here.
"""

from __future__ import annotations

import logging
from collections import Counter

from protocols import stage_pb2 as pb
from protocols.errors import MalformedMessage, ProtocolError, RemoteError, Replied, SenderFault, one_line
from swarm.transport.hivemind.net.bans import Bans
from swarm.transport.hivemind.net.cpu import RefusalBudget
from swarm.transport.hivemind.net.events import EventLog

log = logging.getLogger(__name__)

MALFORMED = ("malformed payload", "malformed message")  # the sender's own bytes: it is banned


def category(e: BaseException) -> str | None:
    """What a failed request says of its sender: not allowed, or malformed; None for the errors of
    a working swarm (a peer not ready, at another step, a link to restart, a downstream failure)."""
    if isinstance(e, SenderFault):  # its own payload: not a reply from further down the chain
        return "malformed payload"
    if isinstance(e, RemoteError):
        return "not allowed" if e.code == pb.REFUSED else None
    if isinstance(e, MalformedMessage):
        return "malformed message"
    return "malformed request" if isinstance(e, ProtocolError) else None


class Refusals:
    def __init__(self, settings, events: EventLog) -> None:
        retries, limits = settings.retries, settings.limits
        self.events = events
        self.banned = Bans(retries.ban_s, retries.ban_growth, retries.ban_max_s)
        self.counted: Counter = Counter()  # requests refused, by `category` (status: peers.status)
        self.cpu = RefusalBudget(limits.refusal_cpu_share, limits.refusal_cpu_window_s)
        self._told: set[tuple[str, str]] = set()  # (sender, category) pairs already in the events

    def turned_away(self, sender: str) -> pb.ErrorReply | None:
        """The reply to a banned sender's request, which is not read at all."""
        if not self.banned.banned(sender):
            return None
        self.counted["not allowed"] += 1
        why = "its requests were malformed or cost too much to refuse"
        return pb.ErrorReply(message=f"peer {sender[-8:]} is banned for a while: {why}", code=pb.REFUSED)

    def refused(self, sender: str, kind: str, e: BaseException) -> str | None:
        """Counts a failed request `kind` of `sender`'s; bans the sender of malformed bytes. Its
        category (None: no refusal, a working swarm's error)."""
        reason = category(e)
        if reason is None:
            return None
        self.counted[reason] += 1
        self._tell(sender, reason, kind, e)
        if reason in MALFORMED:
            self._ban(sender, f"{kind} from {sender[-8:]} was malformed")
        return reason

    def charge(self, sender: str, kind: str, seconds: float, e: BaseException | None) -> None:
        """What a request cost (`e`: why it failed, None: served); a refusal of the sender's own
        doing counts toward its CPU budget, and a sender over it is banned."""
        self.cpu.served(sender, seconds)
        if e is None or isinstance(e, Replied) or category(e) is None:
            return
        if self.cpu.refused(sender, seconds) and not self.banned.banned(sender):
            share = f"{self.cpu.share:g} of a core over {self.cpu.window_s:g}s"
            self._ban(sender, f"refusing {kind} requests from {sender[-8:]} cost more than {share}")

    def _ban(self, sender: str, why: str) -> None:
        self.banned.prune()
        seconds = self.banned.fail(sender)
        self.events.add("ban", f"{why}: refused for {seconds:.0f}s", logging.WARNING, log)

    def _tell(self, sender: str, reason: str, kind: str, e: BaseException) -> None:
        """An event for a sender's first refusal of each kind (a stranger retrying makes no flood)."""
        if (sender, reason) in self._told:
            return
        if len(self._told) > 4096:
            self._told.clear()
        self._told.add((sender, reason))
        self.events.add("refuse", f"{kind} from {sender[-8:]} refused ({reason}): {one_line(e)}")
