//! The DSpark drafter on the GPU against the CPU DSpark drafter (the oracle):
//!
//! (a) parity on the DeepSpec fixture pair (`../shared/fixtures/dspark-deepspec`, f32 weights, head_dim
//!     16), on the same fixture with a pruned draft vocabulary (`d2t`, both W1 layouts), and on the
//!     embedded pair (`models/default/target` + `models/default/dspark`): for a batch of four prompts
//!     in one block pass, the block hidden states, base logits, Markov-corrected logits along the
//!     greedy chain and the confidence head on the GPU's hidden states (max relative error, limit 1e-2:
//!     the GPU computes with bf16 weights and activations; confidence logits end to end are reported),
//!     and the greedy draft tokens (a differing token is allowed only as a
//!     near-tie, reported with its logit margin); then through the `Drafter` interface, greedy and
//!     sampled (temperature 0.8, top-k 50, top-p 0.95, the same uniforms on both sides): tokens and
//!     draft distributions q; and the fused Markov loop alone against the CPU loop on the same block
//!     outputs (greedy, T=1, T=0.8 top-k 50 top-p 0.95) for each Markov kernel: the cluster loop with
//!     W2 in shared memory (the default on sm_90+), the cluster loop reading W2 from global memory and
//!     the single-CTA loop;
//! (b) greedy speculative generation with the GPU DSpark drafter and the CPU target equals plain
//!     greedy generation on 8 prompts (embedded pair) and 4 prompts (fixture pair), k = 7;
//! (c) timing of one block proposal (k = 7) on GPU and CPU for batch 1 and 4, greedy and sampled at
//!     T=1: `propose` wall-clock (readback included) and the GPU block pass, the Markov loop with its
//!     transfers and the Markov kernel alone in CUDA events; median and P90; the GPU with CUDA graphs
//!     (default) and with every kernel launched directly, and with the single-CTA Markov kernel.
//!
//! Exits nonzero on any parity failure.
//! cargo build --release -p specula-experiments --features cuda --bin gpu_dspark_check
//! Usage: gpu_dspark_check [--root DIR] [--fixture DIR] [--reps N]

use anyhow::{bail, Context, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use specula_drafters::dspark::gpu::{GpuBlock, GpuDSparkOptions};
use specula_drafters::dspark::{DSparkConfig, DSparkModel};
use specula_drafters::{DSparkDrafter, DraftProposal, DraftRequest, Drafter};
use specula_engine::{generate, generate_batch, GenerationRequest};
use specula_experiments::max_relative_error as max_rel;
use specula_kernels::cuda::dspark::{MarkovKernel, MarkovSeqParams};
use specula_kernels::cuda::{driver_available, GpuDevice};
use specula_kernels::sampling::{argmax, SamplingParams};
use specula_model::loader::load;
use specula_model::{ModelConfig, SafetensorsSource, SeqInput, Transformer, WeightDtype};
use specula_verifier::AcceptanceRule;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const LIMIT: f64 = 1e-2;
const K: usize = 7;

struct Tally {
    failures: Vec<String>,
    notes: Vec<String>,
}

impl Tally {
    fn check(&mut self, what: &str, err: f64) {
        let ok = err.is_finite() && err <= LIMIT;
        println!("  {what:<62} {err:.3e} {}", if ok { "ok" } else { "FAIL" });
        if !ok {
            self.failures.push(format!("{what}: {err:.3e}"));
        }
    }
    fn fail(&mut self, what: String) {
        println!("  FAIL {what}");
        self.failures.push(what);
    }
    /// A measured error that is printed, not gated.
    fn report(&mut self, what: &str, err: f64) {
        println!("  {what:<62} {err:.3e} (reported)");
    }
    fn note(&mut self, what: String) {
        println!("  note: {what}");
        self.notes.push(what);
    }
}

/// Loads a fresh CPU DSpark model for a target (two drafters cannot share one).
type ModelMaker = Box<dyn Fn(&Transformer) -> Result<DSparkModel>>;

/// A pair: the target, and a loader of its DSpark drafter.
struct Pair {
    name: String,
    target: Transformer,
    make: ModelMaker,
    prompts: Vec<Vec<u32>>,
}

fn fixture_target(dir: &Path) -> Result<Transformer> {
    let cfg = ModelConfig::from_hf_json(&std::fs::read_to_string(dir.join("target_config.json"))?)?;
    let src = SafetensorsSource::open(&[dir.join("target.safetensors")])?;
    Ok(Transformer::load(cfg, &src, WeightDtype::F32)?)
}

fn fixture_prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5, 17, 33, 5, 17, 33, 5, 17],
        vec![100, 101, 102, 103, 100, 101],
        vec![7; 5],
        (0..20).map(|i| (i * 31 + 3) % 500).collect(),
    ]
}

