"""``LoRASlotManager``: which adapters sit in the model's ``max_loras`` slots, and which are
kept loaded on the host.

An adapter is read from disk once into the host cache (``max_cpu_loras`` entries, least
recently used dropped first), then copied into a free slot of every ``LoRAProjection`` when
a batch needs it. When no slot is free, the least recently used slot that the batch does not
use is overwritten. Slot buffers are only ever copied into, so the compiled graphs and CUDA
graphs that read them stay valid: swapping adapters costs a copy, never a recompile.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Protocol, Sequence

import torch

from .adapter import LoRAAdapter, LoRATargets, load_adapter
from .config import LoRAConfig
from .layers import LoRAProjection
from .request import LoRARequest


class LoRAModel(Protocol):
    """What the slot manager needs of a model built with LoRA enabled."""

    def lora_targets(self) -> LoRATargets: ...

    def lora_projections(self) -> list[tuple[int, LoRAProjection]]: ...

    def lora_shard(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class LoRASlotManager:
    def __init__(self, model: LoRAModel, config: LoRAConfig, dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self._targets = model.lora_targets()
        self._projections = model.lora_projections()
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # id -> adapter, LRU first
        self._slots: list[Optional[int]] = [None] * config.max_loras  # slot -> adapter id
        self._slot_use: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recently used first

    @property
    def resident(self) -> dict[int, int]:
        """Adapter id -> slot, for the adapters in slots now."""
        return dict(self._slot_use)

    @property
    def cached(self) -> list[int]:
        """Ids of the adapters loaded in host memory, least recently used first."""
        return list(self._host)

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Reads (once) and checks ``request``'s adapter into the host cache; raises
        LoRAAdapterError for a folder that cannot be served, before any slot is touched."""
        cached = self._host.get(request.lora_int_id)
        if cached is not None:
            if cached.request != request:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                                 f"{cached.request.lora_name!r} at {cached.request.lora_path}; ids must be unique")
            self._host.move_to_end(request.lora_int_id)
            return cached
        adapter = load_adapter(request, self._targets, self.config.max_lora_rank, self.dtype)
        self._host[request.lora_int_id] = adapter
        self._trim_host_cache()
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drops the adapter from its slot and the host cache; False if it was not loaded."""
        slot = self._slot_use.pop(lora_int_id, None)
        if slot is not None:
            self._slots[slot] = None
            for _, projection in self._projections:
                projection.clear_slot(slot)
        return self._host.pop(lora_int_id, None) is not None or slot is not None

    def prepare(self, requests: Sequence[Optional[LoRARequest]]) -> list[int]:
        """The slot of each entry (-1 for None: the base model), loading into slots what is not
        resident. Raises ValueError when the batch needs more adapters than there are slots."""
        needed = list(OrderedDict.fromkeys(r.lora_int_id for r in requests if r is not None))
        if len(needed) > self.config.max_loras:
            raise ValueError(f"a batch uses {len(needed)} LoRA adapters, more than max_loras="
                             f"{self.config.max_loras}; the scheduler must admit at most that many")
        by_id = {r.lora_int_id: r for r in requests if r is not None}
        for lora_id in needed:
            self._ensure_resident(by_id[lora_id], protected=set(needed))
        return [-1 if r is None else self._slot_use[r.lora_int_id] for r in requests]

    def _ensure_resident(self, request: LoRARequest, protected: set[int]) -> int:
        slot = self._slot_use.get(request.lora_int_id)
        if slot is None:
            adapter = self.add_adapter(request)
            slot = self._free_slot(protected)
            self._load(adapter, slot)
            self._slots[slot] = request.lora_int_id
            self._slot_use[request.lora_int_id] = slot
        else:
            self.add_adapter(request)  # checks the id still means this adapter; refreshes the host LRU
        self._slot_use.move_to_end(request.lora_int_id)
        return slot

    def _free_slot(self, protected: set[int]) -> int:
        """An empty slot, else the least recently used one whose adapter is not ``protected``."""
        if None in self._slots:
            return self._slots.index(None)
        for lora_id, slot in self._slot_use.items():
            if lora_id not in protected:
                del self._slot_use[lora_id]
                self._slots[slot] = None
                return slot
        raise ValueError("every LoRA slot holds an adapter of the running batch")  # prepare() bounds this

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        """Copies the adapter into ``slot`` of every projection: this rank's shard of it, cut as
        the base layer is (the whole of it without tensor parallelism)."""
        for layer, projection in self._projections:
            weights = {name: self._shard(name, adapter.weights.get((layer, name))) for name in projection.slice_names}
            projection.load_slot(slot, weights)

    def _shard(self, name: str, pair: Optional[tuple[torch.Tensor, torch.Tensor]]
               ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return None if pair is None else self.model.lora_shard(name, *pair)

    def _trim_host_cache(self) -> None:
        """Drops least recently used host copies beyond the cache size; an adapter in a slot
        keeps its copy (it is what a reload would copy from)."""
        excess = len(self._host) - self.config.host_cache_size
        for lora_id in [i for i in self._host if i not in self._slot_use][:max(excess, 0)]:
            del self._host[lora_id]
