"""Trains a DSpark drafter (dspark.py) for the embedded default target (models/default/target) on the GPU
machine and exports it in the DeepSpec layout.

    python3 train_dspark.py OUT_DIR      (torch + transformers + tokenizers + safetensors; a CUDA GPU, or a
                                          tiny CPU smoke run with SMOKE=1)

Steps: (1) the parity fixture check (check_fixture.py; aborts on failure), (2) training on the training split
(../train_default/data.py) for TRAIN_SECONDS of wall-clock time, (3) held-back evaluation with the bf16-rounded
weights, against the embedded draft model on the same prompts, (4) export to OUT_DIR/dspark/{config.json,
model.safetensors} (bf16; embed_tokens / lm_head are not exported: they are the target's).

Training: per step BATCH windows of SEQ training tokens go once through the frozen target (bf16 autocast,
output_hidden_states); ANCHORS random anchor positions p per window give blocks [x_p, MASK x 6] at positions
p..p+6, all run in one drafter pass with a mask (block i sees context rows < p_i and its own rows). Slot j
(0-based) predicts x_{p+j+1}; its Markov input is x_{p+j} (teacher forcing). Loss per slot:
0.1 CE(x_{p+j+1}) + 0.9 TV(p_draft, p_target) + 1.0 BCE(confidence, 1 - TV) with p_target = softmax of the
target's logits at position p+j (temperature 1, no gradient) and the BCE label detached, weighted
exp(-j / GAMMA_DECAY), normalised by the sum of the weights, averaged over blocks.

Held-back AL estimate: greedy speculative decoding simulated in PyTorch without caches (batched, right-padded
so causal attention makes padding harmless): each step the drafter proposes k tokens, the target's greedy
continuation decides how many are accepted, AL = tokens emitted per target verify step. The DSpark drafter
drafts from the target features of the current sequence (anchor = the target's last emitted token) with its
greedy Markov chain (prev = drafted token); the embedded draft model drafts autoregressively. The Rust engine
measures the real AL; this is a training-time estimate.
"""
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "train_default"))
from data import load_splits  # noqa: E402
from dspark import DSparkDraft, context_features, export_state  # noqa: E402
import check_fixture  # noqa: E402

SMOKE = os.environ.get("SMOKE") == "1"
GAMMA = 7                 # block size (gamma = 7 drafts per block)
GAMMA_DECAY = 7.0         # slot weight exp(-j / GAMMA_DECAY), j = 0..6
MASK_ID = 189             # byte-level token of byte 0x00: never occurs in either split of the corpora (checked below)
TARGET_LAYER_IDS = [1, 4, 6]
SEQ = 128 if SMOKE else 512
BATCH = 2 if SMOKE else 128
ANCHORS = 4 if SMOKE else 32
PEAK_LR = 2e-3
WARMUP = 5 if SMOKE else 150
TRAIN_SECONDS = float(os.environ.get("TRAIN_SECONDS", 15 if SMOKE else 200))
EVAL_EVERY_S = float(os.environ.get("EVAL_EVERY_S", 5 if SMOKE else 40))

DRAFT_CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "hidden_act": "silu",
    "block_size": GAMMA,
    "mask_token_id": MASK_ID,
    "target_layer_ids": TARGET_LAYER_IDS,
    "markov_rank": 64,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "shared_embeddings": True,
    "architectures": ["LlamaDSparkModel"],
    "dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def amp():
    return torch.autocast("cuda", dtype=torch.bfloat16) if DEV == "cuda" else contextlib.nullcontext()


def init_weights(model):
    n_layers = model.c["num_hidden_layers"]
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        if "markov_w1" in name:
            torch.nn.init.normal_(p, std=1.0)
        elif "markov_w2" in name or "confidence_head" in name:
            torch.nn.init.zeros_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))
        else:
            torch.nn.init.normal_(p, std=0.02)


def make_blocks(x, anchors, gen):
    """x [B, L] -> block description for `anchors` distinct random anchors p in [1, L-GAMMA-1] per row."""
    B, L = x.shape
    r = torch.rand(B, L - GAMMA - 1, device=x.device, generator=gen)
    p = r.argsort(1)[:, :anchors] + 1                                   # [B, A]
    return blocks_at(x, p)


