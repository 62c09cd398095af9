"""Training the course model: corpus, tokenizer, the training loop, the model card.

The model it trains is the executor's own `LlamaModel` (model.py), called as
`model(ids (B, T))` with autograd and no cache; this package only brings the data to it and
writes the result as a Hugging Face directory that the executor serves. Four steps, each a
module with its own command line:

    python -m layer3_model.training.data --out DATA          # data.py: fetch, clean, split
    python -m layer3_model.training.tokenizer --data DATA    # tokenizer.py: BPE + chat template
    python -m layer3_model.training.train --size target --data DATA --out OUT
                                 # train.py (tokens.py tokenizes once; card.py writes OUT)

course.py holds the course's shapes (`SIZES`, ModelConfigs) and the HF export
(`save_hf`, `load_hf`).
"""
from .course import SIZES, course_config, hf_config, load_hf, new_model, save_hf
from .data import (
    PLAY_SEPARATOR,
    VALIDATION_PLAYS,
    clean_corpus,
    format_play,
    load_split,
    parse_play,
    prepare,
)
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, STOP_STRINGS, render_chat, train_tokenizer

__all__ = [
    "SIZES", "course_config", "hf_config", "load_hf", "new_model", "save_hf",
    "PLAY_SEPARATOR", "VALIDATION_PLAYS", "clean_corpus", "format_play", "load_split",
    "parse_play", "prepare",
    "CHAT_TEMPLATE", "SPECIAL_TOKENS", "STOP_STRINGS", "render_chat", "train_tokenizer",
]
