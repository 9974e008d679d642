"""A PyTorch DSpark drafter with DeepSpec tensor names, written against the parity fixture in
../shared/fixtures/dspark-deepspec/ (check_fixture.py pins it there).

Semantics (reference.md section 4):
  ctx = hidden_norm(fc(concat of target hidden_states[l+1], l in target_layer_ids))       [C, d]
  block = [anchor, MASK x (gamma-1)] at positions p..p+gamma-1, embedded with the target's embedding
  every layer: h += o_proj(attn(input_layernorm(h))); h += mlp(post_attention_layernorm(h))
    q = q_norm(q_proj(normed block)), keys/values = [k_proj/v_proj(ctx rows); k_proj/v_proj(normed block)],
    k_norm on all keys, RoPE on queries and keys at their own positions, no mask inside the block
  hidden = norm(h); base logits = lm_head(hidden) (the target's); slot j predicts the token at p+j+1
  Markov (vanilla): logits_j = base_j + markov_w2(markov_w1[prev_j]), prev_0 = anchor, prev_j = token j-1
  confidence logit c_j = confidence_head.proj([hidden_j; markov_w1[prev_j]])

One forward runs many blocks of many sequences at once: `mask` says which context rows and block rows
each block row sees (block i: context rows < p_i and the rows of block i).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cos_sin(pos, head_dim, theta):
    """pos [B, T] (long) -> cos, sin [B, 1, T, head_dim] in float32 (HF default rope, rotate_half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    f = pos.float()[..., None] * inv
    emb = torch.cat([f, f], -1)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, x, ctx, rope_q, rope_k, mask):
        B, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], 1)
        K = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, K, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, K, self.nkv, self.hd).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        q, k = q.to(v.dtype), k.to(v.dtype)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, h, ctx, rope_q, rope_k, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_k, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.markov_w1 = nn.Embedding(c["vocab_size"], c["markov_rank"])
        self.markov_w2 = nn.Linear(c["markov_rank"], c["vocab_size"], bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = nn.Linear(c["hidden_size"] + c["markov_rank"], 1)


def rope_theta(c):
    return float(c.get("rope_parameters", {}).get("rope_theta", c.get("rope_theta", 10000.0)))


class DSparkDraft(nn.Module):
    """The drafter's own weights; embedding and LM head are passed in (the target's, frozen)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        d, m = c["hidden_size"], len(c["target_layer_ids"])
        self.fc = nn.Linear(m * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(d, c["rms_norm_eps"])
        self.markov_head = MarkovHead(c)
        self.confidence_head = ConfidenceHead(c)
        self.theta = rope_theta(c)

    def block_hidden(self, features, ctx_pos, block_emb, block_pos, mask):
        """features [B, C, m*d]; ctx_pos [B, C]; block_emb [B, Q, d]; block_pos [B, Q];
        mask [B, Q, C+Q] bool (True = may attend) or None (all rows see everything). -> [B, Q, d] after `norm`."""
        ctx = self.hidden_norm(self.fc(features))
        hd = self.c["head_dim"]
        rope_q = rope_cos_sin(block_pos, hd, self.theta)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, block_pos], 1), hd, self.theta)
        h = block_emb
        for layer in self.layers:
            h = layer(h, ctx, rope_q, rope_k, mask)
        return self.norm(h)

    def markov(self, prev):
        e = self.markov_head.markov_w1(prev)
        return self.markov_head.markov_w2(e), e

    def confidence(self, hidden, markov_emb):
        return self.confidence_head.proj(torch.cat([hidden, markov_emb.to(hidden.dtype)], -1)).squeeze(-1)

    @torch.no_grad()
    def greedy_chain(self, base_logits, anchor, k):
        """base_logits [B, gamma, V], anchor [B] -> tokens [B, k], corrected logits [B, k, V], markov embs."""
        prev, toks, logits, embs = anchor, [], [], []
        for j in range(k):
            corr, e = self.markov(prev)
            lj = base_logits[:, j].float() + corr.float()
            prev = lj.argmax(-1)
            toks.append(prev), logits.append(lj), embs.append(e)
        return torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(embs, 1)


def context_features(hidden_states, layer_ids):
    """HF hidden_states tuple -> concat of the outputs of `layer_ids` (hidden_states[l+1])."""
    return torch.cat([hidden_states[l + 1] for l in layer_ids], -1)


EXPORT_SKIP = ("embed_tokens", "lm_head")


def export_state(model, dtype=torch.bfloat16):
    return {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()
            if not k.startswith(EXPORT_SKIP)}
