"""OpenAI's Responses API (`/v1/responses`) on both servers, stateless, over the chat path.

`handler.py` (the routes), `schema.py` (the body and what is refused), `inputs.py` (the body
as chat-template messages and tools), `output.py` (parser deltas -> items and stream events),
`shape.py` (the response object and the SSE stream). The renderer (the chat template) and the
parser (`harmony/`) are chat's.
"""

from decode_worker.io.api.responses.handler import PREFIX, handle_responses, handle_stored

__all__ = ["PREFIX", "handle_responses", "handle_stored"]
