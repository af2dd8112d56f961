"""Only the run's members act on the run: a stranger on the DHT who knows the run id, the config
and every peer's record is refused at every call (one-line errors, REFUSED), is never routed to,
and the run goes on with the single-process losses."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch
from _swarm_env import assert_same_run, local_rows, smoke
from _util import SMOKE
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from protocols import wire
from protocols.errors import RemoteError
from protocols.message import Encoded, RawPart
from protocols.stubs import STUBS
from swarm.engine.microbatch import MicroBatch
from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.dht.announce import StageRecord, announce, discover, list_run
from swarm.transport.hivemind.dht.runconfig import PublishedConfig, RunConfigError, config_key, publish, resolve_run
from swarm.transport.hivemind.dht.survey import format_table, survey
from swarm.transport.hivemind.net.calls import ask, call
from swarm.transport.hivemind.net.meta import address, batch_to_meta, micro_batch_payload
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.schemas import RUNS_KEY
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trust.owner import Owner
from swarm.transport.hivemind.trust.signatures import sign_call

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

STEPS = 4


def _refused(swarm, node, peer, request, payload=b"", key=None, match=""):
    """`request`: a stub's (protocols.stubs), sent by `node` (signed with `key` if given)."""
    with pytest.raises(RemoteError, match=match) as caught:
        swarm.loop.run(ask(node.streams, peer, request, 10, payload, key))
    assert caught.value.code == pb.REFUSED and "\n" not in str(caught.value)
    return str(caught.value)


