"""Record batches on a plain mesh: sent where every reader takes them, never to C-like readers.

A RawPeer (tests/conftest.py) subscribed the way a C node subscribes (no batch
twin) must get the reference's one record a message; one that also subscribes
the twins is a dafka-like reader and gets batches.  Real sockets, real store.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import zmq

from dafka.config import ConfigError, NodeConfig, node_config_from
from dafka.core import wire
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.node import Store
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)

TWIN = wire.BATCH_CAPABLE


def collect(consumer: Consumer, n: int, since: int, timeout: float = 15.0) -> list[bytes]:
    """The contents of the first ``n`` records of offsets ``since`` and after."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += [r.content for r in consumer.poll_batch(n - len(got), 0.2) if r.offset >= since]
    return got


def records_of(peer, cls: type) -> list[tuple[int, bytes]]:
    """(offset, content) of every record the peer received in messages of class ``cls``."""
    out = []
    for msg in peer.messages(cls):
        contents = getattr(msg, "contents", None) or (msg.content,)
        out += [(msg.sequence + i, c) for i, c in enumerate(contents)]
    return out


def test_dafka_readers_get_batches_and_a_c_like_reader_single_records(cfg: NodeConfig, raw_peer) -> None:
    topic = "bt"
    with Consumer(topic, cfg, offset_reset="earliest") as consumer, Producer(topic, cfg, acks=False) as producer:
        wait_until(lambda: producer.publish(b"first") and consumer.poll(0.2), 10)
        sniffer = raw_peer([TWIN + b"Mbt", b"Mbt"])  # subscribes like a dafka reader
        sniffer.wait_for(lambda p: len(p.peers) >= 2)
        wait_until(lambda: producer.audience.readers(producer._record_header) >= 2, 10)
        assert producer.batching
        base = producer.next_offset
        producer.publish_many(b"a%04d" % i for i in range(1000))
        assert collect(consumer, 1000, base) == [b"a%04d" % i for i in range(1000)]
        sniffer.wait_for(lambda p: len(records_of(p, wire.RecordBatch)) >= 1000)
        assert not sniffer.messages(wire.Record)  # nothing went as single records
        assert len(sniffer.messages(wire.RecordBatch)) < 100  # many records a message

        # A reader subscribed as the C reference does (no twin) joins: from the
        # moment the producer has read its subscription, records go one a message.
        c_like = raw_peer([b"Mbt"])
        c_like.wait_for(lambda p: len(p.peers) >= 2)
        wait_until(lambda: not producer.batching, 10)
        base = producer.next_offset
        producer.publish_many(b"b%04d" % i for i in range(1000))
        assert collect(consumer, 1000, base) == [b"b%04d" % i for i in range(1000)]
        got = c_like.wait_for(lambda p: len(p.messages(wire.Record)) >= 1000 and p.messages(wire.Record))
        assert [(r.sequence, r.content) for r in got[-1000:]] == [(base + i, b"b%04d" % i) for i in range(1000)]
        assert all(m.sequence < base for m in c_like.messages(wire.RecordBatch))

        # It leaves (its pipe closes: the XPUB passes its unsubscriptions on): batches again.
        c_like.close()
        wait_until(lambda: producer.batching, 10)
        base = producer.next_offset
        producer.publish_many(b"c%04d" % i for i in range(100))
        assert collect(consumer, 100, base) == [b"c%04d" % i for i in range(100)]


def test_a_c_like_reader_joining_mid_stream_gets_few_batches(cfg: NodeConfig, raw_peer) -> None:
    # While batching, the publishing path looks for new subscriptions every
    # millisecond: a reader without twins gets batches (which a C node drops
    # and fetches again) for about that long, not until the next 50 ms tick.
    with Producer("mid", cfg, acks=False) as producer:
        stop = threading.Event()

        def publish() -> None:
            while not stop.is_set():
                producer.publish(b"m")
                time.sleep(0.0005)  # a publishing rate, not a wait

        thread = threading.Thread(target=publish)
        thread.start()
        try:
            c_like = raw_peer([b"Mmid"])
            c_like.wait_for(lambda p: len(p.messages(wire.Record)) >= 200)
        finally:
            stop.set()
            thread.join(10)
        assert len(c_like.messages(wire.RecordBatch)) <= 10
        assert not producer.batching


