"""smg's gRPC worker protocol: the `SglangScheduler` service of `smg-grpc-proto`.

smg (the SGLang Model Gateway) in gRPC mode (`grpc://` worker URLs) tokenizes, renders chat
templates and parses outputs itself and sends workers token ids (`Generate`). It is also the
only mode in which it subscribes to a worker's KV events (`SubscribeKvEvents`). Both servers
serve this service beside HTTP (`server.grpc_port`); every RPC runs on the same `ApiApp`,
backend, admission, errors and metrics as the HTTP routes (`servicer.py`).

Modules: `convert.py` (protobuf <-> the API layer's types), `status.py` (errors -> gRPC
status codes), `info.py` (model, server and load reports, the tokenizer bundle),
`servicer.py` (the RPCs).
"""
