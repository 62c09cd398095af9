"""Lab 3 grader: RMSNorm, RoPE, GQA attention with a KV cache and a top-p sampler, each
against layer3_model on fresh random inputs, then all of them together as the course model.

Graded through the `impl` fixture (tests/labs/conftest.py): a student's exercises.py under
`stack grade --lab 3`; under plain pytest the layer3_model package, whose implementations the
lab's simpler signatures reach through labs/lab3_model/lab3_reference.py (the `ex` fixture
makes that switch). Everything runs on the CPU, in fp32 unless a test says otherwise.

* Unit tests compare with the reference on random shapes, dtypes, positions and cache
  states drawn afresh every run (the seed is in the failure message), and check what the
  reference guarantees besides the numbers: the output dtype, inputs left unchanged, the
  cache written in place and never read past the new tokens (those rows hold NaN).
* Two library calls would skip the point of an exercise, so they raise while graded code
  runs: F.rms_norm / torch.rms_norm (nn.RMSNorm goes through F.rms_norm), and
  F.scaled_dot_product_attention. A TorchFunctionMode sees every call to them, however
  they were imported; a dispatch mode also sees the attention kernels called directly.
* The course-model tests plug the student's rms_norm, apply_rope and gqa_attention into
  labs/lab3_model/lab3_forward.py, a plain-torch forward of the shipped course model, and
  compare its logits with layer3_model's for a real prompt: a prefill, a prefill in chunks
  and decode steps through the KV cache; then greedy text through top_p_sample.
"""
from __future__ import annotations

import ast
import importlib.util
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

REFERENCE = "layer3_model"
# The per-test limit (`stack grade --timeout`, 30 s) catches hangs; the course-model tests run
# a real model for seconds idle and ~40 s on a loaded 2-core machine, so they get this one.
HEAVY_TIMEOUT_S = 240

LAB_DIR = Path(__file__).resolve().parents[2] / "labs" / "lab3_model"
ANSWERS = "lab3_reference"  # the layer's code behind the lab's signatures
seeds = random.SystemRandom()  # fresh inputs every run: an answer must be right for any input
PROMPTS = (
    "What news, my lord?",
    "Good morrow, sweet Hamlet. How fares your father?",
    "I pray you, sir, what hour is it?",
    "Is it not strange that desire should so many years outlive performance?",
    "Speak, fair lady: where is the king?",
    "Now is the winter of our discontent made glorious summer.",
)


# ---------------------------------------------------------------- loading
def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, LAB_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.fixture(scope="module")
def ref() -> ModuleType:
    return _load(ANSWERS)


@pytest.fixture(scope="module")
def ex(impl: ModuleType, ref: ModuleType) -> ModuleType:
    """What is graded: the submission, or (for the layer package) the layer's answers."""
    if impl.__name__ == REFERENCE:
        return ref
    if ANSWERS in _imports_of(Path(impl.__file__)):
        pytest.fail(f"{Path(impl.__file__).name} imports {ANSWERS}, the answer key: write your own")
    return impl


@pytest.fixture(scope="module")
def lf() -> ModuleType:
    return _load("lab3_forward")


@pytest.fixture(scope="module")
def course(lf: ModuleType):
    return lf.load_course_model()


# ---------------------------------------------------------------- the shortcut guard
class ShortcutError(AssertionError):
    """The graded function called the library version of what it should compute."""


_REFUSED = {
    "rms_norm": "F.rms_norm / torch.rms_norm / nn.RMSNorm does exercise 1 for you: write the "
                "normalisation out",
    "scaled_dot_product_attention": "F.scaled_dot_product_attention does exercise 3 for you: "
                                    "compute the scores, the mask and the softmax yourself",
}


class _NoLibraryCalls(TorchFunctionMode):
    """Sees every torch-level call, however it was imported or spelled."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _REFUSED:
            raise ShortcutError(_REFUSED[name])
        return func(*args, **(kwargs or {}))


class _NoFusedAttention(TorchDispatchMode):
    """Sees the attention kernels themselves (torch.ops.aten._scaled_dot_product_*)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.overloadpacket.__name__:
            raise ShortcutError(_REFUSED["scaled_dot_product_attention"])
        return func(*args, **(kwargs or {}))


