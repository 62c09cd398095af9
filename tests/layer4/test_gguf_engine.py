"""SmolLM2-135M-Instruct (Q4_1 GGUF) through the layer-4 engine: greedy completions of 8 chat
prompts are token for token those of transformers' generate on the same file (its own GGUF
loader; test-only). The engine runs the model `load("smollm2")` gave layer 3's tests (loaded
by name once a session: `LLM("smollm2")` is that load and this engine)."""
# ruff: noqa: F811  (the shared fixtures are imported, then named as test arguments)
from __future__ import annotations

import pytest
import torch

from layer4_algorithms import LLM, SamplingParams

from ..layer3.smollm2 import CHATS, hf_smollm2, smollm2, smollm2_file  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow
NEW_TOKENS = 20


def test_greedy_chat_matches_transformers(smollm2, hf_smollm2):
    llm = LLM(smollm2, max_model_len=256)
    tok = llm.model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, params)
    eos = tok.eos_token_ids[0]
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, eos_token_id=eos, pad_token_id=eos)
        expected = ref[0, len(prompt):].tolist()
        if expected[-1] == eos:  # transformers keeps the EOS it stopped at; the engine drops it
            expected.pop()
            assert out.outputs[0].finish_reason == "eos"
        assert out.outputs[0].token_ids == expected, tok.decode(prompt)
    assert any("Paris" in o.outputs[0].text for o in outs)
