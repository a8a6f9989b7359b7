"""One INFO line per finished request (``--disable-log-requests`` turns them off).

Fed every engine step, as the metrics are (``on_step``): the engine reports each request's
end exactly once, in a timing with its finish reasons, whatever ended it (length, EOS, a stop
string, an abort), so this is the one place every request passes when it finishes. Prompts are
user data: their text is logged only when ``--max-log-len`` asks, and then at most that many
characters (vLLM logs them at DEBUG; here an operator opts in).
"""
from __future__ import annotations

import logging
from typing import Optional

from ..engine.stats import RequestTiming, StepOutput

logger = logging.getLogger("vgraph.server.requests")


class RequestLog:
    def __init__(self, max_log_len: Optional[int] = None) -> None:
        self.max_log_len = max_log_len
        self._tokens: dict[str, int] = {}  # output tokens so far, per unfinished request
        self._prompts: dict[str, str] = {}  # the logged part of each prompt, with --max-log-len

    def observe(self, step: StepOutput) -> None:
        if self.max_log_len is not None:
            for output in step.outputs:
                if output.request_id not in self._prompts:
                    self._prompts[output.request_id] = _prompt_text(output.prompt, output.prompt_token_ids,
                                                                    self.max_log_len)
        for timing in step.timings:
            self._tokens[timing.request_id] = self._tokens.get(timing.request_id, 0) + timing.num_new_tokens
            if timing.finish_reasons:
                logger.info("%s", self._line(timing))

    def _line(self, timing: RequestTiming) -> str:
        rid = timing.request_id
        latency = "aborted" if timing.e2e_latency is None else f"{timing.e2e_latency:.3f} s"
        line = (f"request {rid} finished: prompt tokens {timing.num_prompt_tokens}, output tokens "
                f"{self._tokens.pop(rid, 0)}, finish {','.join(timing.finish_reasons)}, latency {latency}")
        prompt = self._prompts.pop(rid, None)
        return line if prompt is None else f"{line}, prompt {prompt!r}"


def _prompt_text(prompt: Optional[str], token_ids: list[int], limit: int) -> str:
    """The first ``limit`` characters of the prompt (of its token ids, given as ids)."""
    text = prompt if prompt is not None else " ".join(map(str, token_ids))
    return text[:limit]
