"""What the Tank and Kafka gateways share (:mod:`dafka.gateway.connections`)."""
