"""The node I/O shells: threads, ZeroMQ sockets and timers around the sans-IO core.

* :mod:`~dafka.nodes.node`: the shell every mesh node shares (a thread with a poller).
* :mod:`~dafka.nodes.producer`: the producer (one partition of one topic).
* :mod:`~dafka.nodes.consumer`: the consumer (topics, per partition in order).
* :mod:`~dafka.nodes.tower`: the tower, where nodes find each other.
* :mod:`~dafka.nodes.reader`: what consumers and stores share: assembling partitions.
* :mod:`~dafka.nodes.fairlock`: a lock a publishing loop cannot starve the I/O thread of.
* :mod:`~dafka.nodes.security`: the secure mesh: CURVE keys, allow-lists, roles.
* :mod:`~dafka.nodes.metrics`: Prometheus metrics of towers and nodes.

The public API stays importable from its old paths: :mod:`dafka.producer`
and :mod:`dafka.consumer` re-export it.
"""