@contextmanager
def no_shortcuts() -> Iterator[None]:
    with _NoLibraryCalls(), _NoFusedAttention():
        yield


def graded(ex: ModuleType, name: str, /, *args, **kwargs):
    """ex.<name>(*args, **kwargs) under the shortcut guard (the sampler has none to take)."""
    with torch.no_grad():
        if name.startswith("top_p"):
            return getattr(ex, name)(*args, **kwargs)
        with no_shortcuts():
            return getattr(ex, name)(*args, **kwargs)


# ---------------------------------------------------------------- helpers
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _check(got: object, want: torch.Tensor, what: str, *, atol: float, rtol: float) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: returned {type(got).__name__}, not a tensor"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    g, w = got.double(), want.double()
    assert torch.isfinite(g).all(), f"{what}: the output has NaN or inf where the answer has none"
    err = (g - w).abs()
    bad = err > atol + rtol * w.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {w.numel()} values wrong, max error "
                           f"{err.max().item():.3g} (allowed {atol:g} + {rtol:g} * |expected|)")


# ---------------------------------------------------------------- exercise 1: RMSNorm
@pytest.mark.points(10)
def test_rms_norm(ex, ref):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    shapes = [(rng.randint(1, 9), rng.choice([7, 64, 384])), (rng.randint(1, 3), rng.randint(1, 5), 1000),
              (1, 1), (rng.randint(2, 6), 2048)]
    for shape in shapes:
        H = shape[-1]
        x = _randn(gen, *shape, scale=10 ** rng.uniform(-2, 2))
        w = _randn(gen, H)
        eps = rng.choice([1e-5, 1e-6, 1e-2])
        before = x.clone()
        got = graded(ex, "rms_norm", x, w, eps)
        what = f"rms_norm(x {tuple(shape)}, eps={eps}) [seed {seed}]"
        _check(got, ref.rms_norm(x, w, eps), what, atol=1e-5, rtol=1e-4)
        assert torch.equal(x, before), f"{what}: changed its input x"
    x = torch.zeros(3, 16)  # all zeros: eps keeps the answer finite (zero)
    _check(graded(ex, "rms_norm", x, torch.ones(16), 1e-5), torch.zeros(3, 16), "rms_norm of zeros",
           atol=0, rtol=0)


