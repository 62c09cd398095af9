"""The draft's single-token steps replayed from a CUDA graph: the same
guesses as the eager serving forward after rejections and full accepts, and greedy speculation still
emits plain greedy's tokens. GPU tests; on a CPU the option is a no-op (checked here too)."""
from __future__ import annotations

import pytest

import layer3_model as l3
from layer4_algorithms.spec.decoder import SpeculativeDecoder
from layer4_algorithms.spec.proposers import DraftModelProposer

PROMPT = "HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n"
GREEDY = l3.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _rounds(draft: l3.Model, prop: DraftModelProposer) -> list[list[int]]:
    """Guesses over rounds with rejections and full accepts (the cache rolls back itself)."""
    seq, out = list(draft.encode(PROMPT)), []
    for accept in (0, 4, 2, 4, 1):
        p = prop.propose([seq], [0], [4], [GREEDY], [None])
        out.append(p.tokens[0].tolist())
        bonus = (out[-1][accept] + 1) % 4096 if accept < 4 else 17
        seq = seq + out[-1][:accept] + [bonus]
    return out


def test_cuda_graph_is_a_no_op_on_the_cpu():
    draft = l3.load(l3.course_model_dir("draft"), device="cpu", dtype="float32")
    prop = DraftModelProposer(draft.net, 1, 128, cuda_graph=True)
    assert not prop.cuda_graph and _rounds(draft, prop) and prop.graph_steps == 0


@pytest.mark.gpu
def test_graph_draft_guesses_like_the_eager_draft():
    draft = l3.load(l3.course_model_dir("draft"), device="cuda", dtype="float32")
    eager = _rounds(draft, DraftModelProposer(draft.net, 1, 128, lean=False))
    graphed = DraftModelProposer(draft.net, 1, 128, cuda_graph=True)
    assert _rounds(draft, graphed) == eager
    # every step but the prompt's; a round's catch-up of 1 token (after a rejection) or 2
    # (after a full accept) is fed as graph steps too: 3 + (1+3) + (2+3) + (1+3) + (2+3)
    assert graphed.graph_steps == 3 + 4 + 5 + 4 + 5 and graphed.lean_steps == 0
    assert graphed.graph_error is None  # the lean step's graph was captured


@pytest.mark.gpu
def test_greedy_speculation_with_graph_draft_equals_plain_greedy():
    target = l3.load(l3.course_model_dir("target"), device="cuda", dtype="float32")
    draft = l3.load(l3.course_model_dir("draft"), device="cuda", dtype="float32")
    params = l3.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = target.generate_outputs([PROMPT], params)[0].token_ids
    for k in (2, 4):
        assert SpeculativeDecoder(target, draft, k).generate([PROMPT], params)[0].token_ids == ref


@pytest.mark.gpu
def test_lean_graph_step_matches_the_serving_forward():
    """LeanGraphStep (the draft's captured lean step) against layer 3's forward, 3 rows at
    different positions, the cache's unwritten slots full of garbage; then the eager lean
    step on rows out of order."""
    import torch

    from layer4_algorithms.spec.draft_step import LeanDecodeStep, LeanGraphStep

    draft = l3.load(l3.course_model_dir("draft"), device="cuda", dtype="float32")
    caches = [l3.ContiguousKVCache.for_model(draft.config, 3, 64, dtype=torch.float32,
                                             device="cuda") for _ in "ab"]
    caches[0].k.normal_()  # the same garbage in both caches' unwritten slots
    caches[0].v.normal_()
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    graph = LeanGraphStep(LeanDecodeStep(draft.net, caches[1]), 3)
    with torch.inference_mode():
        for pos in ([0, 9, 3], [1, 10, 4], [2, 11, 63]):
            ids = torch.tensor([5, 77, 4000], device="cuda")
            ref = draft.net(ids, caches[0].context([1] * 3, pos), caches[0], last_only=True)
            out = graph.step(ids, torch.tensor(pos, device="cuda"))
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        # the eager lean step on the GPU (the engine's draft: rows in any order)
        ids = torch.tensor([9, 1234], device="cuda")
        ref = draft.net(ids, caches[0].context([1, 1], [12, 3], rows=[1, 0]), caches[0],
                        last_only=True)
        out = graph.lean.step(ids, [1, 0], [12, 3])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
