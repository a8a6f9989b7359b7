"""Trains vgraph's demo model: a small Llama that writes Python, on the standard library's source.

The corpus is the ``.py`` source of the Python standard library that ships with the running
interpreter (``sysconfig.get_paths()["stdlib"]``), so nothing is downloaded. Files are taken
in sorted order; test suites, ``site-packages`` and huge generated files are skipped; every
25th file is held out for validation (whole files, so validation text is never seen in
training). A byte-level BPE with the demo's special tokens and chat template is trained on
the training files, then a ``LlamaForCausalLM`` built from a config is trained from scratch
with a plain torch loop: AdamW, linear warmup then cosine decay, gradient clipping, fixed
seeds, one CPU thread by default. The result is an ordinary Hugging Face checkpoint (fp16
safetensors declaring float32, config, generation config, tokenizer) that transformers and
vgraph both load.

Retrain the shipped model: two stages, about 45 + 5 minutes on one CPU thread. The first
samples windows anywhere; the second continues from it with half the windows starting at a
line start, as a prompt does (``def fibonacci(n):`` then gets a function body, not a method's)::

    python examples/train_demo_model.py --out /tmp/demo-stage1
    python examples/train_demo_model.py --init-from /tmp/demo-stage1 --line-start-fraction 0.5 \\
        --max-steps 200 --lr 5e-4 --warmup-steps 20 --eval-every 100 --seed 1 \\
        --out vgraph/models/demo-model-v1

Smoke test (seconds): ``python examples/train_demo_model.py --tiny --max-steps 3 --out /tmp/m``.
The loss over the whole validation split of a saved checkpoint (what docs/getting-started.md quotes)::

    python examples/train_demo_model.py --eval-only --out vgraph/models/demo-model-v1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the BPE trainer's threads, before tokenizers loads
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from vgraph.models.demo import (  # noqa: E402
    quiet_progress_bars, save_tokenizer_files, tokenizer_from_json, train_tokenizer_json)

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
MAX_FILE_BYTES = 200_000  # larger .py files in the stdlib are generated tables (pydoc topics...)
VALIDATION_EVERY = 25  # every 25th file (sorted order) is held out


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights; written next to them as training.json."""
    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int = 2200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 16
    line_start_fraction: float = 0.0
    threads: int = 1
    tiny: bool = False


# ---------------------------------------------------------------- corpus


def corpus_files(root: Path, tiny: bool) -> list[Path]:
    """The stdlib's .py files in sorted order, tests, site-packages and generated giants left out."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("test"))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and not name.startswith("test_") and path.stat().st_size <= MAX_FILE_BYTES:
                files.append(path)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return files[:60] if tiny else files


def read_texts(files: list[Path]) -> list[str]:
    """File contents; the few files that are not UTF-8 are skipped rather than mangled."""
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def split(texts: list[str]) -> tuple[list[str], list[str]]:
    """Every VALIDATION_EVERY-th file (sorted order) to validation, the rest to training."""
    train = [t for i, t in enumerate(texts) if i % VALIDATION_EVERY != VALIDATION_EVERY // 2]
    val = [t for i, t in enumerate(texts) if i % VALIDATION_EVERY == VALIDATION_EVERY // 2]
    return train, val


def encode(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """One token stream: each file's tokens followed by </s>, as the model ends a document."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def line_starts(stream: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """Positions whose token begins a line at column 0: right after a token ending in a newline
    (whitespace before an indented line is a token of its own: "\\n   " then " def")."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    newline = torch.tensor([t.endswith("\u010a") for t in vocab])  # byte-level BPE writes "\n" as U+010A
    return torch.nonzero(newline[stream[:-1]]).flatten() + 1