def blocks_at(x, p):
    B, L = x.shape
    A = p.shape[1]
    j = torch.arange(GAMMA, device=x.device)
    pos = (p[:, :, None] + j).view(B, A * GAMMA)                        # position of each block row
    prev = x.gather(1, pos)                                             # x_{p+j}: Markov input (slot 0: anchor)
    tgt = x.gather(1, pos + 1)                                          # x_{p+j+1}: the token slot j predicts
    ids = torch.full_like(prev, MASK_ID).view(B, A, GAMMA)
    ids[:, :, 0] = prev.view(B, A, GAMMA)[:, :, 0]
    blk = torch.arange(A, device=x.device).repeat_interleave(GAMMA)
    ctx_mask = (torch.arange(L, device=x.device)[None, None] < p[:, :, None]).repeat_interleave(GAMMA, 1)
    mask = torch.cat([ctx_mask, (blk[:, None] == blk[None]).expand(B, -1, -1)], 2)
    return dict(p=p, pos=pos, prev=prev, tgt=tgt, ids=ids.view(B, -1), mask=mask)


def slot_weights(device):
    return torch.exp(-torch.arange(GAMMA, device=device, dtype=torch.float32) / GAMMA_DECAY)


def target_pass(target, x):
    with torch.no_grad(), amp():
        out = target(input_ids=x, output_hidden_states=True)
    return context_features(out.hidden_states, TARGET_LAYER_IDS), out.logits


def block_loss(draft, E, feats, tlogits, blk, stats=False):
    B, L = feats.shape[:2]
    ctx_pos = torch.arange(L, device=feats.device)[None].expand(B, -1)
    with amp():
        hidden = draft.block_hidden(feats, ctx_pos, E[blk["ids"]], blk["pos"], blk["mask"])
        base = hidden @ E.T
        corr, memb = draft.markov(blk["prev"])
        conf = draft.confidence(hidden, memb).float()
    logits = base.float() + corr.float()
    logp = F.log_softmax(logits, -1)
    tl = tlogits[torch.arange(B, device=feats.device)[:, None], blk["pos"]].float()
    pt = F.softmax(tl, -1)
    tv = 0.5 * (logp.exp() - pt).abs().sum(-1)                          # [B, Q]
    ce = -logp.gather(-1, blk["tgt"][..., None]).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach(), reduction="none")
    w = slot_weights(feats.device)
    per = (0.1 * ce + 0.9 * tv + 1.0 * bce).view(B, -1, GAMMA)
    loss = (per * w).sum(-1).mean() / w.sum()
    if not stats:
        return loss, None
    agree = (logits.argmax(-1) == tl.argmax(-1)).float()
    s = {}
    for name, v in [("ce", ce), ("tv", tv), ("bce", bce), ("agree", agree), ("conf", torch.sigmoid(conf)),
                    ("1-tv", 1 - tv)]:
        s[name] = v.view(B, -1, GAMMA).mean((0, 1))
    return loss, s


def lr_at(step, frac):
    warm = min(1.0, (step + 1) / WARMUP)
    return PEAK_LR * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def held_back_eval(draft, target, E, held_windows, held_p):
    draft.eval()
    tot, acc = 0.0, None
    for i in range(0, held_windows.shape[0], 32):
        x = held_windows[i:i + 32]
        feats, tl = target_pass(target, x)
        loss, s = block_loss(draft, E, feats, tl, blocks_at(x, held_p[i:i + 32]), stats=True)
        n = x.shape[0]
        tot += loss.item() * n
        acc = {k: v * n for k, v in s.items()} if acc is None else {k: acc[k] + v * n for k, v in s.items()}
    draft.train()
    n = held_windows.shape[0]
    return tot / n, {k: v / n for k, v in acc.items()}


# ---------------------------------------------------------------- greedy speculative decoding simulation

