"""Grammar-constrained decoding in layer 4's engine (course model, CPU): every output parses
and validates against its schema (the `jsonschema` package), rows without a grammar are
untouched, and the mask holds with parallel sampling, preemption, speculative decoding and
async scheduling; the bitmask itself against a plain reference."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

import layer3_model as l3
import layer4_algorithms as l4

from .schemas import SCHEMAS

SO = l4.StructuredOutputsParams
PERSON = SCHEMAS[6]  # {"name", "age", "ok"}


@pytest.fixture(scope="module")
def llm(course_model):
    return l4.LLM(course_model, num_blocks=128, max_num_seqs=32)


def params(spec: SO, i: int = 0, **kw) -> l4.SamplingParams:
    kw.setdefault("temperature", 0.8)
    kw.setdefault("max_tokens", 96)
    return l4.SamplingParams(seed=i, structured_outputs=spec, **kw)


def valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


# ---- the bitmask ---------------------------------------------------------------------------
def test_bitmask_unpacks_bit_t_of_word_t_over_32():
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 70, generator=g) < 0.3  # 70 tokens: 3 words, the last one partial
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = words.to(torch.int32)  # two's complement for bit 31, as llguidance writes it
    assert torch.equal(l4.structured.unpack(bitmask, 70), allowed)
    logits = torch.randn(3, 70, generator=g)
    want = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(l4.apply_token_bitmask_(logits.clone(), bitmask), want)
    with pytest.raises(ValueError, match="covers 64 tokens"):
        l4.apply_token_bitmask_(logits.clone(), bitmask[:, :2])


def test_mask_rows_touches_only_constrained_rows(course_model):
    compiler = l4.GrammarCompiler.for_model(course_model)

    class Row:
        grammar = None

    free, tight = Row(), Row()
    tight.grammar = compiler.state(SO(choice=["yes", "no"]))
    logits = torch.randn(2, course_model.config.vocab_size)
    out = logits.clone()
    l4.structured.mask_rows(out, [free, tight])
    assert torch.equal(out[0], logits[0])
    allowed = torch.isfinite(out[1]).nonzero()[:, 0].tolist()
    texts = {course_model.tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


# ---- outputs match their constraint --------------------------------------------------------
def test_json_schemas_parse_and_validate(llm):
    schemas = SCHEMAS[::4]  # 14 of them here; layer 6's API test runs them all
    outs = llm.generate(["HAMLET.\n"] * len(schemas),
                        [params(SO(json=s), i) for i, s in enumerate(schemas)])
    for s, o in zip(schemas, outs, strict=True):
        assert o.outputs[0].finish_reason == "eos", (s, o.outputs[0].text)
        valid(o.outputs[0].text, s)
    assert llm.grammars.stats["compiles"] >= len(schemas)


def test_regex_choice_and_json_object(llm):
    specs = [SO(regex=r"(Exit|Enter) [A-Z]{2,6}\."), SO(choice=["aye", "nay", "anon"]),
             SO(json_object=True)]
    outs = llm.generate(["HAMLET.\n"] * 3, [params(s, 1, max_tokens=48) for s in specs])
    assert re.fullmatch(r"(Exit|Enter) [A-Z]{2,6}\.", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("aye", "nay", "anon")
    text = outs[2].outputs[0].text  # may be cut by max_tokens: a prefix of an object
    assert text.startswith("{")


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(llm):
    free = l4.SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["ROMEO.\n"], free)[0].outputs[0].text
    mixed = llm.generate(["ROMEO.\n", "HAMLET.\n"], [free, params(SO(json=PERSON))])
    assert mixed[0].outputs[0].text == alone
    valid(mixed[1].outputs[0].text, PERSON)


def test_compiled_grammars_are_cached(llm):
    before = dict(llm.grammars.stats)
    spec = SO(json={"type": "object", "properties": {"w": {"enum": ["x", "y"]}},
                    "required": ["w"], "additionalProperties": False})
    llm.generate(["A"], params(spec, max_tokens=16))
    llm.generate(["B"], params(spec, max_tokens=16))
    assert llm.grammars.stats["compiles"] == before["compiles"] + 1
    assert llm.grammars.stats["hits"] >= before["hits"] + 1


def test_invalid_constraints_are_refused_when_added(llm):
    with pytest.raises(ValueError, match="strng"):
        llm.add_request("A", params(SO(json={"type": "strng"})))
    with pytest.raises(ValueError, match="regex"):
        llm.add_request("A", params(SO(regex="a(b")))
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["b"])
    assert not llm.has_unfinished()


# ---- with the engine's other mechanisms ----------------------------------------------------
def test_parallel_sampling_forks_the_grammar(llm):
    out = llm.generate(["HAMLET.\n"], params(SO(json=PERSON), 3, n=3))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        valid(c.text, PERSON)


def test_greedy_output_survives_preemption(course_model):
    spec = SO(json=SCHEMAS[5])  # {"name", "age"}
    ps = [params(spec, i, temperature=0, max_tokens=40) for i in range(4)]
    prompts = ["HAMLET.\n", "ROMEO.\n", "JULIET.\n", "OTHELLO.\n"]
    roomy = l4.LLM(course_model, num_blocks=64).generate(prompts, ps)
    tight = l4.LLM(course_model, num_blocks=14, block_size=4, max_num_seqs=4)
    squeezed = tight.generate(prompts, ps)
    assert tight.stats.preemptions > 0
    assert [o.outputs[0].text for o in squeezed] == [o.outputs[0].text for o in roomy]
    for o in squeezed:
        valid(o.outputs[0].text, SCHEMAS[5])


def test_async_scheduling_gives_the_synchronous_outputs(course_model):
    ps = [params(SO(json=PERSON), 0, temperature=0), l4.SamplingParams(temperature=0,
                                                                         max_tokens=10)]
    sync = l4.LLM(course_model, num_blocks=64, async_scheduling=False)
    overlap = l4.LLM(course_model, num_blocks=64, async_scheduling=True)
    a = [o.outputs[0].text for o in sync.generate(["HAMLET.\n", "ROMEO.\n"], ps)]
    b = [o.outputs[0].text for o in overlap.generate(["HAMLET.\n", "ROMEO.\n"], ps)]
    assert a == b
    valid(a[0], PERSON)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_decoding_verifies_drafts_against_the_mask(course_model, method):
    spec = SO(json=SCHEMAS[17])  # {"user": {"id", "roles": [...]}}
    ps = [params(spec, i, temperature=0) for i in range(2)] + [
        params(spec, 7, temperature=0.9)]
    prompts = ["HAMLET.\n", "ROMEO.\n", "JULIET.\n"]
    plain = l4.LLM(course_model, num_blocks=64).generate(prompts, ps)
    cfg = dict(method=method, k=3) if method == "ngram" else dict(
        method="draft", k=3, draft=str(l3.course_model_dir("draft")))
    spec_llm = l4.LLM(course_model, num_blocks=64, speculative=cfg)
    fast = spec_llm.generate(prompts, ps)
    assert spec_llm.stats.spec_proposed > 0
    for a, b in zip(plain[:2], fast[:2], strict=True):  # greedy: exactly the same tokens
        assert a.outputs[0].text == b.outputs[0].text
    for o in fast:
        valid(o.outputs[0].text, SCHEMAS[17])
