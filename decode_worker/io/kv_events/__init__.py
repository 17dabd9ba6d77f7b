"""KV events: the worker's one event log and its in-process subscriptions (`hub`), SGLang's
`--kv-events-config` (`config`), the msgpack wire format (`wire`) and the ZMQ publisher with its
replay socket (`publisher`). Importing this package imports neither zmq nor msgspec."""
