"""Engine configuration: one dataclass per concern, composed into ``EngineConfig``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}

LOAD_FORMATS = ("auto", "dummy")


def resolve_dtype(name: str | torch.dtype, checkpoint_dtype: Optional[torch.dtype]) -> torch.dtype:
    """Maps a user dtype ("auto" = the checkpoint's, fp32 if unknown) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return checkpoint_dtype if checkpoint_dtype in _DTYPES.values() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


@dataclass
class ModelConfig:
    model: str  # local HF directory or hub id
    dtype: str | torch.dtype = "auto"
    max_model_len: Optional[int] = None  # default: the checkpoint's max_position_embeddings
    quantization: Optional[str] = None  # None or "fp8"
    seed: int = 0
    tokenizer: Optional[str] = None  # default: the model directory
    revision: Optional[str] = None
    # "auto": weights from the checkpoint's safetensors; "dummy": the model is built from
    # config.json alone and its parameters filled with seeded random values on the device
    # (no weights read: benchmarks of full-size shapes without multi-GB checkpoints).
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unsupported load_format {self.load_format!r}; choose one of "
                             f"{', '.join(LOAD_FORMATS)}")


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # On CUDA the pool is sized from a profiling run and this fraction of device memory; on
    # CPU (or when set) num_gpu_blocks / cpu_kv_cache_gib decide.
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: Optional[int] = None
    cpu_kv_cache_gib: float = 1.0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True


@dataclass
class CompileConfig:
    """How the model is compiled. ``level="none"`` runs it eagerly (``--enforce-eager``)."""

    level: str = "compiled"  # "none" | "compiled"
    splitting_ops: list[str] = field(default_factory=lambda: ["vgraph::unified_attention"])
    compile_sizes: list[int] = field(default_factory=list)  # token counts also compiled statically
    enable_fusion: bool = True  # vgraph's own passes (RMSNorm+quant, SiLU+mul)
    passes: list = field(default_factory=list)  # user passes, run after vgraph's own
    # True: norms and activations call vgraph's ops; False: plain torch, and Inductor generates
    # their kernels. None: see ``resolved_custom_ops``.
    custom_ops: Optional[bool] = None
    dump_graphs_dir: Optional[str] = None  # dump each graph before/after each pass here
    use_cache: bool = True  # the on-disk compile cache under $VGRAPH_CACHE_DIR
    # CUDA graphs (see vgraph/worker/dispatch.py): "none" | "piecewise" | "full" |
    # "full_and_piecewise"; None = "full_and_piecewise" when compiled. Without CUDA the same
    # dispatcher pads batches to the buckets and runs the compiled forward there.
    cudagraph_mode: Optional[str] = None
    # Batch sizes / token counts captured; None = [1, 2, 4] + range(8, max_capture_size + 1, 8).
    # Either way capped by max_num_seqs (decode) and max_num_batched_tokens.
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_capture_size: int = 256

    def __post_init__(self) -> None:
        if self.level not in ("none", "compiled"):
            raise ValueError(f"compile level must be 'none' or 'compiled', got {self.level!r}")
        if any(not isinstance(n, int) or n < 1 for n in self.compile_sizes):
            raise ValueError(f"compile_sizes must be positive token counts, got {self.compile_sizes}")

    def resolved_custom_ops(self, device_type: str, quantized: bool) -> bool:
        """``custom_ops`` when set; unset, off only for a compiled, unquantized model on CPU.

        Why: on CPU the norm and activation ops are the plain-torch reference run one aten call
        at a time behind the dispatcher, while Inductor fuses the same math into one C++ loop
        per piece (about 12% of an 8-request CPU generate, perf/README.md), and without fp8
        quantization the fusion passes have nothing to rewrite. Eager models keep the ops (one
        call instead of several), as do CUDA (Triton kernels) and fp8 models (the passes match
        the ops).
        """
        if self.custom_ops is not None:
            return self.custom_ops
        return not (self.level == "compiled" and device_type == "cpu" and not quantized)


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    max_logprobs: int = 20

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
