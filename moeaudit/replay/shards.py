"""How an expert-parallel replay divides its work among the ranks: the canary's windows and each
layer's routed experts, in contiguous blocks. The plan of the bytes each rank is sent
(``replay.rank_bytes``) and the sharded replay (``replay.sharded``) divide by the same rules, so
every rank computes the same split from the sizes alone."""

from __future__ import annotations


def windows_of(W: int, world: int) -> list[range]:
    """Contiguous blocks of the canary's windows, one per rank (sizes differ by at most one)."""
    base, extra = divmod(W, world)
    out, start = [], 0
    for r in range(world):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def experts_of(E: int, world: int) -> list[range]:
    """Contiguous blocks of a layer's routed experts, one per rank."""
    return windows_of(E, world)