def batches(stream: torch.Tensor, cfg: TrainConfig, seed: int,
            starts_at: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Endless random windows of seq_len + 1 tokens, from a seeded generator. With
    ``starts_at`` (line starts), a line_start_fraction of the windows begin at one of them:
    a prompt begins a line, which a window starting mid-line never teaches (the first stage
    alone indented the body of a prompt's top-level ``def`` like a method's)."""
    gen = torch.Generator().manual_seed(seed)
    high = len(stream) - cfg.seq_len - 1
    pool = None if starts_at is None or cfg.line_start_fraction <= 0 else starts_at[starts_at < high]
    while True:
        starts = torch.randint(0, high, (cfg.batch_size,), generator=gen)
        if pool is not None:
            aligned = torch.rand(cfg.batch_size, generator=gen) < cfg.line_start_fraction
            starts = torch.where(aligned, pool[torch.randint(0, len(pool), (cfg.batch_size,), generator=gen)], starts)
        yield torch.stack([stream[s:s + cfg.seq_len + 1] for s in starts.tolist()])


# ---------------------------------------------------------------- model and schedule


def build_model(cfg: TrainConfig, tokenizer: Any) -> Any:
    """A LlamaForCausalLM from a config: tied embeddings, GQA, plain RoPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.02,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine down to cfg.lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def loss_of(model: Any, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: Any, stream: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean loss over the same validation windows every time (a fixed seed)."""
    model.eval()
    windows = batches(stream, cfg, seed=12345)
    losses = [loss_of(model, next(windows)).item() for _ in range(cfg.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


# ---------------------------------------------------------------- saving


def save_checkpoint(model: Any, tokenizer: Any, out: Path, info: dict[str, Any]) -> None:
    """fp16 safetensors whose config declares float32: half the bytes, and every loader that
    honours the declared dtype (vgraph's default, transformers with dtype=float32) widens the
    fp16 values exactly, so both run the same fp32 numbers."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    with quiet_progress_bars():
        model.save_pretrained(out)  # fp32, so config.json declares float32
    weights = out / "model.safetensors"
    save_file({k: v.to(torch.float16) for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    save_tokenizer_files(out, tokenizer)
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- evaluation of a saved checkpoint


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


@torch.no_grad()
def evaluate_checkpoint(out: Path, stdlib: Path, threads: int) -> dict[str, Any]:
    """Loss over the whole validation split, in consecutive seq_len windows, of the checkpoint
    as saved (fp16 weights widened to float32): the figure to quote, not the sampled one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    trained = json.loads((out / "training.json").read_text(encoding="utf-8"))
    seq_len, tiny = trained["config"]["seq_len"], trained["config"]["tiny"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    _, val_texts = split(read_texts(corpus_files(stdlib, tiny)))
    stream = encode(tokenizer, val_texts)
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, seq_len):
        window = stream[start:start + seq_len + 1][None]
        if window.shape[1] < 2:
            break
        total += loss_of(model, window).item() * (window.shape[1] - 1)
        count += window.shape[1] - 1
    loss = total / count
    return {"event": "eval-checkpoint", "val_tokens": count, "val_loss": round(loss, 4),
            "val_perplexity": round(math.exp(loss), 2),
            "bits_per_char": round(loss * count / math.log(2) / sum(map(len, val_texts)), 4)}


# ---------------------------------------------------------------- main


def log(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def train(cfg: TrainConfig, out: Path, stdlib: Path, init_from: Path | None = None) -> dict[str, Any]:
    """Tokenizer, data, model, loop; writes the checkpoint to ``out`` at every eval and at the end.
    ``init_from``: continue from that checkpoint (its tokenizer and weights; a fresh optimizer)."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    files = corpus_files(stdlib, cfg.tiny)
    train_texts, val_texts = split(read_texts(files))
    if init_from is None:
        tokenizer = tokenizer_from_json(train_tokenizer_json(train_texts, cfg.vocab_size))
    else:
        tokenizer = tokenizer_from_json((init_from / "tokenizer.json").read_text(encoding="utf-8"))
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    chars = sum(map(len, train_texts))
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "stdlib": str(stdlib), "files": len(files),
        "train_files": len(train_texts), "val_files": len(val_texts), "train_chars": chars,
        "train_tokens": len(train_ids), "val_tokens": len(val_ids),
        "chars_per_token": round(chars / len(train_ids), 3), "torch": torch.__version__,
        "transformers": _transformers_version(),
        "config": dataclasses.asdict(cfg)}
    log({"event": "data", "seconds": round(time.perf_counter() - start, 1), **info})
    if init_from is None:
        model = build_model(cfg, tokenizer)
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        info["init_from"] = json.loads((init_from / "training.json").read_text(encoding="utf-8"))
    info["parameters"] = sum(p.numel() for p in model.parameters())
    log({"event": "model", "parameters": info["parameters"]})
    optimizer = make_optimizer(model, cfg)
    stream = batches(train_ids, cfg, seed=cfg.seed, starts_at=line_starts(train_ids, tokenizer))
    t0 = time.perf_counter()
    for step in range(cfg.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = loss_of(model, next(stream))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        done = step + 1
        if done % 10 == 0 or done == cfg.max_steps:
            elapsed = time.perf_counter() - t0
            log({"event": "step", "step": done, "loss": round(loss.item(), 4), "lr": round(lr_at(step, cfg), 6),
                 "tokens": done * cfg.batch_size * cfg.seq_len, "seconds": round(elapsed, 1),
                 "tokens_per_s": round(done * cfg.batch_size * cfg.seq_len / elapsed)})
        if done % cfg.eval_every == 0 or done == cfg.max_steps:
            val = evaluate(model, val_ids, cfg)
            info.update(steps=done, tokens_seen=done * cfg.batch_size * cfg.seq_len,
                        train_seconds=round(time.perf_counter() - t0, 1), val_loss=round(val, 4),
                        val_perplexity=round(math.exp(val), 2))
            save_checkpoint(model, tokenizer, out, info)
            log({"event": "eval", "step": done, "val_loss": round(val, 4), "val_ppl": round(math.exp(val), 2)})
    return info


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, Path, Path, bool, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory (written at each eval)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue training this checkpoint (its tokenizer and weights; model sizes ignored)")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate the checkpoint in --out on the whole validation split; no training")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="the corpus root (default: this Python's standard library)")
    for f in dataclasses.fields(TrainConfig):
        if f.type == "bool" or f.type is bool:
            parser.add_argument(f"--{f.name.replace('_', '-')}", action="store_true",
                                help="a 60-file corpus and a toy model, for smoke tests" if f.name == "tiny" else None)
        else:
            kind = {"int": int, "float": float}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    args = vars(parser.parse_args(argv))
    out, stdlib, eval_only, init_from = args.pop("out"), args.pop("stdlib"), args.pop("eval_only"), args.pop("init_from")
    cfg = TrainConfig(**args)
    if cfg.tiny:  # a toy model so the smoke test takes seconds; explicit flags still override sizes
        cfg = dataclasses.replace(cfg, vocab_size=min(cfg.vocab_size, 512), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  seq_len=32, batch_size=2, eval_batches=1, warmup_steps=1)
    return cfg, out, stdlib, eval_only, init_from


def main(argv: list[str] | None = None) -> None:
    cfg, out, stdlib, eval_only, init_from = parse_args(argv)
    if eval_only:
        log(evaluate_checkpoint(out, stdlib, cfg.threads))
        return
    info = train(cfg, out, stdlib, init_from)
    log({"event": "done", **{k: v for k, v in info.items() if k != "config"}})


if __name__ == "__main__":
    main()