/// The fixture's drafter restricted to a subset of target ids (every third id plus some), with W1
/// indexed by target ids or, when `w1_pruned`, by draft ids: written to a temporary checkpoint with a
/// `d2t` map, as `drafters/tests/dspark_fixture.rs` builds it.
fn pruned_fixture(dir: &Path, target: &Transformer, w1_pruned: bool) -> Result<DSparkModel> {
    let bytes = std::fs::read(dir.join("dspark_draft.safetensors"))?;
    let draft = SafeTensors::deserialize(&bytes)?;
    let mut kept: Vec<u32> = (0..512).filter(|i| i % 3 == 0 || i % 7 == 1).collect();
    kept.sort_unstable();
    kept.dedup();
    let rows = |name: &str| -> Result<(Vec<u8>, Vec<usize>)> {
        let t = draft.tensor(name)?;
        let cols = t.shape()[1];
        let width = cols * t.dtype().bitsize() / 8;
        let mut out = Vec::new();
        for &i in &kept {
            out.extend_from_slice(&t.data()[i as usize * width..(i as usize + 1) * width]);
        }
        Ok((out, vec![kept.len(), cols]))
    };
    let d2t: Vec<u8> = kept
        .iter()
        .enumerate()
        .flat_map(|(i, &t)| (t as i64 - i as i64).to_le_bytes())
        .collect();
    let mut owned = Vec::new();
    for (name, t) in draft.tensors() {
        let replaced = match name.as_str() {
            "lm_head.weight" | "markov_head.markov_w2.weight" => Some(rows(&name)?),
            "markov_head.markov_w1.weight" if w1_pruned => Some(rows(&name)?),
            _ => None,
        };
        let (data, shape) = replaced.unwrap_or_else(|| (t.data().to_vec(), t.shape().to_vec()));
        owned.push((name, data, shape, t.dtype()));
    }
    owned.push((
        "d2t".to_string(),
        d2t,
        vec![kept.len()],
        safetensors::Dtype::I64,
    ));
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, d, s, dt)| Ok((n.clone(), TensorView::new(*dt, s.clone(), d)?)))
        .collect::<Result<_>>()?;
    let path = std::env::temp_dir().join(format!(
        "specula-gpu-dspark-pruned-{}-{w1_pruned}.safetensors",
        std::process::id()
    ));
    std::fs::write(&path, safetensors::serialize(views, None)?)?;
    let cfg = DSparkConfig::from_file(&dir.join("dspark_config.json"))?;
    let src = SafetensorsSource::open(std::slice::from_ref(&path))?;
    let model = DSparkModel::from_source(cfg, &src, target);
    std::fs::remove_file(&path)?;
    Ok(model?)
}

/// Tapped features of every prompt position and the target's greedy next token (the anchor).
fn features(target: &Transformer, layers: &[usize], prompt: &[u32]) -> Result<(Vec<f32>, u32)> {
    let mut cache = target.new_cache(prompt.len() + 64);
    let seq = cache.add_sequence();
    let out = target.forward(
        &mut cache,
        &[SeqInput {
            seq,
            tokens: prompt,
            num_logits: 1,
        }],
        layers,
    )?;
    let h = target.config.hidden_size;
    let mut f = Vec::with_capacity(prompt.len() * h * layers.len());
    for t in 0..prompt.len() {
        for l in &out.hidden {
            f.extend_from_slice(&l[t * h..(t + 1) * h]);
        }
    }
    Ok((f, argmax(&out.logits)?))
}

/// One sequence's CPU reference along its own greedy chain.
struct CpuChain {
    hidden: Vec<f32>,
    base: Vec<f32>,
    corrected: Vec<Vec<f32>>,
    conf: Vec<f32>,
    tokens: Vec<u32>,
}

fn cpu_chain(model: &DSparkModel, feats: &[f32], anchor: u32) -> Result<CpuChain> {
    let mut ctx = model.new_context();
    model.append_context(&mut ctx, feats)?;
    let out = model.block_forward(&[(&ctx, anchor)])?.remove(0);
    let (g, h, vd) = (
        model.config.block_size,
        model.config.hidden_size,
        model.draft_vocab(),
    );
    let mut chain = CpuChain {
        hidden: out.hidden.clone(),
        base: out.base_logits.clone(),
        corrected: Vec::new(),
        conf: Vec::new(),
        tokens: Vec::new(),
    };
    let mut prev = anchor;
    for j in 0..g {
        let e = model.markov_embedding(prev);
        if let Some(c) = model.confidence_logit(&out.hidden[j * h..(j + 1) * h], &e) {
            chain.conf.push(c);
        }
        let mut l = out.base_logits[j * vd..(j + 1) * vd].to_vec();
        model.add_markov_bias(&e, &mut l);
        let x = argmax(&l)? as usize;
        prev = model.draft_to_target().map_or(x as u32, |m| m[x]);
        chain.tokens.push(prev);
        chain.corrected.push(l);
    }
    Ok(chain)
}

