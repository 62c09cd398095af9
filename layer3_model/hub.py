"""Hugging Face hub ids (`org/name`): downloaded with `huggingface_hub` into its own cache.

`snapshot_download` reuses the cache ($HF_HOME/hub, ~/.cache/huggingface/hub by default), so
a model is fetched once. Offline (HF_HUB_OFFLINE=1, or no network) only the cache is
read; a model that is not there is a FileNotFoundError saying where it was expected and
how to get it, never a traceback from deep inside the HTTP stack.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Only what the loader reads: config, weights, tokenizer, template (and a GGUF, if that is
# all a repository has).
PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.gguf"]


def is_hub_id(name: str) -> bool:
    """`org/name` (one slash, no path syntax): what the hub calls a repository id."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/"))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def download(repo_id: str) -> Path:
    """The local snapshot directory of `repo_id` (downloaded unless cached)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    expected = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=PATTERNS,
                                      local_files_only=offline()))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        why = "offline (HF_HUB_OFFLINE=1)" if offline() else (
            f"the hub is not reachable ({type(err).__name__})")
        raise FileNotFoundError(
            f"hub id {repo_id!r}: {why} and it is not in the hub cache (expected under "
            f"{expected}); get it where the network allows with `stack models pull {repo_id}` "
            "(or copy that folder here), or pass a local directory or .gguf file") from None
