"""Integer helpers shared by every layer (pure)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b."""
    return -(-a // b)


def align_down(n: int, multiple: int) -> int:
    """Largest multiple of `multiple` that is <= n."""
    return n - n % multiple


def align_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return cdiv(n, multiple) * multiple
