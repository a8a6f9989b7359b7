"""The built-in demo model, and the tiny random-weight checkpoints the tests are built from.

The demo model (``demo-model-v1``) is a small Llama trained on the Python standard library's
source by examples/train_demo_model.py; its files ship inside the package (``demo-model-v1/``
next to this module), so it runs with nothing downloaded or built. The test checkpoints are
written by transformers' own model classes (so transformers can serve as the numerical oracle
on exactly the same files) with random weights and a small byte-level BPE tokenizer trained
here on an embedded English corpus. Both tokenizers share the special tokens; the demo
model's chat template adds tool support to the test tokenizer's plain one (see
``PLAIN_CHAT_TEMPLATE``). Everything is deterministic for a given seed, so files built twice are identical
and caches keyed on them stay valid.
"""
from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

DEMO_MODEL_NAME = "demo-model-v1"
DEMO_MODEL_DIR = Path(__file__).resolve().parent / DEMO_MODEL_NAME
_DEMO_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")
TOKENIZER_VOCAB_SIZE = 512  # the test tokenizer's (the shipped demo model has its own)
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD) + ROLE_TOKENS  # ids 0..5, in this order

# Role header, message, eos; the generation prompt opens an assistant turn. The tiny test
# checkpoints keep this plain template: they stand for models whose template has no tool
# support (the refusal is tested on them; tool tests use tests/checkpoints.py's own tool
# template), and their files, which caches are keyed on, stay as they were.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# The demo model's template: the plain one plus tools, hermes style (which
# ``--tool-call-parser hermes`` reads back): with ``tools``, one system turn first lists each
# function as a line of compact JSON inside <tools></tools> (after the conversation's own
# system message, which it absorbs; compact because the demo model's context is 512 tokens);
# an assistant's calls are <tool_call> JSON blocks; a tool's result is a user turn wrapped in
# <tool_response>. A chat with no tools and no tool messages renders exactly as the plain
# template did (tests hold it to that), so recorded results stay valid.
_TOOLS_BLOCK = (
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% set ns.first = 1 %}"
    "{% endif %}"
    "{{ 'Functions you may call:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + ((tool['function'] or tool) | tojson(separators=(',', ':'))) }}{% endfor %}"
    "{{ '\\n</tools>\\nTo call one, write <tool_call>\\n{\"name\": <name>, \"arguments\": {...}}\\n</tool_call>'"
    " + eos_token + '\\n' }}"
    "{% endif %}"
)
_TOOL_CALLS = (
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
)
CHAT_TEMPLATE = (
    "{% set ns = namespace(first=0) %}"
    + _TOOLS_BLOCK
    + "{% for message in messages[ns.first:] %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    + _TOOL_CALLS
    + "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' + eos_token + '\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
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


def train_tokenizer_json(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE with the demo's special tokens (ids 0..5), trained on ``texts``.

    Shared by the test tokenizer below and examples/train_demo_model.py, so the shipped demo
    model's tokenizer differs from the test one only in its vocabulary and merges. The same
    texts give the same tokenizer (tests check it for the test tokenizer).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


def tokenizer_from_json(tokenizer_json: str, chat_template: str = CHAT_TEMPLATE) -> Any:
    """A PreTrainedTokenizerFast over ``tokenizer_json`` with bos/eos/pad, the role tokens and
    ``chat_template`` (by default the demo model's, which examples/train_demo_model.py ships)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json), bos_token=BOS, eos_token=EOS,
        pad_token=PAD, additional_special_tokens=list(ROLE_TOKENS),
        chat_template=chat_template, model_max_length=4096)


@functools.lru_cache(maxsize=None)
def _tokenizer_json() -> str:
    """Trains the test BPE once per process; the JSON string is immutable and shareable."""
    return train_tokenizer_json(_CORPUS.splitlines(), TOKENIZER_VOCAB_SIZE)


def build_tokenizer() -> Any:
    """The tiny test checkpoints' tokenizer (512 tokens, trained on the embedded corpus), with
    the plain chat template."""
    return tokenizer_from_json(_tokenizer_json(), PLAIN_CHAT_TEMPLATE)


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
    # Mistral without a sliding window: Llama's layers under Mistral's config and class names
    "mistral": {"class": "MistralForCausalLM", "rope": {"rope_type": "default", "rope_theta": 1e6},
                "tie_word_embeddings": False, "sliding_window": None},
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
def quiet_progress_bars() -> Iterator[None]:
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
    tied embeddings), "qwen3" (q/k norm, explicit head_dim, tied) or "mistral" (no sliding
    window, untied). ``config_overrides``
    replace config fields (e.g. ``num_hidden_layers=4``); ``max_shard_size`` (e.g. "100KB")
    writes a sharded checkpoint with an index. Returns the directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = random_model(arch, tokenizer, seed, config_overrides).to(dtype)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    with quiet_progress_bars():
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


def demo_model_dir() -> str:
    """The shipped demo checkpoint's directory (package data), checked to be complete.

    Why a check: a vgraph installed without its package data (a hand-made wheel, a copied
    tree) would otherwise fail later with a loader error about some file in site-packages.
    """
    missing = [name for name in _DEMO_FILES if not (DEMO_MODEL_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the built-in demo model at {DEMO_MODEL_DIR} lacks {', '.join(missing)}: "
                                "this vgraph was installed without its package data; reinstall it")
    return str(DEMO_MODEL_DIR)


def demo_model_path(name: str) -> Optional[str]:
    """The built-in demo model's directory when ``name`` is its name, ``demo-model-v1``, and no
    local directory of that name exists; None for any other name. Lets ``LLM("demo-model-v1")``
    and ``--model demo-model-v1`` run it, as the server serves it under that name, instead of
    looking the name up on the Hugging Face Hub."""
    if name != DEMO_MODEL_NAME or os.path.isdir(name):
        return None
    return demo_model_dir()