@pytest.mark.points(5)
def test_rms_norm_low_precision(ex, ref):
    seed = seeds.randrange(2**31)
    gen = _gen(seed)
    for dtype, scale in ((torch.bfloat16, 3.0), (torch.float16, 400.0)):
        # fp16 at |x| ~ 400: x**2 overflows fp16 (max 65504); the statistics must be fp32.
        x = _randn(gen, 5, 384, scale=scale, dtype=dtype)
        w = _randn(gen, 384, dtype=dtype)
        what = f"rms_norm(x {dtype}, |x| ~ {scale:g}) [seed {seed}]"
        _check(graded(ex, "rms_norm", x, w, 1e-5), ref.rms_norm(x, w, 1e-5), what, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- exercise 2: RoPE
@pytest.mark.points(10)
def test_apply_rope(ex, ref):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    cases = [(rng.randint(1, 12), rng.randint(1, 6), D, theta)
             for D, theta in ((8, 10000.0), (64, 10000.0), (64, 500000.0), (128, rng.uniform(100, 1e6)),
                              (32, rng.uniform(100, 1e6)))]
    for T, heads, D, theta in cases:
        x = _randn(gen, T, heads, D)
        positions = torch.tensor([rng.randrange(2048) for _ in range(T)])
        before = x.clone()
        got = graded(ex, "apply_rope", x, positions, theta)
        what = f"apply_rope(x {(T, heads, D)}, positions {positions.tolist()}, theta={theta:g}) [seed {seed}]"
        _check(got, ref.apply_rope(x, positions, theta), what, atol=1e-3, rtol=1e-3)
        assert torch.equal(x, before), f"{what}: changed its input x"
    x = _randn(gen, 4, 2, 64, dtype=torch.bfloat16)
    positions = torch.arange(100, 104)
    _check(graded(ex, "apply_rope", x, positions, 10000.0), ref.apply_rope(x, positions, 10000.0),
           f"apply_rope(bf16 x) [seed {seed}]", atol=3e-2, rtol=3e-2)


@pytest.mark.points(5)
def test_apply_rope_rotates_by_relative_position(ex):
    """What RoPE is for, checked without the reference: a rotation (norms kept), the identity
    at position 0, and q.k depending only on the distance between the two positions."""
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    q, k = _randn(gen, 1, 4, 64), _randn(gen, 1, 4, 64)

    def rope(x, pos):
        return graded(ex, "apply_rope", x, torch.tensor([pos]), 10000.0)

    _check(rope(q, 0), q, f"apply_rope at position 0 (must change nothing) [seed {seed}]", atol=1e-6, rtol=0)
    m, n, shift = rng.randrange(500), rng.randrange(500), rng.randrange(1, 1000)
    rq = rope(q, m)
    _check(rq.norm(dim=-1), q.norm(dim=-1), f"|apply_rope(q)| (a rotation keeps norms) [seed {seed}]",
           atol=1e-4, rtol=1e-4)
    dots = (rq * rope(k, n)).sum(-1)
    shifted = (rope(q, m + shift) * rope(k, n + shift)).sum(-1)
    _check(shifted, dots, f"q.k at positions ({m}+{shift}, {n}+{shift}) vs ({m}, {n}): must depend on "
           f"m - n only [seed {seed}]", atol=2e-3, rtol=1e-3)


# ---------------------------------------------------------------- exercise 3: attention
def _attention_case(ex, ref, gen, *, T: int, start: int, Hq: int, Hkv: int, D: int,
                    scale: float | None, what: str) -> None:
    max_len = start + T + 3
    k_cache = torch.full((max_len, Hkv, D), float("nan"))  # rows past the new tokens: never read
    v_cache = torch.full((max_len, Hkv, D), float("nan"))
    k_cache[:start], v_cache[:start] = _randn(gen, start, Hkv, D), _randn(gen, start, Hkv, D)
    q, k, v = _randn(gen, T, Hq, D), _randn(gen, T, Hkv, D), _randn(gen, T, Hkv, D)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = ref.gqa_attention(q, k, v, want_k, want_v, start, scale)
    got = graded(ex, "gqa_attention", q, k, v, k_cache, v_cache, start, scale)
    what = f"{what}: gqa_attention(T={T}, start={start}, Hq={Hq}, Hkv={Hkv}, D={D}, scale={scale})"
    _check(got, want, what, atol=1e-4, rtol=1e-4)
    n = start + T
    assert torch.equal(k_cache[:n], want_k[:n]) and torch.equal(v_cache[:n], want_v[:n]), (
        f"{what}: the cache must keep rows 0..{start - 1} and hold the new k, v in rows "
        f"{start}..{n - 1} afterwards (write into k_cache / v_cache in place)")


@pytest.mark.points(10)
def test_gqa_attention_prefill(ex, ref):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    for Hq, Hkv in ((4, 4), (6, 2), (8, 1), (6, 3)):  # multi-head, GQA, multi-query
        D = rng.choice([16, 64])
        scale = rng.choice([None, rng.uniform(0.05, 0.5)])
        _attention_case(ex, ref, gen, T=rng.randint(1, 16), start=0, Hq=Hq, Hkv=Hkv, D=D, scale=scale,
                        what=f"prefill [seed {seed}]")


@pytest.mark.points(10)
def test_gqa_attention_decode_with_cache(ex, ref):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    for Hq, Hkv in ((6, 2), (4, 4), (8, 1)):
        start = rng.randint(1, 40)
        for step in range(3):  # consecutive decode steps, one token each
            _attention_case(ex, ref, gen, T=1, start=start + step, Hq=Hq, Hkv=Hkv, D=64, scale=None,
                            what=f"decode step {step} [seed {seed}]")


@pytest.mark.points(5)
def test_gqa_attention_chunk_after_a_cached_prefix(ex, ref):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    for Hq, Hkv in ((6, 2), (4, 1)):
        _attention_case(ex, ref, gen, T=rng.randint(2, 8), start=rng.randint(3, 20), Hq=Hq, Hkv=Hkv,
                        D=32, scale=None, what=f"chunked prefill [seed {seed}]")


# ---------------------------------------------------------------- exercise 4: the sampler
@pytest.mark.points(10)
def test_top_p_filter(ex, ref):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    for shape in ((rng.randint(1, 5), rng.choice([2, 10, 1000])), (4096,), (2, 3, 50)):
        logits = _randn(gen, *shape, scale=10 ** rng.uniform(-1, 1))
        for p in (0.1, 0.5, 0.9, 0.99, rng.uniform(0.05, 0.95)):
            before = logits.clone()
            got = graded(ex, "top_p_filter", logits, p)
            want = ref.top_p_filter(logits, p)
            what = f"top_p_filter(logits {tuple(shape)}, p={p:.4g}) [seed {seed}]"
            assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype, (
                f"{what}: expected a {want.dtype} tensor of shape {tuple(want.shape)}")
            assert torch.equal(logits, before), f"{what}: changed its input logits"
            kept, want_kept = torch.isfinite(got), torch.isfinite(want)
            differ = kept != want_kept
            probs = torch.softmax(logits.double(), dim=-1).reshape(-1, shape[-1])
            for r, j in differ.reshape(-1, shape[-1]).nonzero().tolist():
                # tolerated only where the mass ranked above the token is p, to rounding
                above = probs[r][probs[r] > probs[r, j]].sum().item()
                assert abs(above - p) < 1e-5, (
                    f"{what}: keeps {int(kept.sum())} tokens where the answer keeps {int(want_kept.sum())}")
            same = kept & want_kept
            assert torch.equal(got[same], want[same]), f"{what}: changed the logits it keeps"
            assert (got[~kept] == float("-inf")).all(), f"{what}: dropped tokens must be -inf"
    logits = _randn(gen, 3, 100)
    assert torch.equal(graded(ex, "top_p_filter", logits, 1.0), logits), "top_p_filter(p=1) must keep all"
    only = graded(ex, "top_p_filter", logits, 1e-6)
    assert (torch.isfinite(only).sum(-1) == 1).all() and torch.equal(
        only.argmax(-1), logits.argmax(-1)), "top_p_filter(p=1e-6) must keep exactly the most likely token"


def _frequencies(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


@pytest.mark.timeout(HEAVY_TIMEOUT_S)
@pytest.mark.points(10)
def test_top_p_sample(ex):
    seed = seeds.randrange(2**31)
    rng, gen = random.Random(seed), _gen(seed)
    logits = _randn(gen, 7, 300, scale=3)
    greedy = graded(ex, "top_p_sample", logits, 0.9, 0.0, _gen(1))
    assert isinstance(greedy, torch.Tensor) and greedy.dtype == torch.int64 and greedy.shape == (7,), (
        f"top_p_sample must return (B,) int64 token ids, got {greedy!r}")
    assert torch.equal(greedy, logits.argmax(-1)), "temperature 0 must pick each row's argmax"

    # One distribution, many rows: each row is one draw. Probabilities in a random order.
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005], dtype=torch.float64)
    order = torch.randperm(8, generator=gen)
    row = probs[order].log().float()
    N = 6000
    batch = row.expand(N, 8).contiguous()
    tolerance = 5 * math.sqrt(0.25 / N)  # five standard deviations of a frequency, at worst

    def expect(p: float, temperature: float) -> torch.Tensor:
        sharp = probs ** (1 / temperature)
        sharp = sharp / sharp.sum()
        keep = (sharp.cumsum(0) - sharp) < p  # probs are sorted: the nucleus is a prefix
        out = torch.where(keep, sharp, 0.0)
        return (out / out.sum())[order]  # in vocabulary order, as the row

    for p, temperature in ((0.75, 1.0), (1.0, 1.0), (0.9, 0.5), (0.5, 2.0)):
        draw_seed = rng.randrange(2**31)
        tokens = graded(ex, "top_p_sample", batch, p, temperature, _gen(draw_seed))
        what = f"top_p_sample(p={p}, temperature={temperature}) over {N} rows [seed {seed}]"
        assert tokens.shape == (N,) and tokens.dtype == torch.int64, f"{what}: expected ({N},) int64"
        want = expect(p, temperature)
        outside = (want[tokens] == 0).sum().item()
        assert outside == 0, f"{what}: drew {outside} tokens outside the nucleus"
        freq = _frequencies(tokens, 8)
        assert (freq - want).abs().max() < tolerance, (
            f"{what}: token frequencies {freq.numpy().round(3)} vs probabilities {want.numpy().round(3)}")
        again = graded(ex, "top_p_sample", batch, p, temperature, _gen(draw_seed))
        assert torch.equal(tokens, again), f"{what}: the same seeded generator must give the same tokens"


