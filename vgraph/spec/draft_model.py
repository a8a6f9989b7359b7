"""Draft-model proposals: a smaller checkpoint with the target's vocabulary guesses the next
k tokens greedily, and the target verifies them in one forward.

The draft is an ordinary vgraph model: a ``ModelRunner`` of its own (load, compiled forward,
CUDA graphs on a GPU, paged KV cache), started from the target's resolved config with the
draft's checkpoint, unsharded, in the engine's process (under tensor parallelism the ranks
verify; the draft runs once, here). This module drives that runner with step plans it builds
itself, the way the scheduler drives the target's.

Per request the draft's KV cache holds the request's tokens up to ``num_valid`` plus the
guesses it fed last time (``fed``). Each round:

1. catch-up: one chunk per request from its first position the cache does not hold (after the
   target kept or rejected the last guesses) to its last token, sampling guess 1;
2. k-1 single-token steps, all proposing requests batched in each, feeding guess i to get i+1.

After verification only the common prefix of ``fed`` with the request's real tokens stays
valid; the rejected guesses' positions are simply overwritten by the next catch-up. A
request's blocks are freed when the scheduler forgets it (finished, aborted, preempted).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..config import CacheConfig, EngineConfig, LoRASettings, ParallelConfig
from ..core.step_plan import PlannedChunk, PlannedRequest, StepPlan
from ..sampling_params import SamplingParams
from .config import SpeculativeConfig
from .proposer import ProposalRequest, Proposer

if TYPE_CHECKING:
    import torch

    from ..worker.runner import ModelRunner

logger = logging.getLogger("vgraph")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


@dataclass
class _DraftSequence:
    """What the draft's KV cache holds for one request."""

    block_ids: list[int] = field(default_factory=list)
    num_valid: int = 0  # leading positions whose K/V are the request's real tokens'
    fed: list[int] = field(default_factory=list)  # guesses whose K/V follow them (unverified)


