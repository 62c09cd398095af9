"""The GEMV that receives the all-reduce in its prologue (layer 2's gemv_receive.py: gate_up's
norm GEMV and the qkv GEMV with RoPE and the cache write), run on the CPU through Triton's
interpreter: W simulated ranks in one process, each a stand-in for a PeerAllReduce (its LL
region, counters, sync words and status word in plain CPU memory every "rank" addresses
directly) running the class's own host code (gemv_all_reduce with defer, PendingSum).

The ranks run one after another: every rank's sending GEMV, then every rank's receiving GEMV,
whose programs run in order: the first draws every chunk's ticket and receives them all (the
chunks made small here: several tickets, a ragged last chunk), the others find none left and
the flag set.
Against the same chain unfused (the receive kernel, then layer 1's GEMV) on a second set of
ranks: the same bits (sum, y, h, cache rows). The PTX-only helpers (8-byte volatile store,
release stores, acquire wait, %globaltimer) are plain stores, no-ops and a zero clock here; the
PTX is compiled, not run, in test_gemv_receive_compile.py, and runs in the multigpu tests.
"""
from __future__ import annotations

import pytest
import torch

from layer1_kernels import interpreter  # noqa: F401  (first: TRITON_INTERPRET on a CPU)

# isort: split
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the multigpu tests run the real kernels")

BLOCKS, WARPS, SLOT_WORDS, EPS = 4, 1, 512, 1e-5
CHUNK = 4  # words a ticket receives here (a GPU: two a thread)


@triton.jit
def _store(ptrs, values, mask):
    tl.store(ptrs, values, mask=mask)


@triton.jit
def _clock(dummy):
    return dummy.to(tl.int64) * 0


@triton.jit
def _release(addrs, value):
    tl.store(addrs, value)


@triton.jit
def _no_wait(addr, value, timeout_ns, status_addr, code):
    pass


@pytest.fixture
def R(monkeypatch):
    """The stand-in rank class, the PTX-only helpers replaced (looked up at call time)."""
    from layer2_comm import gemv_receive, gemv_send, peer_kernels
    from layer2_comm.peer_all_reduce import PeerAllReduce

    if type(gemv_receive.norm_gemv_receive_kernel).__name__ != "InterpretedFunction":
        pytest.skip("needs Triton's interpreter")
    monkeypatch.setattr(gemv_send, "_store_volatile", _store)
    monkeypatch.setattr(peer_kernels, "_globaltimer", _clock)
    monkeypatch.setattr(gemv_receive, "_globaltimer", _clock)
    monkeypatch.setattr(gemv_receive, "_release", _release)
    monkeypatch.setattr(gemv_receive, "_wait", _no_wait)
    monkeypatch.setattr(gemv_receive, "chunk_words", lambda threads: CHUNK)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch

    class Rank:
        """What PeerAllReduce's host code of the fused path reads, on the CPU."""
        LL_MAX_BYTES = PeerAllReduce.LL_MAX_BYTES
        gemv_all_reduce = PeerAllReduce.gemv_all_reduce
        sends_from_gemv = PeerAllReduce.sends_from_gemv
        _receive_launch = PeerAllReduce._receive_launch
        _receive_args = PeerAllReduce._receive_args
        _after_receive = PeerAllReduce._after_receive
        _settle = PeerAllReduce._settle
        _usable = PeerAllReduce._usable

        def __init__(self, rank, world, lls, receive):
            self.rank, self.world, self._lls = rank, world, lls
            self.device, self.blocks, self.num_warps = torch.device("cpu"), BLOCKS, WARPS
            self.timeout_s, self.debug, self._ll_slot_words = 0.0, False, SLOT_WORDS
            self.gemv_send, self.gemv_receive = True, receive
            self._state = torch.zeros(2 * BLOCKS, dtype=torch.int32)
            self._sync = torch.zeros(gemv_send.SYNC_INTS, dtype=torch.int32)
            self._status = torch.zeros(1, dtype=torch.int32)
            self._status_np = self._status.numpy()
            self._closed, self._broken, self._pending = False, None, None

        def _pdl(self):
            return {}

        def __call__(self, x):  # only to settle: nothing else runs here
            self._settle()
            raise AssertionError("no other collective in these tests")

    return Rank


def _world(R, world: int, receive: bool):
    lls = tuple(torch.zeros(2 * world * SLOT_WORDS, dtype=torch.int64) for _ in range(world))
    return [R(r, world, lls, receive) for r in range(world)]


def _rand(g, *shape, scale=1.0, dtype=torch.float16):
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def _sent(ranks, xs, ws, silu):
    """Every rank's sending GEMV (defer): PendingSums where the ranks receive in the GEMV."""
    return [ranks[r].gemv_all_reduce(xs[r], ws[r], silu, defer=True) for r in range(len(ranks))]


