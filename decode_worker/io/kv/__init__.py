"""KV transfer between a prefill peer and the decode worker: the wire protocol and its checks,
the bootstrap (ZMQ) channel, the NIXL agent, the receiver (decode side) and the sender
(prefill side)."""
