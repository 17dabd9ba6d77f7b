"""`decode-worker demo`: a prefill peer and decode workers on one machine, and a multi-turn chat
driven through them."""
