"""Device-side experiment for the Hopper TMA matmul path (one `run` call; not part of CI).

  python3 benchmarks/matmul_variants.py [--quick]

1. correctness of `matmul` (the dispatching public op) at awkward sizes and layouts, and of
   every TMA config launched directly, vs an fp32 torch reference; output poisoned first;
2. timing (do_bench median, bf16) at 4096^3 and 8192^3: torch.matmul, the pointer kernel
   (autotuned), the TMA persistent kernel (autotuned, as `matmul` runs it), each TMA config
   on a persistent grid and on a full grid (one tile per program), and two kernel variants
   (no flatten; separate epilogue tile counter). torch.matmul timed before and after.
Prints a short table last; full log to $OUT/matmul_variants.log.
"""
from __future__ import annotations

import importlib
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

mm = importlib.import_module("layer1_kernels.matmul")
_tile_coords = mm._tile_coords
QUICK = "--quick" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
LOG = open(os.path.join(OUT, "matmul_variants.log"), "a")
SUMMARY: list[str] = []


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def operand(rows: int, cols: int, dtype, transposed: bool) -> torch.Tensor:
    if transposed:
        return torch.randn(cols, rows, device="cuda", dtype=dtype).T
    return torch.randn(rows, cols, device="cuda", dtype=dtype)


# ---- variants of the TMA kernel, for comparison only -------------------------------------

