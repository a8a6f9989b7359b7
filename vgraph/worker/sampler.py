"""Turns a batch of last-token logits into next tokens (and logprobs) with batched tensor ops.

The engine builds one ``SamplingMetadata`` per step from the scheduled requests; ``Sampler``
then runs the whole batch through the same pipeline as vLLM:

0. structured outputs: the rows with a grammar get their disallowed tokens set to -inf (one
   batched op over those rows, ``structured.bitmask.apply_masks``), before everything else, so
   penalties, temperature and truncation only ever choose among allowed tokens, greedy or not.
1. logprobs, when any row asks for them, from ``log_softmax`` of the *raw* model logits
   (before the grammar mask, penalties, temperature and truncation: a constrained row reports
   what the model thought of the token, not the probability within the allowed set). This matches vLLM's default
   ``logprobs_mode="raw_logprobs"``: the numbers describe the model, not the sampling knobs,
   so they are comparable across requests with different settings.
2. penalties on the logits: repetition (HF/vLLM: tokens seen in the prompt or the output have
   positive logits divided and non-positive ones multiplied), then frequency and presence
   (OpenAI: ``freq * count`` and ``pres * (count > 0)`` over the *output* tokens only).
3. min_tokens: EOS and stop token ids get ``-inf`` while the row is short of ``min_tokens``.
4. greedy rows take the argmax of those logits.
5. random rows: temperature, top-k, top-p, min-p, then an exponential race
   (``argmax(probs / q)`` with ``q ~ Exp(1)``), which samples exactly from ``probs``. Seeded
   rows draw ``q`` from their own generator, so their tokens do not depend on the rest of the
   batch; the other rows share the default RNG.

Per-request Python work is limited to gathering id lists when the metadata is built and
drawing noise for seeded rows; logprobs stay on the device until the step is finished
(``logprob_rows``). On a GPU the metadata's tensors are built in pinned host memory and copied
without blocking (``upload``), so the host builds the step while the forward runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .logprob_rows import LogprobRows
from .runner_requests import PENDING, RunnerRequest
from ..structured.bitmask import GrammarMasks, apply_masks


def _pad_ids(id_lists: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """Right-pads ragged id lists into a [B, L] int64 tensor (L >= 1 so scatter has a column)."""
    width = max((len(ids) for ids in id_lists), default=0) or 1
    rows = [list(ids) + [pad] * (width - len(ids)) for ids in id_lists]
    return device_tensor(rows, torch.int64, device).reshape(len(id_lists), width)


def _token_counts(id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str,
                  pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """[B, V] counts of each token id per row, via one scatter_add (padding and ``PENDING``
    placeholders go to column V). ``pending``: ``(rows, ids)`` of tokens whose ids are still on
    the device (``launched.pending_tokens``), each counted once more in its row."""
    ids = _pad_ids(id_lists, vocab_size, device).clamp_(max=vocab_size)
    ids.masked_fill_(ids == PENDING, vocab_size)
    counts = torch.zeros(len(id_lists), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    if pending is not None:
        rows, pending_ids = pending
        counts.index_put_((rows, pending_ids), torch.ones_like(rows, dtype=torch.int32), accumulate=True)
    return counts[:, :vocab_size]


def _min_tokens_ban(request: RunnerRequest, vocab_size: int) -> list[int]:
    """Token ids a row may not produce yet: stop ids, plus EOS unless ``ignore_eos``.

    With ``ignore_eos`` the EOS token does not end the request, so it is an ordinary token and
    is left alone; stop_token_ids always end it and are always held back.
    """
    params = request.sampling_params
    if len(request.output_token_ids) >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= set(request.eos_token_ids)
    return sorted(t for t in banned if 0 <= t < vocab_size)


def device_tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` on ``device``, staged through pinned host memory when that is a GPU."""
    device = torch.device(device)
    return upload(values, dtype, device, pin=device.type == "cuda")


