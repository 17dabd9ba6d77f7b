"""The decode worker program (`decode-worker serve`): the engine on its compute thread, the
event-loop backend the HTTP API talks to, and the process around them."""
