"""FedBN on the device (agent.keep_local_bn): an agent keeps its own batch norm when it
installs a reply, over a real Mosquitto and a real aggregator, while the deltas both ways
stay against the model the aggregator knows the agent holds."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch

from edge_agent.protocol_client import EdgeAgent
from edge_agent.state import AgentState
from fedmq.config import Config
from fedmq.data import RotatedClusters, load_dataset
from fedmq.models import batch_norm_index, model_spec, resolve_model_name
from fedmq.training import fit
from sim.fleet import start_aggregator

BARS_DATA = "recipes.my_fleet:load_bars"
BARS_MODEL = "recipes.my_fleet:make_model?input=1x16x16&width=8"


def test_the_batch_norm_index_covers_the_norm_layers_and_nothing_else() -> None:
    spec = model_spec("resnet20")
    index = set(batch_norm_index("resnet20").tolist())
    offset = 0
    for key, shape in zip(spec.names, spec.shapes, strict=True):
        n = int(torch.tensor(shape).prod())
        positions = set(range(offset, offset + n))
        assert (positions <= index) if ".bn" in key or key.startswith("bn") else not positions & index, key
        offset += n
    assert len(index) == 2 * 1376  # weights and biases, means and variances
    assert len(batch_norm_index("resnet20-gn")) == 0  # GroupNorm keeps nothing per device


def test_an_agent_keeps_its_own_batch_norm_through_a_reply_and_the_server_decodes_its_upload(mosquitto) -> None:
    cfg = Config(model=BARS_MODEL, fleet="fedbn")
    cfg.broker.url = mosquitto.url
    cfg.data.dataset = BARS_DATA
    cfg.data.proxy_per_cluster, cfg.data.pretrain_per_cluster = 100, 200
    cfg.aggregator.pretrain_epochs = 1
    cfg.cdfl.clusters = 2
    cfg.codec.name = "fp32"  # a lossless delta: the server's copy of the upload is checked to float rounding
    name = resolve_model_name(cfg.model, cfg.data.dataset)
    own = batch_norm_index(name)
    rest = torch.ones(model_spec(name).numel, dtype=torch.bool)
    rest[own] = False
    clusters = RotatedClusters(load_dataset(BARS_DATA), load_dataset(BARS_DATA, train=False), 2, seed=0,
                               proxy_per_cluster=100, pretrain_per_cluster=200)
    data = clusters.take(1, 200, np.random.default_rng(0))
    received: list[torch.Tensor] = []
    with contextlib.ExitStack() as stack:
        service = start_aggregator(copy.deepcopy(cfg), clusters, stack, {"seconds": 0.0, "batches": 0})
        strategy = service.engine.strategy
        update_many = strategy.update_many

        def recording(uploads):  # what the server decoded, then the real update
            received.extend(u.vector.clone() for u in uploads)
            return update_many(uploads)

        strategy.update_many = recording
        agents = {}
        for agent_id, keep in (("keeps", True), ("plain", False)):
            c = copy.deepcopy(cfg)
            c.agent.keep_local_bn = keep
            agent = EdgeAgent(c, agent_id, reply_timeout_s=60.0).start(timeout=30.0)
            stack.callback(agent.stop)
            agents[agent_id] = agent
            joined = agent.join()
            assert joined.wire is None  # the first model is the server's, whole
            trained = fit(name, joined.vector, data.x, data.y, epochs=1, lr=0.05, seed=1).vector
            assert not torch.equal(trained[own], joined.vector[own])  # training moved the statistics
            reply = agent.upload(agent.update_envelope(trained, len(data.y)))[0]
            torch.testing.assert_close(received[-1], trained, atol=1e-5, rtol=0)  # what the server applied
            assert not torch.equal(reply.vector[rest], trained[rest])  # the reply's weights are installed
            if keep:
                assert torch.equal(reply.vector[own], trained[own])  # its own batch norm survived
                assert torch.equal(reply.vector[rest], reply.wire[rest])
                assert not torch.equal(reply.wire[own], trained[own])  # the reply brought others
                # Its next upload is a delta against what it decoded, as the server knows it.
                again = fit(name, reply.vector, data.x, data.y, epochs=1, lr=0.05, seed=2).vector
                agent.upload(agent.update_envelope(again, len(data.y)))
                torch.testing.assert_close(received[-1], again, atol=1e-5, rtol=0)
            else:
                assert reply.wire is None and not torch.equal(reply.vector[own], trained[own])


def test_the_wire_vector_survives_a_restart_of_the_agent(tmp_path) -> None:
    vector, wire = torch.arange(6, dtype=torch.float32), torch.arange(6, dtype=torch.float32) * 2
    state = AgentState("car-1", "digits-cnn", model_spec("digits-cnn").hash, vector=vector, wire=wire, tau=3)
    state.save(tmp_path)
    back = AgentState.load(tmp_path)
    assert back is not None and torch.equal(back.vector, vector) and torch.equal(back.wire, wire)
    AgentState("car-1", "digits-cnn", model_spec("digits-cnn").hash, vector=vector, tau=3).save(tmp_path)
    assert AgentState.load(tmp_path).wire is None