def upload(values: list, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """Builds ``values`` on the host, in pinned memory when ``pin``, and copies them to
    ``device``. Why: ``torch.tensor(..., device=cuda)`` copies from pageable memory, which
    blocks the host until the copy is done, about ten times per step; from pinned memory the
    copy is queued behind the forward (``non_blocking``) and the host goes on building the
    step. The pinned block is not reused before the copy has run (torch's host allocator
    records the copy's stream)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=pin)
    return host.to(device, non_blocking=pin)


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, as [B] / [B, V] tensors built once."""

    vocab_size: int
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows so dividing is harmless
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor  # [B] int64; vocab_size where disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    repetition_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    no_penalties: bool
    # [B, V] int32 output-token counts; None when no row has a penalty.
    output_token_counts: Optional[torch.Tensor]
    # [B, V] bool prompt-token presence; None when no row has a repetition penalty.
    prompt_token_mask: Optional[torch.Tensor]
    # (row, token) index pairs to set to -inf for min_tokens; None when nothing is banned.
    min_tokens_rows: Optional[torch.Tensor]
    min_tokens_cols: Optional[torch.Tensor]
    generators: list[Optional[torch.Generator]]  # per row; None = default RNG
    num_logprobs: list[Optional[int]]  # per row, as asked (None = no logprobs)
    max_num_logprobs: Optional[int]  # largest top-n asked in the batch; None if nobody asked
    # Structured outputs: the constrained rows and their packed allowed-token masks; None when
    # no row has a grammar.
    grammar_rows: Optional[torch.Tensor] = None  # [G] int64
    grammar_bitmask: Optional[torch.Tensor] = None  # [G, ceil(V / 32)] int32

    @classmethod
    def from_requests(cls, requests: list[RunnerRequest], vocab_size: int,
                      device: torch.device | str = "cpu",
                      masks: Optional[GrammarMasks] = None,
                      pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> "SamplingMetadata":
        """Gathers the batch's parameters into tensors on ``device``, one row per request
        (``masks``: the constrained rows' grammar masks, from ``structured.bitmask.fill_masks``;
        ``pending``: the rows' output tokens still on the device, which penalties count too,
        from ``launched.pending_tokens``)."""
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        no_rep = all(v == 1.0 for v in rep)
        no_penalties = no_rep and all(v == 0.0 for v in freq + pres)
        rows, cols = _min_tokens_indices(requests, vocab_size, device)
        asked = [p.logprobs for p in params]
        return cls(
            vocab_size=vocab_size,
            temperature=device_tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                      torch.float32, device),
            greedy=device_tensor(greedy, torch.bool, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=device_tensor(top_k, torch.int64, device),
            top_p=device_tensor([p.top_p for p in params], torch.float32, device),
            min_p=device_tensor([p.min_p for p in params], torch.float32, device),
            no_top_k=all(k == vocab_size for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
            repetition_penalty=device_tensor(rep, torch.float32, device),
            frequency_penalty=device_tensor(freq, torch.float32, device),
            presence_penalty=device_tensor(pres, torch.float32, device),
            no_penalties=no_penalties,
            output_token_counts=None if no_penalties else _token_counts(
                [r.output_token_ids for r in requests], vocab_size, device, pending),
            prompt_token_mask=None if no_rep else _token_counts(
                [r.prompt_token_ids for r in requests], vocab_size, device) > 0,
            min_tokens_rows=rows,
            min_tokens_cols=cols,
            generators=[None if g else r.generator for g, r in zip(greedy, requests)],
            num_logprobs=asked,
            max_num_logprobs=max((n for n in asked if n is not None), default=None),
            grammar_rows=None if masks is None else device_tensor(masks.rows, torch.int64, device),
            grammar_bitmask=None if masks is None else _to_device(masks.bitmask, device),
        )


class SamplingMetadataCache:
    """The last step's metadata, reused while the sampled rows are the same requests in the
    same order and nothing in it changes from step to step (no penalty counts, no min_tokens
    bans, no grammar masks): a steady decode batch then builds none of its ~10 tensors."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._requests: list[RunnerRequest] = []
        self._meta: Optional[SamplingMetadata] = None

    def get(self, requests: list[RunnerRequest], masks: Optional[GrammarMasks] = None,
            pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> SamplingMetadata:
        if masks is None and self._meta is not None and _same_rows(self._requests, requests):
            return self._meta
        meta = SamplingMetadata.from_requests(requests, self.vocab_size, self.device, masks, pending)
        steady = meta.no_penalties and meta.min_tokens_rows is None and meta.grammar_rows is None
        self._requests, self._meta = (list(requests), meta) if steady else ([], None)
        return meta


def _same_rows(old: list[RunnerRequest], new: list[RunnerRequest]) -> bool:
    return len(old) == len(new) and all(a is b for a, b in zip(old, new))


def _to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, without blocking the host."""
    device = torch.device(device)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _min_tokens_indices(requests: list[RunnerRequest], vocab_size: int, device: torch.device | str
                        ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Flattened (row, token) pairs of every id banned by min_tokens in this batch."""
    rows: list[int] = []
    cols: list[int] = []
    for i, request in enumerate(requests):
        banned = _min_tokens_ban(request, vocab_size)
        rows.extend([i] * len(banned))
        cols.extend(banned)
    if not rows:
        return None, None
    return device_tensor(rows, torch.int64, device), device_tensor(cols, torch.int64, device)


@dataclass
class SamplerOutput:
    """One token per row; ``logprobs`` is None unless some row asked for them.

    When present, the rows' logprobs still on the device (``LogprobRows``: read on the host when
    the step is finished, not here); rows that did not ask get a None entry.
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: Optional[LogprobRows] = None


def apply_grammar(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Structured outputs: disallowed tokens of the constrained rows to -inf (a new tensor)."""
    if md.grammar_rows is None or md.grammar_bitmask is None:
        return logits
    return apply_masks(logits, md.grammar_rows, md.grammar_bitmask)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only); returns a new tensor."""
    counts = md.output_token_counts
    if md.no_penalties or counts is None:
        return logits
    if md.prompt_token_mask is not None:
        seen = md.prompt_token_mask | (counts > 0)
        rep = md.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * counts
    return logits - md.presence_penalty.unsqueeze(1) * (counts > 0)


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Bans EOS / stop ids on rows that have not produced ``min_tokens`` yet."""
    if md.min_tokens_rows is None:
        return logits
    logits = logits.clone()
    logits[md.min_tokens_rows, md.min_tokens_cols] = float("-inf")
    return logits


def apply_top_k_top_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Masks tokens outside each row's top-k and top-p sets to -inf (one sort for both).

    Top-k keeps exactly k tokens (ties broken by the sort). Top-p keeps the smallest prefix of
    the sorted distribution whose mass reaches ``top_p``: a token is dropped when the mass
    strictly before it is already >= top_p; the mass before the most likely token is
    exactly 0 < top_p, so that token always stays.
    """
    if md.no_top_k and md.no_top_p:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = rank >= md.top_k.unsqueeze(1)
    if not md.no_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 are exempt: float cumsum can reach 1.0 before the tail ends.
        top_p = md.top_p.unsqueeze(1)
        drop |= (mass_before >= top_p) & (top_p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Zeroes tokens whose probability is below ``min_p`` times the row's largest probability."""
    if md.no_min_p:
        return probs
    threshold = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_noise(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs``; seeded rows use only their own generator.

    A seeded row draws exactly one vocab-sized vector per step from its generator, so its
    stream depends only on its seed and step count, never on which rows share the batch.
    """
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for row, gen in enumerate(generators):
        if gen is None:
            continue
        if gen.device == probs.device:
            q[row].exponential_(generator=gen)
        else:  # a host generator (seeded rows) for a GPU: drawn into pinned memory, copied without a wait
            pin = probs.device.type == "cuda"
            noise = torch.empty(probs.shape[-1], pin_memory=pin).exponential_(generator=gen)
            q[row].copy_(noise, non_blocking=pin)
    # Exp(1) can round to 0 in float; a tiny floor keeps zero-probability tokens at 0 / tiny = 0.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def sample_random(logits: torch.Tensor, md: SamplingMetadata,
                  draft_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one exponential-race draw per row.

    ``draft_ids`` (speculative decoding, -1 on rows without one): a row that verifies a guessed
    token x keeps x with probability p(x), else draws from p with x removed. A guess proposed
    without a distribution of its own (n-gram) is a point mass, for which this is exactly
    rejection sampling: the token the row ends with is distributed as p, as without guessing."""
    logits = logits / md.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, md)
    probs = apply_min_p(logits.softmax(dim=-1), md)
    sampled = (probs / _exponential_noise(probs, md.generators)).argmax(dim=-1)
    if draft_ids is None:
        return sampled
    has_draft = draft_ids >= 0
    drafts = draft_ids.clamp_min(0).unsqueeze(1)
    keep = _uniform(probs.shape[0], probs, md.generators) < probs.gather(1, drafts).squeeze(1)
    residual = probs.scatter(1, drafts, 0.0)
    recovered = (residual / _exponential_noise(residual, md.generators)).argmax(dim=-1)
    return torch.where(has_draft, torch.where(keep, draft_ids, recovered), sampled)


def _uniform(rows: int, like: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """One U(0, 1) draw per row; seeded rows from their own generator."""
    u = torch.rand(rows, device=like.device)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(1, generator=gen, device=gen.device).item()
    return u


class Sampler(torch.nn.Module):
    """Stateless: all per-request state lives in ``SamplingMetadata`` and the requests' generators."""

    def forward(self, logits: torch.Tensor, md: SamplingMetadata,
                draft_ids: Optional[torch.Tensor] = None) -> SamplerOutput:
        """``logits``: [B, V] float32 of each row's last position; returns one token per row.
        ``draft_ids``: [B], the guessed token each row verifies (-1: none; see sample_random)."""
        if logits.shape[-1] != md.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, metadata expects {md.vocab_size}")
        raw = logits
        logits = apply_grammar(logits.float(), md)
        logits = apply_min_tokens(apply_penalties(logits, md), md)
        token_ids = self._choose(logits, md, draft_ids)
        logprobs = (None if md.max_num_logprobs is None
                    else LogprobRows.of(raw.float().log_softmax(dim=-1), token_ids, md.num_logprobs))
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _choose(logits: torch.Tensor, md: SamplingMetadata, draft_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Greedy rows take the argmax (a guess is kept when it is the argmax: the same rule)."""
        if md.all_greedy:
            return logits.argmax(dim=-1)
        sampled = sample_random(logits, md, draft_ids)
        if md.all_random:
            return sampled
        return torch.where(md.greedy, logits.argmax(dim=-1), sampled)
