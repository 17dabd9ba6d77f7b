"""SGLang's PD transfer protocol (0.5.23, NIXL backend): frames, bootstrap client and server,
the aux buffer schema and the KV layout bridge onto this worker's pools."""
