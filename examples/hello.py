"""Publish a few records and read them back, in one process.

Run a tower and a store first (`make run` starts both), then:

    .venv/bin/python examples/hello.py
"""

from __future__ import annotations

from dafka.consumer import Consumer
from dafka.producer import Producer


def main() -> None:
    with Producer("greetings") as producer:
        receipts = [producer.publish(f"hello {i}".encode()) for i in range(5)]
        producer.flush(10)
        print("acknowledged:", all(r.acked() for r in receipts))
    with Consumer("greetings", offset_reset="earliest") as consumer:
        for _ in range(5):
            record = consumer.poll(10)
            if record is None:
                break
            print(record.partition[:8], record.offset, record.content.decode())


if __name__ == "__main__":
    main()
