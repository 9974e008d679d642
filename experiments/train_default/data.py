"""The training / held-back split of ../shared/data/corpora used by every script here.

Each corpus is split at a line boundary: the first 95% trains the tokenizer and the models, the last 5%
is held back for evaluation (acceptance measurements on "held-back text" use only this part).
"""
import os

CORPORA = ["python-stdlib-3.11.txt", "tinyshakespeare.txt"]
HELD_BACK_FRACTION = 0.05


def corpus_dir():
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in [os.environ.get("SPECULA_CORPORA", ""),
                 os.path.join(here, "..", "..", "..", "shared", "data", "corpora"),
                 os.path.join(here, "corpora")]:
        if cand and os.path.exists(os.path.join(cand, CORPORA[0])):
            return cand
    raise FileNotFoundError("corpora not found: set SPECULA_CORPORA")


def split(text):
    cut = int(len(text) * (1 - HELD_BACK_FRACTION))
    cut = text.rfind("\n", 0, cut) + 1
    return text[:cut], text[cut:]


def load_splits():
    d = corpus_dir()
    out = {}
    for name in CORPORA:
        with open(os.path.join(d, name), encoding="utf-8") as f:
            out[name] = split(f.read())
    return out
