"""The built-in demo model, and the tiny random-weight checkpoints it is made like.

Each checkpoint is written by transformers' own model classes (so transformers can serve as
the numerical oracle on exactly the same files) together with a small byte-level BPE
tokenizer trained here on an embedded English corpus. Everything is deterministic for a
given seed, so files built twice are identical and caches keyed on them stay valid.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import unicodedata
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

DEMO_MODEL_NAME = "demo-model-v1"
# Bumped whenever the demo checkpoint's files change: a copy an older vgraph built under the
# cache dir is then rebuilt instead of reused (2: unreadable tokens suppressed).
DEMO_BUILD = "2"
_BUILD_FILE = "vgraph-demo-build.txt"
TOKENIZER_VOCAB_SIZE = 512
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD) + ROLE_TOKENS  # ids 0..5, in this order

# Role header, message, eos; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
A language model reads a sequence of tokens and predicts the next one, again and again.
Once upon a time there was a small village by a river, and the people there baked bread.
Every morning the baker woke before dawn, lit the oven, and mixed flour, water and salt.
The children walked to school along the river path, counting ducks and throwing stones.
In the evening the village gathered in the square to share news, songs and stories.
Computers store numbers in binary, and a graphics card multiplies large matrices quickly.
An inference server batches many requests together so that the hardware stays busy.
The cache keeps the keys and values of earlier tokens, so each new token costs less.
Attention lets every token look back at the tokens before it and weigh what matters.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Please write a short poem about the sea, the wind, and a boat that sails at night.
The sea was calm and silver under the moon; the wind was soft; the boat sailed home.
Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.
The sun is a star, and the earth travels around it once every year, spinning as it goes.
Mathematics is the study of numbers, shapes and patterns; one, two, three, four, five.
Six, seven, eight, nine, ten. The first prime numbers are two, three, five, seven, eleven.
She opened the window, looked at the garden, and saw that the roses had begun to bloom.
He said that the train would leave at nine o'clock, but it was late by twenty minutes.
They built a bridge of stone across the valley, and it still stands after many centuries.
Good morning, good afternoon, good evening, and good night. See you again tomorrow.
The library was quiet; only the turning of pages and the ticking of a clock were heard.
A recipe: take two eggs, a cup of milk, a spoonful of sugar, and stir them together well.
Rain fell on the roof all night, and in the morning the streets shone like glass.
Questions and answers: What is the capital of France? Paris. What color is the sky? Blue.
The engineer measured the latency of each request and the throughput of the whole system.
Small steps, repeated with patience, carry a traveler across mountains and deserts.
The old map showed a road through the forest, a lake to the north, and a castle on a hill.
Birds sang in the trees, bees hummed among the flowers, and the summer day grew warm.
If you want to learn something well, teach it to someone else and answer their questions.
The market sold apples, pears, plums, cheese, honey, fresh fish and warm loaves of bread.
We walked along the beach, collected shells, and watched the waves roll in and out.
Winter came with snow and frost; the lake froze, and the children skated until dark.
Spring returned with green leaves, long days, and the sound of water running in the hills.
The program reads the input, checks it carefully, computes the result and prints it out.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2024 appear in many texts.
Thank you for your help. You are welcome. Have a nice day, and good luck with your work!
"""


@functools.lru_cache(maxsize=None)
def _tokenizer_json() -> str:
    """Trains the byte-level BPE once per process; the JSON string is immutable and shareable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok.to_str()


def build_tokenizer() -> Any:
    """The demo tokenizer as a PreTrainedTokenizerFast (bos/eos/pad, role tokens, chat template)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token=BOS, eos_token=EOS,
        pad_token=PAD, additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE, model_max_length=4096)


def _rope_kwargs(rope: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings in the config shape of the installed transformers (5: rope_parameters)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": dict(rope)}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope["rope_theta"],
            "rope_scaling": None if scaling.get("rope_type") == "default" else scaling}


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                # small, so all three llama3 frequency regimes occur at head_dim 16
                "original_max_position_embeddings": 64}
_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"class": "LlamaForCausalLM", "rope": _LLAMA3_ROPE, "tie_word_embeddings": False},
    "qwen2": {"class": "Qwen2ForCausalLM", "rope": {"rope_type": "default", "rope_theta": 1e6},
              "tie_word_embeddings": True},
    # head_dim 32 != hidden/heads (16): exercises head_dim taken from the config
    "qwen3": {"class": "Qwen3ForCausalLM", "rope": {"rope_type": "default", "rope_theta": 1e6},
              "tie_word_embeddings": True, "head_dim": 32},
}


def _hf_model(arch: str, vocab_size: int, tokenizer: Any, overrides: dict[str, Any]) -> Any:
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown demo architecture {arch!r}; choose one of {', '.join(_ARCHS)}")
    spec = dict(_ARCHS[arch])
    model_cls = getattr(transformers, spec.pop("class"))
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **_rope_kwargs(spec.pop("rope")), **spec)
    kwargs.update(overrides)
    config = model_cls.config_class(**kwargs)
    return model_cls(config)


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random norm weights and biases: HF initializes them to ones/zeros, which would hide
    a norm or bias that was loaded wrongly (or not at all)."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """No "Writing model shards" bar for a checkpoint that takes milliseconds to write."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny_checkpoint(path: str | os.PathLike, arch: str = "llama", seed: int = 0, *,
                          dtype: torch.dtype = torch.float32,
                          max_shard_size: Optional[str] = None,
                          **config_overrides: Any) -> str:
    """Writes a tiny random checkpoint (weights, config, generation config, tokenizer).

    ``arch``: "llama" (Llama 3.1-style llama3 RoPE scaling, untied), "qwen2" (q/k/v biases,
    tied embeddings) or "qwen3" (q/k norm, explicit head_dim, tied). ``config_overrides``
    replace config fields (e.g. ``num_hidden_layers=4``); ``max_shard_size`` (e.g. "100KB")
    writes a sharded checkpoint with an index. Returns the directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = random_model(arch, tokenizer, seed, config_overrides).to(dtype)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    with _quiet_progress_bars():
        model.save_pretrained(out, **save_kwargs)
    save_tokenizer_files(out, tokenizer)
    return str(out)


def random_model(arch: str, tokenizer: Any, seed: int, overrides: dict[str, Any]) -> Any:
    """The seeded random HF model (fp32), norms and biases perturbed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _hf_model(arch, len(tokenizer), tokenizer, overrides)
    _perturb(model, seed)
    return model


