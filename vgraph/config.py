"""Engine configuration: one frozen dataclass per concern, composed into ``EngineConfig``.

Every setting has exactly one default, here. ``LLM(**kwargs)`` (``EngineConfig.from_kwargs``)
and the CLI flags (``vgraph.cli``) are derived from these fields, so the three cannot drift
apart. A field's ``metadata`` carries what the CLI needs besides the default: the help text,
and where the flag differs from ``--field-name``, its name and choices.

The caller's config is never changed: ``EngineConfig.resolved`` returns a copy in which
everything left open ("auto" device, unset ``custom_ops``, ``cudagraph_mode`` and
``max_model_len``, a hub id) has been decided once, and the engine and the runner only ever
read that copy.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch

from .spec.config import SpeculativeConfig

from .pooling_params import POOLING_TYPES

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Other names of the same dtypes (torch's and vLLM's), made the canonical one when a
# ModelConfig is built, so `--dtype half` and `--dtype float16` give equal configs.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}

LOAD_FORMATS = ("auto", "dummy")
DISTRIBUTED_BACKENDS = ("gloo", "nccl")
# How the ranks run (vLLM's names): in the engine's process, one local process each, one Ray actor each.
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# Ray placement group strategies: how the ranks' bundles are spread over the cluster's nodes.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("fp8",)
# The KV cache's dtypes, as vLLM spells them: auto is the model's dtype; fp8 and fp8_e4m3 are
# one setting (e4m3 with per-tensor scales). fp8_e5m2 is a choice so that it is refused with
# the reason (see CacheConfig) rather than as an unknown value.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}


def resolve_dtype(name: str | torch.dtype, checkpoint_dtype: Optional[torch.dtype]) -> torch.dtype:
    """Maps a user dtype ("auto" = the checkpoint's, fp32 if unknown) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return checkpoint_dtype if checkpoint_dtype in _DTYPES.values() else torch.float32
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


class CompileLevel(str, enum.Enum):
    """``none`` runs the model eagerly (``--enforce-eager``); ``compiled`` through Inductor."""

    NONE = "none"
    COMPILED = "compiled"


class CudaGraphMode(str, enum.Enum):
    """Which kinds of CUDA graphs exist (see vgraph/worker/dispatch.py)."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_full(self) -> bool:
        return self in (CudaGraphMode.FULL, CudaGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CudaGraphMode.PIECEWISE, CudaGraphMode.FULL_AND_PIECEWISE)


def _enum(kind: type[enum.Enum], value: Any, what: str) -> Any:
    """``value`` as a member of ``kind`` (None stays None); a clear error names the choices."""
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}") from None


def cli(help: str, **extra: Any) -> dict[str, Any]:
    """Field metadata for the CLI: ``help`` plus optional ``flag`` (the option's name when it
    is not ``--field-name``), ``choices``, ``nargs``, ``negative`` (the ``--no-x`` form of a
    boolean that defaults to True), ``value`` (a flag that stores this value when given),
    ``aliases`` (more spellings of the flag, of ``negative`` for a boolean that defaults to
    True: vLLM's names, so its command lines run unchanged) and ``positive`` (for a boolean that
    defaults to True, a flag that turns it on, as vLLM's ``--enable-x``)."""
    return {"help": help, **extra}


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(metadata=cli("local HF model directory or hub id (default: the demo model)"))
    dtype: str | torch.dtype = field(default="auto", metadata=cli(
        "weights and activations dtype. Default auto: the checkpoint's torch_dtype, on every device "
        "(float32 when it names none); on CPU, float32 runs vgraph's packed float32 GEMM. "
        "half and float are other names of float16 and float32",
        choices=["auto", "float32", "float16", "bfloat16", *_DTYPE_ALIASES]))
    max_model_len: Optional[int] = field(default=None, metadata=cli(
        "longest sequence (prompt + output); default: the checkpoint's max_position_embeddings"))
    quantization: Optional[str] = field(default=None, metadata=cli(
        "quantize the weights at load (an fp8 checkpoint is used as fp8 anyway)", choices=list(QUANTIZATIONS)))
    seed: int = field(default=0, metadata=cli("seed for weight init (dummy load) and unseeded sampling"))
    tokenizer: Optional[str] = field(default=None, metadata=cli("tokenizer directory or id (default: the model's)"))
    revision: Optional[str] = field(default=None, metadata=cli("hub revision of the model"))
    # "auto": weights from the checkpoint's safetensors; "dummy": the model is built from
    # config.json alone and its parameters filled with seeded random values on the device
    # (no weights read: benchmarks of full-size shapes without multi-GB checkpoints).
    load_format: str = field(default="auto", metadata=cli(
        "dummy: build the model from config.json with random weights, reading no weight files "
        "(for benchmarks)", choices=list(LOAD_FORMATS)))
    # Embeddings (/v1/embeddings, LLM.embed): how the final norm's hidden states become one
    # vector per input. Any decoder model serves them; "last" suits a causal model, which has
    # read the whole input only at its last token.
    pooling_type: str = field(default="last", metadata=cli(
        "embeddings: pool the final hidden states of the input's last token or their mean",
        choices=list(POOLING_TYPES)))
    pooling_normalize: bool = field(default=True, metadata=cli(
        "embeddings: L2-normalize each embedding", negative="--no-pooling-normalize"))

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unsupported load_format {self.load_format!r}; choose one of "
                             f"{', '.join(LOAD_FORMATS)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unsupported quantization {self.quantization!r}; choose one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"unsupported pooling_type {self.pooling_type!r}; choose one of "
                             f"{', '.join(POOLING_TYPES)}")


# Tokens per KV block when none is given. On CPU a decode step's attention streams every
# sequence's K/V from memory, and longer contiguous runs stream faster: on the offline suite's
# prefill-heavy workload (perf Llama, 2 threads) the attention took 0.87 s at 16-token blocks,
# 0.71 s at 32, 0.68 s at 64, 0.61 s at 128 and 0.62 s at 256, and the step's host work
# (block tables, slot lists) shrinks with the block count. The cost is a coarser prefix
# cache: only whole blocks are shared. On CUDA the Triton kernels are tuned for 16.
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128


def resolve_device(device: str) -> str:
    """``auto`` as the engine resolves it: cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_block_size(device_type: str) -> int:
    """The KV block size an engine on this device type resolves to when none is given."""
    return CPU_BLOCK_SIZE if device_type == "cpu" else GPU_BLOCK_SIZE


@dataclass(frozen=True)
class CacheConfig:
    # None: default_block_size of the device (see ``resolved``).
    block_size: Optional[int] = field(default=None, metadata=cli(
        f"tokens per KV cache block (default: {GPU_BLOCK_SIZE} on CUDA; {CPU_BLOCK_SIZE} on CPU, where "
        "longer blocks stream faster in decode attention)"))
    enable_prefix_caching: bool = field(default=True, metadata=cli(
        "reuse the KV blocks of a shared prompt prefix", negative="--no-prefix-caching",
        aliases=["--no-enable-prefix-caching"], positive="--enable-prefix-caching"))
    # On CUDA the pool is sized from a profiling run and this fraction of device memory; on
    # CPU (or when set) num_gpu_blocks / cpu_kv_cache_gib decide.
    gpu_memory_utilization: float = field(default=0.9, metadata=cli(
        "CUDA only: fraction of GPU memory vgraph may use (weights, activations, graphs and the KV cache); "
        "the KV cache gets what the rest leaves"))
    num_gpu_blocks: Optional[int] = field(default=None, metadata=cli(
        "KV cache blocks on any device, overriding the memory-based sizing (default: sized from memory)",
        aliases=["--num-gpu-blocks-override"]))
    cpu_kv_cache_gib: float = field(default=1.0, metadata=cli(
        "CPU only: KV cache size in GiB (on CUDA, --gpu-memory-utilization sizes it)", flag="--kv-cache-gib"))
    # None: off, except under ``vgraph serve`` on CPU (engine/launch.py turns it on there).
    kv_cache_prefault: Optional[bool] = field(default=None, metadata=cli(
        "CPU only: map all of the KV cache's memory at startup, in a background thread, so that no step "
        "waits for the first touch of its pages (a fresh 2 MiB page cost ~5 ms in a VM, ~100 ms for a step "
        "that reaches new blocks in every layer); default: on for vgraph serve, off otherwise"))
    # "fp8_e4m3" is made "fp8" when the config is built, so both spellings give equal configs.
    kv_cache_dtype: str = field(default="auto", metadata=cli(
        "the KV cache's dtype: auto (the model's) or fp8 (= fp8_e4m3: e4m3 with one scale for K and one "
        "for V per layer, from the checkpoint's k_scale/v_scale tensors, else 1.0; half the memory of a "
        "16-bit cache, so twice the tokens). fp8_e5m2 is refused", choices=list(KV_CACHE_DTYPES)))

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be at least 1, got {self.num_gpu_blocks}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib}")
        object.__setattr__(self, "kv_cache_dtype",
                           _KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype))
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ValueError("kv_cache_dtype fp8_e5m2 is not supported: vgraph's fp8 KV cache is e4m3 with "
                             "per-tensor scales (use fp8 or fp8_e4m3)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES[:3])}")

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache is allocated in: e4m3 for fp8, else the model's (activation)
        dtype, which is only known once the checkpoint is read."""
        return torch.float8_e4m3fn if self.fp8_kv_cache else model_dtype

    def resolved(self, device_type: str) -> "CacheConfig":
        """The block size decided for the device."""
        if self.block_size is not None:
            return self
        return replace(self, block_size=default_block_size(device_type))


# The step's token budget when none is given. On CUDA, large steps fill the GPU. On CPU, a
# step's activations should stay in the last-level cache: prefill in 512-token steps measured
# 1.3x faster than in 8192-token ones on the perf Llama (compiled, one thread; the MLP's
# activations of 8192 rows alone are 46 MB), and no slower at any size measured down to 256.
GPU_STEP_TOKENS = 8192
CPU_STEP_TOKENS = 512
# Overlapped scheduling in one CPU process: the model runs on a worker thread with one core
# fewer for its kernels (perf/suites/host_overhead.py measures both; see SchedulerConfig).
CPU_ASYNC_SCHEDULING = False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata=cli("most sequences in one step"))
    # None: GPU_STEP_TOKENS on CUDA, CPU_STEP_TOKENS on CPU (see ``resolved``).
    max_num_batched_tokens: Optional[int] = field(default=None, metadata=cli(
        f"most tokens in one step (default: {GPU_STEP_TOKENS} on CUDA; {CPU_STEP_TOKENS} on CPU, "
        "where steps whose activations stay in cache prefill fastest; vgraph serve on CPU: 128, or "
        "--max-num-seqs if larger, so a prompt's prefill chunks stall running streams less)"))
    enable_chunked_prefill: bool = field(default=True, metadata=cli(
        "split long prompts over several steps", negative="--no-chunked-prefill",
        aliases=["--no-enable-chunked-prefill"], positive="--enable-chunked-prefill"))
    long_prefill_token_threshold: int = field(default=0, metadata=cli(
        "with chunked prefill, no prompt chunk of more than this many tokens in one step, however much "
        "of the budget is left (0: no cap); steps that carry running streams' decodes then stay short"))
    # None: decided for the device (see ``resolved``).
    async_scheduling: Optional[bool] = field(default=None, metadata=cli(
        "overlapped scheduling: the engine schedules step N+1 and builds its inputs while step N runs, "
        "then reads step N's tokens (same tokens as without; default: on for CUDA and for CPU tensor "
        "parallelism, off for one CPU process)"))

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be 0 (off) or positive, got "
                             f"{self.long_prefill_token_threshold}")

    def resolved(self, device_type: str, max_model_len: int, world_size: int = 1) -> "SchedulerConfig":
        """The token budget decided for the device; without chunked prefill it must also
        take the longest prompt in one step. Overlapped scheduling, unless set: on where the
        model runs apart from the engine's thread (a GPU, worker processes)."""
        overlap = self.async_scheduling
        if overlap is None:
            overlap = device_type != "cpu" or world_size > 1 or CPU_ASYNC_SCHEDULING
        if self.max_num_batched_tokens is not None:
            return replace(self, async_scheduling=overlap)
        tokens = CPU_STEP_TOKENS if device_type == "cpu" else GPU_STEP_TOKENS
        if not self.enable_chunked_prefill:
            tokens = max(tokens, max_model_len)
        return replace(self, max_num_batched_tokens=tokens, async_scheduling=overlap)


