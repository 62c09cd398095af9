"""Layer 4's released text (CompletionOutput.text) against what layer 6's stream used to
compute itself: a second FinishRule per completion fed the engine's token ids. On the course
model with stop strings, step by step, the deltas must be the same pieces."""
from __future__ import annotations

import pytest

import layer6_serving as l6
from layer6_serving.streams import DeltaTracker

l4 = l6.parallel.engine
l3 = l4.executor


class OldTracker:
    """The old layer-6 way (kept here as the reference): one FinishRule per completion over
    the token ids; EOS fed at the end so the detokenizer flushes."""

    def __init__(self, params, eos, tokenizer) -> None:
        self.params, self.eos, self.tok = params, eos, tokenizer
        self.rules, self.sent = {}, {}

    def update(self, outputs) -> dict[int, str]:
        pieces = {}
        for c in outputs:
            rule = self.rules.setdefault(c.index, l3.FinishRule(self.params, self.eos,
                                                               self.tok.decoder()))
            text = ""
            for t in c.token_ids[self.sent.get(c.index, 0):]:
                if not rule.finished:
                    text += rule.append(t)[0]
            if c.finish_reason not in (None, "abort") and not rule.finished:
                text += rule.append(self.eos[0])[0] if self.eos else ""
                if not rule.finished:
                    text += rule.text[rule.emitted:]
            self.sent[c.index] = len(c.token_ids)
            pieces[c.index] = text
        return pieces


@pytest.fixture(scope="module")
def llm():
    model = l3.load(l3.course_model_dir("target"), device="cpu", dtype="float32")
    return l4.LLM(model, num_blocks=128, block_size=16)


@pytest.mark.parametrize("seed", range(3))
def test_released_text_equals_the_old_stream(llm, seed):
    stops = [("\n\n",), ("ROMEO", "the"), ("e",), (".\n", "lord")]
    prompts = ["ROMEO.\n", "JULIET.\nO Romeo", "HAMLET.\nTo be, or not to be"]
    old, new, got_old, got_new, reasons = {}, {}, {}, {}, set()
    for i, p in enumerate(prompts):
        sp = l4.SamplingParams(temperature=1.0, seed=seed * 10 + i, max_tokens=60,
                               stop=stops[(i + seed) % len(stops)], n=2)
        rid = llm.add_request(p, sp)
        old[rid] = OldTracker(sp, llm.model.eos_token_ids, llm.model.tokenizer)
        new[rid] = DeltaTracker(lambda t: "")
    while llm.has_unfinished():
        for o in llm.step():
            pieces = old[o.request_id].update(o.outputs)
            deltas = {d.index: d.text for d in new[o.request_id].update(o.outputs)}
            for idx, text in pieces.items():
                assert deltas.get(idx, "") == text, (o.request_id, idx)
                got_old[o.request_id, idx] = got_old.get((o.request_id, idx), "") + text
                got_new[o.request_id, idx] = got_new.get((o.request_id, idx), "") + deltas.get(
                    idx, "")
            if o.finished:
                for c in o.outputs:
                    assert got_new[o.request_id, c.index] == c.text
                    reasons.add(c.finish_reason)
    assert got_old == got_new and any(got_new.values())
    assert "stop" in reasons  # the stop strings did cut something