class DraftBlocks:
    """The draft's own block pool: a free list, grown per request as its sequence grows. No
    prefix sharing: the draft's cache is small and per request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extends ``blocks`` to hold ``num_tokens``; False (and nothing taken) if the pool is short."""
        needed = -(-num_tokens // self.block_size) - len(blocks)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            blocks.append(self.free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
        blocks.clear()


class DraftModelProposer(Proposer):
    """Greedy k-token guesses from a draft model's runner, one batched forward per guess."""

    def __init__(self, config: SpeculativeConfig, runner: "ModelRunner", budget: int) -> None:
        super().__init__(config)
        self.runner = runner
        self.blocks = DraftBlocks(runner.num_blocks, runner.spec.block_size)
        self.budget = budget  # most tokens in one draft forward (the target's step budget)
        self.sequences: dict[str, _DraftSequence] = {}
        self._in_runner: list[str] = []  # runner copies made last round, dropped by the next plan

    def forget(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.blocks.release(sequence.block_ids)

    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        guesses: dict[str, list[int]] = {}
        ready = [(r, self._catch_up_from(r)) for r in batch]
        ready = [(r, start) for r, start in ready if self._reserve(r)]
        if ready:
            self._first_guesses(ready, guesses)
            self._further_guesses([r for r, _ in ready], guesses)
        return [guesses.get(r.request_id, []) for r in batch]

    def _catch_up_from(self, request: ProposalRequest) -> int:
        """The first position the draft's cache does not hold for ``request``: past its valid
        prefix and the fed guesses the target kept; at most its last token (which must run to
        sample guess 1)."""
        sequence = self.sequences.setdefault(request.request_id, _DraftSequence())
        tokens, valid = request.token_ids, sequence.num_valid
        for guess in sequence.fed:
            if valid >= len(tokens) or tokens[valid] != guess:
                break
            valid += 1
        sequence.num_valid, sequence.fed = min(valid, len(tokens) - 1), []
        return sequence.num_valid

    def _reserve(self, request: ProposalRequest) -> bool:
        """Blocks for the request's tokens and all but the last of its guesses (whose K/V is
        never written); a request the pool cannot hold proposes nothing this step."""
        sequence = self.sequences[request.request_id]
        return self.blocks.grow(sequence.block_ids, len(request.token_ids) + self._count(request) - 1)

    def _count(self, request: ProposalRequest) -> int:
        return min(self.k, request.room)

    def _first_guesses(self, ready: list[tuple[ProposalRequest, int]], guesses: dict[str, list[int]]) -> None:
        """The catch-up chunks, packed into forwards of at most ``budget`` tokens (a long
        prompt's chunk split over several); each request's last chunk samples guess 1."""
        new = [PlannedRequest(r.request_id, list(r.token_ids), _GREEDY) for r, _ in ready]
        forget, self._in_runner = self._in_runner, [r.request_id for r, _ in ready]
        chunks: list[PlannedChunk] = []
        room = self.budget
        for request, start in ready:
            end = len(request.token_ids)
            while start < end:
                size = min(end - start, room)
                chunks.append(self._chunk(request.request_id, size, start, start + size == end))
                start, room = start + size, room - size
                if room == 0:
                    self._run(StepPlan(forget, new, chunks), guesses)
                    forget, new, chunks, room = [], [], [], self.budget
        if chunks:
            self._run(StepPlan(forget, new, chunks), guesses)
        for request, _ in ready:
            self.sequences[request.request_id].num_valid = len(request.token_ids)

    def _further_guesses(self, requests: list[ProposalRequest], guesses: dict[str, list[int]]) -> None:
        """Guess i fed back for guess i+1, every request still short of its count in one step."""
        for i in range(1, self.k):
            chunks = [self._chunk(r.request_id, 1, len(r.token_ids) + i - 1, True)
                      for r in requests if self._count(r) > i and r.request_id in guesses]
            if not chunks:
                return
            for chunk in chunks:
                self.sequences[chunk.request_id].fed.append(guesses[chunk.request_id][-1])
            self._run(StepPlan([], [], chunks), guesses)

    def _chunk(self, request_id: str, size: int, start: int, samples: bool) -> PlannedChunk:
        return PlannedChunk(request_id, size, start, samples, [], 0, 0, list(self.sequences[request_id].block_ids))

    def _run(self, plan: StepPlan, guesses: dict[str, list[int]]) -> None:
        for request_id, token_id in self.runner.execute(plan).sampled.items():
            guesses.setdefault(request_id, []).append(token_id)


# The draft's forwards' activations and its CUDA graphs, kept free for it when the target sizes
# its KV cache on a GPU: an allowance (a draft is small; its largest forward is the step budget).
DRAFT_WORKING_BYTES = 512 << 20


def draft_memory(config: SpeculativeConfig, target: EngineConfig, dtype: "torch.dtype") -> tuple[int, int]:
    """What the draft will hold on the target's device, for the target's KV sizing (the draft
    loads after it): bytes up front (weights in the target's ``dtype``, working memory, the
    blocks its pool holds beyond the target's) and its KV bytes per block of the target's block
    size (its pool grows with the target's: ``_draft_engine_config``)."""
    from ..models.demo import demo_model_path
    from ..models.llama import arch_spec
    from ..models.loader import load_hf_config, resolve_model_path
    from ..worker.kv_sizing import KVSpec

    path = demo_model_path(config.model) or resolve_model_path(config.model)
    arch = arch_spec(load_hf_config(path))
    block_size = target.cache.block_size
    per_block = KVSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, dtype).bytes_per_block
    spare_blocks = 2 * target.scheduler.max_num_seqs + -(-target.max_model_len // block_size)
    return _checkpoint_numel(path) * dtype.itemsize + DRAFT_WORKING_BYTES + spare_blocks * per_block, per_block


def _checkpoint_numel(path: str) -> int:
    """Parameters in the checkpoint's weight files, read from their headers."""
    from safetensors import safe_open

    from ..models.loader import safetensors_files

    total = 0
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= dim
                total += numel
    return total


def build_draft_proposer(config: SpeculativeConfig, target: EngineConfig, tokenizer: Any, vocab_size: int,
                         target_blocks: int) -> DraftModelProposer:
    """Starts the draft's runner from the target's resolved config and checks that it shares
    the target's vocabulary (else its guesses would be other tokens' ids). ``target_blocks``:
    the target's KV pool, which bounds the tokens the draft's cache must ever hold."""
    from ..models.demo import demo_model_path
    from ..models.loader import load_hf_config, resolve_model_path
    from ..worker.runner import ModelRunner

    path = demo_model_path(config.model) or resolve_model_path(config.model)
    hf_config = load_hf_config(path)
    _check_vocabulary(config.model, path, hf_config, tokenizer, vocab_size)
    draft_config = _draft_engine_config(target, path, int(getattr(hf_config, "max_position_embeddings", 2048)),
                                        target_blocks * target.cache.block_size)
    logger.info("draft model %s: %d KV blocks of %d tokens", config.model, draft_config.cache.num_gpu_blocks,
                draft_config.cache.block_size)
    runner = ModelRunner(draft_config)
    return DraftModelProposer(config, runner, draft_config.scheduler.max_num_batched_tokens)


def _check_vocabulary(name: str, path: str, hf_config: Any, tokenizer: Any, vocab_size: int) -> None:
    """The draft's vocabulary size must be the target's, and its tokenizer (when it ships one)
    must map the same strings to the same ids."""
    from ..models.loader import load_tokenizer

    draft_vocab = int(getattr(hf_config, "vocab_size", -1))
    if draft_vocab != vocab_size:
        raise ValueError(f"draft model {name!r} has a vocabulary of {draft_vocab} tokens, the target {vocab_size}: "
                         "a draft model must share the target's vocabulary")
    if not any(os.path.exists(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        return  # no tokenizer beside the draft: the sizes are all there is to compare
    if load_tokenizer(path).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"draft model {name!r} has a different tokenizer from the target's (the same ids are "
                         "other strings): a draft model must share the target's vocabulary")


def _draft_engine_config(target: EngineConfig, path: str, max_position_embeddings: int,
                         target_tokens: int) -> EngineConfig:
    """The target's resolved config with the draft's checkpoint: unsharded, no LoRA, no
    speculation, serial, and a KV pool for every seat at ``max_model_len``, but no more than
    the target's own pool (``target_tokens``) plus two blocks a seat could ever need (a partial
    block, and the guesses past it)."""
    max_model_len = target.max_model_len
    if max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model's max_position_embeddings ({max_position_embeddings}) is below the "
                         f"target's max_model_len ({max_model_len}): lower max_model_len or pick another draft")
    block_size = target.cache.block_size
    seats = target.scheduler.max_num_seqs
    per_seat = -(-max_model_len // block_size)
    target_blocks = -(-target_tokens // block_size)  # each running sequence holds at least one of them
    num_blocks = max(per_seat, min(seats * per_seat, target_blocks + 2 * min(seats, target_blocks)))
    unresolved = replace(target, model=replace(target.model, model=path, tokenizer=None, quantization=None,
                                               revision=None, load_format="auto"),
                         cache=CacheConfig(block_size=block_size, enable_prefix_caching=False,
                                           num_gpu_blocks=num_blocks),
                         scheduler=replace(target.scheduler, async_scheduling=False),
                         parallel=ParallelConfig(), lora=LoRASettings(), speculative_config=None)
    return unresolved.resolved(model_path=path, max_position_embeddings=max_position_embeddings, quantized=False)
