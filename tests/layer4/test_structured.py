"""Grammar-constrained decoding in layer 4's engine (course model, CPU): every output parses
and validates against its schema (the `jsonschema` package), rows without a grammar are
untouched, and the mask holds with parallel sampling, preemption, speculative decoding and
async scheduling; the bitmask itself against a plain reference."""
from __future__ import annotations

import json
import re

import pytest
import torch

import layer3_model as l3
import layer4_algorithms as l4

from .l4_helpers import random_bitmask_case as random_case
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
    import jsonschema  # ~3 s of imports: paid by the worker that runs this file, not at collection

    jsonschema.validate(json.loads(text), schema)


# ---- the bitmask ---------------------------------------------------------------------------
class Row:
    """A sequence as TokenMasks reads it: only its grammar (None: a free row)."""
    grammar = None


def rows_for(model, compiler, pattern: str) -> list[Row]:
    """One Row a letter of pattern: "f" free, "g" a grammar (one of SCHEMAS), "x" a grammar
    that has failed (EOS only)."""
    out = []
    for i, c in enumerate(pattern):
        q = Row()
        if c in "gx":
            q.grammar = compiler.state(SO(json=SCHEMAS[i % 8]))
            if c == "x":
                q.grammar.accept(model.tokenizer.encode("zzz", add_special_tokens=False)[0])
                assert q.grammar.failed
        out.append(q)
    return out


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


def test_bitmask_on_chosen_rows_leaves_the_others():
    logits, bitmask, rows, want = random_case(7, 3, 100)
    got = l4.apply_token_bitmask_(logits.clone(), bitmask, rows, impl="torch")
    assert torch.equal(got, want)
    got = l4.apply_token_bitmask_(logits.clone(), bitmask, rows.tolist(), impl="torch")
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="say which rows"):
        l4.apply_token_bitmask_(logits.clone(), bitmask)
    with pytest.raises(ValueError, match="2 row indices for 3"):
        l4.apply_token_bitmask_(logits.clone(), bitmask, rows[:2])


def test_the_apply_graphs_are_for_cuda_graph_decoding_on_a_gpu(course_model):
    """The apply's CUDA graphs: on a GPU under CUDA-graph decoding only (whose logits sit in
    static buffers); a CPU engine and CPU masks have none."""
    llm = l4.LLM(course_model, num_blocks=16, async_scheduling=True)
    assert llm.masks.graphs is None
    assert l4.structured.TokenMasks(64, "cpu", graphs=True).graphs is None  # (CUDA only)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bitmask_kernel_equals_the_torch_reference_in_the_interpreter(dtype):
    """The Triton kernel (Triton's CPU interpreter) against the torch path: a vocabulary that
    is not a multiple of 32 nor of the kernel's block, a subset of rows, a padded row stride."""
    logits, bitmask, rows, want = random_case(5, 3, 2100, dtype)
    wide = torch.zeros(5, 2200, dtype=dtype)
    wide[:, :2100] = logits
    got = l4.apply_token_bitmask_(wide[:, :2100], bitmask, rows, impl="triton")
    assert torch.equal(got, want)
    assert torch.equal(wide[:, 2100:], torch.zeros(5, 100, dtype=dtype))  # past V: untouched
    flat = torch.cat([bitmask.view(-1), rows.to(torch.int32)])  # as TokenMasks sends them
    R, W = bitmask.shape
    got = l4.apply_token_bitmask_(logits.clone(), flat[:R * W].view(R, W), flat[R * W:],
                                  impl="triton")
    assert torch.equal(got, want)