def test_a_stranger_is_refused_everywhere_and_the_run_keeps_its_losses(swarm, tmp_path):
    cfg = smoke()
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(cfg.model.num_stages)])
    stranger = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    stranger_key = RSAPrivateKey()
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        owner = pipeline.owner
        first, second = hosted[0], hosted[1]
        peer = second.node.peer_id
        to = address(run_id, 1)

        # control calls: unsigned, or signed by anyone but the owner
        setup = pb.SetupRequest(to=to, config_digest=second.place.digest, session="mine", lr_horizon=9)
        setup.admission.CopyFrom(Owner(stranger_key, run_id).admit("mine", peer, 1))
        _refused(swarm, stranger, peer, STUBS.setup.of(setup), match="unsigned setup")
        _refused(swarm, stranger, peer, STUBS.setup.of(setup), key=stranger_key, match="not by the run's owner")
        apply = pb.ApplyRequest(to=to, step=0, scale=1.0)
        _refused(swarm, stranger, peer, STUBS.apply.of(apply), key=stranger_key, match="not by the run's owner")
        _refused(swarm, stranger, peer, STUBS.save.of(pb.SaveRequest(to=to)), key=stranger_key)
        _refused(swarm, stranger, peer, STUBS.load.of(pb.LoadRequest(to=to)), b"weights of my choosing", stranger_key)
        restore = pb.RestoreRequest(to=to, step=0, lineage="x")
        _refused(swarm, stranger, peer, STUBS.restore.of(restore), key=stranger_key)
        # the owner's own signature does not travel: not to another peer, not twice
        signed_for_first = pb.ApplyRequest(to=address(run_id, 0), step=99)
        auth = sign_call(owner.key, "apply", signed_for_first, b"", first.node.peer_id)
        assert second.gate.calls.peer_id != auth.service
        with pytest.raises(RemoteError, match="signed for another peer"):
            second.gate.control("apply", signed_for_first, auth, pb.Chunk())
        first.gate.calls.signer("apply", signed_for_first, auth, pb.Chunk())
        with pytest.raises(RemoteError, match="replayed"):
            first.gate.calls.signer("apply", signed_for_first, auth, pb.Chunk())
        changed = pb.ApplyRequest(to=address(run_id, 0), step=98)
        with pytest.raises(RemoteError, match="bad signature"):
            first.gate.calls.signer("apply", changed, auth, pb.Chunk())

        # payloads: NaN activations from a stranger, with no admission or with a copied one
        (record,) = swarm.loop.run(discover(stranger, run_id, 1))
        admission = pb.Admission.FromString(record.admission)
        batch = MicroBatch(0, 0, torch.arange(4), torch.zeros(4, dtype=torch.long))
        nan = micro_batch_payload(
            batch, wire.encode(Encoded((4, 8), torch.float32, RawPart(torch.full((4, 8), float("nan")))))
        )
        head = pb.MicroBatchHead(to=to, sender=stranger.peer_id, batch=batch_to_meta(batch), budget_s=5)
        _refused(swarm, stranger, peer, STUBS.micro_batch.of(head), nan, match="showed no admission")
        head.admission.CopyFrom(pb.Admission.FromString(swarm.loop.run(discover(stranger, run_id, 0))[0].admission))
        _refused(swarm, stranger, peer, STUBS.micro_batch.of(head), nan, match="shown by")
        # the weights stay with the members
        state = pb.StateRequest(to=to, admission=admission)
        _refused(swarm, stranger, peer, STUBS.state.of(state), match="shown by")
        snapshot = pb.StateRequest(to=to, snapshot=True, stage=1, step=0)
        _refused(swarm, stranger, peer, STUBS.state.of(snapshot), match="showed no admission")

        # a record of its own, as fast as can be, with a member's admission: never routed to
        fake = StageRecord(stranger.peer_id, 1, cfg.model.num_stages, [], 1e9, 0, ready=True)
        fake.session, fake.admission = pipeline.session, record.admission
        assert swarm.loop.run(announce(stranger, run_id, fake, 60))
        assert stranger.peer_id in [r.peer_id for r in swarm.loop.run(discover(first.node, run_id, 1))]
        assert not first.router.routable(fake) and first.router.routable(record)

        # counted, and shown by peers.status
        (row,) = [r for r in swarm.loop.run(survey(stranger, run_id)) if r.peer_id == peer]
        assert row.trust.refused["not allowed"] >= 10 and not row.trust.banned
        assert "refused" in format_table([row])

        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        assert not first.router.bans.failures, "the stranger's record was never tried"
        assert sum(h.meters.processed for h in hosted) > 0
        assert_same_run(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(stranger.shutdown())


def test_the_runs_config_record_names_its_owner_and_nobody_else_can_write_it(swarm):
    run_id = uuid.uuid4().hex[:8]
    owner_key, stranger_key = RSAPrivateKey(), RSAPrivateKey()
    trainer = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True, signing_key=owner_key)))
    stranger = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True, signing_key=stranger_key)))
    owner = Owner(owner_key, run_id).peer_id
    mine = PublishedConfig.of(run_id, SMOKE.read_text(), [], str(SMOKE))
    try:
        assert swarm.loop.run(publish(trainer, run_id, mine, 60, owned=True))
        found = swarm.loop.run(resolve_run(swarm.hosts[0][0], run_id, 5))
        assert found.owner == owner and found.digest == mine.digest
        # the owner's subkey, written with another key: every node refuses to store it
        forged = {**mine.to_value(), "yaml": mine.yaml + "\n# mine now"}
        expires = get_dht_time() + 60
        subkey = mine.digest.encode() + trainer.owned_by
        assert not swarm.loop.run(stranger.dht.store(config_key(run_id), forged, expires, subkey=subkey))
        assert swarm.loop.run(resolve_run(swarm.hosts[1][0], run_id, 5)).yaml == mine.yaml
        # the run listing every node knows: only well-formed, signed entries are stored
        for value, entry in (({"num_stages": 0}, b"x"), ({"num_stages": "4"}, b"x"), ({"num_stages": 4}, None)):
            entry = run_id if entry is None else run_id.encode() + stranger.owned_by
            assert not swarm.loop.run(stranger.dht.store(RUNS_KEY, value, expires, subkey=entry)), (value, entry)
        assert swarm.loop.run(list_run(stranger, run_id, 4, expires))
        # a claim of its own: joiners refuse to guess between owners, --owner picks
        assert swarm.loop.run(publish(stranger, run_id, mine, 60, owned=True))
        with pytest.raises(RunConfigError, match="claimed by 2 owners"):
            swarm.loop.run(resolve_run(swarm.hosts[2][0], run_id, 5))
        assert swarm.loop.run(resolve_run(swarm.hosts[2][0], run_id, 5, owner)).owner == owner
    finally:
        for node in (trainer, stranger):
            swarm.loop.run(node.shutdown())


