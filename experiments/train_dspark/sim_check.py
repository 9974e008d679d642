"""Checks the PyTorch speculative decoding simulation of train_dspark_v2.py against the Rust acceptance runs, prompt by
prompt: greedy (T=0), k=7, the first N prompts of each Rust prompt set, a DSpark checkpoint and the embedded draft
model, next to the per-prompt records of experiments/results/embedded_pair_acceptance/{dspark,embedded}/results.jsonl
(made with models/default/dspark, so pass that directory to compare like with like). Greedy decoding is deterministic,
so the two should agree except where bf16 (Rust) and float32 (here) argmaxes differ on near-ties.

    SPECULA_EVAL_DATASETS=... python3 sim_check.py [DSPARK_DIR] [N]      (default models/default/dspark, N = 2)
"""
import json
import os
import sys
import time

import torch

import train_dspark_v2 as v2
from dspark import DSparkDraft
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM


def rust_records(kind):
    path = os.path.join(v2.ROOT, "experiments", "results", "embedded_pair_acceptance", kind, "results.jsonl")
    out = {}
    for ln in open(path):
        r = json.loads(ln)
        if r.get("kind") == "result" and r["setting"]["k"] == 7 and r["setting"]["temperature"] == 0.0:
            out[(r["dataset"], r["prompt_index"])] = r
    return out


@torch.no_grad()
def main():
    ddir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(v2.ROOT, "models", "default", "dspark")
    n_per = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    tok = Tokenizer.from_file(os.path.join(v2.ROOT, "models", "default", "target", "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    target = LlamaForCausalLM.from_pretrained(os.path.join(v2.ROOT, "models", "default", "target"), dtype=torch.float32).eval()
    small = LlamaForCausalLM.from_pretrained(os.path.join(v2.ROOT, "models", "default", "draft"), dtype=torch.float32).eval()
    E = target.lm_head.weight
    cfg = json.load(open(os.path.join(ddir, "config.json")))
    assert cfg["target_layer_ids"] == v2.TARGET_LAYER_IDS and cfg["block_size"] == v2.GAMMA and cfg["mask_token_id"] == v2.MASK_ID
    draft = DSparkDraft(cfg)
    draft.load_state_dict({k: v.float() for k, v in load_file(os.path.join(ddir, "model.safetensors")).items()})
    draft.eval()

    ev, seen = [], {}
    for name, x in v2.load_eval_prompts(tok, print):
        i = seen.get(name, 0)
        seen[name] = i + 1
        if i < n_per:
            ev.append((name, i, x))
    print(f"{len(ev)} prompts; DSpark {ddir}")
    for label, fn, kind in [("DSpark", v2.dspark_drafter(draft, target, E, 7), "dspark"),
                            ("draft model", v2.ar_drafter(small, 7), "embedded")]:
        rust = rust_records(kind)
        t1 = time.time()
        res = v2.simulate(target, fn, [x for _, _, x in ev], 7, 0, None, max_new=128, eos=eos)
        print(f"\n{label}: simulated in {time.time() - t1:.0f}s; per prompt (PyTorch | Rust): prompt tokens, verify steps, "
              "accepted drafts")
        same, tot_py, tot_rs = 0, [0, 0], [0, 0]
        for j, (name, i, x) in enumerate(ev):
            r = rust.get((name, i))
            a, s = int(res["row_acc"][j]), int(res["row_steps"][j])
            tot_py[0] += a
            tot_py[1] += s
            if r:
                tot_rs[0] += r["accepted_tokens"]
                tot_rs[1] += r["num_verify_steps"]
                same += (a, s) == (r["accepted_tokens"], r["num_verify_steps"])
            rs = f"{r['prompt_tokens']} {r['num_verify_steps']} {r['accepted_tokens']}" if r else "-"
            print(f"  {name}[{i}]: {len(x)} {s} {a} | {rs}")
        print(f"  pooled AL PyTorch {1 + tot_py[0] / tot_py[1]:.3f}, Rust {1 + tot_rs[0] / max(1, tot_rs[1]):.3f}; "
              f"{same}/{len(ev)} prompts identical")


if __name__ == "__main__":
    main()
