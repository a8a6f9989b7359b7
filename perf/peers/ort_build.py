"""ONNX Runtime GenAI's model builder (``python -m onnxruntime_genai.models.builder``) with one
correction, run in the peer's environment: ``python -m perf.peers.ort_build BUILDER_ARGS...``.

Why: the builder (0.18) takes *every* ``nn.Linear`` whose ``out_features`` equals the vocabulary
size for the LM head. The ~24M perf Llama has vocab_size == hidden_size == 512, so each layer's
``o_proj`` (512 -> 512) also matches: the exported graph then computes its logits from a hidden
state inside the stack, not after the last layer. Its greedy tokens agreed with transformers on
1 of 256 positions (layer-by-layer comparison: every decoder layer's output equal to 0.0, the
logits not), and its timings would be of a different, partly pruned graph. Here a Linear is the
LM head only if it is the model's own output embedding (``get_output_embeddings()``); nothing
else in the builder changes. Models whose vocabulary differs from their hidden size (the
0.5B-shaped one) build identically either way.
"""
from __future__ import annotations

import runpy
import sys


def main() -> None:
    import torch

    import onnxruntime_genai.models  # noqa: F401 - puts the builder's own folder on sys.path
    # builder.py imports its classes as the top-level package ``builders`` (that folder), so the
    # class to correct is that module's, not ``onnxruntime_genai.models.builders``'s.
    from builders import base

    stock = base.Model.has_lm_head

    def has_lm_head(self, module) -> bool:  # noqa: ANN001 - the builder's own signature
        head = getattr(self.weights, "get_output_embeddings", lambda: None)()
        if isinstance(head, torch.nn.Linear) and isinstance(module, torch.nn.Linear):
            return module is head
        return stock(self, module)

    base.Model.has_lm_head = has_lm_head
    sys.argv = ["onnxruntime_genai.models.builder", *sys.argv[1:]]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
