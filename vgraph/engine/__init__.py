"""Engine-side pieces around the step loop: LLMEngine, AsyncEngine, the offline LLM, detokenization."""
