"""Actor ids: node (rank), thread and actor index packed into one 64-bit integer.

Like OneFlow's actor addresses, an id says where its actor runs, so routing a
message needs no lookup table: ``thread_of(id)`` picks the queue, ``rank_of``
the process.
"""
from __future__ import annotations

RANK_BITS, THREAD_BITS, INDEX_BITS = 16, 8, 40
_INDEX_MASK = (1 << INDEX_BITS) - 1
_THREAD_MASK = (1 << THREAD_BITS) - 1


def actor_id(rank: int, thread: int, index: int) -> int:
    if not (0 <= rank < 1 << RANK_BITS and 0 <= thread < 1 << THREAD_BITS and 0 <= index <= _INDEX_MASK):
        raise ValueError(f"actor address out of range: rank {rank}, thread {thread}, index {index}")
    return (rank << (THREAD_BITS + INDEX_BITS)) | (thread << INDEX_BITS) | index


def rank_of(aid: int) -> int:
    return aid >> (THREAD_BITS + INDEX_BITS)


def thread_of(aid: int) -> int:
    return (aid >> INDEX_BITS) & _THREAD_MASK


def index_of(aid: int) -> int:
    return aid & _INDEX_MASK
