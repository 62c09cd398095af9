"""The course model at training time: a Llama in plain PyTorch whose parameter names are
Hugging Face's, so its state_dict *is* an HF checkpoint (`model.layers.0.self_attn.q_proj.weight`...).

Training needs autograd and a whole sequence at a time, so this module is separate from
the executor (no KV cache, no custom kernels): RMSNorm, rotary embeddings (HF's
rotate_half convention), grouped-query attention through `scaled_dot_product_attention`
(causal), and a SwiGLU MLP. `save_hf` writes the directory that the executor and
`transformers.AutoModelForCausalLM` both load.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass
class CourseModelConfig:
    """Shapes of a Llama-architecture model (names follow HF's LlamaConfig)."""

    vocab_size: int = 4096
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")

    def hf_config(self, bos: int, eos: int, pad: int, dtype: torch.dtype) -> dict[str, object]:
        """config.json for `LlamaForCausalLM`."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self),
                "head_dim": self.head_dim, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "attention_dropout": 0.0, "rope_scaling": None,
                "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
                "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
                "torch_dtype": str(dtype).removeprefix("torch.")}


# The two course models: target ~11M parameters, draft ~1.2M (same tokenizer, for speculative decoding).
# The draft has only 2 layers: at batch 1 a small model's step costs per-layer overhead more than
# FLOPs, and speculative decoding pays off only when a draft step is a small fraction of a target step.
SIZES: dict[str, CourseModelConfig] = {
    "target": CourseModelConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                num_attention_heads=6, num_key_value_heads=2),
    "draft": CourseModelConfig(hidden_size=160, intermediate_size=448, num_hidden_layers=2,
                               num_attention_heads=5, num_key_value_heads=1),
    # For tests and smoke runs: trains in seconds on a CPU.
    "tiny": CourseModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 like HF: the mean of squares overflows/underflows easily in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(cfg: CourseModelConfig, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq, head_dim): each frequency repeated in both halves (rotate_half layout)."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim) rotated by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: CourseModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # GQA: query head h reads kv head h // (n_heads // n_kv), as HF's repeat_kv arranges them.
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: CourseModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: CourseModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: float) -> torch.Tensor:
        # Residual dropout regularises training on a small corpus; it is the identity in
        # eval mode, so the exported HF model computes exactly what this one does.
        x = x + F.dropout(self.self_attn(self.input_layernorm(x), cos, sin), p, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), p, self.training)


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: CourseModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CourseLlama(nn.Module):
    """Llama for training. forward(ids (batch, seq)) -> logits (batch, seq, vocab).

    `dropout` (residual, training mode only) is not part of the exported architecture."""

    def __init__(self, cfg: CourseModelConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg, self.dropout = cfg, dropout
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) weights; residual output projections scaled by 1/sqrt(2 * layers) so the
        residual stream's variance does not grow with depth at initialisation (GPT-2's recipe)."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        cos, sin = rope_cos_sin(self.cfg, ids.shape[1], ids.device)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, self.dropout)
        return self.lm_head(self.model.norm(x))

    def num_parameters(self) -> int:
        """Distinct parameters (a tied lm_head counts once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, ids: list[int], max_new_tokens: int, temperature: float = 0.8,
                 top_k: int = 40, seed: int = 0) -> list[int]:
        """Sample a continuation (no KV cache: fine for a model card's sample). Returns new ids."""
        gen = torch.Generator().manual_seed(seed)
        device = next(self.parameters()).device
        out = list(ids)
        for _ in range(max_new_tokens):
            window = torch.tensor([out[-self.cfg.max_position_embeddings:]], device=device)
            logits = self(window)[0, -1].float().cpu() / max(temperature, 1e-5)
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
        return out[len(ids):]


def save_hf(model: CourseLlama, out: Path, special_ids: dict[str, int],
            dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, generation_config.json and model.safetensors (tied lm_head omitted, as HF does)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight")  # safetensors refuses shared storage; HF re-ties on load
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the file ships in the repo
    bos, eos, pad = special_ids["bos"], special_ids["eos"], special_ids["pad"]
    cfg = model.cfg.hf_config(bos, eos, pad, dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": True,
           "temperature": 0.8, "top_k": 40, "top_p": 0.95, "max_new_tokens": 256}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def load_hf(path: Path, dropout: float = 0.0) -> CourseLlama:
    """A CourseLlama from a directory save_hf wrote (fp32 weights), e.g. to fine-tune or compare."""
    path = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} is missing: not a model directory save_hf wrote")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") != "llama":
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r}, expected 'llama'")
    fields = CourseModelConfig.__dataclass_fields__
    model = CourseLlama(CourseModelConfig(**{k: raw[k] for k in fields if k in raw}), dropout)
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if model.cfg.tie_word_embeddings else set()):
        raise ValueError(f"{path}: weights do not fit the config (missing {missing}, unexpected {unexpected})")
    return model
