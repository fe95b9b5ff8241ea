"""A Kafka-protocol gateway: stock Kafka clients produce to and consume from the mesh.

* :mod:`dafka.kafka.codec`: frames, request headers, the versions served
  (message bodies by kafka-python's protocol module);
* :mod:`dafka.kafka.records`: record batches v2 (and older message sets),
  compression, CRC-32C;
* :mod:`dafka.kafka.groups`: the classic consumer-group coordinator, sans-IO;
* :mod:`dafka.kafka.serving`: answers to requests, sans-IO, over a store backend;
* :mod:`dafka.kafka.admin`: the admin requests' answers (configs, partitions, records,
  groups, the cluster) and what each means on a mesh, sans-IO;
* :mod:`dafka.kafka.gateway`: the listener in the Tank gateway's process.
"""