def fetch_as(raw_peer, partition: str, topic: str, capable: bool, first: int, count: int) -> tuple[list, list]:
    """A raw requester (taking batches or not) FETCHes; the (offset, content) it got in batches and singly."""
    requester = raw_peer([])
    prefix = wire.P_DIRECT_RECORD + requester.address.encode()
    if capable:
        requester.sub.setsockopt(zmq.SUBSCRIBE, TWIN + prefix)
    requester.sub.setsockopt(zmq.SUBSCRIBE, prefix)
    fetch = wire.P_FETCH + partition.encode()
    # Wait until the holder subscribed to our FETCHes (a store takes all, a producer its own).
    requester.wait_for(lambda p: any(s[:2] == b"\x01F" and fetch.startswith(s[1:]) for s in p.subscriptions))
    # That says nothing of the other direction: our SUB connects to the holder
    # only once it hears the holder's beacon, and our subscription reaches it a
    # moment later; an answer published before then is dropped by its PUB, and
    # one chosen before the holder read our subscriptions goes as single
    # records (it cannot know yet that we take batches).  So first the record
    # before ``first``, asked again until it comes: then the holder has our
    # subscriptions (that record is not counted, however late a repeat of it comes).
    assert first >= 1
    warm_up = wire.Fetch(partition, requester.address, topic, first - 1, 1)
    asked_at = [0.0]

    def warmed(p):
        if records_of(p, wire.DirectRecordBatch) or records_of(p, wire.DirectRecord):
            return True
        if time.monotonic() - asked_at[0] >= 0.5:
            asked_at[0] = time.monotonic()
            p.send(warm_up)
        return False

    requester.wait_for(warmed)
    request = wire.Fetch(partition, requester.address, topic, first, count)
    requester.send(request)
    progress = [0, time.monotonic()]

    def answered(p):
        batched = [r for r in records_of(p, wire.DirectRecordBatch) if r[0] >= first]
        single = [r for r in records_of(p, wire.DirectRecord) if r[0] >= first]
        got = len(set(batched + single))
        if got > progress[0]:
            progress[:] = [got, time.monotonic()]
        elif time.monotonic() - progress[1] >= 0.5:
            progress[1] = time.monotonic()
            p.send(request)  # as a real reader: what does not come is asked for again
        return got >= count and (batched, single)

    batched, single = requester.wait_for(answered)
    assert sorted(set(batched + single))[:count] == [(first + i, b"r%04d" % (first + i)) for i in range(count)]
    requester.close()
    return batched, single


def test_a_producer_answers_in_batches_only_requesters_that_take_them(cfg: NodeConfig, raw_peer) -> None:
    with Producer("fp", cfg) as producer:  # acks on, no store: everything stays held
        producer.publish_many(b"r%04d" % i for i in range(3000))
        batched, single = fetch_as(raw_peer, producer.address, "fp", True, 100, 2500)
        assert batched and not single
        batched, single = fetch_as(raw_peer, producer.address, "fp", False, 100, 2500)
        assert single and not batched
        producer.close(0.1)


def test_a_store_answers_in_batches_only_requesters_that_take_them(cfg: NodeConfig, raw_peer, tmp_path: Path) -> None:
    with Store(tmp_path / "db", cfg) as store:
        with Producer("fs", cfg) as producer:
            wait_until(lambda: len(producer.peers) >= 1 and len(store.peers) >= 1, 10)
            producer.publish_many(b"r%04d" % i for i in range(3000))
            assert producer.flush(15)
            partition = producer.address
        # The producer is gone: only the store answers.
        batched, single = fetch_as(raw_peer, partition, "fs", True, 100, 2500)
        assert batched and not single
        batched, single = fetch_as(raw_peer, partition, "fs", False, 100, 2500)
        assert single and not batched


def test_batches_false_keeps_one_record_a_message(cfg: NodeConfig, raw_peer) -> None:
    never = replace(cfg, batches=False)
    with Producer("nb", never, acks=False) as producer:
        sniffer = raw_peer([TWIN + b"Mnb", b"Mnb"])
        sniffer.wait_for(lambda p: len(p.peers) >= 1 and len(producer.peers) >= 1)
        wait_until(lambda: producer.audience.readers(producer._record_header) >= 1, 10)
        assert not producer.batching
        producer.publish_many(b"x%03d" % i for i in range(300))
        got = sniffer.wait_for(lambda p: len(p.messages(wire.Record)) >= 300 and p.messages(wire.Record))
        assert [r.content for r in got] == [b"x%03d" % i for i in range(300)]
        assert not sniffer.messages(wire.RecordBatch)


def test_the_batches_setting_is_a_boolean() -> None:
    assert node_config_from({"batches": False}).batches is False
    assert NodeConfig().batches is True
    with pytest.raises(ConfigError):
        node_config_from({"batches": "no"})
