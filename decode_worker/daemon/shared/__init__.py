"""What the three programs share: the model runtime, the model-compat and pool-layout facts a
transfer needs, and child-process helpers."""
