"""`python -m swarm bench fuzz`: malformed messages at a run's stage peers while it trains.

An in-process swarm (a bootstrap peer, one host per stage, the trainer) trains a config while a
fuzzer, a stranger on the DHT that also holds a stolen admission to each stage's previous stage,
sends `count` malformed messages (swarm.bench.fuzz_cases) to the stage peers, each on a new stream,
several at once, kind after kind (swarm.bench.fuzz_campaign), and floods of 2 MiB messages it holds
open (swarm.bench.fuzz_floods). Every message must be answered by a one-line error or a closed
stream within the peer's limits (a hang is counted), no peer may stop serving, the run's losses
must equal the single-process run's, and this process's memory may grow by at most the documented
bound (docs/security.md). It prints the outcomes per category, and the CPU the stage peers spent on
each kind of message (swarm.transport.hivemind.net.cpu).
"""

from __future__ import annotations

import asyncio
import re
import resource
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from protocols.errors import ProtocolError, RemoteError
from protocols.framing import read_frame
from swarm.bench.fuzz_cases import Case
from swarm.transport.hivemind.net.streams import PeerStream

OUTCOMES = ("refused", "closed", "answered", "hung", "multi-line")


@dataclass
class Cost:
    """What the stage peers spent on one kind of message: CPU seconds, for `messages` of `sent` bytes."""

    messages: int = 0
    sent: int = 0
    cpu_s: float | None = 0.0  # None: not measured (another handler than the stage server's)


@dataclass
class Tally:
    """Outcomes per category: `refused` (a one-line error reply), `closed` (the peer closed the
    stream without one: it could not tell a request in it), `answered` (a reply that is not an
    error: only a stranger's status call may get one), `hung` (nothing within the limit),
    `multi-line` (an error reply of more than one line)."""

    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    slowest_s: float = 0.0
    seconds: Counter = field(default_factory=Counter)  # per category, summed
    answered_kinds: Counter = field(default_factory=Counter)
    reasons: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # refusals' first words
    costs: dict[str, Cost] = field(default_factory=lambda: defaultdict(Cost))  # per kind of message, in order sent
    info_s: list = field(default_factory=list)  # status calls during the floods: seconds to answer (None: failed)

    def add(self, category: str, outcome: str, seconds: float, detail: str = "") -> None:
        self.counts[category][outcome] += 1
        self.slowest_s = max(self.slowest_s, seconds)
        self.seconds[category] += seconds
        if outcome == "answered":
            self.answered_kinds[detail] += 1
        elif detail:
            self.reasons[category][re.sub(r"\b[0-9A-Za-z]{8}\b|\d+", "_", " ".join(detail.split()[:5]))] += 1

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def of(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.counts.values())

    def cost(self, kind: str, messages: int, sent: int, cpu_s: float | None) -> None:
        cost = self.costs[kind]
        cost.messages, cost.sent = cost.messages + messages, cost.sent + sent
        cost.cpu_s = None if cpu_s is None or cost.cpu_s is None else cost.cpu_s + cpu_s

    def cpu_table(self) -> str:
        """The CPU the stage peers spent on each kind of message (its refusal included)."""
        lines = [
            f"{'CPU of the stage peers':<30}{'messages':>9}{'MiB sent':>10}{'CPU s':>9}{'ms each':>9}{'ms/MiB':>9}"
        ]
        for kind, c in self.costs.items():
            mib = c.sent / 2**20
            if c.cpu_s is None:
                lines.append(f"{kind:<30}{c.messages:>9}{mib:>10.1f}  not metered (hivemind's handler)")
                continue
            per_mib = f"{1000 * c.cpu_s / mib:>9.2f}" if mib >= 0.01 else f"{'-':>9}"
            each = 1000 * c.cpu_s / max(c.messages, 1)
            lines.append(f"{kind:<30}{c.messages:>9}{mib:>10.1f}{c.cpu_s:>9.3f}{each:>9.3f}{per_mib}")
        total = sum(c.cpu_s or 0.0 for c in self.costs.values())
        lines.append(f"{'total':<30}{sum(c.messages for c in self.costs.values()):>9}{'':>10}{total:>9.3f}")
        return "\n".join(lines)

    def table(self) -> str:
        lines = [f"{'category':<24}" + "".join(f"{o:>11}" for o in OUTCOMES) + f"{'ms each':>9}"]
        for category in sorted(self.counts):
            n = sum(self.counts[category].values())
            counts = "".join(f"{self.counts[category][o]:>11}" for o in OUTCOMES)
            lines.append(f"{category:<24}{counts}{1000 * self.seconds[category] / n:>9.0f}")
        lines.append(f"{'total':<24}" + "".join(f"{self.of(o):>11}" for o in OUTCOMES))
        lines.append("most common refusal per category:")
        for category in sorted(self.reasons):
            reason, n = self.reasons[category].most_common(1)[0]
            lines.append(f"  {category:<24} {n:>6}x {reason} ...")
        return "\n".join(lines)


async def send(p2p, peer_id: str, case: Case, limit_s: float) -> tuple[str, str]:
    """The peer's answer to one case: (outcome, detail)."""
    if case.handler is not None:  # another handler than the stage protocol's
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), case.handler)
        stream = PeerStream(reader, writer)
    else:
        stream = await PeerStream.open(p2p, peer_id)
    try:
        stream.writer.write(case.data)
        await stream.writer.drain()
        if case.hang_up:
            return "closed", ""
        if not case.stall:
            await stream.end()
        return await answer(stream, limit_s)
    except (ConnectionError, OSError) as e:
        return "closed", str(e)[:80]
    finally:
        stream.close()


async def answer(stream: PeerStream, limit_s: float) -> tuple[str, str]:
    """The peer's reply on `stream` within `limit_s`, as (outcome, detail)."""
    try:
        frame = await asyncio.wait_for(read_frame(stream.replies()), limit_s)
    except TimeoutError:
        return "hung", ""
    except ProtocolError:  # the stream ended before a reply: the peer closed it
        return "closed", ""
    except RemoteError as e:  # a hivemind handler's error reply
        return _refusal(str(e))
    except (ConnectionError, OSError) as e:
        return "closed", str(e)[:80]
    if frame.kind != "error":
        return "answered", frame.kind
    return _refusal(frame.head.message)


def _refusal(message: str) -> tuple[str, str]:
    return ("multi-line" if "\n" in message or not message else "refused"), message


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
