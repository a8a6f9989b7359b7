"""Greedy tokens from Hugging Face transformers: the oracle every vgraph mode must equal."""
from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def _hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation (EOS ignored) and the log-softmax of each step's logits.

    Cached: many tests (each execution mode) compare against the same oracle runs."""
    model = _hf_model(path)
    ids = torch.tensor([list(prompt_ids)])
    out = model(ids, use_cache=True)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, -1))
        nxt = int(logits.argmax())
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=64)
@torch.inference_mode()
def hf_prompt_logprobs(path: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt), vocab]: row j is the log-softmax of the logits after prompt token j."""
    return _hf_model(path)(torch.tensor([list(prompt)])).logits[0].float().log_softmax(-1)


@functools.lru_cache(maxsize=64)
@torch.inference_mode()
def hf_hidden(path: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt), hidden]: the final norm's output (transformers' last hidden state)."""
    return _hf_model(path)(torch.tensor([list(prompt)]), output_hidden_states=True).hidden_states[-1][0].float()


def hf_embedding(path: str, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """The hidden states pooled as vgraph's embeddings are: the last row or the mean, L2-normalized."""
    h = hf_hidden(path, tuple(prompt))
    v = h[-1] if pooling == "last" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=0) if normalize else v