def test_token_masks_reuse_their_buffers_and_mask_only_grammar_rows(course_model):
    """TokenMasks: the constrained rows get their grammar's mask (as a fresh fill_masks +
    apply would), the free rows are untouched, the host buffers are the same from step to
    step (two arenas in turn) and grow when more rows are constrained than they hold."""
    compiler = l4.GrammarCompiler.for_model(course_model)
    V = course_model.config.vocab_size
    masks = l4.structured.TokenMasks(V, "cpu", rows=2)
    seen = []
    for pattern in ("fgfg", "ggff", "fgfg", "gfgggg", "fgfg", "gfgf"):
        seqs = rows_for(course_model, compiler, pattern)
        logits = torch.randn(len(seqs), V)
        got = logits.clone()
        assert masks.apply(got, seqs) == pattern.count("g")
        idx = [i for i, c in enumerate(pattern) if c == "g"]
        bitmask = l4.structured.allocate(len(idx), V)
        for j, i in enumerate(idx):  # each state's own fill: the same rows
            seqs[i].grammar.fill(bitmask[j].numpy())
        want = l4.apply_token_bitmask_(logits.clone(), bitmask, idx, impl="torch")
        assert torch.equal(got, want)
        host = masks._host[masks._arena]
        seen.append((host.data_ptr(), host.numel()))
    assert seen[0] != seen[1] and seen[2] == seen[0]  # two arenas in turn, reused
    # grown at step 4 (a new buffer: the allocator may hand back a freed address), then reused
    assert seen[3][1] > seen[2][1] and seen[5] == seen[3]
    assert masks.stats["steps"] == 6 and masks.stats["rows"] == 15
    assert masks.apply(torch.randn(2, V), rows_for(course_model, compiler, "ff")) == 0


