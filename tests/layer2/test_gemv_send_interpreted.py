"""The GEMV that sends its outputs as LL packets (layer 2's gemv_send_kernel) and the receive
kernel that polls and sums (ll_receive_kernel), run on the CPU through Triton's interpreter:
W simulated ranks in one process, each with its own LL region, counters and status word, in
plain CPU memory that every "rank" addresses directly (as NVLink maps peers' memory).

The ranks run one after another: every rank's GEMV, then every rank's receive, so no receive
ever waits (the packets are there) and the timeout is 0: a packet with the wrong flag, slot or
half shows as a status code, wrong data as a wrong sum. The 8-byte volatile store and
%globaltimer are PTX the interpreter cannot run: here a plain store and a zero clock (the PTX
is compiled, not run, in test_gemv_send_compile.py; the real thing runs in the multigpu test).
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

BLOCKS, WARPS, SLOT_WORDS = 4, 1, 512


@triton.jit
def _store(ptrs, values, mask):
    tl.store(ptrs, values, mask=mask)


@triton.jit
def _clock(dummy):
    return dummy.to(tl.int64) * 0


@pytest.fixture
def K(monkeypatch):
    """(gemv_send, peer_kernels) with the PTX-only helpers replaced (looked up at call time)."""
    from layer2_comm import gemv_send, peer_kernels

    if type(peer_kernels.ll_receive_kernel).__name__ != "InterpretedFunction":
        pytest.skip("needs Triton's interpreter")
    monkeypatch.setattr(gemv_send, "_store_volatile", _store)
    monkeypatch.setattr(peer_kernels, "_globaltimer", _clock)
    return gemv_send, peer_kernels


class _Ranks:
    def __init__(self, world: int):
        self.world = world
        self.lls = tuple(torch.zeros(2 * world * SLOT_WORDS, dtype=torch.int64)
                         for _ in range(world))
        self.state = [torch.zeros(2 * BLOCKS, dtype=torch.int32) for _ in range(world)]
        self.status = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]

    def send(self, K, rank, x, w, silu):
        from layer1_kernels import GEMV_PARTS as P

        N, Kd = w.shape
        block_n, block_k, warps, stages = P.unpack(P.config_for(N, Kd, 1))
        block_n = max(2, block_n)
        y = torch.empty(1, 2 * (-(-N // 2)), dtype=x.dtype)
        K[0].gemv_send_kernel[(-(-N // block_n),)](
            x, w, y, N, w.stride(0), self.lls, self.state[rank], SLOT_WORDS, K=Kd,
            PROLOGUE=P.SILU if silu else P.NONE, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=Kd % block_k == 0, STAGES=stages, RANK=rank, WORLD=self.world, PDL=False,
            PDL_EARLY=False, num_warps=warps)
        return y

    def receive(self, K, rank, y):
        nwords = y.numel() // 2
        out = torch.empty_like(y)
        block = WARPS * 32 * 2
        K[1].ll_receive_kernel[(BLOCKS,)](
            y.view(torch.int32), out.view(torch.int32), nwords,
            max(1, min(BLOCKS, -(-nwords // block))), self.lls, self.state[rank],
            self.status[rank].data_ptr(), 0, SLOT_WORDS, RANK=rank, WORLD=self.world,
            BLOCK=block, KIND=2 if y.dtype == torch.bfloat16 else 1, num_warps=WARPS)
        return out


def _inputs(world, n, k, dtype, silu, salt):
    g = torch.Generator().manual_seed(salt)
    xs = [torch.randn(1, 2 * k if silu else k, generator=g).to(dtype) for _ in range(world)]
    ws = [(0.1 * torch.randn(n, k, generator=g)).to(dtype) for _ in range(world)]
    return xs, ws


@pytest.mark.parametrize("world", [2, 3])
def test_sent_outputs_sum_to_the_gemvs_all_reduced(K, world):
    """Calls in a row (both prologues, odd N, several blocks' words, both dtypes): every rank's
    y has gemv's bits, every rank's sum is the fp32 sum in rank order of those, the counters
    advance on every block and the halves alternate."""
    import layer1_kernels as kernels

    ranks = _Ranks(world)
    plan = [(7, 32, torch.float16, False), (130, 32, torch.bfloat16, True),
            (300, 16, torch.float16, False), (9, 32, torch.bfloat16, True),
            (64, 48, torch.bfloat16, False)]
    for call, (n, k, dtype, silu) in enumerate(plan):
        xs, ws = _inputs(world, n, k, dtype, silu, call)
        ys = [ranks.send(K, r, xs[r], ws[r], silu) for r in range(world)]
        outs = [ranks.receive(K, r, ys[r]) for r in range(world)]
        gemv = kernels.gemv_silu_mul if silu else kernels.gemv
        want_y = [gemv(xs[r], ws[r], impl="triton") for r in range(world)]
        total = torch.stack([v.float() for v in want_y]).sum(0)
        want = total.to(dtype)
        # Triton 3.6's interpreter rounds fp32 -> bf16 toward zero (a GPU to nearest even), in
        # the receive's last step as anywhere: either rounding of the fp32 sum is right here
        cut = (total.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
        for r in range(world):
            where = f"call {call} rank {r}"
            assert int(ranks.status[r]) == 0, f"{where}: peer {int(ranks.status[r]) - 1} late"
            assert torch.equal(ys[r][:, :n], want_y[r]), f"{where}: y differs from gemv"
            if n % 2:
                assert float(ys[r][0, n]) == 0.0  # the padding column
            got = outs[r][:, :n]
            ok = (got == want) | ((got == cut) & (dtype == torch.bfloat16))
            assert bool(ok.all()), f"{where}: wrong sum"
            assert ranks.state[r][0::2].tolist() == [call + 1] * BLOCKS
            # my packets in peer p's region: this call's half, my slot, flag call + 1
            p = (r + 1) % world
            half = (call % 2) * world * SLOT_WORDS
            packets = ranks.lls[p][half + r * SLOT_WORDS:][:(n + 1) // 2]
            assert ((packets >> 32) == call + 1).all()


def test_a_peer_that_never_sent_is_reported(K):
    """Rank 1 skips its GEMV: rank 0's receive finds no packet of this call in rank 1's slot
    (the previous call's are in the other half) and records code 2 (rank 1 + 1)."""
    ranks = _Ranks(2)
    for call in range(2):
        xs, ws = _inputs(2, 6, 16, torch.float16, False, call)
        ys = [ranks.send(K, r, xs[r], ws[r], False) for r in range(2 if call == 0 else 1)]
        ranks.receive(K, 0, ys[0])
        assert int(ranks.status[0]) == (0 if call == 0 else 2)
