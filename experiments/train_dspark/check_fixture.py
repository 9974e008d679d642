"""Pins dspark.py to the DeepSpec reference: runs the parity fixture (../shared/fixtures/dspark-deepspec/,
reference outputs of DeepSeek's public DeepSpec code on a tiny Qwen3 target) through HF transformers and
DSparkDraft in float32 and compares every reference tensor.

    python3 check_fixture.py [FIXTURE_DIR]      (exit status 1 if a relative error exceeds 1e-4)
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file

from dspark import DSparkDraft, context_features

TOL = 1e-4


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@torch.no_grad()
def check(fx, device="cpu", log=print):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    exp = load_file(os.path.join(fx, "expected.safetensors"))
    tcfg = json.load(open(os.path.join(fx, "target_config.json")))
    dcfg = json.load(open(os.path.join(fx, "dspark_config.json")))
    target = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in tcfg.items() if k != "transformers_version"}))
    target.config._attn_implementation = "eager"
    missing, unexpected = target.load_state_dict(load_file(os.path.join(fx, "target.safetensors")), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    target = target.to(device).float().eval()

    dw = load_file(os.path.join(fx, "dspark_draft.safetensors"))
    draft = DSparkDraft(dcfg)
    missing, unexpected = draft.load_state_dict({k: v for k, v in dw.items() if not k.startswith(("embed_tokens", "lm_head"))})
    assert not missing and not unexpected, (missing, unexpected)
    draft = draft.to(device).float().eval()
    embed, lm_head = dw["embed_tokens.weight"].to(device), dw["lm_head.weight"].to(device)
    assert torch.equal(embed.cpu(), target.model.embed_tokens.weight.cpu()) and torch.equal(lm_head.cpu(), target.lm_head.weight.cpu())

    ids = exp["prompt_ids"].to(device)[None]
    out = target(input_ids=ids, output_hidden_states=True)
    feats = context_features(out.hidden_states, dcfg["target_layer_ids"])
    n = ids.shape[1]
    gamma = dcfg["block_size"]
    anchor = out.logits[0, -1].argmax()
    block_ids = torch.full((1, gamma), dcfg["mask_token_id"], device=device)
    block_ids[0, 0] = anchor
    ctx_pos = torch.arange(n, device=device)[None]
    block_pos = torch.arange(n, n + gamma, device=device)[None]
    hidden = draft.block_hidden(feats, ctx_pos, embed[block_ids], block_pos, None)
    base = hidden @ lm_head.T
    toks, corrected, embs = draft.greedy_chain(base, anchor[None], gamma)
    conf = draft.confidence(hidden, embs)

    rows = [("target_logits", out.logits[0], exp["target_logits"]),
            ("context_features", feats[0], exp["context_features"]),
            ("block_hidden", hidden[0], exp["block_hidden"]),
            ("base_logits", base[0], exp["base_logits"]),
            ("markov_corrected_logits", corrected[0], exp["markov_corrected_logits"]),
            ("confidence_logits", conf[0], exp["confidence_logits"])]
    ok = True
    log(f"DSpark parity fixture {fx} (float32, {device}):")
    for name, got, want in rows:
        e = rel_err(got, want)
        ok &= e <= TOL
        log(f"  {name:24s} {tuple(want.shape)!s:12s} max rel err {e:.2e} {'ok' if e <= TOL else 'FAIL'}")
    for name, got, want in [("block_input_ids", block_ids[0], exp["block_input_ids"]),
                            ("greedy_draft_tokens", toks[0], exp["greedy_draft_tokens"])]:
        same = torch.equal(got.cpu(), want)
        ok &= same
        log(f"  {name:24s} {got.tolist()} {'equal' if same else 'DIFFER from ' + str(want.tolist())}")
    # The batched training path: the same block inside a longer context (rows >= p hidden by the mask),
    # next to a second block with another anchor, must give the same hidden states.
    extra = torch.randn(1, 5, feats.shape[-1], device=device)
    feats2 = torch.cat([feats, extra], 1)
    C = feats2.shape[1]
    p2 = torch.tensor([n, 7], device=device)
    ids2 = torch.full((1, 2, gamma), dcfg["mask_token_id"], device=device)
    ids2[0, :, 0] = torch.stack([anchor, ids[0, 7]])
    pos2 = (p2[:, None] + torch.arange(gamma, device=device)).view(1, -1)
    blk = torch.arange(2, device=device).repeat_interleave(gamma)
    mask = torch.cat([(torch.arange(C, device=device)[None] < p2[blk][:, None]), blk[:, None] == blk[None]], 1)[None]
    h2 = draft.block_hidden(feats2, torch.arange(C, device=device)[None], embed[ids2.view(1, -1)], pos2, mask)
    e = rel_err(h2[0, :gamma], exp["block_hidden"])
    ok &= e <= TOL
    log(f"  {'batched masked path':24s} {'(2 blocks)':12s} max rel err {e:.2e} {'ok' if e <= TOL else 'FAIL'}")
    log(f"fixture check: {'PASS' if ok else 'FAIL'} (tolerance {TOL:g} relative to the largest magnitude)")
    return ok


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    fx = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "..", "..", "shared", "fixtures", "dspark-deepspec")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sys.exit(0 if check(fx, dev) else 1)