def test_mask_rows_touches_only_constrained_rows(course_model):
    compiler = l4.GrammarCompiler.for_model(course_model)
    free, tight = Row(), Row()
    tight.grammar = compiler.state(SO(choice=["yes", "no"]))
    logits = torch.randn(2, course_model.config.vocab_size)
    out = logits.clone()
    l4.structured.mask_rows(out, [free, tight])
    assert torch.equal(out[0], logits[0])
    allowed = torch.isfinite(out[1]).nonzero()[:, 0].tolist()
    texts = {course_model.tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def test_fill_threads_over_lanes_give_the_one_thread_masks(course_model):
    """With lanes the compiler deals a constraint's states out to its compiles in turn (forks
    take the next lane), and the pool's fill of rows ordered by lane writes the rows one
    thread writes one by one: mixed schemas, a failed row (EOS only) included."""
    compiler = l4.GrammarCompiler.for_model(course_model, lanes=3)
    states = [compiler.state(SO(json=PERSON)) for _ in range(4)]
    assert [q.lane for q in states] == [0, 1, 2, 0]
    assert states[0].fork().lane == 1  # (the counter moved on: the 5th state of PERSON)
    grammars = [q.grammar for q in rows_for(course_model, compiler, "ggxgggfg") if q.grammar]
    for q in grammars[:3]:  # mid-document rows too
        for t in course_model.tokenizer.encode('{"', add_special_tokens=False):
            q.accept(t)
    V = course_model.config.vocab_size
    one, many = l4.structured.allocate(len(grammars), V), l4.structured.allocate(len(grammars), V)
    pool = l4.structured.grammar.llg().LLExecutor(3)
    l4.structured.fill_masks(grammars, one)
    l4.structured.fill_masks(grammars, many, pool)
    assert torch.equal(one, many)
    assert compiler.stats["compiles"] <= 3 + 3 * 6  # at most one compile a (schema, lane)


def test_engine_outputs_do_not_depend_on_its_fill_threads(course_model):
    spec = SO(json=SCHEMAS[5])
    ps = [params(spec, i, temperature=0 if i % 2 else 0.8, max_tokens=40) for i in range(6)]
    prompts = ["HAMLET.\n", "ROMEO.\n", "JULIET.\n"] * 2
    texts = []
    for threads in (1, 3):
        llm = l4.LLM(course_model, num_blocks=64, async_scheduling=True,
                     grammar_fill_threads=threads)
        assert llm.grammars.lanes == threads and llm.masks.fill_threads == threads
        texts.append([o.outputs[0].text for o in llm.generate(prompts, ps)])
        assert llm.masks.stats["steps"] > 0
    assert texts[0] == texts[1]
    for t in texts[1]:
        valid(t, SCHEMAS[5])


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


def test_async_scheduling_gives_the_synchronous_outputs(course_model, monkeypatch):
    """Constrained requests keep async scheduling: their decode steps take their inputs from
    the previous step's device tokens (the overlap path), and the outputs (greedy and seeded
    sampling, beside free rows, requests finishing at different steps) are the synchronous
    engine's."""
    overlapped = []
    execute = l4.model_runner.ModelRunner.execute

    def spy(self, out, prev_tokens=None):
        if prev_tokens is not None:
            overlapped.append(sum(s.pending >= 0 and s.seq.grammar is not None
                                  for s in out.scheduled))
        return execute(self, out, prev_tokens)

    monkeypatch.setattr(l4.model_runner.ModelRunner, "execute", spy)
    ps = [params(SO(json=PERSON), 0, temperature=0), l4.SamplingParams(temperature=0,
                                                                         max_tokens=10),
          params(SO(json=SCHEMAS[17]), 1), params(SO(regex=r"(Aye|Nay), [a-z]{1,6}!"), 2),
          l4.SamplingParams(temperature=0.9, seed=5, max_tokens=30),
          params(SO(json=SCHEMAS[5]), 3, temperature=0)]
    prompts = ["HAMLET.\n", "ROMEO.\n", "JULIET.\n", "OTHELLO.\n", "LEAR.\n", "PUCK.\n"]
    sync = l4.LLM(course_model, num_blocks=64, async_scheduling=False)
    a = [o.outputs[0].text for o in sync.generate(prompts, ps)]
    assert not overlapped
    overlap = l4.LLM(course_model, num_blocks=64, async_scheduling=True)
    b = [o.outputs[0].text for o in overlap.generate(prompts, ps)]
    assert a == b
    assert overlapped and max(overlapped) >= 3  # constrained rows decoded on the overlap path
    assert overlap.masks.stats["steps"] > 0 and overlap._inflight is None
    valid(a[0], PERSON)
    valid(a[2], SCHEMAS[17])
    assert re.fullmatch(r"(Aye|Nay), [a-z]{1,6}!", a[3])
    valid(a[5], SCHEMAS[5])


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


def test_a_voided_row_beside_constrained_rows(course_model):
    """Async scheduling: a constrained request whose row cannot be sampled (its temperature
    slipped past normalization) joins constrained requests already decoding; it ends with
    "error" and its bad token never reaches its grammar, the others are exactly those of a
    run without it and validate."""
    ps = [params(SO(json=PERSON), i, temperature=0) for i in range(3)]
    prompts = ["HAMLET.\n", "ROMEO.\n", "JULIET.\n"]

    def run(hostile: bool):
        llm = l4.LLM(course_model, num_blocks=64, async_scheduling=True)
        rids = [llm.add_request(p, sp) for p, sp in zip(prompts, ps, strict=True)]
        done, bad, steps = {}, None, 0
        while llm.has_unfinished():
            steps += 1
            if hostile and steps == 4:  # the others are decoding: not a first-tokens step
                bad = llm.add_request("PUCK.\n", params(SO(json=PERSON), 9))
                seq = llm._requests[bad][1][0]
                seq.params = l4.SamplingParams(temperature=1e-40, max_tokens=96,
                                               structured_outputs=SO(json=PERSON))
            for o in llm.step(unfinished=False):
                done[o.request_id] = o
        for o in llm.drain():
            done[o.request_id] = o
        assert llm.masks.stats["steps"] > 0
        return [done[r] for r in rids], (done[bad], seq) if hostile else None

    ref, _ = run(False)
    got, (bad, seq) = run(True)
    assert bad.outputs[0].finish_reason == "error"
    assert seq.grammar.position == len(seq.output_ids)  # no token taken for the void row
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    for o in got:
        valid(o.outputs[0].text, PERSON)


# ---- the apply replayed from CUDA graphs (mask_graph.py) -----------------------------------
def test_mask_graphs_capture_steady_launches_and_fall_back_when_capture_fails(monkeypatch):
    """MaskGraphs: a launch whose buffers were seen WARM times before is captured and then
    replayed, also when two arenas alternate (each its own graph); other buffers launch
    plainly; a capture that fails (here, really: no CUDA) leaves the graphs off with the
    reason, and every launch still masks exactly (the Triton kernel in the interpreter)."""
    mg = l4.structured.mask_graph
    logits, bitmask, rows, want = random_case(5, 3, 100)
    R, W = bitmask.shape
    n = R * W + R
    host = torch.cat([bitmask.view(-1), rows.to(torch.int32)])
    dev = torch.empty_like(host)

    fixed = logits.clone()  # one logits buffer, as CUDA-graph decoding reuses

    def launch(graphs, buffer=fixed):
        buffer.copy_(logits)
        graphs.run(buffer, host, dev, R, n, W)
        assert torch.equal(buffer, want)

    real = mg.MaskGraphs()
    for _ in range(mg.WARM + 3):
        launch(real)
    assert real.failed and real.stats == {"captures": 0, "replays": 0, "plain": mg.WARM + 3}
    replayed = []

    class FakeGraph:  # what a capture would give on a GPU: the same launches, replayed
        def __init__(self, args):
            self.args = args

        def replay(self):
            replayed.append(1)
            mg.plain(*self.args)

    fake = mg.MaskGraphs()
    monkeypatch.setattr(fake, "_capture", lambda *a: fake._graphs.setdefault(
        a[-1], (FakeGraph(a[:-2]), None)))
    for _ in range(mg.WARM + 4):
        launch(fake)
    assert len(fake._graphs) == 1 and len(replayed) == 4 and fake.stats["plain"] == mg.WARM
    launch(fake, logits.clone())  # another logits buffer: plain, the graph kept
    assert len(replayed) == 4 and fake.stats["plain"] == mg.WARM + 1
    launch(fake)
    assert len(replayed) == 5
    # two arenas in turn (TokenMasks alternates its host buffers step by step): each is
    # captured once seen WARM times, though never twice in a row
    host2 = host.clone()
    turns = mg.MaskGraphs()
    monkeypatch.setattr(turns, "_capture", lambda *a: turns._graphs.setdefault(
        a[-1], (FakeGraph(a[:-2]), None)))
    before = len(replayed)
    for step in range(2 * (mg.WARM + 3)):
        fixed.copy_(logits)
        turns.run(fixed, host2 if step % 2 else host, dev, R, n, W)
        assert torch.equal(fixed, want)
    assert len(turns._graphs) == 2 and turns.stats["plain"] == 2 * mg.WARM
    assert len(replayed) - before == 6
    # argmax=True (an all-greedy step): a replayed graph also leaves the masked rows' argmax
    # in a buffer of its own; a plain launch leaves none (sampling computes it)
    assert real.run(fixed, host, dev, R, n, W, argmax=True) is None

    class GreedyGraph(FakeGraph):
        def replay(self):
            super().replay()
            self.out.copy_(self.args[0].argmax(-1))

    greedy = mg.MaskGraphs()

    def capture(*a):
        g = GreedyGraph(a[:-2])
        g.out = torch.empty(a[0].shape[0], dtype=torch.int64)
        return greedy._graphs.setdefault(a[-1], (g, g.out))

    monkeypatch.setattr(greedy, "_capture", capture)
    got = []
    for _ in range(mg.WARM + 2):
        fixed.copy_(logits)
        got.append(greedy.run(fixed, host, dev, R, n, W, argmax=True))
    assert got[:mg.WARM] == [None] * mg.WARM
    assert torch.equal(got[-1], want.argmax(-1)) and got[-1] is got[-2]
