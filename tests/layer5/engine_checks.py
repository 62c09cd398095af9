"""What the layer-5 tests share: a tiny random Llama, and checks that a parallel engine's
greedy tokens equal the single-process engine's, or differ first where the reference's top
two logits nearly tie (a different reduction order may flip such a choice; nothing else
may); and per-rank results that must match their unsharded references."""
from __future__ import annotations

import math

import torch

import layer5_parallel as l5

NEAR_TIE = 1e-3  # fp32 logits: sums in another order move them by ~1e-6; a real bug by far more


def assert_same_or_near_tie_at(ref_llm, prompt_ids: list[int], want: list[int], got: list[int],
                               label: str, lowest: float = 0.0) -> None:
    """want (the reference's greedy tokens) == got, or the first token where they differ was
    a near-tie for the reference: its logit margin there is in [lowest, NEAR_TIE) (the GPU
    tests accept any margin below NEAR_TIE: TF32 recomputed logits may reorder a tie)."""
    if want == got:
        return
    j = next(k for k in range(len(want)) if want[k] != got[k])
    last = ref_llm.prompt_logits([prompt_ids + want[:j]])[0][-1]
    margin = float(last[want[j]] - last[got[j]])
    assert lowest <= margin < NEAR_TIE, (f"{label} token {j}: {got[j]} instead of {want[j]}, "
                                    f"logit margin {margin:.2e} (not a near-tie)")


def assert_all_same_or_near_tie(ref: dict, got: dict, lowest: float = 0.0) -> None:
    """Per prompt (ref["ids"][i]): got["tokens"][i] == ref["tokens"][i], or near-tie as above;
    ref["llm"] is the reference engine."""
    for i, (want, tokens) in enumerate(zip(ref["tokens"], got["tokens"], strict=True)):
        assert_same_or_near_tie_at(ref["llm"], ref["ids"][i], want, tokens, f"prompt {i}", lowest)


def assert_prompts_same_or_near_tie(ref_llm, prompts: list[str], want: list[list[int]],
                                    got: list[list[int]]) -> None:
    """The GPU tests' form: text prompts (encoded by the reference's model), one completion
    each, any margin below NEAR_TIE accepted."""
    ids = [ref_llm.model.encode(p) for p in prompts]
    assert_all_same_or_near_tie({"llm": ref_llm, "ids": ids, "tokens": want}, {"tokens": got},
                                lowest=-math.inf)


def assert_ranks_match(rank_checks, world: int, seed: int) -> None:
    """rank_checks(seed) on `world` gloo ranks (layer 2's launch); each rank returns
    [(case, {name: (got, want)})] and every got must be close to its want."""
    reports = l5.engine.executor.comm.launch(rank_checks, world, seed, backend="gloo",
                                             timeout_s=60)
    for rank, report in enumerate(reports):
        for case, pairs in report:
            for name, (got, want) in pairs.items():
                where = f"{name}: rank {rank}/{world}, case {case}, seed {seed}"
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=where)


def tiny_model(layers: int) -> l5.engine.executor.Model:
    """A random Llama small enough that a fault test's ranks start in seconds: 4 heads over 2
    KV heads (a tensor-parallel split of 2 still shares KV heads), vocabulary 97."""
    l3 = l5.engine.executor
    config = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=40,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, max_position_embeddings=64)
    return l3.Model(l3.random_model(config, seed=2))
