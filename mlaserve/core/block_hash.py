"""Prefix-cache hashes of full KV blocks: each chained to its parent, so one hash names a whole prefix."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NewType, Protocol

import xxhash

# 16-byte xxh3-128 digest. 128 bits so that a collision (which would silently reuse another prompt's KV)
# is out of reach even with billions of cached blocks.
BlockHash = NewType("BlockHash", bytes)

# Parent of the first block. A fixed value (not per process) so hashes are reproducible across runs.
_ROOT_HASH = b"\x00" * 16


class HashedTokens(Protocol):
    """What update_block_hashes reads and extends: a request's tokens and its per-group hash lists."""

    @property
    def all_token_ids(self) -> list[int]: ...

    block_hashes: dict[int, list[BlockHash]]


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], group_id: int = 0
) -> BlockHash:
    """Chained hash of one full block: the parent hash pins the whole prefix, not just this block's tokens.

    Ints are packed little-endian signed 64-bit (pickle/repr are not stable across Python versions); the
    group id and the token count are hashed too, so cache groups never share a hash and blocks of different
    sizes cannot alias.
    """
    n = len(token_ids)
    payload = struct.pack(f"<qq{n}q", group_id, n, *token_ids)
    return BlockHash(xxhash.xxh3_128_digest((parent_hash or _ROOT_HASH) + payload))


def update_block_hashes(request: HashedTokens, block_size: int, group_id: int = 0) -> list[BlockHash]:
    """Extend (lazily) and return the request's hashes of every full block of all_token_ids for a group."""
    hashes = request.block_hashes.get(group_id)
    if hashes is None:
        hashes = request.block_hashes[group_id] = []
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], group_id)
        hashes.append(parent)
    return hashes
