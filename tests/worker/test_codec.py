"""utils/codec.py: the data-only encoding of the messages that cross hosts, and the CURVE
sockets they travel on (multiproc/multinode.py's ClusterAuth).

- Every message a multi-node engine sends comes back equal, derived fields included
  (SamplingParams' tokenized stop ids), tuples as tuples, sets as sets, tensors bit for
  bit; a feature's own dataclass crosses once it registers.
- Nothing else does: pickle's bytes, an unregistered class (on either side), a field of
  the wrong type, a tensor whose bytes do not match its shape are refused with
  CodecError, whose text never quotes the bytes.
- A CURVE server built by ClusterAuth takes a client holding the cluster's secret and
  refuses one with another secret; the same bytes sent again on a new connection (a
  replay of a recorded session) deliver nothing.
"""
from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import zmq

from nanopaged.config import EngineConfig
from nanopaged.messages import (CachedRequestData, Logprobs, ModelRunnerOutput, NewRequestData, PreemptionCosts,
                                SchedulerOutput, WeightsInfo)
from nanopaged.model.config import ModelConfig
from nanopaged.sampling_params import SamplingParams, StructuredOutputsParams
from nanopaged.utils import codec
from nanopaged.multiproc.cluster_auth import ClusterAuth
from nanopaged.multiproc.multinode import Join, NodePlan, Ping, Report
from nanopaged.spec_decode.messages import SpecDecodeModelRunnerOutput, SpecDecodeSchedulerOutput
from nanopaged.structured_output.messages import GrammarOutput

MARKER = b"STRANGER-BYTES-7f3a"


class Bomb:
    """What a stranger sends: unpickling it would run touch."""

    def __reduce__(self):
        return (eval, ("open('/tmp/should-not-exist', 'w')",))


def _sampling_params() -> SamplingParams:
    p = SamplingParams(temperature=0.7, top_k=5, stop_token_ids=[7], bad_words=["x"], logit_bias={3: -1.5},
                       structured_outputs=StructuredOutputsParams(regex="a+"), seed=11)
    p._all_stop_token_ids, p._bad_words_token_ids = frozenset({7, 2}), [[4, 5]]     # as the Processor fills them
    return p


def _messages() -> list:
    sp = _sampling_params()
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(3, 0, list(range(50)), [9], sp, [1, 2], 4)],
        scheduled_cached_reqs=CachedRequestData([1], [[2]], [[3]], [True], [4]),
        num_scheduled_tokens={3: 46, 1: 1}, total_num_scheduled_tokens=47, sample_from={5: 3},
        blocks_to_copy=[(1, 2)], blocks_to_swap_in=[(0, 4)], finished_seq_ids={8, 9}, num_blocks_taken_back={1: 1})
    out = ModelRunnerOutput({3: 5, 1: 6}, {3: Logprobs([[5, 1]], [[-0.25, -1.5]], [1])})
    # a feature's messages: the base's with its fields added (spec_decode/messages.py)
    spec_so = SpecDecodeSchedulerOutput(scheduled_cached_reqs=CachedRequestData([1], [[2]], [[3]], [False], [4]),
                                        num_scheduled_tokens={1: 3}, total_num_scheduled_tokens=3,
                                        num_blocks_taken_back={1: 1}, scheduled_spec_decode_tokens={1: [4, 5]})
    spec_out = SpecDecodeModelRunnerOutput({1: 6}, num_accepted_tokens={1: 2}, draft_token_ids={1: [7, 8]})
    model = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-5,
                        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                        tie_word_embeddings=True, eos_token_id=[2])
    config = EngineConfig(nnodes=2, tensor_parallel_size=2, master_port=29500, dtype=torch.float32,
                          speculative_config={"method": "ngram"})
    return [so, out, spec_so, spec_out, GrammarOutput([3], torch.tensor([[-1, 5]], dtype=torch.int32)),
            PreemptionCosts(1e-4, 2e-3),
            WeightsInfo({"Q4_1": 10, "float32": 3}), Join(1, "b pid 7", {"nnodes": 2}, model, "/m"),
            NodePlan({"nnodes": 2}, 2, dict(config=config, ops="torch"), [None, "tcp://127.0.0.1:5"],
                     ("127.0.0.1", 5, "pg/ab/")),
            Report("died", 1, "rank 1 died"), Ping("stop", None),
            (4, "execute_model", (so,), 1.5), (4, 1, True, {3: 5}), [None, 1.5, b"raw", {"k": (1, 2)}]]