@triton.jit
def _variant_kernel(a_desc, b_desc, c_desc, M, N, K,
                    A_T: tl.constexpr, B_T: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
                    FLATTEN: tl.constexpr, SEP_COUNTER: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_c = tl.program_id(0) - tl.num_programs(0)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if A_T:
                a = a_desc.load([k, pid_m * BLOCK_M]).T
            else:
                a = a_desc.load([pid_m * BLOCK_M, k])
            if B_T:
                b = b_desc.load([pid_n * BLOCK_N, k]).T
            else:
                b = b_desc.load([k, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        if SEP_COUNTER:
            tile_c += tl.num_programs(0)
            pid_m, pid_n = _tile_coords(tile_c, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if EPILOGUE_SPLIT == 2:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([off_m, off_n], left.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def launch_cfg(kernel, a, b, c, cfg: dict, persistent: bool = True, **extra) -> torch.Tensor:
    """Launch a TMA kernel with one explicit config (no autotuner)."""
    bm, bn, bk, st, w, split = cfg["bm"], cfg["bn"], cfg["bk"], cfg["st"], cfg["w"], cfg["split"]
    a_t, b_t = mm._tma_layout(a), mm._tma_layout(b)
    at = a.T if a_t else a
    bt = b.T if b_t else b
    a_d = TensorDescriptor(at, list(at.shape), list(at.stride()), [bk, bm] if a_t else [bm, bk])
    b_d = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [bn, bk] if b_t else [bk, bn])
    c_d = TensorDescriptor(c, list(c.shape), list(c.stride()), [bm, bn // split])
    M, K = a.shape
    N = b.shape[1]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, tiles) if persistent else tiles,)
    kernel[grid](a_d, b_d, c_d, M, N, K, A_T=a_t, B_T=b_t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 GROUP_M=8, EPILOGUE_SPLIT=split, num_warps=w, num_stages=st, **extra)
    return c


def cfg_of(c: triton.Config) -> dict:
    k = c.kwargs
    return dict(bm=k["BLOCK_M"], bn=k["BLOCK_N"], bk=k["BLOCK_K"], st=c.num_stages, w=c.num_warps,
                split=k["EPILOGUE_SPLIT"])


def cfg_name(d: dict) -> str:
    return f"{d['bm']}x{d['bn']}x{d['bk']} s{d['st']} w{d['w']} e{d['split']}"


LISTED = [cfg_of(c) for c in mm._TMA_CONFIGS]
EXTRA = [dict(bm=128, bn=256, bk=128, st=2, w=8, split=2), dict(bm=256, bn=128, bk=64, st=4, w=8, split=2),
         dict(bm=128, bn=256, bk=64, st=4, w=8, split=1)]


# ---- 1. correctness ----------------------------------------------------------------------

def check_matmul() -> bool:
    ok = True
    cases = [(1000, 1000, 1000, False, False), (4095, 1023, 4097, False, False), (64, 8192, 4096, False, False),
             (1000, 1032, 776, False, False), (1000, 1032, 776, True, False), (1000, 1032, 776, False, True),
             (1000, 1032, 776, True, True), (1, 4096, 4096, False, False), (8, 8, 8, False, True),
             (3000, 64, 16, False, False), (129, 4096, 8, False, True), (4096, 4096, 4096, False, True)]
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        for m, k, n, a_t, b_t in (cases if dtype == torch.bfloat16 else cases[:1] + cases[3:7]):
            a, b = operand(m, k, dtype, a_t), operand(k, n, dtype, b_t)
            ref = a.float() @ b.float()
            torch.full((m, n), float("nan"), dtype=dtype, device="cuda")  # poison the next (m, n) block
            c = mm.matmul(a, b)
            torch.cuda.synchronize()
            err = rel_err(c, ref)
            good = bool(torch.isfinite(c).all()) and err < tol and c.shape == (m, n)
            path = "tma" if mm._use_tma(a, b, c) else "ptr"
            ok &= good
            say(f"check matmul {str(dtype)[6:]} {m}x{k}x{n} aT={int(a_t)} bT={int(b_t)} path={path}: "
                f"rel_err={err:.2e} {'ok' if good else 'FAIL'}")
    return ok


def check_configs() -> bool:
    ok = True
    m, k, n = 1000, 1032, 776
    for cfg in LISTED + EXTRA:
        for a_t, b_t in ((False, False), (False, True), (True, False)):
            a, b = operand(m, k, torch.bfloat16, a_t), operand(k, n, torch.bfloat16, b_t)
            c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            try:
                launch_cfg(mm._matmul_tma_kernel, a, b, c, cfg)
                torch.cuda.synchronize()
                err = rel_err(c, a.float() @ b.float())
                good = bool(torch.isfinite(c).all()) and err < 1e-2
                msg = f"rel_err={err:.2e}"
            except Exception as e:  # noqa: BLE001
                good, msg = cfg in EXTRA, f"{type(e).__name__}: {str(e)[:120]}"
            ok &= good
            say(f"check cfg {cfg_name(cfg)} aT={int(a_t)} bT={int(b_t)}: {msg} {'ok' if good else 'FAIL'}")
    for flatten, sep in ((False, False), (True, True)):
        cfg = LISTED[0]
        a, b = operand(m, k, torch.bfloat16, False), operand(k, n, torch.bfloat16, True)
        c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch_cfg(_variant_kernel, a, b, c, cfg, FLATTEN=flatten, SEP_COUNTER=sep)
        torch.cuda.synchronize()
        err = rel_err(c, a.float() @ b.float())
        say(f"check variant flatten={flatten} sep={sep}: rel_err={err:.2e} "
            f"{'ok' if torch.isfinite(c).all() and err < 1e-2 else 'FAIL'}")
    return ok


# ---- 2. timing ---------------------------------------------------------------------------

def bench(fn, rep: int = 200) -> float:
    return do_bench(fn, warmup=50, rep=rep, return_mode="median")


def time_size(n: int) -> None:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    tflops = lambda ms: 2 * n**3 / ms / 1e9  # noqa: E731
    rows: list[tuple[str, float]] = []

    def rec(name: str, ms: float) -> None:
        rows.append((name, ms))
        say(f"time {n}^3 {name}: {ms:.3f} ms {tflops(ms):.0f} TFLOP/s")

    rec("torch.matmul #1", bench(lambda: torch.matmul(a, b), 400))
    rec("pointer kernel (autotuned)", bench(lambda: mm._launch(mm._matmul_tuned, a, b, c), 400))
    rec("matmul() TMA persistent (autotuned)", bench(lambda: mm.matmul(a, b), 400))
    best = mm._matmul_tma_tuned.best_config
    say(f"  autotuner picked {cfg_name(cfg_of(best))}")
    rec("torch.matmul #2", bench(lambda: torch.matmul(a, b), 400))
    ref = a.float() @ b.float()
    say(f"  rel_err matmul() at {n}^3: {rel_err(mm.matmul(a, b), ref):.2e}")
    del ref
    for cfg in [] if QUICK else LISTED + EXTRA:
        for persistent in (True, False):
            try:
                ms = bench(lambda cfg=cfg, p=persistent: launch_cfg(mm._matmul_tma_kernel, a, b, c, cfg, p), 150)
                rec(f"  cfg {cfg_name(cfg)} {'persist' if persistent else 'fullgrid'}", ms)
            except Exception as e:  # noqa: BLE001
                say(f"time {n}^3 cfg {cfg_name(cfg)}: {type(e).__name__} {str(e)[:100]}")
    for flatten, sep in () if QUICK else ((False, False), (True, True)):
        for cfg in LISTED[:3]:
            ms = bench(lambda cfg=cfg, f=flatten, s=sep: launch_cfg(_variant_kernel, a, b, c, cfg, FLATTEN=f, SEP_COUNTER=s), 150)
            rec(f"  variant flatten={int(flatten)} sep={int(sep)} {cfg_name(cfg)}", ms)
    rec("torch.matmul #3", bench(lambda: torch.matmul(a, b), 400))
    # nn.Linear layout: B = w.T (column-major)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_lin = bench(lambda: torch.matmul(a, w.T), 200)
    o_lin = bench(lambda: mm.matmul(a, w.T), 200)
    say(f"time {n}^3 B=w.T: torch {t_lin:.3f} ms, matmul() {o_lin:.3f} ms, ratio {t_lin / o_lin:.3f}")

    torch_ms = sorted(ms for name, ms in rows if name.startswith("torch"))[1]  # median of 3
    ptr = dict(rows)["pointer kernel (autotuned)"]
    new = dict(rows)["matmul() TMA persistent (autotuned)"]
    best_name, best_ms = min(((nm, ms) for nm, ms in rows if nm.startswith("  ")), key=lambda r: r[1],
                             default=("-", new))
    SUMMARY.append(f"{n}^3 | torch {tflops(torch_ms):4.0f} | pointer {tflops(ptr):4.0f} ({torch_ms / ptr:.3f}x) | "
                   f"TMA autotuned {tflops(new):4.0f} ({torch_ms / new:.3f}x, {cfg_name(cfg_of(best))}) | "
                   f"best single: {best_name.strip()} {tflops(best_ms):.0f} ({torch_ms / best_ms:.3f}x) | "
                   f"w.T: {t_lin / o_lin:.3f}x")


def main() -> None:
    t0 = time.time()
    say(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
        "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    ok1 = check_matmul()
    say(f"[{time.time() - t0:.0f}s] matmul checks {'PASS' if ok1 else 'FAIL'}")
    ok2 = True if QUICK else check_configs()
    say(f"[{time.time() - t0:.0f}s] config checks {'PASS' if ok2 else 'FAIL'}")
    for n in (4096, 8192):
        time_size(n)
        say(f"[{time.time() - t0:.0f}s] timed {n}")
    say("\n=== SUMMARY (TFLOP/s, ratio = torch time / ours) ===")
    say(f"correctness: matmul {'PASS' if ok1 else 'FAIL'}, per-config {'PASS' if ok2 else 'FAIL'}")
    for line in SUMMARY:
        say(line)


if __name__ == "__main__":
    main()
