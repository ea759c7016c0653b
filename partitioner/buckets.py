"""Gradient all-reduce buckets: the runtime fills them in backward order and the simulator prices the last one."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["BUCKET_BYTES", "gradient_buckets"]

#: Gradient bytes per all-reduce bucket (DistributedDataParallel's default, 25 MiB).
BUCKET_BYTES = 25 << 20


def gradient_buckets(sizes: Sequence[float], kinds: Sequence[Hashable] | None = None,
                     limit: float = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``sizes`` (bytes, in the order the gradients become final) grouped into buckets.

    A bucket closes before an item that would take it past ``limit`` (an item larger than
    the limit gets a bucket of its own) or whose kind (dtype) differs from the bucket's, as
    in DistributedDataParallel: every replica forms the same buckets from the same order.
    """
    out: list[list[int]] = []
    filled = 0.0
    for i, size in enumerate(sizes):
        if not out or filled + size > limit or (kinds is not None and kinds[out[-1][0]] != kinds[i]):
            out.append([])
            filled = 0.0
        out[-1].append(i)
        filled += size
    return out
