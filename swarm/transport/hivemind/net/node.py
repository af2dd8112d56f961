"""One peer's presence in the swarm: a hivemind P2P daemon plus a DHT node sharing it.

Every process (bootstrap, stage, trainer, status) is one `SwarmNode`; the DHT node lives in the
same asyncio loop as the stage server, so there is no extra DHT process per peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from swarm.netlab.shaper import TokenBucket
from swarm.rates import parse_rate
from swarm.transport.hivemind.net.reach import BEHIND_NAT, Reach, Reachability, check
from swarm.transport.hivemind.net.relay import Relay
from swarm.transport.hivemind.net.schemas import validators
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.net.streams import StreamPool
from swarm.transport.hivemind.trust.keys import IdentityError, load_identity

# p2pd's Go threads (GOMAXPROCS). One carries far more than the links hivepipe is for, and Go's
# default of one per core makes daemons that share a machine with the stages spend more CPU per
# byte: its idle threads spin looking for work (docs/bench/README.md, "Network CPU per byte").
DAEMON_THREADS = 1


@contextlib.contextmanager
def _go_threads(threads: int):
    """GOMAXPROCS for the Go programs started inside (0: unset, Go's default); restored after."""
    before = os.environ.get("GOMAXPROCS")
    if threads:
        os.environ["GOMAXPROCS"] = str(threads)
    else:
        os.environ.pop("GOMAXPROCS", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GOMAXPROCS", None)
        else:
            os.environ["GOMAXPROCS"] = before


def check_daemon_threads(threads: int) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"--daemon_threads must be 0 (one per core) or a positive integer, got {threads}")


@contextlib.contextmanager
def _identity(path: str | None):
    """(identity file, its key, whether the file was there before): `path`'s, created if missing,
    or a new key in a file that lives while the daemon starts (it reads it once). The key is ours:
    it signs this peer's DHT records, and its peer id is the one the daemon takes."""
    if path is not None:
        existed = os.path.exists(path)
        yield path, load_identity(path), existed
        return
    with tempfile.TemporaryDirectory(prefix="hivepipe-identity-") as directory:
        temporary = os.path.join(directory, "identity.key")
        key = load_identity(temporary)
        yield temporary, key, False


_STARTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its lock on daemon starts


async def start_daemon(threads: int = DAEMON_THREADS, **options) -> P2P:
    """`P2P.create(**options)` with a daemon of `threads` Go threads (0: one per core). Starts in
    one event loop take turns: hivemind copies the environment after awaiting, and two starts with
    different counts would otherwise swap them."""
    check_daemon_threads(threads)
    async with _STARTING.setdefault(asyncio.get_running_loop(), asyncio.Lock()):
        with _go_threads(threads):
            return await P2P.create(**options)


@dataclass
class NodeOptions:
    """What hivemind and Petals users pass to a peer (see `peers/_common.py`)."""

    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: Sequence[str] | None = None
    identity_path: str | None = None
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    startup_timeout: float = 30.0
    shape_rate: str | None = None  # in-process shaping of what this peer sends (no root needed)
    shape_delay: str | None = None  # one-way delay added to every message this peer sends
    # declared link rates: each neighbour's payloads are paced at their share (swarm.transport.hivemind.flow.pacing)
    uplink: str | None = None
    downlink: str | None = None
    daemon_threads: int = DAEMON_THREADS  # p2pd's Go threads; 0: one per core
    settings: Settings = field(default_factory=Settings)  # timeouts and limits of everything this peer does
    # signs this peer's owned DHT records (a trainer: the run owner's key; default: one per process)
    signing_key: RSAPrivateKey | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PeerLink:
    """This peer's own link: `egress`, a swarm.netlab.shaper.TokenBucket paced by every payload it
    sends (in-process shaping), or None; its declared rates in bits/s, or None."""

    egress: TokenBucket | None = None
    uplink_bits: int | None = None
    downlink_bits: int | None = None


class SwarmNode:
    """`reach`: how this peer is reached and reaches the others (directly, or through a relay),
    made on `p2p` (from then on, it opens the node's streams)."""

    def __init__(
        self,
        p2p: P2P,
        dht: DHTNode,
        reach: Reach,
        link: PeerLink | None = None,
        settings: Settings | None = None,
        owned_by: bytes = b"",
    ) -> None:
        self.p2p = p2p
        self.dht = dht
        # a DHT key or subkey holding `owned_by` can only be written with this peer's key (hivemind's
        # RSASignatureValidator; every node checks the records it stores and the ones it reads)
        self.owned_by = owned_by
        link = link or PeerLink()
        self.egress = egress = link.egress  # paced by every payload we send, or None
        self.uplink_bits, self.downlink_bits = link.uplink_bits, link.downlink_bits  # declared, or None
        self.settings = settings or Settings()
        self.reach = reach
        self.relay: Relay | None = None  # what it does for peers behind NAT, when it can be dialed itself
        self.identity: RSAPrivateKey | None = None  # the key its peer id derives from (it signs its accounts)
        # streams to the peers we call, kept for reuse
        streams = self.settings.streams
        self.streams = StreamPool(p2p, streams.keep_idle_s, egress, streams.end_wait_s)

    @classmethod
    async def create(cls, options: NodeOptions | None = None) -> SwarmNode:
        options = options or NodeOptions()
        initial = list(options.initial_peers)
        for maddr in initial:  # the daemon's own error would blame --host_maddrs
            if problem := _not_a_peer_address(maddr):
                raise RuntimeError(f"--initial_peers {maddr!r}: {problem}")
        egress = None
        if options.shape_rate or options.shape_delay:
            try:
                egress = TokenBucket(options.shape_rate or "100gbit", delay_s=options.shape_delay or 0.0)
            except ValueError as e:
                raise RuntimeError(f"--shape_rate / --shape_delay: {e}") from None
        links = {}
        for name in ("uplink", "downlink"):
            text = getattr(options, name)
            try:
                links[name] = parse_rate(text) if text else None
            except ValueError as e:
                raise RuntimeError(f"--{name}: {e}") from None
        try:
            check_daemon_threads(options.daemon_threads)
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        try:
            with _identity(options.identity_path) as (identity_path, key, existed):
                daemon = dict(
                    initial_peers=initial,
                    host_maddrs=list(options.host_maddrs),
                    announce_maddrs=list(options.announce_maddrs) if options.announce_maddrs else None,
                    identity_path=identity_path,
                    check_if_identity_free=existed,
                    use_relay=options.use_relay,
                    use_auto_relay=options.use_auto_relay,
                    startup_timeout=options.startup_timeout,
                    **options.extra,
                )
                p2p = await start_daemon(
                    options.daemon_threads, **daemon, dht_mode="client" if options.client_mode else "server"
                )
                reachability = Reachability()
                if initial and not options.client_mode:  # a client (peers.status) is never called
                    reachability = await check(p2p, initial)
                    if reachability.state == BEHIND_NAT:  # nobody can send it DHT requests
                        await p2p.shutdown()
                        daemon["check_if_identity_free"] = False  # it was ours a moment ago
                        p2p = await start_daemon(options.daemon_threads, **daemon, dht_mode="client")
        except IdentityError as e:
            raise RuntimeError(f"--identity_path: {e}") from None
        except Exception as e:
            checks = (
                "--initial_peers, --host_maddrs and --identity_path" if initial else "--host_maddrs and --identity_path"
            )
            raise RuntimeError(f"the p2p daemon did not start: {e} (check {checks})") from e
        signing_key = options.signing_key or key
        validator = validators(signing_key)
        try:
            dht = await DHTNode.create(
                p2p=p2p,
                initial_peers=initial,
                client_mode=options.client_mode or reachability.state == BEHIND_NAT,
                num_workers=4,
                record_validator=validator,
            )
        except Exception as e:
            await p2p.shutdown()
            where = ", ".join(initial) or "no initial peers"
            raise RuntimeError(f"could not join the DHT via {where}: {e}") from e
        owned_by = RSASignatureValidator(signing_key).local_public_key
        reach = Reach(p2p, reachability, initial)
        link = PeerLink(egress, links["uplink"], links["downlink"])
        node = cls(p2p, dht, reach, link, options.settings, owned_by)
        node.identity = key
        await node._serve_reach(options)
        return node

    async def _serve_reach(self, options: NodeOptions) -> None:
        """A peer that can be dialed tells others whether they can be, and relays to those that
        cannot; one behind NAT gets itself held by its relay before anyone looks for it."""
        if self.reach.behind_nat:
            await self.reach.serve_relayed()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.reach.holding.held.wait(), options.startup_timeout)
        elif not options.client_mode:
            self.relay = Relay(self.p2p)
            await self.relay.serve()

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def maddrs(self) -> list[str]:
        """Full multiaddrs others join with (`.../p2p/<peer id>`)."""
        return [str(a) for a in await self.p2p.get_visible_maddrs()]

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Bounded: the DHT's goodbye talks to the daemon, which may already be gone."""
        self.reach.close()
        self.streams.close()
        try:
            await asyncio.wait_for(self.dht.shutdown(), timeout)
        except Exception:
            pass
        finally:
            await asyncio.wait_for(self.p2p.shutdown(), timeout)


def _not_a_peer_address(maddr: str) -> str | None:
    """Why `maddr` cannot be dialled as a peer (a multiaddr ending in /p2p/PEER_ID), or None."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        parsed = Multiaddr(maddr)
    except Exception as e:  # the parser's own error types; any of them means the text is no address
        return f"not a multiaddr ({str(e).splitlines()[0]})"
    if "p2p" not in [protocol.name for protocol in parsed.protocols()]:
        return "it names no peer: it must end in /p2p/PEER_ID (the bootstrap prints its full address)"
    return None