@dataclass(frozen=True)
class CompileConfig:
    """How the model is compiled, and which CUDA graphs replay it."""

    level: CompileLevel | str = field(default=CompileLevel.COMPILED, metadata=cli(
        "no compilation (and no CUDA graphs)", flag="--enforce-eager", value=CompileLevel.NONE))
    splitting_ops: list[str] = field(default_factory=lambda: ["vgraph::unified_attention"], metadata=cli(
        "ops the graph is split at (attention runs between compiled pieces)", nargs="+"))
    compile_sizes: list[int] = field(default_factory=list, metadata=cli(
        "token counts compiled statically besides the dynamic shape", nargs="*"))
    enable_fusion: bool = field(default=True, metadata=cli("vgraph's fusion passes (RMSNorm+quant, SiLU+mul, all-reduce+RMSNorm)",
                                                           negative="--no-fusion"))
    # Part of the fusion passes: off here, or with enable_fusion, the pass is not in the pass
    # manager, whose uuid (and so the compile cache key) changes with it.
    enable_allreduce_fusion: bool = field(default=True, metadata=cli(
        "under tensor parallelism, fuse each all-reduce with the residual add and RMSNorm after it",
        negative="--no-allreduce-fusion"))
    # Pass objects, PlacedPass (a pass and its position) or specs ("[before:]module:Name",
    # "[before:]path/to/file.py:Name"), which are loaded here: see vgraph/passes/loading.py.
    passes: list = field(default_factory=list, metadata=cli(
        "a user pass, MODULE:NAME or path/to/file.py:NAME (a callable on an FX graph with uuid(), or "
        "a class making one); runs after vgraph's own passes, or before them as before:MODULE:NAME "
        "(or when the pass's position attribute says before). Repeatable", flag="--pass"))
    # True: norms and activations call vgraph's ops; False: plain torch, and Inductor generates
    # their kernels. None: see ``resolved_custom_ops``.
    custom_ops: Optional[bool] = field(default=None, metadata=cli(
        "norms and activations as vgraph ops (--custom-ops) or in plain torch, so Inductor generates "
        "their kernels (--no-custom-ops). Default: plain torch for a compiled, unquantized model on "
        "CPU, the ops otherwise"))
    dump_graphs_dir: Optional[str] = field(default=None, metadata=cli(
        "dump each graph before and after each pass into this directory"))
    use_cache: bool = field(default=True, metadata=cli(
        "the on-disk compile cache under $VGRAPH_CACHE_DIR", negative="--no-compile-cache"))
    # None = full_and_piecewise on CUDA when compiled, none elsewhere (see resolved_graph_mode).
    cudagraph_mode: Optional[CudaGraphMode | str] = field(default=None, metadata=cli(
        "CUDA graphs: FULL for decode batches, PIECEWISE for mixed ones. Default: full_and_piecewise "
        "on CUDA, none on CPU (where it would only pad); --enforce-eager turns graphs off",
        choices=[m.value for m in CudaGraphMode]))
    # Batch sizes / token counts captured; None = [1, 2, 4] + range(8, max_capture_size + 1, 8).
    # Either way capped by max_num_seqs (decode) and max_num_batched_tokens.
    cudagraph_capture_sizes: Optional[list[int]] = field(default=None, metadata=cli(
        "batch sizes / token counts to capture (default: 1 2 4 8 16 ... max-capture-size)", nargs="+"))
    max_capture_size: int = field(default=256, metadata=cli("largest default capture size"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", _enum(CompileLevel, self.level, "compile level"))
        object.__setattr__(self, "cudagraph_mode", _enum(CudaGraphMode, self.cudagraph_mode, "cudagraph_mode"))
        if self.passes:
            object.__setattr__(self, "passes", _loaded_passes(self.passes))
        if any(not isinstance(n, int) or n < 1 for n in self.compile_sizes):
            raise ValueError(f"compile_sizes must be positive token counts, got {self.compile_sizes}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {sizes}")
        if self.max_capture_size < 1:
            raise ValueError(f"max_capture_size must be >= 1, got {self.max_capture_size}")

    @property
    def compiled(self) -> bool:
        return self.level is CompileLevel.COMPILED

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
        return not (self.compiled and device_type == "cpu" and not quantized)

    def resolved_graph_mode(self, device_type: str) -> CudaGraphMode:
        """Graphs need the compiled forward, so eager means none. Unset, FULL_AND_PIECEWISE on
        CUDA and NONE elsewhere: without graphs, padding a batch up to a bucket only adds rows
        to compute (a 17-sequence decode would run as 24). Set explicitly, the same buckets and
        padding run on CPU as on CUDA, which is how the tests exercise them."""
        if not self.compiled:
            return CudaGraphMode.NONE
        if self.cudagraph_mode is None:
            return CudaGraphMode.FULL_AND_PIECEWISE if device_type == "cuda" else CudaGraphMode.NONE
        return self.cudagraph_mode


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (vgraph/distributed/): tensor parallelism shards
    every layer's heads and MLP over ``tensor_parallel_size`` worker processes, one per device,
    which all-reduce over torch.distributed (gloo on CPU, NCCL on CUDA: see ``resolved``);
    pipeline parallelism splits the decoder layers into ``pipeline_parallel_size`` stages of
    that many ranks each, which pass activations point to point. Rank = stage * T + tp rank."""

    tensor_parallel_size: int = field(default=1, metadata=cli(
        "worker processes (one per device) that each hold 1/N of the attention heads, the MLP and the "
        "vocabulary, and their own KV cache; 1 runs the model in the engine's process", aliases=["-tp"]))
    pipeline_parallel_size: int = field(default=1, metadata=cli(
        "pipeline stages, each holding a contiguous slice of the decoder layers (and their KV cache) "
        "on its own tensor_parallel_size ranks; activations pass from stage to stage", aliases=["-pp"]))
    # None: resolved from the device (gloo on CPU, nccl on CUDA).
    distributed_backend: Optional[str] = field(default=None, metadata=cli(
        "torch.distributed backend of the tensor-parallel group (default: gloo on CPU, nccl on CUDA)",
        choices=list(DISTRIBUTED_BACKENDS)))
    # None: decided at resolution (vgraph/distributed/executors.py, choose_executor_backend).
    distributed_executor_backend: Optional[str] = field(default=None, metadata=cli(
        "how the ranks run: uni (the model in the engine's process; one rank), mp (one process per rank on "
        "this machine) or ray (one Ray actor per rank on a Ray cluster's nodes). Default: uni for one rank; "
        "ray when RAY_ADDRESS names a cluster or the ranks outnumber this machine's GPUs; else mp",
        choices=list(EXECUTOR_BACKENDS)))
    placement_group_strategy: str = field(default="PACK", metadata=cli(
        "with the ray executor, how the ranks (one placement-group bundle each) spread over the nodes: PACK "
        "(as few nodes as fit), SPREAD (as many as possible), STRICT_PACK (one node), STRICT_SPREAD (one "
        "node per rank)", choices=list(PLACEMENT_STRATEGIES)))

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {self.pipeline_parallel_size!r}")
        if self.distributed_backend is not None and self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"unsupported distributed_backend {self.distributed_backend!r}; choose one of "
                             f"{', '.join(DISTRIBUTED_BACKENDS)}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"unsupported distributed_executor_backend {backend!r}; choose one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank in the engine's process, but "
                             f"the world has {self.world_size} ranks; use 'mp' (this machine) or 'ray' (a cluster)")
        if self.placement_group_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"unsupported placement_group_strategy {self.placement_group_strategy!r}; choose one "
                             f"of {', '.join(PLACEMENT_STRATEGIES)}")

    @property
    def world_size(self) -> int:
        """Engine ranks in all (each its own process): T ranks in each of P stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose reply is a step's result (the one that samples for the engine): tp
        rank 0 of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def resolved(self, device_type: str) -> "ParallelConfig":
        """The backend decided for the device: NCCL needs CUDA tensors and gloo's CUDA support is
        partial, so each device has its one backend; an explicit mismatch is an error here rather
        than a hang or crash inside the first collective. The executor is decided here too, once,
        so the resolved config says how the ranks run (the engine-core process included)."""
        from .distributed.executors import choose_executor_backend

        wanted = "nccl" if device_type == "cuda" else "gloo"
        if self.distributed_backend is not None and self.distributed_backend != wanted:
            raise ValueError(f"distributed_backend {self.distributed_backend!r} does not run on {device_type}; "
                             f"use {wanted!r} (or leave it unset)")
        return replace(self, distributed_backend=wanted,
                       distributed_executor_backend=choose_executor_backend(self, device_type))


@dataclass(frozen=True)
class LoRASettings:
    """Multi-LoRA serving (vgraph/lora/): PEFT adapters in ``max_loras`` fixed slots beside the
    projections, chosen per request. Off by default: without it the model and its graphs are
    exactly the plain ones."""

    enable_lora: bool = field(default=False, metadata=cli(
        "serve LoRA adapters (per request: lora_request offline, the model name or --lora-modules when served)"))
    max_loras: int = field(default=1, metadata=cli(
        "LoRA adapters resident at once (slots); a step runs at most this many different adapters"))
    max_lora_rank: int = field(default=16, metadata=cli("largest LoRA rank an adapter may have"))
    max_cpu_loras: Optional[int] = field(default=None, metadata=cli(
        "LoRA adapters kept loaded in host memory, least recently used dropped first (default: max_loras)"))

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


def _loaded_passes(passes: list) -> list:
    """Specs loaded into passes (a bad spec or position is a ValueError naming it); imported
    here, not at module level, so a config without passes never imports the pass library."""
    from vgraph.passes.loading import load_pass, position_of
    loaded = [load_pass(p) if isinstance(p, str) else p for p in passes]
    for p in loaded:
        position_of(p)
    return loaded


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRASettings = field(default_factory=LoRASettings)
    device: str = field(default="auto", metadata=cli("auto (cuda when available, else cpu), cpu, cuda or cuda:N"))
    max_logprobs: int = field(default=20, metadata=cli("largest logprobs / top_logprobs a request may ask"))
    # A dict or its JSON text (vLLM's fields), made a SpeculativeConfig here.
    speculative_config: Optional[SpeculativeConfig] = field(default=None, metadata=cli(
        "speculative decoding, as JSON with vLLM's fields: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\''))

    def __post_init__(self) -> None:
        # Normalized while the object is built: a dict or JSON text becomes the dataclass.
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if not (self.device in DEVICES or self.device.startswith("cuda:")):
            raise ValueError(f"unsupported device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be at least 0, got {self.max_logprobs}")

    # ------------------------------------------------------------------ resolution

    def resolved(self, *, model_path: str | os.PathLike, max_position_embeddings: int,
                 quantized: bool) -> "EngineConfig":
        """A copy with every open choice decided, from facts about the checkpoint (found by the
        engine: its local path, its position limit, whether it runs fp8). Raises ValueError
        when ``max_model_len`` exceeds what the model supports."""
        device = resolve_device(self.device)
        wanted = self.model.max_model_len or max_position_embeddings
        if wanted > max_position_embeddings:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings "
                             f"{max_position_embeddings}")
        kind = torch.device(device).type
        parallel = self.parallel.resolved(kind)
        if parallel.distributed_executor_backend != "ray":  # Ray's ranks use the cluster's GPUs, not ours
            _check_parallel_devices(device, self.parallel.world_size)
        c = self.compile
        # Lists copied: a caller who changes its own lists later does not change this engine.
        compile_config = replace(c, custom_ops=c.resolved_custom_ops(kind, quantized),
                                 cudagraph_mode=c.resolved_graph_mode(kind), splitting_ops=list(c.splitting_ops),
                                 compile_sizes=list(c.compile_sizes), passes=list(c.passes),
                                 cudagraph_capture_sizes=None if c.cudagraph_capture_sizes is None
                                 else list(c.cudagraph_capture_sizes))
        return replace(self, device=device, compile=compile_config,
                       cache=self.cache.resolved(kind),
                       scheduler=self.scheduler.resolved(kind, wanted, self.parallel.world_size),
                       parallel=parallel, speculative_config=_resolved_speculative(self.speculative_config, kind),
                       model=replace(self.model, model=str(model_path), max_model_len=wanted))

    @property
    def is_resolved(self) -> bool:
        return (self.device != "auto" and self.model.max_model_len is not None
                and self.cache.block_size is not None and self.scheduler.max_num_batched_tokens is not None
                and self.scheduler.async_scheduling is not None
                and self.compile.custom_ops is not None and self.compile.cudagraph_mode is not None
                and self.parallel.distributed_backend is not None
                and self.parallel.distributed_executor_backend is not None)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            raise ValueError("the device is not resolved yet (EngineConfig.resolved)")
        return torch.device(self.device)

    @property
    def max_forward_rows(self) -> int:
        """The most rows one forward can carry, padding included: the step's token budget or a
        decode of every seat (memory profiling runs one)."""
        s = self.scheduler
        if s.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens is not resolved yet (EngineConfig.resolved)")
        return max(s.max_num_batched_tokens, s.max_num_seqs)

    @property
    def max_model_len(self) -> int:
        """The resolved sequence limit (prompt + output)."""
        if self.model.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet (EngineConfig.resolved)")
        return self.model.max_model_len

    # ------------------------------------------------------------------ from keyword arguments

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """``LLM(model, **kwargs)``: each keyword names a field of one of the sub-configs (or
        of EngineConfig itself); ``enforce_eager=True`` is vLLM's spelling of
        ``level="none"``, and ``compile_config`` gives the whole CompileConfig at once."""
        compile_config = kwargs.pop("compile_config", None)
        if kwargs.pop("enforce_eager", False):
            kwargs["level"] = CompileLevel.NONE
        parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in kwargs.items():
            section = FIELD_SECTION.get(key)
            if section is None:
                raise TypeError(f"unknown engine argument {key!r}")
            parts[section][key] = value
        if compile_config is not None:
            compile_config = replace(compile_config, **parts["compile"])
        return cls(model=ModelConfig(model=model, **parts["model"]), cache=CacheConfig(**parts["cache"]),
                   scheduler=SchedulerConfig(**parts["scheduler"]),
                   compile=compile_config or CompileConfig(**parts["compile"]),
                   parallel=ParallelConfig(**parts["parallel"]), lora=LoRASettings(**parts["lora"]),
                   **parts["engine"])


# On CPU a verify step's extra rows cost real compute: guesses stop paying at about 32 sequences
# (perf/results/spec-decode-cpu.json: 1.38x at batch 1, 1.00x at 32), so they stop above 16
# unless ``disable_by_batch_size`` is given. On a GPU a decode batch is memory-bound far longer.
CPU_SPEC_MAX_BATCH = 16


def _resolved_speculative(spec: Optional[SpeculativeConfig], device_type: str) -> Optional[SpeculativeConfig]:
    if spec is None or spec.disable_by_batch_size is not None or device_type != "cpu":
        return spec
    return replace(spec, disable_by_batch_size=CPU_SPEC_MAX_BATCH)


def _check_parallel_devices(device: str, world_size: int) -> None:
    """Parallelism on CUDA puts rank r (of tensor_parallel_size x pipeline_parallel_size) on
    ``cuda:r`` (restrict the choice with CUDA_VISIBLE_DEVICES): there must be a device per rank,
    and a fixed ``cuda:N`` cannot hold several ranks."""
    if world_size == 1 or not device.startswith("cuda"):
        return
    if device != "cuda":
        raise ValueError(f"device {device!r} names one GPU, but {world_size} ranks (tensor_parallel_size x "
                         "pipeline_parallel_size) put rank r on cuda:r; pass device='cuda' and choose the GPUs "
                         "with CUDA_VISIBLE_DEVICES")
    visible = torch.cuda.device_count()
    if world_size > visible:
        raise ValueError(f"{world_size} ranks (tensor_parallel_size x pipeline_parallel_size) need {world_size} "
                         f"CUDA devices, but {visible} {'is' if visible == 1 else 'are'} visible; ranks on several "
                         "machines run on a Ray cluster (--distributed-executor-backend ray)")


# Where each engine argument lives: section name -> its dataclass ("engine": EngineConfig's own).
# ``ModelConfig.model`` is the positional argument; the section fields of EngineConfig are
# the sections themselves.
SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                             "compile": CompileConfig, "parallel": ParallelConfig, "lora": LoRASettings,
                             "engine": EngineConfig}
_ARGUMENTS = [(f.name, section) for section, kind in SECTIONS.items() for f in fields(kind)
              if f.name not in SECTIONS]
FIELD_SECTION: dict[str, str] = dict(_ARGUMENTS)
assert len(FIELD_SECTION) == len(_ARGUMENTS), "engine argument names must be unique across the sections"
