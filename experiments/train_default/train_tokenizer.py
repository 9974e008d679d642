"""Trains the byte-level BPE tokenizer (4096 tokens) shared by the embedded default target and draft.

Runs anywhere the `tokenizers` package is installed (no GPU): python3 train_tokenizer.py OUT_DIR
Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json.
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data import load_splits

VOCAB_SIZE = 4096
EOS = "<|endoftext|>"


def main(out_dir):
    splits = load_splits()
    train_texts = [train for train, _ in splits.values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def chunks():
        for t in train_texts:
            for i in range(0, len(t), 100_000):
                yield t[i:i + 100_000]

    tok.train_from_iterator(chunks(), trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    n = sum(len(tok.encode(t).ids) for t in train_texts)
    print(f"vocab {tok.get_vocab_size()}, training tokens {n}, bytes/token {sum(len(t.encode()) for t in train_texts) / n:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