def test_a_member_sending_non_finite_values_is_refused_banned_and_costs_nobody_else(swarm, tmp_path):
    """A peer admitted to stage 0 (its key stolen, say) sends stage 1 NaN activations: they are
    refused before any model sees them, the sender is banned, stage 1's link to stage 2 is not
    reset, and the run's losses stay the single-process ones."""
    cfg = smoke()
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(cfg.model.num_stages)])
    rogue = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        middle, after = hosted[1], hosted[2].node.peer_id
        batch = MicroBatch(0, 0, torch.arange(4), torch.zeros(4, dtype=torch.long))
        nan = micro_batch_payload(
            batch, wire.encode(Encoded((4, 32), torch.float32, RawPart(torch.full((4, 32), float("nan")))))
        )
        head = pb.MicroBatchHead(to=address(run_id, 1), sender=rogue.peer_id, batch=batch_to_meta(batch), budget_s=5)
        head.admission.CopyFrom(pipeline.owner.admit(pipeline.session, rogue.peer_id, 0))
        # steps and epochs must be plausible: a member's word that the run is far ahead moves no one
        ahead = pb.MicroBatchHead()
        ahead.CopyFrom(head)
        ahead.batch.step = 50
        with pytest.raises(RemoteError, match="at step 0") as caught:
            swarm.loop.run(call(rogue.streams, middle.node.peer_id, "micro_batch", ahead, nan, 10))
        assert caught.value.code == pb.UNAVAILABLE and middle.runtime is not None and middle.state.session is not None
        ahead.batch.step, ahead.epoch = 0, (1 << 64) - 1
        with pytest.raises(RemoteError, match="ahead of this peer's clock"):
            swarm.loop.run(call(rogue.streams, middle.node.peer_id, "micro_batch", ahead, nan, 10))
        with pytest.raises(RemoteError, match="not finite"):
            swarm.loop.run(call(rogue.streams, middle.node.peer_id, "micro_batch", head, nan, 10))
        message = _refused(swarm, rogue, middle.node.peer_id, STUBS.micro_batch.of(head), nan, match="banned")
        assert rogue.peer_id[-8:] in message
        assert middle.links.numbering.epoch(after) is None  # its link to stage 2 was not restarted
        (row,) = [r for r in swarm.loop.run(survey(swarm.trainer, run_id)) if r.peer_id == middle.node.peer_id]
        assert (
            row.trust.refused["malformed payload"] >= 1 and row.trust.banned >= 1
        )  # (the hosts serve every test here)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        assert_same_run(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(rogue.shutdown())


def test_a_senders_payload_bytes_and_requests_at_once_are_capped(swarm):
    """A member's micro-batch declaring more payload bytes than it may have at the peer at once is
    refused from its head, before any of the payload is read, and the peer goes on serving."""
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    node = swarm.loop.run(SwarmNode.create(swarm.options(settings=Settings.of(max_held_bytes_per_sender=4096))))
    server = StageServer(node)
    swarm.loop.run(server.start())
    try:
        hosted = server.host(HostedStage(node, run_id, cfg, 0))
        swarm.loop.run(server.announcer.announce_now())
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 2, data)
        head = pb.MicroBatchHead(to=address(run_id, 0), sender=swarm.trainer.peer_id, budget_s=5)
        batch = MicroBatch(0, 0, torch.arange(64), torch.zeros(64, dtype=torch.long))
        head.batch.CopyFrom(batch_to_meta(batch))
        head.admission.CopyFrom(pipeline.owner.admit(pipeline.session, swarm.trainer.peer_id, trainer=True))
        big = micro_batch_payload(batch, inputs=torch.zeros(64, 1, 8, 8))  # 16 KiB
        assert len(big) > 4096
        with pytest.raises(RemoteError, match="at once") as caught:  # a while later it may: another peer now
            swarm.loop.run(call(swarm.trainer.streams, node.peer_id, "micro_batch", head, big, 10))
        assert caught.value.code == pb.UNAVAILABLE and "limit 4096" in str(caught.value)
        deadline = time.monotonic() + 10
        while (server.held or server.active) and time.monotonic() < deadline:  # the refused stream winds down
            time.sleep(0.05)
        assert not server.held and not server.active
        assert hosted.meters.processed == 0  # never reached the stage
    finally:
        swarm.loop.run(server.stop())
        swarm.loop.run(node.shutdown())


