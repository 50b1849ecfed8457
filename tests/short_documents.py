"""A prepared corpus of short documents for the packing tests: `count` lines of 1-14 common words
(seeded), tokenized by `mplan.data.prepare` with a 300-token vocabulary, so shares of a few dozen
tokens hold whole documents."""
from __future__ import annotations

import json
import random
from pathlib import Path

from mplan.data import prepare

WORDS = "the of and to in is was for on that with as by at from his her an be are".split()


def short_documents(root: Path, count: int) -> str:
    """Prepare `count` short documents under `root`; the token directory's path."""
    chooser = random.Random(0)
    lines = [" ".join(chooser.choice(WORDS) for _ in range(chooser.randint(1, 14))) for _ in range(count)]
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines) + "\n", encoding="utf-8")
    return prepare(str(root / "docs.jsonl"), str(root / "tokens"), vocab_size=300, progress=None)["directory"]
