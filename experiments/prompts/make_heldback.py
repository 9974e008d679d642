"""Writes heldback.jsonl: prompts taken only from the held-back 5% of each training corpus (the split
of ../train_default/data.py), for measuring the embedded pair's acceptance on text it never saw.

20 prompts per corpus, evenly spaced through its held-back part, each a run of whole lines of about
256 characters (~64 tokens of the pair's 4096-token BPE).
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train_default"))
import data  # noqa: E402

PER_CORPUS = 20
TARGET_CHARS = 256


def prompts_from(held_back):
    lines = held_back.splitlines(keepends=True)
    step = len(lines) // PER_CORPUS
    out = []
    for i in range(PER_CORPUS):
        start = i * step
        text = ""
        for line in lines[start:start + step]:
            if len(text) >= TARGET_CHARS:
                break
            text += line
        text = text.strip("\n")
        if text.strip():
            out.append(text)
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "heldback.jsonl"), "w", encoding="utf-8") as f:
        for name, (_, held_back) in data.load_splits().items():
            for p in prompts_from(held_back):
                f.write(json.dumps({"turns": [p], "source": name}) + "\n")


if __name__ == "__main__":
    main()