@torch.no_grad()
def dspark_drafter(draft, target, E, k):
    def fn(seqs, lens):
        N, T = seqs.shape
        out = target(input_ids=seqs, output_hidden_states=True)
        feats = context_features(out.hidden_states, TARGET_LAYER_IDS)
        p = lens - 1                                                    # anchor position (last emitted token)
        anchor = seqs.gather(1, p[:, None])[:, 0]
        ids = torch.full((N, GAMMA), MASK_ID, device=seqs.device)
        ids[:, 0] = anchor
        pos = p[:, None] + torch.arange(GAMMA, device=seqs.device)
        mask = torch.cat([torch.arange(T, device=seqs.device)[None] < p[:, None],
                          torch.ones(N, GAMMA, dtype=torch.bool, device=seqs.device)], 1)[:, None].expand(-1, GAMMA, -1)
        ctx_pos = torch.arange(T, device=seqs.device)[None].expand(N, -1)
        hidden = draft.block_hidden(feats, ctx_pos, E[ids], pos, mask)
        toks, _, embs = draft.greedy_chain(hidden @ E.T, anchor, GAMMA)
        conf = torch.sigmoid(draft.confidence(hidden, embs))
        return toks[:, :k], conf[:, :k]
    return fn


@torch.no_grad()
def ar_drafter(model, k):
    def fn(seqs, lens):
        N = seqs.shape[0]
        cur = torch.cat([seqs, torch.zeros(N, k, dtype=seqs.dtype, device=seqs.device)], 1)
        rows = torch.arange(N, device=seqs.device)
        out = []
        for i in range(k):
            logits = model(input_ids=cur[:, :seqs.shape[1] + i]).logits
            t = logits[rows, lens - 1 + i].argmax(-1)
            cur[rows, lens + i] = t
            out.append(t)
        return torch.stack(out, 1), None
    return fn


@torch.no_grad()
def simulate(target, drafter, prompts, k, steps):
    """Greedy speculative decoding of every prompt for `steps` verify steps. -> AL, per-slot conditional
    acceptance, mean confidence per slot (if the drafter gives one)."""
    N, P = prompts.shape
    dev = prompts.device
    seqs = torch.zeros(N, P + 1 + steps * (k + 1) + k + 1, dtype=torch.long, device=dev)
    seqs[:, :P] = prompts
    rows = torch.arange(N, device=dev)
    seqs[:, P] = target(input_ids=prompts).logits[:, -1].argmax(-1)     # the first emitted token = first anchor
    lens = torch.full((N,), P + 1, device=dev)
    accepted = []
    confs = []
    for _ in range(steps):
        T = int(lens.max())
        drafts, conf = drafter(seqs[:, :T], lens)
        ver = seqs[:, :T + k].clone()
        ver[rows[:, None], lens[:, None] + torch.arange(k, device=dev)] = drafts
        g = target(input_ids=ver).logits[rows[:, None], lens[:, None] - 1 + torch.arange(k + 1, device=dev)].argmax(-1)
        a = (drafts == g[:, :k]).long().cumprod(1).sum(1)               # accepted drafts
        keep = torch.arange(k + 1, device=dev)[None] <= a[:, None]
        idx = lens[:, None] + torch.arange(k + 1, device=dev)
        seqs[rows[:, None], idx] = torch.where(keep, g, seqs[rows[:, None], idx])
        lens = lens + a + 1
        accepted.append(a)
        if conf is not None:
            confs.append(conf)
    a = torch.stack(accepted).flatten()
    al = (a + 1).float().mean().item()
    cond = [((a >= j + 1).sum() / (a >= j).sum().clamp_min(1)).item() for j in range(k)]
    mconf = torch.cat(confs).mean(0).tolist() if confs else None
    return al, cond, mconf


# ---------------------------------------------------------------- main