/// Greedy tokens: equal, or a near-tie at the first difference (reported with its margin).
fn compare_tokens(
    tally: &mut Tally,
    what: &str,
    cpu: &[u32],
    gpu: &[u32],
    cpu_logits_at: impl Fn(usize) -> Option<Vec<f32>>,
    draft_index: impl Fn(u32) -> Option<usize>,
) -> usize {
    let same = cpu.iter().zip(gpu).take_while(|(a, b)| a == b).count();
    if same == cpu.len() && cpu.len() == gpu.len() {
        return same;
    }
    if same == cpu.len().min(gpu.len()) {
        tally.fail(format!(
            "{what}: {} CPU tokens but {} GPU tokens",
            cpu.len(),
            gpu.len()
        ));
        return same;
    }
    let (a, b) = (cpu[same], gpu[same]);
    match (cpu_logits_at(same), draft_index(a), draft_index(b)) {
        (Some(l), Some(ia), Some(ib)) => {
            let scale = l.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
            let margin = (l[ia] - l[ib]) as f64 / scale as f64;
            if margin <= LIMIT {
                tally.note(format!(
                    "{what}: slot {same}: CPU {a} vs GPU {b}, a near-tie (CPU logit margin \
                     {:.3e}, {margin:.2e} of max |logit|)",
                    l[ia] - l[ib]
                ));
            } else {
                tally.fail(format!(
                    "{what}: slot {same}: CPU {a} vs GPU {b}, CPU logit margin {:.3e} \
                     ({margin:.2e} of max |logit|): not a near-tie",
                    l[ia] - l[ib]
                ));
            }
        }
        _ => tally.fail(format!("{what}: slot {same}: CPU {a} vs GPU {b}")),
    }
    same
}

/// (a) Block pass, Markov loop and confidence head of a batch of four prompts, low level.
fn parity_block(
    tally: &mut Tally,
    pair: &Pair,
    device: &Arc<GpuDevice>,
    opts: &GpuDSparkOptions,
) -> Result<()> {
    println!(
        "{}: block pass over {} prompts",
        pair.name,
        pair.prompts.len()
    );
    let model = (pair.make)(&pair.target)?;
    let layers = model.config.target_layer_ids.clone();
    let g = model.config.block_size;
    let vd = model.draft_vocab();
    let vocab = model.config.vocab_size;
    let map = model.draft_to_target().map(|m| m.to_vec());
    let mut cpu = Vec::new();
    let mut inputs = Vec::new();
    for p in &pair.prompts {
        let (f, anchor) = features(&pair.target, &layers, p)?;
        cpu.push(cpu_chain(&model, &f, anchor)?);
        inputs.push((f, anchor, p.len()));
    }
    let mut d =
        DSparkDrafter::new((pair.make)(&pair.target)?).to_gpu(device.clone(), opts.clone())?;
    let gpu = d.gpu().context("GPU backend")?;
    let mut blocks = Vec::new();
    for (f, anchor, n) in &inputs {
        let slot = gpu.add_slot()?;
        // Two pieces, as the engine hands over prefill chunks.
        let w = f.len() / n;
        let cut = n / 2;
        gpu.append_context(slot, 0, &f[..cut * w])?;
        gpu.append_context(slot, cut, &f[cut * w..])?;
        blocks.push(GpuBlock {
            slot,
            ctx_len: *n,
            anchor: *anchor,
        });
    }
    gpu.block_pass(&blocks)?;
    let outs = gpu.read_block_outputs()?;
    // The first pass of a batch size runs directly and is captured; the second replays the graph
    // and must give the same bits.
    gpu.block_pass(&blocks)?;
    let replay = gpu.read_block_outputs()?;
    let identical = outs
        .iter()
        .zip(&replay)
        .all(|(a, b)| a.hidden == b.hidden && a.base_logits == b.base_logits);
    let how = match (opts.graphs, gpu.graph_error()) {
        (false, _) => "graphs off".to_string(),
        (true, None) => format!("graph replay, {} graphs captured", gpu.graph_count()),
        (true, Some(e)) => format!("graphs switched off by a failed capture: {e}"),
    };
    if identical && (!opts.graphs || gpu.graph_error().is_none()) {
        println!("  second block pass ({how}) bit-identical to the first          ok");
    } else {
        tally.fail(format!(
            "{}: second block pass ({how}) identical to the first: {identical}",
            pair.name
        ));
    }
    let params: Vec<MarkovSeqParams> = blocks
        .iter()
        .map(|b| MarkovSeqParams {
            anchor: b.anchor,
            slots: g,
            sampling: SamplingParams::greedy(),
            // The whole vocabulary: min(vocab_limit, vocab) unpruned, vocab_limit pruned.
            limit: vocab,
            confidence_threshold: None,
        })
        .collect();
    let results = gpu.markov_loop(&params, &vec![0.0; blocks.len() * g])?;
    let corrected = gpu.read_corrected_logits()?;
    let (mut e_hidden, mut e_base, mut e_markov, mut e_conf) = (0f64, 0f64, 0f64, 0f64);
    let mut e_conf_head = 0f64;
    for (i, ((c, o), r)) in cpu.iter().zip(&outs).zip(results).enumerate() {
        let r = r.map_err(|e| anyhow::anyhow!("prompt {i}: {e}"))?;
        e_hidden = e_hidden.max(max_rel(&o.hidden, &c.hidden));
        e_base = e_base.max(max_rel(&o.base_logits, &c.base));
        let same = compare_tokens(
            tally,
            &format!("{} prompt {i} greedy chain", pair.name),
            &c.tokens,
            &r.tokens,
            |j| c.corrected.get(j).cloned(),
            |t| match &map {
                None => Some(t as usize),
                Some(m) => m.iter().position(|&x| x == t),
            },
        );
        // Corrected logits and confidence are comparable along the common prefix of the chains
        // (slot j's inputs include token j - 1), plus the first slot after it.
        for j in 0..(same + 1).min(g) {
            let row = (i * g + j) * vd;
            e_markov = e_markov.max(max_rel(&corrected[row..row + vd], &c.corrected[j]));
        }
        if !c.conf.is_empty() {
            let n = (same + 1).min(g).min(r.confidence_logits.len());
            e_conf = e_conf.max(max_rel(&r.confidence_logits[..n], &c.conf[..n]));
            // The head alone: the CPU head on the GPU's own hidden states and the same previous
            // tokens (the chains agree before slot n).
            let h = model.config.hidden_size;
            let head: Vec<f32> = (0..n)
                .map(|j| {
                    let prev = if j == 0 {
                        blocks[i].anchor
                    } else {
                        c.tokens[j - 1]
                    };
                    let e = model.markov_embedding(prev);
                    model
                        .confidence_logit(&o.hidden[j * h..(j + 1) * h], &e)
                        .context("confidence head")
                })
                .collect::<Result<_>>()?;
            e_conf_head = e_conf_head.max(max_rel(&r.confidence_logits[..n], &head));
        }
    }
    tally.check(
        &format!("{} block hidden (after final norm)", pair.name),
        e_hidden,
    );
    tally.check(&format!("{} base logits", pair.name), e_base);
    tally.check(&format!("{} Markov-corrected logits", pair.name), e_markov);
    if cpu[0].conf.is_empty() {
        println!("  (no confidence head)");
    } else {
        // End to end, the confidence logit is one dot product over the block hidden state, whose
        // bf16-path error (checked above) it carries; with small logits and cancellation in the dot
        // its relative error can exceed the hidden state's (1.3e-2 on the fixture's random weights
        // against 7e-3 for the hidden state), so it is reported, and the head itself is checked on
        // the GPU's own hidden states.
        tally.check(
            &format!("{} confidence head on the GPU hidden states", pair.name),
            e_conf_head,
        );
        tally.report(
            &format!("{} confidence logits end to end", pair.name),
            e_conf,
        );
    }
    Ok(())
}