def _rope_inputs(g, dtype, nq=2, nkv=1, d=8, slots=6):
    cos = _rand(g, 16, d // 2, dtype=torch.float32).to(dtype)
    sin = _rand(g, 16, d // 2, dtype=torch.float32).to(dtype)
    return dict(cos=cos, sin=sin, positions=torch.tensor([5]), slots=torch.tensor([3]),
                k_cache=torch.zeros(slots, nkv, d, dtype=dtype),
                v_cache=torch.zeros(slots, nkv, d, dtype=dtype), heads=(nq, nkv, d))


def _norm_gemv(x, w, nw, res, rope):
    """The consumer of a sum x (a PendingSum or a tensor): the fused or layer 1's GEMV."""
    import layer1_kernels as kernels

    if rope is None:
        if not isinstance(x, torch.Tensor):
            return x.norm_gemv(w, nw, EPS, res)
        return kernels.gemv_rms_norm(x, w, nw, EPS, res, impl="triton")
    args = (rope["cos"], rope["sin"], rope["positions"], rope["k_cache"], rope["v_cache"],
            rope["slots"], *rope["heads"])
    if not isinstance(x, torch.Tensor):
        return x.norm_gemv_rope(w, nw, EPS, res, None, *args)
    return kernels.gemv_rms_norm_rope(x, w, nw, EPS, res, None, *args, impl="triton")


def _assert_received(sync, epoch, nwords, where):
    """The sync words after a receiving GEMV: its epoch, every chunk done, every ticket drawn
    (and one more at least: the taker's last try), the epoch in every copy of the flag."""
    from layer2_comm import gemv_send

    chunks, n = -(-nwords // CHUNK), gemv_send.READY_COPIES.value
    assert int(sync[gemv_send.EPOCH.value]) == epoch, where
    assert int(sync[gemv_send.DONE.value]) == chunks, where
    assert int(sync[gemv_send.TICKET.value]) > chunks, where
    assert sync[gemv_send.READY.value:][::32][:n].tolist() == [epoch] * n, where


@pytest.mark.parametrize("world", [2, 3])
def test_received_in_the_gemv_equals_receive_then_gemv(R, world):
    """Calls in a row, gate_up-like (norm GEMV) and qkv-like (RoPE + cache write) receivers,
    sent by both prologues, a plain receive between: the fused ranks' y, h and cache rows are
    the unfused ranks' bits; every block's counter advances once a call, the sync words hold
    the call's epoch, and the packets went into the call's half."""
    fused, plain = _world(R, world, True), _world(R, world, True)
    # (sender N = receiver K, sender K, silu, receiver: norm N' or "rope", dtype)
    plan = [(32, 16, False, 24, torch.float16), (32, 32, True, "rope", torch.float16),
            (64, 16, True, 40, torch.bfloat16), (32, 16, False, None, torch.float16),
            (36, 48, True, "rope", torch.bfloat16), (44, 16, False, 8, torch.float16)]
    for call, (n, k, silu, recv, dtype) in enumerate(plan):
        g = torch.Generator().manual_seed(call)
        xs = [_rand(g, 1, 2 * k if silu else k, dtype=dtype) for _ in range(world)]
        ws = [_rand(g, n, k, scale=0.1, dtype=dtype) for _ in range(world)]
        res = _rand(g, 1, n, dtype=dtype)  # the residual stream: the same on every rank
        nw = 1 + _rand(g, n, scale=0.1, dtype=dtype)
        rope = _rope_inputs(g, dtype) if recv == "rope" else None
        nout = 32 if recv == "rope" else recv
        wr = _rand(g, nout or 1, n, scale=0.1, dtype=dtype)
        pend = _sent(fused, xs, ws, silu)
        assert all(not isinstance(p, torch.Tensor) for p in pend)
        # unfused: every rank's send, then every rank's receive kernel (PendingSum.receive)
        sums = [s.receive() for s in _sent(plain, xs, ws, silu)]
        for r in range(world):
            where = f"call {call} rank {r}"
            if recv is None:  # a plain receive (the lm_head's): PendingSum.receive()
                got = pend[r].receive()
                assert torch.equal(got, sums[r]), f"{where}: receive() differs"
            else:
                rope_f = rope if rope is None else {**rope, "k_cache": rope["k_cache"].clone(),
                                                   "v_cache": rope["v_cache"].clone()}
                y, h = _norm_gemv(pend[r], wr, nw, res, rope_f)
                want_y, want_h = _norm_gemv(sums[r], wr, nw, res, rope)
                assert torch.equal(h, want_h), f"{where}: h (the new residual) differs"
                assert torch.equal(y, want_y), f"{where}: y differs"
                if rope is not None:
                    assert torch.equal(rope_f["k_cache"], rope["k_cache"]), f"{where}: k cache"
                    assert torch.equal(rope_f["v_cache"], rope["v_cache"]), f"{where}: v cache"
                    rope["k_cache"].zero_(), rope["v_cache"].zero_()
                assert pend[r].taken and fused[r]._pending is None
            assert int(fused[r]._status[0]) == 0, f"{where}: peer {int(fused[r]._status[0]) - 1}"
            assert fused[r]._state[0::2].tolist() == [call + 1] * BLOCKS, where
            assert fused[r]._state.tolist() == plain[r]._state.tolist(), where
            if recv is not None:
                _assert_received(fused[r]._sync, call + 1, n // 2, where)
            p = (r + 1) % world
            half = (call % 2) * world * SLOT_WORDS
            packets = fused[0]._lls[p][half + r * SLOT_WORDS:][:n // 2]
            assert ((packets >> 32) == call + 1).all(), where


def test_a_pending_sum_is_settled_before_the_next_send(R):
    """A sum nobody took: the rank's next gemv_all_reduce receives it first (the receive
    kernel), so the counters stay in order and both sums are right; a settled sum answers
    receive() with the same tensor, and no GEMV takes it any more."""
    ranks, plain = _world(R, 2, True), _world(R, 2, True)
    g = torch.Generator().manual_seed(5)
    pend, sums = [], []
    for _ in range(2):
        xs = [_rand(g, 1, 16) for _ in range(2)]
        ws = [_rand(g, 32, 16, scale=0.1) for _ in range(2)]
        pend.append(_sent(ranks, xs, ws, False))
        sums.append([s.receive() for s in _sent(plain, xs, ws, False)])
    for r in range(2):
        assert pend[0][r].taken and ranks[r]._pending is pend[1][r]
        assert ranks[r]._state[0::2].tolist() == [1] * BLOCKS  # call 0 received, 1 pending
        wr, res, nw = _rand(g, 8, 32), _rand(g, 1, 32), 1 + _rand(g, 32, scale=0.1)
        assert pend[0][r].norm_gemv(wr, nw, EPS, res) is None
        first = pend[0][r].receive()
        assert first is pend[0][r].receive() and torch.equal(first, sums[0][r])
        assert torch.equal(pend[1][r].receive(), sums[1][r])
        assert ranks[r]._state[0::2].tolist() == [2] * BLOCKS
        assert int(ranks[r]._status[0]) == 0


def test_a_peer_that_never_sent_is_reported(R):
    """Rank 1 skips its second GEMV: rank 0's receiving GEMV (the chunks' taker) finds no
    packet of that call in rank 1's slot and records code 2 (rank 1 + 1); every chunk is still
    counted and the flag released, so the other programs go on (nothing hangs) and the
    counters advance."""
    ranks = _world(R, 2, True)
    g = torch.Generator().manual_seed(7)
    for call in range(2):
        xs = [_rand(g, 1, 16) for _ in range(2)]
        ws = [_rand(g, 32, 16, scale=0.1) for _ in range(2)]
        who = range(2) if call == 0 else range(1)
        pend = [ranks[r].gemv_all_reduce(xs[r], ws[r], False, defer=True) for r in who]
        wr, res, nw = _rand(g, 8, 32), _rand(g, 1, 32), 1 + _rand(g, 32, scale=0.1)
        for r in who:
            assert _norm_gemv(pend[r], wr, nw, res, None) is not None
        assert int(ranks[0]._status[0]) == (0 if call == 0 else 2)
        _assert_received(ranks[0]._sync, call + 1, 16, f"call {call}")
        assert ranks[0]._state[0::2].tolist() == [call + 1] * BLOCKS


def test_what_the_fused_gemv_does_not_take_falls_back(R):
    """A bias, no residual, a width that does not match: norm_gemv says None (the caller
    receives and runs layer 1's GEMV); the sum stays pending until then."""
    ranks = _world(R, 2, True)
    g = torch.Generator().manual_seed(9)
    xs = [_rand(g, 1, 16) for _ in range(2)]
    ws = [_rand(g, 32, 16, scale=0.1) for _ in range(2)]
    pend = _sent(ranks, xs, ws, False)
    wr, res, nw = _rand(g, 8, 32), _rand(g, 1, 32), 1 + _rand(g, 32, scale=0.1)
    p = pend[0]
    assert p.shape == (1, 32) and p.dtype == torch.float16
    assert p.norm_gemv(wr, nw, EPS, None) is None
    assert p.norm_gemv(wr, nw, EPS, res, bias=torch.zeros(8, dtype=torch.float16)) is None
    assert p.norm_gemv(_rand(g, 8, 30), nw[:30], EPS, res[:, :30]) is None
    assert not p.taken and ranks[0]._pending is p