def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    def save_log():
        with open(os.path.join(out_dir, "train_log.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")

    t_start = time.time()
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "none (CPU smoke run)"
    log(f"torch {torch.__version__}, GPU {gpu}")

    # (1) the parity fixture, float32, before anything else
    fx = os.environ.get("SPECULA_FIXTURE", os.path.join(ROOT, "..", "shared", "fixtures", "dspark-deepspec"))
    fx_lines = []
    ok = check_fixture.check(fx, DEV, log=lambda s: (log(s), fx_lines.append(s)))
    with open(os.path.join(out_dir, "fixture_check.txt"), "w") as f:
        f.write("\n".join(fx_lines) + "\n")
    if not ok:
        save_log()
        sys.exit("fixture check failed: not training")

    # (2) data, target, draft model
    tok = Tokenizer.from_file(os.path.join(ROOT, "models", "default", "target", "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    train_ids, held_ids = [], []
    for name, (tr, hb) in load_splits().items():
        train_ids += tok.encode(tr).ids + [eos]
        held_ids += tok.encode(hb).ids + [eos]
    data = torch.tensor(train_ids, dtype=torch.long, device=DEV)
    held = torch.tensor(held_ids, dtype=torch.long, device=DEV)
    n_mask = int((data == MASK_ID).sum() + (held == MASK_ID).sum())
    log(f"train tokens {len(data)}, held-back tokens {len(held)}; mask id {MASK_ID} ({tok.id_to_token(MASK_ID)!r}, "
        f"byte 0x00) occurs {n_mask} times in the corpora")
    assert n_mask == 0
    if SMOKE:
        data, held = data[:200_000], held[:50_000]

    target = LlamaForCausalLM.from_pretrained(os.path.join(ROOT, "models", "default", "target"), dtype=torch.float32).to(DEV).eval()
    small = LlamaForCausalLM.from_pretrained(os.path.join(ROOT, "models", "default", "draft"), dtype=torch.float32).to(DEV).eval()
    for p in list(target.parameters()) + list(small.parameters()):
        p.requires_grad_(False)
    assert target.config.tie_word_embeddings
    E = target.lm_head.weight                                           # = embed_tokens (tied), frozen
    assert torch.equal(E, target.model.embed_tokens.weight)

    torch.manual_seed(0)
    draft = DSparkDraft(DRAFT_CONFIG).to(DEV)
    init_weights(draft)
    n_own = sum(p.numel() for p in draft.parameters())
    n_small = sum(p.numel() for p in small.parameters())
    n_target = sum(p.numel() for p in target.parameters())
    log(f"target {n_target / 1e6:.2f}M params; embedded draft model {n_small / 1e6:.2f}M params (tied embedding "
        f"{small.model.embed_tokens.weight.numel() / 1e6:.2f}M)")
    log(f"DSpark drafter: {n_own / 1e6:.2f}M own params + the target's embedding/LM head ({E.numel() / 1e6:.2f}M, shared); "
        f"{DRAFT_CONFIG['num_hidden_layers']} layers, hidden {DRAFT_CONFIG['hidden_size']}, FFN {DRAFT_CONFIG['intermediate_size']}, "
        f"{DRAFT_CONFIG['num_attention_heads']}/{DRAFT_CONFIG['num_key_value_heads']} heads x {DRAFT_CONFIG['head_dim']}, "
        f"Markov rank {DRAFT_CONFIG['markov_rank']}, target layers {TARGET_LAYER_IDS}, mask id {MASK_ID}, gamma {GAMMA}, "
        f"gamma_decay {GAMMA_DECAY}")
    log(f"training: {BATCH} windows x {SEQ} tokens, {ANCHORS} anchors per window, AdamW peak lr {PEAK_LR}, "
        f"cosine over {TRAIN_SECONDS:.0f}s wall clock")

    # fixed held-back evaluation windows and anchors
    g = torch.Generator(device=DEV).manual_seed(123)
    n_win = 8 if SMOKE else 128
    starts = torch.randint(0, len(held) - SEQ - 1, (n_win,), device=DEV, generator=g)
    held_windows = held[starts[:, None] + torch.arange(SEQ, device=DEV)]
    held_p = torch.rand(n_win, SEQ - GAMMA - 1, device=DEV, generator=g).argsort(1)[:, :ANCHORS] + 1

    decay, no_decay = [], []
    for n, p in draft.named_parameters():
        (no_decay if n.endswith(("norm.weight", "bias")) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95), fused=DEV == "cuda")
    gen = torch.Generator(device=DEV).manual_seed(1)

    def report(step, elapsed, train_loss):
        hl, s = held_back_eval(draft, target, E, held_windows, held_p)
        f = lambda v: " ".join(f"{x:.3f}" for x in v.tolist())  # noqa: E731
        log(f"step {step} ({elapsed:.0f}s) train loss {train_loss:.4f} held-back loss {hl:.4f} | held-back per slot: "
            f"agree {f(s['agree'])} | tv {f(s['tv'])} | ce {f(s['ce'])} | conf {f(s['conf'])} vs 1-tv {f(s['1-tv'])}")
        return hl

    log("per-slot columns are slots 1..7; 'agree' = teacher-forced argmax equals the target's argmax")
    report(0, 0, float("nan"))
    t0 = time.time()
    step, last_eval, ema = 0, 0.0, None
    best = (float("inf"), None, 0)
    while True:
        elapsed = time.time() - t0
        if elapsed >= TRAIN_SECONDS:
            break
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, elapsed / TRAIN_SECONDS)
        ix = torch.randint(0, len(data) - SEQ - 1, (BATCH,), device=DEV, generator=gen)
        x = data[ix[:, None] + torch.arange(SEQ, device=DEV)]
        feats, tl = target_pass(target, x)
        loss, _ = block_loss(draft, E, feats, tl, make_blocks(x, ANCHORS, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            v = loss.item()
            ema = v if ema is None else 0.9 * ema + 0.1 * v
        if time.time() - t0 - last_eval >= EVAL_EVERY_S:
            last_eval = time.time() - t0
            hl = report(step, last_eval, ema if ema is not None else loss.item())
            if hl < best[0]:
                best = (hl, {k: v.detach().clone() for k, v in draft.state_dict().items()}, step)
    hl = report(step, time.time() - t0, ema if ema is not None else loss.item())
    log(f"trained {step} steps in {time.time() - t0:.0f}s ({(time.time() - t0) / max(1, step) * 1000:.1f} ms/step, "
        f"{step * BATCH * ANCHORS / 1e6:.1f}M blocks)")
    if best[1] is not None and best[0] < hl:
        draft.load_state_dict(best[1])
        log(f"keeping the best held-back state (step {best[2]}, loss {best[0]:.4f})")

    # (3) export bf16, reload the rounded weights, evaluate what was exported
    state = export_state(draft)
    draft.load_state_dict({k: v.float() for k, v in state.items()})
    draft.eval()
    dout = os.path.join(out_dir, "dspark")
    os.makedirs(dout, exist_ok=True)
    save_file(state, os.path.join(dout, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dout, "config.json"), "w") as f:
        json.dump(DRAFT_CONFIG, f, indent=1)
    log(f"exported {dout}: {sorted(os.listdir(dout))}, {os.path.getsize(os.path.join(dout, 'model.safetensors'))} bytes, "
        f"{len(state)} tensors")
    save_log()

    log("")
    log("held-back evaluation with the exported (bf16-rounded) weights, float32 compute:")
    hl, s = held_back_eval(draft, target, E, held_windows, held_p)
    log(f"teacher-forced held-back loss {hl:.4f}; per-slot agreement with the target's argmax: "
        + " ".join(f"{v:.3f}" for v in s["agree"].tolist()))
    n_prompts, prompt_len, n_steps = (4, 32, 3) if SMOKE else (256, 128, 40)
    gp = torch.Generator(device=DEV).manual_seed(7)
    ps = torch.randint(0, len(held) - prompt_len - 1, (n_prompts,), device=DEV, generator=gp)
    prompts = held[ps[:, None] + torch.arange(prompt_len, device=DEV)]
    log(f"greedy speculative decoding simulation: {n_prompts} held-back prompts of {prompt_len} tokens, {n_steps} "
        f"verify steps each; AL = tokens per verify step; 'accept' = P(slot j accepted | slots < j accepted)")
    log("| drafter | k | est. greedy AL | accept per slot | mean confidence per slot |")
    log("|---|---|---|---|---|")
    results = {}
    for name, fn, k in [("DSpark", dspark_drafter(draft, target, E, 7), 7),
                        ("DSpark (first 5 drafts)", dspark_drafter(draft, target, E, 5), 5),
                        ("draft model (autoregressive)", ar_drafter(small, 7), 7),
                        ("draft model (autoregressive)", ar_drafter(small, 5), 5)]:
        t1 = time.time()
        al, cond, conf = simulate(target, fn, prompts, k, n_steps)
        results[(name, k)] = al
        log(f"| {name} | {k} | {al:.3f} | {' '.join(f'{c:.3f}' for c in cond)} | "
            f"{' '.join(f'{c:.3f}' for c in conf) if conf else '-'} |  ({time.time() - t1:.0f}s)")
    log("")
    log(f"total {time.time() - t_start:.0f}s")
    save_log()


if __name__ == "__main__":
    main(sys.argv[1])