@pytest.mark.parametrize("message", _messages(), ids=lambda m: type(m).__name__)
def test_every_message_comes_back_equal(message):
    back = codec.decode(codec.encode(message))
    assert type(back) is type(message)
    if isinstance(message, GrammarOutput):        # a tensor field: == is not a bool
        assert back.structured_output_seq_ids == message.structured_output_seq_ids
        assert torch.equal(back.grammar_bitmask, message.grammar_bitmask)
    else:
        assert back == message
    if isinstance(message, SchedulerOutput) and message.scheduled_new_reqs:   # fields that do not take part in ==
        p, q = message.scheduled_new_reqs[0].sampling_params, back.scheduled_new_reqs[0].sampling_params
        assert (q._all_stop_token_ids, q._bad_words_token_ids, q._stop_ids) == (
            p._all_stop_token_ids, p._bad_words_token_ids, p._stop_ids)
        assert back.blocks_to_copy == [(1, 2)] and type(back.finished_seq_ids) is set


def test_tensors_come_back_bit_for_bit():
    for t in (torch.randn(3, 5), torch.randn(4).to(torch.bfloat16), torch.zeros(0, 7, dtype=torch.int64),
              torch.arange(12, dtype=torch.int32).reshape(3, 4)[:, ::2], torch.tensor(True)):
        back = codec.decode(codec.encode(t))
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_a_feature_registers_its_own_message():
    @dataclass
    class DraftProbs:                      # a feature's own message
        seq_ids: list[int]
        probs: torch.Tensor

    m = DraftProbs([1], torch.ones(1, 3))
    with pytest.raises(TypeError, match="DraftProbs is not registered"):
        codec.encode(m)
    codec.register(DraftProbs)
    back = codec.decode(codec.encode(m))
    assert back.seq_ids == [1] and torch.equal(back.probs, m.probs)


def _refused(data: bytes, match: str) -> None:
    with pytest.raises(codec.CodecError, match=match) as e:
        codec.decode(data)
    assert MARKER.decode() not in str(e.value)


def test_what_is_not_a_message_is_refused_without_quoting_it(tmp_path):
    ext, enc = codec.msgspec.msgpack.Ext, codec._ENCODER.encode
    _refused(pickle.dumps([Bomb(), MARKER]), "not a message")
    _refused(enc(ext(codec.OBJECT, enc([MARKER.decode(), []]))), "not registered in this process")
    _refused(enc(ext(codec.OBJECT, enc(["nanopaged.messages.PreemptionCosts", [MARKER.decode(), 1.0]]))),
             "PreemptionCosts whose fields do not check")
    _refused(enc(ext(codec.OBJECT, enc(["nanopaged.messages.PreemptionCosts", [1.0]]))), "with 1 fields, not 2")
    _refused(enc(ext(codec.TENSOR, enc(["float32", [2, 2], MARKER]))), "bytes do not match")
    _refused(enc(ext(codec.TENSOR, enc(["float32", [-1], b""]))), "shape")
    _refused(enc(ext(codec.TENSOR, enc(["object", [1], b"x"]))), "dtype")
    _refused(enc(ext(99, MARKER)), "unknown kind 99")
    _refused(MARKER, "not a message")
    with pytest.raises(codec.CodecError, match="a list where Report was expected"):
        codec.decode(codec.encode([1]), Report)
    # a message that would build an EngineConfig runs its checks
    fields = dict(vars(EngineConfig(nnodes=2, tensor_parallel_size=2, master_port=1)), max_logprobs=-1)
    name = "nanopaged.config.EngineConfig"
    init = [codec._wrap(fields[f]) for f in codec._REGISTRY[name].init_fields]
    _refused(enc(ext(codec.OBJECT, enc([name, init]))), r"EngineConfig whose fields do not check \(ValueError\)")
    assert not (tmp_path / "should-not-exist").exists()


# -- CURVE ---------------------------------------------------------------------------------------

def _curve_pair(secret_server: bytes, secret_client: bytes, address: str | None = None):
    ctx = zmq.Context()
    server = ctx.socket(zmq.PULL)
    server_auth = ClusterAuth(ctx, secret_server)
    server_auth.serve(server, "a test port")
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.PUSH)
    ClusterAuth(ctx, secret_client).connect_to(client)
    client.connect(address or f"tcp://127.0.0.1:{port}")
    return ctx, server, client, server_auth, port


