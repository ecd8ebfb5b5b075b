"""Prompt normalisation before a reward model reads the text (`normalize_prompts` on the CLIP-based kinds).

Prompt sets scraped from the web carry trademark signs, emoji and invisible characters that a CLIP tokenizer turns
into rare tokens, which move a text embedding (and so a CLIP or preference score) without changing what the prompt
asks for. `normalize_prompt`:

    1. drop trademark, registered, copyright and service-mark signs (before 2, which would spell TM and SM out)
    2. Unicode NFKC (full-width letters, ligatures and compatibility forms to their plain equivalents)
    3. drop control and format characters (zero-width spaces and joiners, direction marks) and emoji variation
       selectors
    4. replace every other symbol (Unicode categories So, Sk, Sm, Sc: emoji, arrows, currency signs) by a space
    5. collapse runs of whitespace and strip the ends

Letters, digits and punctuation are kept as they are (case too: the tokenizer lowercases if it wants to).
"""
from __future__ import annotations

import re
import unicodedata

MARKS = {"\u2122", "\u00ae", "\u00a9", "\u2120"}  # (TM), (R), (C), (SM)
SYMBOLS = {"So", "Sk", "Sm", "Sc"}


def normalize_prompt(text: str) -> str:
    """`text` normalised as in the module docstring."""
    out = []
    for ch in unicodedata.normalize("NFKC", "".join(c for c in text if c not in MARKS)):
        category = unicodedata.category(ch)
        if (category in ("Cc", "Cf") and not ch.isspace()) or "\ufe00" <= ch <= "\ufe0f":
            continue
        out.append(" " if category in SYMBOLS else ch)
    return re.sub(r"\s+", " ", "".join(out)).strip()