def save_tokenizer_files(out: Path, tokenizer: Any) -> None:
    """Generation config (bos/eos/pad) and the tokenizer, next to the weights."""
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_demo_checkpoint(path: str | os.PathLike) -> str:
    """The demo model's files: the tiny seed-0 Llama, made to write only readable text
    (``_suppress_unreadable_tokens``), plus a file naming its build. Returns the directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = random_model("llama", tokenizer, 0, {})
    _suppress_unreadable_tokens(model, unreadable_token_ids(tokenizer))
    with _quiet_progress_bars():
        model.save_pretrained(out)
    save_tokenizer_files(out, tokenizer)
    (out / _BUILD_FILE).write_text(DEMO_BUILD + "\n", encoding="utf-8")
    return str(out)


def unreadable_token_ids(tokenizer: Any) -> list[int]:
    """Tokens whose text alone is not readable: a control character (newline and tab aside)
    or bytes that are not a whole UTF-8 character (decoded as U+FFFD). In the demo vocabulary
    these are single bytes of the byte-level alphabet; special tokens are left alone."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special and not _readable(
        tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False))]


def _readable(text: str) -> bool:
    return "\ufffd" not in text and all(c in "\n\t" or unicodedata.category(c) != "Cc" for c in text)


@torch.no_grad()
def _suppress_unreadable_tokens(model: Any, token_ids: list[int], margin: float = 100.0) -> None:
    """Gives ``token_ids`` a logit far below every other token's at every position.

    Why: untrained, the model samples its 512 tokens almost uniformly, and about 160 of them
    are single bytes that are not text by themselves (control bytes, pieces of multi-byte
    characters that random sampling never completes): its output was full of \\x00..\\x1f
    and U+FFFD. How: residual dimension 0 is held constant (1.0 in every embedding, and no
    layer writes it: row 0 of each o_proj and down_proj is zero), so after the final norm it
    is positive (about 1) at every position; each suppressed token's lm_head row is
    ``-margin`` there and 0 elsewhere, a logit near -100 where the others lie within a few
    units of 0. A plain Llama checkpoint still, so transformers runs it unchanged.
    """
    inner = model.model
    inner.embed_tokens.weight[:, 0] = 1.0
    for layer in inner.layers:
        layer.self_attn.o_proj.weight[0] = 0.0
        layer.mlp.down_proj.weight[0] = 0.0
    inner.norm.weight[0] = 1.0
    model.lm_head.weight[token_ids] = 0.0
    model.lm_head.weight[token_ids, 0] = -margin


def demo_model_path(name: str) -> Optional[str]:
    """The built-in demo model's directory (built on first use) when ``name`` is its name,
    ``demo-model-v1``, and no local directory of that name exists; None for any other name.
    Lets ``LLM("demo-model-v1")`` and ``--model demo-model-v1`` run it, as the server serves
    it under that name, instead of looking the name up on the Hugging Face Hub."""
    if name != DEMO_MODEL_NAME or os.path.isdir(name):
        return None
    from ..paths import cache_dir
    return ensure_demo_model(cache_dir())


def _is_current(target: Path) -> bool:
    build = target / _BUILD_FILE
    return build.is_file() and build.read_text(encoding="utf-8").strip() == DEMO_BUILD


def ensure_demo_model(cache_dir: str | os.PathLike) -> str:
    """``<cache_dir>/demo-model-v1``, built on first use and reused after (rebuilt when an
    older vgraph built it: see ``DEMO_BUILD``).

    Built in a temporary sibling directory and renamed into place, so a crash never leaves a
    half-written model and concurrent first users end up with one complete copy.
    """
    cache = Path(cache_dir)
    target = cache / DEMO_MODEL_NAME
    if _is_current(target):
        return str(target)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=cache))
    except OSError as exc:  # read-only, full, or a file in the way: built for this process only
        from ..paths import private_dir
        return build_demo_checkpoint(private_dir("the demo model", cache, exc) / DEMO_MODEL_NAME)
    try:
        build_demo_checkpoint(tmp)
        _replace_stale(target, cache)
        os.rename(tmp, target)
    except OSError:
        if not _is_current(target):  # lost a race only if the winner finished
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _replace_stale(target: Path, cache: Path) -> None:
    """Moves an out-of-date build aside (then deletes it), so the new one can be renamed in."""
    if not target.exists() or _is_current(target):
        return
    stale = cache / f".{DEMO_MODEL_NAME}-stale-{uuid.uuid4().hex[:8]}"
    with contextlib.suppress(FileNotFoundError):  # another process moved it first
        os.rename(target, stale)
    shutil.rmtree(stale, ignore_errors=True)