def _close(ctx, auth, *socks) -> None:
    for s in socks:
        s.close(linger=0)
    auth.stop()
    ctx.term()


def test_curve_takes_the_secret_holder_and_refuses_another_secret():
    secret = b"0123456789abcdef-cluster"
    ctx, server, client, auth, _ = _curve_pair(secret, secret)
    client.send(b"hello")
    assert server.poll(5000) and server.recv() == b"hello"
    _close(ctx, auth, server, client)
    ctx, server, client, auth, _ = _curve_pair(secret, b"another secret of 24 b")
    client.send(b"hello")
    assert not server.poll(1500)
    _close(ctx, auth, server, client)


class _Recorder:
    """A TCP relay between a client and a server that keeps what the client sent."""

    def __init__(self, target: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.sent = self.listener.getsockname()[1], target, bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target))

        def pump(src, dst, keep):
            try:
                while data := src.recv(65536):
                    keep and self.sent.extend(data)
                    dst.sendall(data)
            except OSError:
                pass
        threading.Thread(target=pump, args=(upstream, conn, False), daemon=True).start()
        pump(conn, upstream, True)


def test_a_replayed_session_delivers_nothing():
    """The bytes of a session that delivered one message, sent again on a new connection
    (a stranger who recorded them), deliver none: CURVE's keys are per connection."""
    secret = b"0123456789abcdef-cluster"
    ctx = zmq.Context()
    server = ctx.socket(zmq.PULL)
    auth = ClusterAuth(ctx, secret)
    auth.serve(server, "a test port")
    port = server.bind_to_random_port("tcp://127.0.0.1")
    relay = _Recorder(port)
    client = ctx.socket(zmq.PUSH)
    ClusterAuth(ctx, secret).connect_to(client)
    client.connect(f"tcp://127.0.0.1:{relay.port}")
    client.send(codec.encode(Report("alive")))
    assert server.poll(5000) and codec.decode(server.recv()) == Report("alive")
    time.sleep(0.2)
    recorded = bytes(relay.sent)
    assert len(recorded) > 100
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(recorded)
            time.sleep(0.3)
    assert not server.poll(1000)
    client.close(linger=0)
    _close(ctx, auth, server)


# -- the cluster secret and the addresses ------------------------------------------------------

def test_the_cluster_secret_rules(tmp_path, monkeypatch):
    """Node 0 without a secret writes one to a 0600 file and announces the path, never the
    secret; another node without one, a file others may read, a short secret and a missing
    file are errors that name the cause."""
    from nanopaged.multiproc.cluster_auth import cluster_secret

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NANOPAGED_CLUSTER_SECRET", raising=False)
    node = dict(nnodes=2, tensor_parallel_size=2, master_port=29500)
    said = []
    secret = cluster_secret(EngineConfig(**node), announce=said.append)
    path = said[0].split("wrote a new one to ")[1].split(" (mode 0600)")[0]
    assert os.stat(path).st_mode & 0o777 == 0o600 and open(path, "rb").read().strip() == secret
    assert secret.decode() not in said[0] and "--cluster-secret-file" in said[0] and len(secret) == 64
    assert cluster_secret(EngineConfig(**node, node_rank=1, cluster_secret_file=path)) == secret
    with pytest.raises(ValueError, match="node 1 needs node 0's cluster secret: give --cluster-secret-file"):
        cluster_secret(EngineConfig(**node, node_rank=1))
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match=r"other users may read it \(mode 0644\): chmod 600 it"):
        cluster_secret(EngineConfig(**node, cluster_secret_file=path))
    with pytest.raises(ValueError, match="cannot read it"):
        cluster_secret(EngineConfig(**node, cluster_secret_file=str(tmp_path / "missing")))
    monkeypatch.setenv("NANOPAGED_CLUSTER_SECRET", "short")
    with pytest.raises(ValueError, match="NANOPAGED_CLUSTER_SECRET: the cluster secret has 5 bytes; give at least 16"):
        cluster_secret(EngineConfig(**node, node_rank=1))


def test_an_address_names_its_interface():
    """gloo binds an interface by name: the one that holds the address, or an error."""
    import psutil

    from nanopaged.multiproc.cluster_auth import interface_of

    assert interface_of("127.0.0.1") == "lo"
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                assert interface_of(a.address) == name
    with pytest.raises(ValueError, match="no network interface of this host has the address 192.0.2.1"):
        interface_of("192.0.2.1")           # TEST-NET-1: documentation only
