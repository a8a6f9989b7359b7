"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as in vLLM."""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from ..config import CompileConfig, EngineConfig
from ..lora.request import LoRARequest
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from .gc_tuning import frozen_for_the_run
from .inputs import PromptType, prompt_to_ids, template_supports_tools
from .llm_engine import LLMEngine
from .output_processor import OutputProcessor
from .outputs import EmbeddingRequestOutput, OutputKind, RequestOutput
from .stats import StepOutput

Conversation = list[dict[str, Any]]


class LLM:
    """Runs a batch of prompts to completion with continuous batching."""

    def __init__(self, model: str, *, compile_config: Optional[CompileConfig] = None,
                 enforce_eager: bool = False, **kwargs: Any) -> None:
        """``model``: a local HF model directory, a hub id, or ``"demo-model-v1"``, the built-in
        demo model (shipped inside the package, never fetched).

        Every other keyword is a field of one of the config dataclasses in ``vgraph.config``,
        with the default written there (and nowhere else): ``ModelConfig`` (dtype,
        max_model_len, quantization, seed, tokenizer, revision, load_format), ``CacheConfig``
        (block_size, enable_prefix_caching, gpu_memory_utilization, num_gpu_blocks,
        cpu_kv_cache_gib), ``SchedulerConfig`` (max_num_seqs, max_num_batched_tokens,
        enable_chunked_prefill), ``CompileConfig`` (level, passes, custom_ops, cudagraph_mode,
        ...) and ``EngineConfig`` itself (device, max_logprobs). ``compile_config`` gives a whole
        CompileConfig (CompileConfig keywords then override its fields, on a copy);
        ``enforce_eager=True`` is ``level="none"``. ``ParallelConfig``'s ``tensor_parallel_size``
        and ``pipeline_parallel_size`` run the model in T x P worker processes (``close()`` stops them). An unknown keyword is a TypeError naming it;
        a bad value, a ValueError naming the choices. See ``EngineConfig.from_kwargs``.
        """
        config = EngineConfig.from_kwargs(model, compile_config=compile_config, enforce_eager=enforce_eager,
                                          **kwargs)
        self.engine = LLMEngine(config)
        self.outputs = OutputProcessor(self.engine.tokenizer)  # each request's output, built once it finishes
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); a no-op otherwise. Also
        done at interpreter exit, and by ``with LLM(...) as llm:``."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True,
                 lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None
                 ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in the order given. ``lora_request``: the
        adapter every prompt runs with, or one per prompt (None: the base model)."""
        prompts = self._as_list(prompts)
        return self._submit_and_run(prompts, self._params_for(prompts, sampling_params), use_tqdm,
                                    _per_prompt(lora_request, len(prompts)))

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]],
              pooling_params: Optional[PoolingParams] = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the order given: the final norm's hidden states pooled
        ("last" token by default, or "mean": ``pooling_type``) and L2-normalized unless
        ``pooling_normalize=False``; ``pooling_params`` overrides either per call. Prompts
        are prefill only and batch with each other like generation requests do."""
        prompts = self._as_list(prompts)
        params = pooling_params or PoolingParams()
        return self._submit_and_run(prompts, [params] * len(prompts), use_tqdm)

    def _submit_and_run(self, prompts: list, params: Sequence[Union[SamplingParams, PoolingParams]],
                        use_tqdm: bool, lora_requests: Optional[Sequence[Optional[LoRARequest]]] = None) -> list:
        ids = []
        loras = lora_requests or [None] * len(prompts)
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                self.add_request(rid, prompt, p, OutputKind.FINAL_ONLY, lora_request=lora)
                ids.append(rid)
        except Exception:
            self.abort_request(ids)  # nothing half-submitted stays in the engine
            raise
        return self._run(ids, use_tqdm)

    # ------------------------------------------------------------------ stepping by hand

    def add_request(self, request_id: str, prompt: PromptType, params: Union[SamplingParams, PoolingParams],
                    kind: OutputKind = OutputKind.CUMULATIVE, arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> None:
        """Submits one request to be stepped with ``step`` (``generate`` does both); ``kind``
        says which outputs ``step`` returns for it. A bad request raises ValueError."""
        text, token_ids = prompt_to_ids(prompt, self.engine.tokenizer)
        self.engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params, arrival_time,
                                lora_request)
        self.outputs.add(request_id, text, token_ids, params, kind)

    def step(self) -> StepOutput:
        """One engine step: the outputs due (per each request's ``OutputKind``), the timings and
        the engine's state. Sequences ended by a stop string are ended in the engine too."""
        step = self.engine.step()
        outputs, finishes = self.outputs.process(step.deltas)
        timings = step.timings + (self.engine.finish_sequences(finishes) if finishes else [])
        return StepOutput(outputs, timings, step.stats)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        self.outputs.remove(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True, tools: Optional[list[dict[str, Any]]] = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template (or ``chat_template``) to each conversation.

        ``tools`` (OpenAI's function-tool shape) are rendered by the template, as the server
        does; the reply is returned as text (reading tool calls out of it is the server's
        ``--tool-call-parser``; a ``structured_outputs`` JSON schema can enforce a call)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.encode_chat(c, chat_template, add_generation_prompt, tools)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, conversation: Conversation, chat_template: Optional[str] = None,
                    add_generation_prompt: bool = True,
                    tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        tok = self.engine.tokenizer
        template = chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        if tools and not template_supports_tools(template):
            raise ValueError("tools: the chat template never reads 'tools', so they would be dropped; "
                             "pass a chat_template that supports tools")
        text = tok.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt, tools=tools or None)
        return list(tok.encode(text, add_special_tokens=False))

    @staticmethod
    def _as_list(prompts: Any) -> list:
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        return [prompts] if single else list(prompts)

    @staticmethod
    def _params_for(prompts: list, sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        return list(sampling_params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            with frozen_for_the_run():
                while self.engine.has_unfinished_requests():
                    for out in self.step().outputs:
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:
            self.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _per_prompt(lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]],
                num_prompts: int) -> Optional[list[Optional[LoRARequest]]]:
    """One adapter (or None) per prompt, from one for all or a list of them."""
    if lora_request is None:
        return None
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"{len(loras)} lora requests for {num_prompts} prompts")
    if not all(r is None or isinstance(r, LoRARequest) for r in loras):
        raise TypeError("lora_request must be a LoRARequest, None, or a list of them (one per prompt)")
    return loras
