"""A peer that serves the same model over HTTP, for the side-by-side rows of
`stack bench --layer 6 --peer transformers`: Hugging Face's `transformers serve`.

Both servers read one Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so they serve identical weights and render chats with the same
template: the course model's directory as it ships, or (`model_dir("smollm2-body", ...)`)
random weights of SmolLM2-135M's body written here with the course tokenizer (its vocabulary
sets the embedding size, so every sampled id decodes).

`transformers serve` (checked on 5.17 and 5.23) takes the model as its positional
FORCE_MODEL, answers /health, wants the request's "model" to be that same string, streams
OpenAI chunks (usage on the last one; no [DONE]) and answers 422 to fields it does not know
(vLLM's ignore_eos: the load generator's "transformers" dialect sends a generation_config
without EOS instead). It needs fastapi, uvicorn, pydantic and openai.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import sys
from pathlib import Path

import torch

import layer5_parallel as l5

PEERS = ("transformers",)
# How the bench asks the peer to stop. `transformers serve` (5.23) after continuous batching
# outlives SIGINT: uvicorn shuts down, then the re-raised KeyboardInterrupt waits on a batching
# thread that never ends (the bench waited its whole 15 s grace). After SIGTERM's identical
# uvicorn shutdown the re-raised SIGTERM ends the process.
PEER_STOP_SIGNAL = signal.SIGTERM
# a random model of a known shape: SmolLM2-135M's body on the course vocabulary
SHAPES = {"smollm2-body": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                               rms_norm_eps=1e-5, rope_theta=100000.0,
                               max_position_embeddings=2048, tie_word_embeddings=True)}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_dir(model: str, work: Path) -> Path:
    """A Hugging Face directory for `model`: "course" (the shipped course model), a directory
    that is one, or a name in SHAPES (random weights, written once under `work`)."""
    x = l5
    if model == "course":
        return x.course_model_dir("target")
    if model in SHAPES:
        out = Path(work) / model
        if not (out / "model.safetensors").is_file():
            course = x.course_model_dir("target")
            base = json.loads((course / "config.json").read_text())
            cfg = x.ModelConfig.from_dict({**base, **SHAPES[model]})
            special = {k: base[f"{k}_token_id"] for k in ("bos", "eos", "pad")}
            x.save_hf(x.random_model(cfg, seed=0), out, special, dtype=torch.bfloat16)
            for f in _TOKENIZER_FILES:
                shutil.copy(course / f, out / f)
        return out
    path = Path(model)
    missing = [f for f in ("config.json", "model.safetensors", *_TOKENIZER_FILES)
               if not (path / f).is_file()]
    if not path.is_dir() or missing:
        raise ValueError(f"--peer needs a Hugging Face directory both servers can read: "
                         f"{model!r} is not one (missing {', '.join(missing) or 'the directory'}"
                         f"); use --model course, a model directory, or one of {list(SHAPES)}")
    return path


def peer_available(peer: str) -> str | None:
    """None if `peer` can run here, else why not (one line)."""
    if peer != "transformers":
        return f"unknown peer {peer!r} (known: {', '.join(PEERS)})"
    need = ("transformers", "fastapi", "uvicorn", "pydantic", "openai", "typer")
    lacking = [m for m in need if importlib.util.find_spec(m) is None]
    if lacking:
        return f"transformers serve needs {', '.join(lacking)} (not installed)"
    return None


def peer_command(peer: str, path: Path, port: int, *, device: str, dtype: str = "auto",
                 kv: dict[str, int] | None = None, continuous_batching: bool = True
                 ) -> tuple[list[str], dict[str, str], str]:
    """(command, extra environment, the request's model name) for the peer on
    127.0.0.1:port, in our engine's dtype. Continuous batching on: the peer's own engine
    (paged KV cache), as ours is one. kv: our engine's {block_size, num_blocks,
    max_batch_tokens}, given to the peer as its own, so both have the same KV pool and token
    budget per step (its default, 0.9 of the memory its own process has not taken, sees no
    other process: on a shared CPU the kernel killed it for memory)."""
    if peer != "transformers":
        raise ValueError(f"unknown peer {peer!r} (known: {', '.join(PEERS)})")
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(path),
           "--host", "127.0.0.1", "--port", str(port), "--device", device,
           "--dtype", dtype, "--log-level", "warning"]
    cmd.append("--continuous-batching" if continuous_batching else "--no-continuous-batching")
    if kv:
        cmd += ["--cb-block-size", str(kv["block_size"]), "--cb-num-blocks",
                str(kv["num_blocks"]), "--cb-max-batch-tokens", str(kv["max_batch_tokens"])]
        if device.startswith("cuda"):  # CUDA graphs where ours has them, none where not
            cmd.append("--cb-use-cuda-graph" if kv.get("cuda_graph") else
                       "--no-cb-use-cuda-graph")
    # offline: no update check against PyPI, no hub look-ups
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
           "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return cmd, env, str(path)
