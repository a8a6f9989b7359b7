"""Which data-parallel replica serves a submission: a pure policy, no engines, no I/O.

Two goals pull against each other. Load: a replica with fewer outstanding sequences finishes
a new one sooner. Prefix affinity: a replica that already served a prompt prefix holds its KV
blocks in its prefix cache, so sending the next prompt with that prefix there skips its prefill.
The rule that reconciles them:

- A prompt's *prefix keys* are chained hashes of its first full KV blocks of token ids (block
  ``i``'s key hashes block ``i``'s ids together with block ``i - 1``'s key, as the prefix
  cache's block hashes do), up to ``max_affinity_blocks`` blocks. A prompt shorter than one
  block has no key.
- The router remembers, for each key it saw, the replica that first served it (bounded LRU).
  The *affine* replica of a prompt is the owner of its deepest remembered key: the replica
  likely to hold the longest cached prefix.
- The affine replica is chosen while its load is within ``max_imbalance`` outstanding
  sequences of the least loaded replica's (``load[affine] - min(load) <= max_imbalance``):
  a hot prefix can make its replica at most that much busier than the idlest one; beyond it,
  traffic spills over. Otherwise (no key known, or the owner overloaded) the least loaded
  replica is chosen, the lowest index on a tie, so the choice is deterministic.
- Keys a replica served that had no owner become its own; owners never move (a spilled
  request does not steal a prefix: the owner still holds its blocks, and traffic returns to
  it once the load evens out).

Load is counted in sequences (prompts x ``n``), not requests: a request with ``n=8`` costs
its replica eight sequences of decode work.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class RouterConfig:
    """How a ``PrefixAffinityRouter`` weighs load against cached prefixes."""

    num_replicas: int
    block_size: int = 16  # the KV cache's block size: the prefix cache's unit of reuse
    max_affinity_blocks: int = 8  # prefix keys per prompt (deeper blocks rarely decide anything)
    max_imbalance: int = 8  # outstanding sequences the affine replica may have above the least loaded
    max_prefixes: int = 65536  # keys remembered (LRU): bounds the router's memory

    def __post_init__(self) -> None:
        for name in ("num_replicas", "block_size", "max_affinity_blocks", "max_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be at least 0, got {self.max_imbalance}")


@dataclass(frozen=True)
class Route:
    """A routing decision: the replica, and whether prefix affinity chose it."""

    replica: int
    affine: bool


def prefix_keys(token_ids: Optional[Sequence[int]], block_size: int, max_blocks: int) -> list[int]:
    """Chained hashes of the first full blocks of ``token_ids`` (empty without token ids)."""
    if not token_ids:
        return []
    keys: list[int] = []
    previous = 0
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        keys.append(previous)
    return keys


def least_loaded(loads: Sequence[int], exclude: Optional[int] = None) -> int:
    """The replica with the fewest outstanding sequences, the lowest index on a tie."""
    candidates = [i for i in range(len(loads)) if i != exclude] or list(range(len(loads)))
    return min(candidates, key=lambda i: (loads[i], i))


class PrefixAffinityRouter:
    """Load-aware, prefix-affine replica choice (the rule is in the module docstring).

    Pure: it sees loads passed in and keeps only the prefix -> owner table, so tests drive it
    with made-up loads and the engine keeps the true counts."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._owners: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica, oldest first

    def keys(self, token_ids: Optional[Sequence[int]]) -> list[int]:
        """The prefix keys of a prompt, as ``route`` takes them."""
        return prefix_keys(token_ids, self.config.block_size, self.config.max_affinity_blocks)

    def affine_replica(self, keys: Sequence[int]) -> Optional[int]:
        """The owner of the deepest remembered key, if any."""
        for key in reversed(keys):
            owner = self._owners.get(key)
            if owner is not None:
                return owner
        return None

    def route(self, keys: Sequence[int], loads: Sequence[int]) -> Route:
        """Chooses a replica for a prompt with prefix ``keys`` given each replica's outstanding
        sequences, and records the keys it did not know as served there."""
        if len(loads) != self.config.num_replicas:
            raise ValueError(f"expected {self.config.num_replicas} loads, got {len(loads)}")
        owner = self.affine_replica(keys)
        if owner is not None and loads[owner] - min(loads) <= self.config.max_imbalance:
            route = Route(owner, affine=True)
        else:
            route = Route(least_loaded(loads), affine=False)
        self.record(keys, route.replica)
        return route

    def record(self, keys: Sequence[int], replica: int) -> None:
        """Notes that ``replica`` served a prompt with ``keys``: unknown keys become its own,
        known ones are refreshed (the least recently used are forgotten past the bound)."""
        for key in keys:
            if key in self._owners:
                self._owners.move_to_end(key)
            else:
                self._owners[key] = replica
        while len(self._owners) > self.config.max_prefixes:
            self._owners.popitem(last=False)
