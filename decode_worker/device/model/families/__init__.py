"""One small module per supported architecture family (see registry.py)."""