# ---------------------------------------------------------------- the course model
@pytest.fixture
def prompt(course) -> tuple[int, random.Random, list[int]]:
    """A fresh seed (named in failures), the random stream it seeds, and a chat prompt drawn
    from PROMPTS with it, as token ids."""
    seed = seeds.randrange(2**31)
    rng = random.Random(seed)
    return seed, rng, course.tokenizer.encode_chat([{"role": "user", "content": rng.choice(PROMPTS)}])


def _caches(lf, course, max_len: int):
    import layer3_model as l3

    return lf.new_cache(course.config, max_len), l3.ContiguousKVCache.for_model(
        course.config, 1, max_len, dtype=torch.float32)


@pytest.mark.timeout(HEAVY_TIMEOUT_S)
@pytest.mark.points(10)
def test_course_model_prefill_logits(ex, lf, course, prompt):
    seed, _, ids = prompt
    ids = torch.tensor(ids)
    mine, theirs = _caches(lf, course, len(ids) + 1)
    with no_shortcuts():
        got = lf.forward(ex, course.net, ids, 0, mine)
    want = lf.layer3_forward(course.net, ids, 0, theirs)
    _check(got, want, f"course-model logits for a {len(ids)}-token prompt [seed {seed}]", atol=2e-3, rtol=1e-4)


