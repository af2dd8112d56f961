"""Seeing a running swarm (real hivemind on loopback): every stage peer's and the trainer's
Prometheus metrics agree with what the peers report, the trainer's status record on the DHT is
the owner's alone, and the health page's data shows every stage's peers, links and events."""

from __future__ import annotations

import time
import urllib.request
import uuid

import pytest
from _swarm_env import STEPS, smoke
from hivemind.utils.crypto import RSAPrivateKey
from prometheus_client.parser import text_string_to_metric_families

from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.progress import RunProgress
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.dht.runstatus import RunStatus, fetch_status, publish_status, start_status, status_key
from swarm.transport.hivemind.monitor.exporter import MetricsServer
from swarm.transport.hivemind.monitor.health import read_swarm
from swarm.transport.hivemind.monitor.peer_metrics import NodeCollector
from swarm.transport.hivemind.monitor.stage_metrics import StageCollector
from swarm.transport.hivemind.monitor.trainer_metrics import TrainerCollector, run_status
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.schemas import owned

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)


def scrape(server: MetricsServer) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def one(samples: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
    assert key in samples, f"{key} not among {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def test_metrics_status_record_and_page_data_of_a_running_swarm(swarm):
    cfg = smoke("compression.forward=topk:0.2+ef21")
    run_id = uuid.uuid4().hex[:8]
    stages = cfg.model.num_stages
    swarm.host(cfg, run_id, [(s, s) for s in range(stages)])
    servers = [swarm.hosts[s][1] for s in range(stages)]
    exporters = [MetricsServer(0, [StageCollector(server, swarm.loop.loop)], "127.0.0.1") for server in servers]
    publisher = trainer_metrics = None
    # signs as the run's owner, as peers.trainer's node does (the pipeline's owner key)
    reporter = swarm.loop.run(
        SwarmNode.create(swarm.options(client_mode=True, signing_key=RSAPrivateKey.process_wide()))
    )
    started = time.monotonic()
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        progress = RunProgress(Schedule.of(cfg, len(data[0]), STEPS).total_steps)
        results = ResultsWriter(None)
        results.listeners.append(progress.observe)
        publisher = swarm.loop.run(start_status(reporter, run_id, lambda: run_status(pipeline, progress)))
        collectors = [NodeCollector(swarm.trainer), TrainerCollector(pipeline, progress)]
        trainer_metrics = MetricsServer(0, collectors, "127.0.0.1")
        train(cfg, pipeline, data, results, STEPS, progress=False)
        wall = time.monotonic() - started
        statuses = {status.stage: status for status in pipeline.statuses()}

        # every stage peer's metrics are what it reports (and what happened)
        for stage, exporter in enumerate(exporters):
            got, status = scrape(exporter), statuses[stage]
            at = {"run": run_id, "stage": stage}
            assert one(got, "hivepipe_stage_micro_batches_total", **at) == status.processed > 0
            assert one(got, "hivepipe_stage_step", **at) == STEPS
            assert one(got, "hivepipe_stage_serving", **at) == 1
            assert one(got, "process_resident_memory_bytes", **{}) > 10 << 20
            assert one(got, "hivepipe_dht_peers", **{}) >= 1
            parts = {
                part: one(got, "hivepipe_stage_seconds_total", part=part, **at)
                for part in ("compute", "sending", "waiting")
            }
            assert parts["compute"] > 0 and parts["waiting"] > 0 and parts["compute"] + parts["waiting"] <= wall
            assert one(got, "hivepipe_events_total", kind="setup", role="stage") >= 1
            if stage < stages - 1:  # activations out: EF21 keeps state, TopK 20% compresses
                assert one(got, "hivepipe_stage_feedback_state_bytes", **at) > 0
                (link,) = [link for link in status.links if link.upstream]
                down = {**at, "neighbour": link.neighbour, "boundary": stage, "direction": "forward"}
                sent = sum(n for key, n in link.sent.items() if key.startswith("forward"))
                assert one(got, "hivepipe_link_sent_bytes_total", **down) == sent > 0
                assert one(got, "hivepipe_link_compression_ratio", **down) > 1.5
            if stage > 0:  # activations in: their arrival rate; gradients back
                (link,) = [link for link in status.links if not link.upstream]
                up = {**at, "neighbour": link.neighbour, "boundary": stage - 1}
                assert one(got, "hivepipe_link_received_bytes_total", direction="forward", **up) > 0
                assert one(got, "hivepipe_link_arrival_bits_per_second", direction="forward", **up) > 0
                assert one(got, "hivepipe_link_sent_bytes_total", direction="backward", **up) > 0

        # the trainer's
        got = scrape(trainer_metrics)
        run = {"run": run_id}
        assert one(got, "hivepipe_trainer_step", **run) == STEPS
        assert one(got, "hivepipe_trainer_samples", **run) == STEPS * cfg.train.batch_size
        assert one(got, "hivepipe_trainer_samples_per_second", **run) > 0
        loss = [r["loss"] for r in results.rows if r["type"] == "step"][-1]
        assert one(got, "hivepipe_trainer_loss", **run) == loss
        for stage in range(stages):
            assert one(got, "hivepipe_trainer_members", stage=stage, **run) == 1
        split = sum(
            one(got, "hivepipe_trainer_seconds_total", part=p, **run) for p in ("compute", "sending", "waiting")
        )
        assert 0 < split <= time.monotonic() - started
        assert one(got, "hivepipe_trainer_pauses_total", **run) == 0
        forward0 = sum(
            n
            for s in statuses.values()
            for link in s.links
            if link.boundary == 0
            for k, n in link.sent.items()
            if k.startswith("forward")
        )
        assert one(got, "hivepipe_run_link_bytes_total", boundary=0, direction="forward", **run) == forward0

        # the trainer's status record: the owner's only
        swarm.loop.run(publisher.refresh())
        mine = owned(reporter.owned_by)[1]
        assert mine == pipeline.owner.peer_id
        record = swarm.loop.run(fetch_status(swarm.boot, run_id, mine))
        assert (record.step, record.total_steps, record.state, record.owner) == (STEPS, STEPS, "training", mine)
        assert record.members == dict.fromkeys(range(stages), 1) and "setup" in {e.kind for e in record.events}
        stranger = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
        try:
            forged = RunStatus(step=999, state="finished")
            swarm.loop.run(publish_status(stranger, run_id, forged, 30))
            assert swarm.loop.run(fetch_status(swarm.boot, run_id, mine)).step == STEPS  # the owner's record stands
            theirs = owned(stranger.owned_by)[1]  # anyone may publish a record for any run: readers name the owner
            assert swarm.loop.run(fetch_status(swarm.boot, run_id, theirs)).step == 999
            # nobody else can write under the owner's key (every node validates signatures)
            assert not swarm.loop.run(
                stranger.dht.store(status_key(run_id), forged.to_value(), time.time() + 30, subkey=reporter.owned_by)
            )
        finally:
            swarm.loop.run(stranger.shutdown())

        # the health page's data: every stage's peer, every link, progress (the owner's record, the
        # stranger's newer one notwithstanding: no config is published here, the owner is the one who
        # admitted the stage peers) and events
        page = swarm.loop.run(read_swarm(swarm.trainer, run_id))
        (shown,) = page["runs"]
        peers = {s["stage"]: [p["peer_id"] for p in s["peers"]] for s in shown["stages"]}
        assert peers == {s: [swarm.hosts[s][0].peer_id] for s in range(stages)}
        assert [(link["boundary"], link["from"], link["to"]) for link in shown["links"]] == [
            (b, peers[b][0], peers[b + 1][0]) for b in range(stages - 1)
        ]
        assert all(link["forward"]["ratio"] > 1.5 and link["forward"]["mbit_s"] > 0 for link in shown["links"])
        assert shown["progress"]["step"] == STEPS and shown["owner"] == mine
        sources = {e["source"] for e in shown["events"] if e["kind"] == "setup"}
        assert "trainer" in sources and len(sources) == stages + 1
    finally:
        for exporter in [*exporters, trainer_metrics]:
            if exporter is not None:
                exporter.close()
        if publisher is not None:
            swarm.loop.run(publisher.stop())
        swarm.loop.run(reporter.shutdown())
        swarm.unhost(run_id)
