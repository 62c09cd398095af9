"""cudnn_attention_tokens: cuDNN's fused attention for one token-major sequence. On a CPU, the
inputs it cannot take are refused with errors that name the problem; on a GPU it computes
layer 1's reference at GQA, ragged lengths and the serving layout, and replays from a CUDA
graph."""
from __future__ import annotations

import pytest
import torch

from layer1_kernels import cudnn_attention_tokens, flash_attention_reference, flash_attention_tokens


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def fused_rows(t: int, hq: int, hkv: int, d: int, seed: int, device: str,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k and v (T, Hkv, D): views of one fused (T, (Hq + 2 Hkv) D) qkv output,
    the layout layer 3's prefill hands the attention."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def reference(q, k, v, causal: bool = True) -> torch.Tensor:
    four = [t.transpose(0, 1)[None].double() for t in (q, k, v)]
    return flash_attention_reference(*four, causal=causal)[0].transpose(0, 1)


@pytest.mark.parametrize("args,msg", [
    (dict(t=8, d=16, dtype=torch.float32), "takes"),             # fp32: cuDNN has no such kernel
    (dict(t=8, d=12, dtype=torch.bfloat16), "multiple of 8"),
    (dict(t=8, d=16, dtype=torch.bfloat16), "needs CUDA tensors"),  # right inputs, on a CPU
])
def test_inputs_cudnn_cannot_take_are_named(args: dict, msg: str) -> None:
    q, k, v = fused_rows(args["t"], 4, 2, args["d"], seed=1, device="cpu", dtype=args["dtype"])
    with pytest.raises(ValueError, match=msg):
        cudnn_attention_tokens(q, k, v)


def test_shape_errors_are_named() -> None:
    q, k, v = fused_rows(8, 4, 2, 16, seed=2, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3-D"):
        cudnn_attention_tokens(q[None], k, v)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cudnn_attention_tokens(q[:, :3], k, v)
    with pytest.raises(ValueError, match="shapes differ"):
        cudnn_attention_tokens(q, k, v[:4])
    # causal with a cached prefix (Nq < Nk): SDPA's top-left mask is not ours
    with pytest.raises(ValueError, match="Nq == Nk"):
        cudnn_attention_tokens(q[:5], k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("t,hq,hkv,d", [(2048, 32, 8, 64), (1000, 32, 8, 128), (77, 8, 8, 64),
                                        (333, 4, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference_in_the_serving_layout(t, hq, hkv, d, dtype) -> None:
    """GQA (native: k and v keep their Hkv heads), ragged lengths, strided fused-qkv views;
    the result token-major like flash_attention_tokens' and within bf16 of it."""
    q, k, v = fused_rows(t, hq, hkv, d, seed=t + d, device="cuda", dtype=dtype)
    torch.full((t, hq, d), float("nan"), dtype=dtype, device="cuda")  # poison the allocator
    out = cudnn_attention_tokens(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, reference(q, k, v)) < 1e-2
    flash = flash_attention_tokens(q, k, v, torch.empty_like(q))
    assert rel_err(out, flash.float()) < 1e-2
    print(f"cudnn t={t} d={d}: out strides {out.stride()} contiguous {out.is_contiguous()}")


@pytest.mark.gpu
def test_gpu_non_causal_and_scale() -> None:
    q, k, v = fused_rows(300, 8, 2, 64, seed=5, device="cuda", dtype=torch.bfloat16)
    out = cudnn_attention_tokens(q[:100], k, v, causal=False, scale=0.05)
    four = [x.transpose(0, 1)[None] for x in (q[:100], k, v)]
    ref = flash_attention_reference(*four, causal=False, scale=0.05)[0].transpose(0, 1)
    assert rel_err(out, ref.float()) < 1e-2


@pytest.mark.gpu
def test_gpu_replays_from_a_cuda_graph() -> None:
    """Captured like any kernel (cuDNN's plan built by the warm-up call before capture): the
    replay on new inputs written in place gives the eager call's numbers."""
    q, k, v = fused_rows(512, 32, 8, 64, seed=7, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cudnn_attention_tokens(q, k, v)  # warm-up: plan and workspace outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cudnn_attention_tokens(q, k, v)
    q2, k2, v2 = fused_rows(512, 32, 8, 64, seed=8, device="cuda", dtype=torch.bfloat16)
    for dst, src in ((q, q2), (k, k2), (v, v2)):
        dst.copy_(src)  # the views share one buffer: q, k, v all rewritten
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cudnn_attention_tokens(q, k, v))
    assert rel_err(out, reference(q, k, v)) < 1e-2