/// Both drafters through the `Drafter` interface: greedy and sampled proposals for a batch.
fn parity_drafter(
    tally: &mut Tally,
    pair: &Pair,
    device: &Arc<GpuDevice>,
    opts: &GpuDSparkOptions,
) -> Result<()> {
    println!(
        "{}: Drafter interface, batch of {}",
        pair.name,
        pair.prompts.len()
    );
    let mut cpu = DSparkDrafter::new((pair.make)(&pair.target)?);
    let mut gpu =
        DSparkDrafter::new((pair.make)(&pair.target)?).to_gpu(device.clone(), opts.clone())?;
    if gpu.name() != "dspark-gpu" || cpu.name() != "dspark" {
        tally.fail(format!("names: CPU {:?}, GPU {:?}", cpu.name(), gpu.name()));
    }
    let layers = cpu.tapped_target_layers().to_vec();
    let vocab = pair.target.config.vocab_size;
    for (i, p) in pair.prompts.iter().enumerate() {
        let (f, anchor) = features(&pair.target, &layers, p)?;
        let mut committed = p.clone();
        committed.push(anchor);
        for d in [&mut cpu, &mut gpu] {
            d.add_sequence(i as u64, &committed)?;
            d.append_target_features(i as u64, 0, &f)?;
        }
    }
    let settings = [
        ("greedy", SamplingParams::greedy()),
        (
            "sampled T=0.8 top-k 50 top-p 0.95",
            SamplingParams {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.95,
            },
        ),
    ];
    for (label, sampling) in settings {
        let run = |d: &mut DSparkDrafter| -> Result<Vec<DraftProposal>> {
            let mut streams: Vec<ChaCha8Rng> = (0..pair.prompts.len())
                .map(|i| ChaCha8Rng::seed_from_u64(1000 + i as u64))
                .collect();
            let mut reqs: Vec<DraftRequest> = streams
                .iter_mut()
                .enumerate()
                .map(|(i, s)| DraftRequest {
                    seq: i as u64,
                    max_tokens: K,
                    sampling,
                    vocab_limit: vocab,
                    uniforms: s,
                })
                .collect();
            Ok(d.propose(&mut reqs)?)
        };
        let (pc, pg) = (run(&mut cpu)?, run(&mut gpu)?);
        let (mut equal, mut total, mut e_q) = (0usize, 0usize, 0f64);
        for (i, (c, g)) in pc.iter().zip(&pg).enumerate() {
            let same = c
                .tokens
                .iter()
                .zip(&g.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            equal += same;
            total += c.tokens.len();
            let (qc, qg) = (c.probs.as_ref(), g.probs.as_ref());
            let (Some(qc), Some(qg)) = (qc, qg) else {
                tally.fail(format!(
                    "{} {label} prompt {i}: missing draft distributions",
                    pair.name
                ));
                continue;
            };
            // q of the slots both drafted from the same prefix (for greedy, q is one-hot at the
            // token, so a differing token's slot is left to the near-tie classification).
            let upto = if sampling.is_greedy() { same } else { same + 1 };
            for j in 0..upto.min(qc.len()).min(qg.len()) {
                if qc[j].len() != qg[j].len() {
                    tally.fail(format!(
                        "{} {label} prompt {i} slot {j}: q over {} vs {} ids",
                        pair.name,
                        qc[j].len(),
                        qg[j].len()
                    ));
                    continue;
                }
                e_q = e_q.max(max_rel(&qg[j], &qc[j]));
            }
            if same < c.tokens.len() {
                tally.note(format!(
                    "{} {label} prompt {i}: tokens differ from slot {same} (CPU {:?}, GPU {:?})",
                    pair.name, c.tokens, g.tokens
                ));
            }
        }
        println!("  {label}: {equal}/{total} draft tokens equal");
        if sampling.is_greedy() {
            tally.check(
                &format!("{} {label}: draft distributions q", pair.name),
                e_q,
            );
            if equal != total {
                // Greedy differences were classified (near-tie or not) by the block-level check.
                tally.note(format!(
                    "{} greedy: {} of {total} draft tokens differ",
                    pair.name,
                    total - equal
                ));
            }
        } else {
            // Sampled q end to end carries the block pass's bf16 error through softmax, top-k and
            // top-p (a boundary entry can be kept on one side only), so it is reported here and
            // held to the limit by the fused-loop check below, which feeds both loops the same
            // block outputs.
            println!(
                "  {label}: draft distributions q end to end: max rel err {e_q:.3e} (reported)"
            );
        }
    }
    Ok(())
}

/// The fused Markov loop against the CPU drafter's loop over the same block outputs (the GPU's,
/// read back) with the same uniforms: what is left is the loop itself (bf16 Markov weights on the
/// device, summation order), so tokens must agree and q must match to the limit, greedy and sampled.
fn markov_exactness(
    tally: &mut Tally,
    pair: &Pair,
    device: &Arc<GpuDevice>,
    opts: &GpuDSparkOptions,
) -> Result<()> {
    println!(
        "{}: fused Markov loop vs the CPU loop on the same block outputs",
        pair.name
    );
    let model = (pair.make)(&pair.target)?;
    let mut d =
        DSparkDrafter::new((pair.make)(&pair.target)?).to_gpu(device.clone(), opts.clone())?;
    let layers = model.config.target_layer_ids.clone();
    let g = model.config.block_size;
    let vocab = pair.target.config.vocab_size;
    for (i, p) in pair.prompts.iter().enumerate() {
        let (f, anchor) = features(&pair.target, &layers, p)?;
        let mut committed = p.clone();
        committed.push(anchor);
        d.add_sequence(i as u64, &committed)?;
        d.append_target_features(i as u64, 0, &f)?;
    }
    let blocks: Vec<GpuBlock> = (0..pair.prompts.len() as u64)
        .map(|s| d.gpu_block_of(s).context("GPU block"))
        .collect::<Result<_>>()?;
    let gpu = d.gpu().context("GPU backend")?;
    gpu.block_pass(&blocks)?;
    let outs = gpu.read_block_outputs()?;
    let settings = [
        ("greedy", SamplingParams::greedy()),
        (
            "sampled T=1",
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
        ),
        (
            "sampled T=0.8 top-k 50 top-p 0.95",
            SamplingParams {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.95,
            },
        ),
    ];
    for (label, sampling) in settings {
        let seed = |i: usize| ChaCha8Rng::seed_from_u64(77 + i as u64);
        let mut uniforms = vec![0f64; blocks.len() * g];
        if !sampling.is_greedy() {
            for i in 0..blocks.len() {
                let mut s = seed(i);
                for u in &mut uniforms[i * g..(i + 1) * g] {
                    *u = specula_verifier::UniformSource::next_uniform(&mut s);
                }
            }
        }
        let params: Vec<MarkovSeqParams> = blocks
            .iter()
            .map(|b| MarkovSeqParams {
                anchor: b.anchor,
                slots: g,
                sampling,
                limit: vocab,
                confidence_threshold: None,
            })
            .collect();
        let fused = gpu.markov_loop(&params, &uniforms)?;
        let kernel = kernel_name(gpu.last_markov_kernel());
        let (mut e_q, mut equal, mut total) = (0f64, 0usize, 0usize);
        for (i, (f, out)) in fused.into_iter().zip(&outs).enumerate() {
            let f = f.map_err(|e| anyhow::anyhow!("prompt {i}: {e}"))?;
            let mut s = seed(i);
            let mut req = DraftRequest {
                seq: i as u64,
                max_tokens: g,
                sampling,
                vocab_limit: vocab,
                uniforms: &mut s,
            };
            let (c, _) =
                DSparkDrafter::host_markov_loop(&model, None, out, blocks[i].anchor, &mut req)?;
            let same = c
                .tokens
                .iter()
                .zip(&f.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            equal += same;
            total += c.tokens.len();
            let qc = c.probs.context("CPU q")?;
            let upto = if sampling.is_greedy() { same } else { same + 1 };
            for (j, (q_cpu, q_gpu)) in qc.iter().zip(&f.probs).take(upto).enumerate() {
                if q_cpu.len() != q_gpu.len() {
                    tally.fail(format!(
                        "{} {label} prompt {i} slot {j}: q over {} vs {} ids",
                        pair.name,
                        q_cpu.len(),
                        q_gpu.len()
                    ));
                    continue;
                }
                e_q = e_q.max(max_rel(q_gpu, q_cpu));
            }
            if same < c.tokens.len() || c.tokens.len() != f.tokens.len() {
                let what = format!(
                    "{} {label} prompt {i}: fused loop tokens {:?}, CPU loop {:?}",
                    pair.name, f.tokens, c.tokens
                );
                if sampling.is_greedy() {
                    tally.fail(what);
                } else {
                    // A sampled draw can only move when the uniform falls within the q difference
                    // of a CDF boundary; the q check bounds that difference.
                    tally.note(what);
                }
            }
        }
        println!("  {label} ({kernel}): {equal}/{total} tokens equal");
        tally.check(
            &format!("{} fused loop {label} ({kernel}): q", pair.name),
            e_q,
        );
    }
    Ok(())
}

/// (b) Greedy speculative generation with the GPU drafter equals plain greedy generation.
fn speculative_equality(
    tally: &mut Tally,
    pair: &Pair,
    device: &Arc<GpuDevice>,
    opts: &GpuDSparkOptions,
) -> Result<()> {
    let max_new = 48;
    let reqs: Vec<GenerationRequest> = pair
        .prompts
        .iter()
        .map(|p| GenerationRequest {
            prompt_ids: p.clone(),
            max_new_tokens: max_new,
            sampling: SamplingParams::greedy(),
            seed: 0,
            stop_token_ids: vec![],
            vocab_limit: None,
            stop_strings: vec![],
            num_draft_tokens: K,
        })
        .collect();
    let mut d =
        DSparkDrafter::new((pair.make)(&pair.target)?).to_gpu(device.clone(), opts.clone())?;
    let out = generate_batch(
        &pair.target,
        Some(&mut d),
        &AcceptanceRule::Greedy,
        &reqs,
        None,
    )?;
    let mut equal = 0;
    for (i, (o, r)) in out.outputs.iter().zip(&reqs).enumerate() {
        let mut plain = r.clone();
        plain.num_draft_tokens = 0;
        let want = generate(&pair.target, &plain, |_| {})?.token_ids;
        if o.token_ids == want {
            equal += 1;
        } else {
            tally.fail(format!(
                "{} prompt {i}: speculative greedy (GPU DSpark) differs from plain greedy",
                pair.name
            ));
        }
    }
    println!(
        "{}: greedy speculation with the GPU DSpark drafter, k = {K}: {equal}/{} outputs equal \
         plain greedy; AL {:.2}, drafter {:?}",
        pair.name,
        reqs.len(),
        out.run.acceptance_length.unwrap_or(1.0),
        out.run.drafter
    );
    Ok(())
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// A short name of a Markov kernel choice, for reports.
fn kernel_name(k: Option<MarkovKernel>) -> &'static str {
    match k {
        None => "none",
        Some(MarkovKernel::SingleCta) => "single CTA",
        Some(MarkovKernel::Cluster { w2_shared: true }) => "cluster, W2 in smem",
        Some(MarkovKernel::Cluster { w2_shared: false }) => "cluster, W2 global",
    }
}

struct TimingRow {
    graphs: bool,
    markov: &'static str,
    sampling: &'static str,
    batch: usize,
    cpu_wall: (f64, f64),
    gpu_wall: (f64, f64),
    gpu_block: (f64, f64),
    gpu_markov: (f64, f64),
    gpu_markov_kernel: (f64, f64),
}

/// (c) One block proposal (k = 7), GPU vs CPU, batch 1 and 4, greedy and sampled at temperature 1,
/// on the embedded pair; the GPU drafter with `opts` (graphs on or off).
fn timing(
    pair: &Pair,
    device: &Arc<GpuDevice>,
    opts: &GpuDSparkOptions,
    reps: usize,
    with_cpu: bool,
) -> Result<Vec<TimingRow>> {
    let mut cpu = DSparkDrafter::new((pair.make)(&pair.target)?);
    let mut gpu =
        DSparkDrafter::new((pair.make)(&pair.target)?).to_gpu(device.clone(), opts.clone())?;
    let layers = cpu.tapped_target_layers().to_vec();
    let vocab = pair.target.config.vocab_size;
    for (i, p) in pair.prompts.iter().take(4).enumerate() {
        let (f, anchor) = features(&pair.target, &layers, p)?;
        let mut committed = p.clone();
        committed.push(anchor);
        for d in [&mut cpu, &mut gpu] {
            d.add_sequence(i as u64, &committed)?;
            d.append_target_features(i as u64, 0, &f)?;
        }
    }
    let propose = |d: &mut DSparkDrafter, batch: usize, sampling: SamplingParams| -> Result<f64> {
        let mut streams: Vec<ChaCha8Rng> = (0..batch)
            .map(|i| ChaCha8Rng::seed_from_u64(i as u64))
            .collect();
        let mut reqs: Vec<DraftRequest> = streams
            .iter_mut()
            .enumerate()
            .map(|(i, s)| DraftRequest {
                seq: i as u64,
                max_tokens: K,
                sampling,
                vocab_limit: vocab,
                uniforms: s,
            })
            .collect();
        let t = Instant::now();
        d.propose(&mut reqs)?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    };
    let mut rows = Vec::new();
    let settings = [
        ("greedy", SamplingParams::greedy()),
        (
            "T=1",
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
        ),
    ];
    for (label, sampling) in settings {
        for batch in [1usize, 4] {
            let mut cw = Vec::new();
            let mut gw = Vec::new();
            for _ in 0..3 {
                if with_cpu {
                    propose(&mut cpu, batch, sampling)?;
                }
                propose(&mut gpu, batch, sampling)?;
            }
            for _ in 0..reps {
                if with_cpu {
                    cw.push(propose(&mut cpu, batch, sampling)?);
                }
                gw.push(propose(&mut gpu, batch, sampling)?);
            }
            // Device times with CUDA events: the block pass alone, then the Markov loop with its
            // uploads and readback (it synchronises on its results), and the Markov kernel alone.
            // The device part of a proposal, re-run on the drafter's own context slots.
            let blocks: Vec<GpuBlock> = (0..batch as u64)
                .map(|seq| gpu.gpu_block_of(seq).context("GPU block"))
                .collect::<Result<_>>()?;
            let block = gpu.block_size();
            let g = gpu.gpu().context("GPU backend")?;
            g.set_kernel_timing(true)?;
            let s = g.device().stream.clone();
            let ctx = s.context().clone();
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let (e0, e1, e2) = (
                ctx.new_event(flags)?,
                ctx.new_event(flags)?,
                ctx.new_event(flags)?,
            );
            let (mut bt, mut mt, mut kt) = (Vec::new(), Vec::new(), Vec::new());
            let params: Vec<MarkovSeqParams> = blocks
                .iter()
                .map(|b| MarkovSeqParams {
                    anchor: b.anchor,
                    slots: block,
                    sampling,
                    limit: vocab,
                    confidence_threshold: None,
                })
                .collect();
            let uniforms: Vec<f64> = (0..batch * block)
                .map(|i| (i as f64 + 0.5) / 64.0 % 1.0)
                .collect();
            for _ in 0..reps {
                e0.record(&s)?;
                g.block_pass(&blocks)?;
                e1.record(&s)?;
                g.markov_loop(&params, &uniforms)?;
                e2.record(&s)?;
                e2.synchronize()?;
                bt.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
                mt.push(e1.elapsed_ms(&e2)? as f64 * 1e3);
                kt.push(g.last_markov_kernel_ms()?.context("kernel timing")? as f64 * 1e3);
            }
            g.set_kernel_timing(false)?;
            let p = |v: &mut Vec<f64>| {
                if v.is_empty() {
                    (f64::NAN, f64::NAN)
                } else {
                    (percentile(v, 0.5), percentile(v, 0.9))
                }
            };
            rows.push(TimingRow {
                graphs: opts.graphs,
                markov: kernel_name(g.last_markov_kernel()),
                sampling: label,
                batch,
                cpu_wall: p(&mut cw),
                gpu_wall: p(&mut gw),
                gpu_block: p(&mut bt),
                gpu_markov: p(&mut mt),
                gpu_markov_kernel: p(&mut kt),
            });
        }
    }
    Ok(rows)
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let root = arg("--root").map_or_else(repo_root, PathBuf::from);
    let fixture = arg("--fixture").map_or_else(
        || root.join("../shared/fixtures/dspark-deepspec"),
        PathBuf::from,
    );
    let reps: usize = arg("--reps").map_or(Ok(50), |v| v.parse())?;
    if !driver_available() {
        bail!("no CUDA driver on this machine: the GPU DSpark check needs a GPU (the CPU drafter is the fallback)");
    }
    let started = Instant::now();
    let device = Arc::new(GpuDevice::new(0)?);
    println!("device: {} ({})", device.name, device.arch);
    let opts = GpuDSparkOptions {
        max_sequences: 8,
        max_context: 1024,
        ..Default::default()
    };
    let mut tally = Tally {
        failures: Vec::new(),
        notes: Vec::new(),
    };

    // The pairs.
    if !fixture.exists() {
        bail!("{} is missing (pass --fixture DIR)", fixture.display());
    }
    let fx = fixture.clone();
    let fixture_pair = Pair {
        name: "fixture".into(),
        target: fixture_target(&fixture)?,
        make: Box::new(move |t| {
            let cfg = DSparkConfig::from_file(&fx.join("dspark_config.json"))?;
            let src = SafetensorsSource::open(&[fx.join("dspark_draft.safetensors")])?;
            Ok(DSparkModel::from_source(cfg, &src, t)?)
        }),
        prompts: fixture_prompts(),
    };
    let pruned_pairs: Vec<Pair> = [false, true]
        .into_iter()
        .map(|w1_pruned| -> Result<Pair> {
            let fx = fixture.clone();
            Ok(Pair {
                name: format!(
                    "fixture pruned (W1 by {} ids)",
                    if w1_pruned { "draft" } else { "target" }
                ),
                target: fixture_target(&fixture)?,
                make: Box::new(move |t| pruned_fixture(&fx, t, w1_pruned)),
                prompts: fixture_prompts(),
            })
        })
        .collect::<Result<_>>()?;
    let loaded = load(&root.join("models/default/target"), WeightDtype::Auto)
        .context("loading models/default/target")?;
    let tok = loaded
        .tokenizer
        .context("the embedded target has a tokenizer")?;
    let texts = [
        "def read_config(path):",
        "import os\n\nclass Cache:\n    def __init__(self",
        "KING HENRY:\nWhat says",
        "for i in range(",
        "The quick brown fox",
        "fn main() {\n    let",
        "ROMEO:\nBut soft, what light",
        "# Compute the mean of a list\ndef mean(xs):",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false))
        .collect::<Result<_, _>>()?;
    let dsdir = root.join("models/default/dspark");
    let default_pair = Pair {
        name: "embedded".into(),
        target: loaded.model,
        make: Box::new(move |t| Ok(DSparkModel::load(&dsdir, t)?)),
        prompts,
    };
    println!("\n(a) parity with the CPU DSpark drafter (limit {LIMIT:.0e}, max relative error):");
    for pair in [
        &fixture_pair,
        &pruned_pairs[0],
        &pruned_pairs[1],
        &default_pair,
    ] {
        parity_block(&mut tally, pair, &device, &opts)?;
        parity_drafter(&mut tally, pair, &device, &opts)?;
        // Every Markov kernel against the CPU loop: the default choice (the cluster loop with W2 in
        // shared memory on sm_90+, the single-CTA loop for top-k / top-p), the cluster loop reading
        // W2 from global memory, and the single-CTA loop for every setting.
        for (cluster, w2_shared) in [(true, true), (true, false), (false, true)] {
            let o = GpuDSparkOptions {
                markov_cluster: cluster,
                markov_w2_shared: w2_shared,
                ..opts.clone()
            };
            markov_exactness(&mut tally, pair, &device, &o)?;
        }
    }

    println!(
        "\n(b) greedy speculative generation, GPU DSpark drafter + CPU target vs plain greedy:"
    );
    speculative_equality(&mut tally, &default_pair, &device, &opts)?;
    speculative_equality(&mut tally, &fixture_pair, &device, &opts)?;

    println!("\n(c) timing one block proposal (k = {K}), {reps} repetitions:");
    let mut rows = timing(&default_pair, &device, &opts, reps, true)?;
    let direct = GpuDSparkOptions {
        graphs: false,
        ..opts.clone()
    };
    rows.extend(timing(&default_pair, &device, &direct, reps, false)?);
    let single_cta = GpuDSparkOptions {
        markov_cluster: false,
        ..opts.clone()
    };
    rows.extend(timing(&default_pair, &device, &single_cta, reps, false)?);

    println!("\nsummary ({:.1} s):", started.elapsed().as_secs_f64());
    println!("  embedded pair, k = {K}, us p50 / p90; block pass and Markov loop (uploads, kernel, readback) in CUDA events");
    println!(
        "  {:<7} {:<20} {:<7} {:<6} {:>18} {:>18} {:>18} {:>22} {:>18}",
        "graphs",
        "Markov kernel",
        "drafts",
        "batch",
        "CPU propose",
        "GPU propose",
        "GPU block pass",
        "GPU Markov+transfers",
        "Markov kernel"
    );
    let f = |v: (f64, f64)| {
        if v.0.is_nan() {
            "-".to_string()
        } else {
            format!("{:.1} / {:.1}", v.0, v.1)
        }
    };
    for r in &rows {
        println!(
            "  {:<7} {:<20} {:<7} {:<6} {:>18} {:>18} {:>18} {:>22} {:>18}",
            if r.graphs { "on" } else { "off" },
            r.markov,
            r.sampling,
            r.batch,
            f(r.cpu_wall),
            f(r.gpu_wall),
            f(r.gpu_block),
            f(r.gpu_markov),
            f(r.gpu_markov_kernel),
        );
    }
    println!("  notes: {}", tally.notes.len());
    if !tally.failures.is_empty() {
        println!("  FAILURES ({}):", tally.failures.len());
        for f in &tally.failures {
            println!("    {f}");
        }
        bail!("{} parity failure(s)", tally.failures.len());
    }
    println!("  all parity checks passed");
    Ok(())
}
