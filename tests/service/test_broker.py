"""The embedded broker (kilnfs://): every message delivered exactly once to competing consumers."""
from __future__ import annotations

import threading
import time
from queue import Empty

from kombu import Connection

from workers import broker


def connection(folder) -> Connection:
    broker.register()
    return Connection("kilnfs://", transport_options=broker.transport_options(folder, 0.01))


def test_competing_consumers_get_each_message_once(tmp_path):
    with connection(tmp_path) as producer:
        queue = producer.SimpleQueue("jobs")
        for i in range(300):
            queue.put({"n": i})
        queue.close()
    received: list[int] = []
    lock = threading.Lock()

    deadline = time.monotonic() + 60

    def consume():
        with connection(tmp_path) as conn:
            q = conn.SimpleQueue("jobs")
            while len(received) < 300 and time.monotonic() < deadline:
                try:
                    message = q.get(timeout=0.5)
                except Empty:
                    continue
                with lock:
                    received.append(message.payload["n"])
                message.ack()
            q.close()

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(received) == list(range(300))
    assert not any((tmp_path / "processing").iterdir())


def test_half_written_messages_are_not_delivered(tmp_path):
    with connection(tmp_path) as conn:
        q = conn.SimpleQueue("jobs")
        (tmp_path / "queue" / ".put-0123").write_bytes(b'{"body": "tru')  # a put in progress
        try:
            q.get(timeout=0.2)
            raise AssertionError("a half-written message was delivered")
        except Empty:
            pass
        q.put({"n": 1})
        assert q.get(timeout=10).payload == {"n": 1}
        q.close()


def test_two_broker_folders_in_one_process(tmp_path):
    for i in range(2):
        with connection(tmp_path / str(i)) as conn:
            q = conn.SimpleQueue("jobs")
            q.put({"n": i})
            assert q.get(timeout=10).payload == {"n": i}
            q.close()
