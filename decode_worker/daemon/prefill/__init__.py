"""The reference prefill peer (`decode-worker prefill`): prefill on the model, then NIXL-write
the KV and the first token into a decode worker's pools."""
