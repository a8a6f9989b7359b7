"""The engine and its callers: LLMEngine (the step), EngineLoop (serving it), EngineClient and its
transports (the server's side), OutputProcessor (text and outputs), the offline LLM, launch (the topology)."""