def test_a_peer_trusts_the_first_setup_that_succeeds_and_nobody_else_after(swarm):
    """Trust on first use, without --owner: a stranger's setup that fails (another config) pins
    nothing; the trainer's pins it; a stranger's setup after that is refused."""
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    (hosted,) = swarm.host(cfg, run_id, [(0, 0)])
    stranger = Owner(RSAPrivateKey(), run_id)
    peer = hosted.node.peer_id
    try:
        setup = pb.SetupRequest(to=address(run_id, 0), config_digest="0" * 16, session="mine", lr_horizon=9)
        setup.admission.CopyFrom(stranger.admit("mine", peer, 0))
        with pytest.raises(RemoteError, match="config mismatch"):
            swarm.loop.run(call(swarm.trainer.streams, peer, "setup", setup, b"", 10, stranger.key))
        assert hosted.gate.owner is None
        pipeline = swarm.pipeline(cfg, run_id, 2, build_data(cfg))
        assert hosted.gate.owner == pipeline.owner.peer_id
        setup.config_digest = hosted.place.digest
        _refused(swarm, swarm.trainer, peer, STUBS.setup.of(setup), key=stranger.key, match="not by the run's owner")
    finally:
        swarm.unhost(run_id)


def test_a_strangers_oversized_dht_request_never_reaches_a_peer(swarm):
    """The DHT's handlers are hivemind's unary ones: a request crosses the p2p daemons whole. A
    stranger that lifts its own client's limit and sends 8 and 64 MiB to a stage peer's
    `rpc_find`: the peer's daemon never hands them over (they fail at the caller), 1 MiB does arrive
    (and is refused as malformed), and the peer's DHT still answers. Memory: docs/security.md."""
    node = swarm.hosts[0][0]
    handlers = node.p2p._client.control.unary_handlers
    name = "DHTProtocol.rpc_find"
    find, seen = handlers[name], []

    async def recording(data: bytes, remote):
        seen.append((remote, len(data)))  # the swarm's own lookups arrive here too
        return await find(data, remote)

    handlers[name] = recording
    stranger = swarm.loop.run(P2P.create(initial_peers=swarm.maddrs))
    try:
        stranger._client.control.persistent_conn_max_msg_size = 1 << 30  # past its own client's check
        failed = []
        for size in (1 << 20, 8 << 20, 64 << 20):
            call_ = stranger._client.call_unary_handler(node.p2p.peer_id, name, bytes(size))
            try:
                swarm.loop.run(asyncio.wait_for(call_, 3))
            except Exception as e:  # noqa: BLE001  what the stranger hears is not the point: what arrived is
                failed.append((size, type(e).__name__))
        assert [size for remote, size in seen if remote == stranger.peer_id] == [1 << 20], seen
        assert failed[0] == (1 << 20, "P2PHandlerError") and [size for size, _ in failed[1:]] == [8 << 20, 64 << 20]
    finally:
        handlers[name] = find
        swarm.loop.run(stranger.shutdown())
    key = f"hivepipe-test-{uuid.uuid4().hex[:8]}"
    assert swarm.loop.run(node.dht.store(key, b"still here", get_dht_time() + 30))
    assert swarm.loop.run(swarm.trainer.dht.get(key, latest=True)).value == b"still here"