@pytest.mark.timeout(HEAVY_TIMEOUT_S)
@pytest.mark.points(10)
def test_course_model_decode_steps(ex, lf, course, prompt):
    seed, rng, ids = prompt
    steps = 8
    mine, theirs = _caches(lf, course, len(ids) + steps)
    with no_shortcuts():
        lf.forward(ex, course.net, torch.tensor(ids), 0, mine)
    want = lf.layer3_forward(course.net, torch.tensor(ids), 0, theirs)
    for step in range(steps):
        token = rng.choice(want[-1].topk(5).indices.tolist())  # a likely next token
        start = len(ids) + step
        with no_shortcuts():
            got = lf.forward(ex, course.net, torch.tensor([token]), start, mine)
        want = lf.layer3_forward(course.net, torch.tensor([token]), start, theirs)
        _check(got, want, f"course-model logits at decode step {step} (position {start}) [seed {seed}]",
               atol=2e-3, rtol=1e-4)


@pytest.mark.timeout(HEAVY_TIMEOUT_S)
@pytest.mark.points(5)
def test_course_model_chunked_prefill_and_greedy_text(ex, lf, course, prompt):
    seed, rng, ids = prompt
    mine, theirs = _caches(lf, course, len(ids))
    want = lf.layer3_forward(course.net, torch.tensor(ids), 0, theirs)
    start = 0
    while start < len(ids):
        n = min(rng.randint(1, 6), len(ids) - start)
        with no_shortcuts():
            got = lf.forward(ex, course.net, torch.tensor(ids[start:start + n]), start, mine)
        _check(got, want[start:start + n], f"course-model logits of the chunk at {start}..{start + n - 1}, "
               f"after {start} cached tokens [seed {seed}]", atol=2e-3, rtol=1e-4)
        start += n

    import layer3_model as l3

    new = 24
    with no_shortcuts():
        tokens, _ = lf.generate(ex, course, ids, new, temperature=0.0, stop=None)
    expected = course.generate_outputs(ids, l3.SamplingParams(temperature=0.0, max_tokens=new))[0].token_ids
    assert tokens == expected, (f"greedy generation from your pieces: {course.tokenizer.decode(tokens)!r}; "
                                f"layer3_model: {course.tokenizer.decode(expected)!r} [seed {seed}]")
