//! Parity of the DSpark drafter with DeepSeek's public DeepSpec reference implementation, on the
//! outputs it produced for a tiny random Qwen3 target and drafter (`shared/fixtures/dspark-deepspec`,
//! f32): context features, block hidden states, base logits, Markov-corrected logits along the
//! greedy chain, greedy draft tokens and confidence logits.

use safetensors::SafeTensors;
use specula_drafters::dspark::{DSparkConfig, DSparkDrafter, DSparkModel};
use specula_drafters::{DraftRequest, Drafter};
use specula_kernels::sampling::SamplingParams;
use specula_model::{ModelConfig, SafetensorsSource, SeqInput, Transformer, WeightDtype};
use specula_verifier::UniformSource;
use std::path::{Path, PathBuf};

fn fixture_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/dspark-deepspec");
    assert!(
        dir.exists(),
        "{} is missing: the shared fixtures must sit beside the repository",
        dir.display()
    );
    dir
}

fn read_f32(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_ids(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::I64, "{name}");
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

/// max |ours - ref| / max |ref| over the tensor.
fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
    diff / scale
}

struct Fixture {
    target: Transformer,
    drafter: DSparkModel,
    expected: Vec<u8>,
}

fn load() -> Fixture {
    let dir = fixture_dir();
    let cfg = ModelConfig::from_hf_json(
        &std::fs::read_to_string(dir.join("target_config.json")).unwrap(),
    )
    .unwrap();
    let src = SafetensorsSource::open(&[dir.join("target.safetensors")]).unwrap();
    let target = Transformer::load(cfg, &src, WeightDtype::F32).unwrap();
    let dcfg = DSparkConfig::from_file(&dir.join("dspark_config.json")).unwrap();
    let dsrc = SafetensorsSource::open(&[dir.join("dspark_draft.safetensors")]).unwrap();
    let drafter = DSparkModel::from_source(dcfg, &dsrc, &target).unwrap();
    Fixture {
        target,
        drafter,
        expected: std::fs::read(dir.join("expected.safetensors")).unwrap(),
    }
}

const LIMIT: f64 = 1e-4;

/// The target's tapped features, computed by our forward, for the prompt.
fn target_features(f: &Fixture, prompt: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let layers = f.drafter.config.target_layer_ids.clone();
    let mut cache = f.target.new_cache(64);
    let seq = cache.add_sequence();
    let out = f
        .target
        .forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: prompt,
                num_logits: prompt.len(),
            }],
            &layers,
        )
        .unwrap();
    let h = f.target.config.hidden_size;
    let mut features = Vec::new();
    for t in 0..prompt.len() {
        for l in &out.hidden {
            features.extend_from_slice(&l[t * h..(t + 1) * h]);
        }
    }
    (features, out.logits)
}

#[test]
fn block_pass_markov_chain_and_confidence_match_deepspec() {
    let f = load();
    let st = SafeTensors::deserialize(&f.expected).unwrap();
    let prompt = read_ids(&st, "prompt_ids");
    let (features, target_logits) = target_features(&f, &prompt);
    let e = rel_err(&target_logits, &read_f32(&st, "target_logits"));
    assert!(e <= LIMIT, "target logits rel err {e}");
    let expected_features = read_f32(&st, "context_features");
    let e = rel_err(&features, &expected_features);
    assert!(e <= LIMIT, "context features rel err {e}");

    // The block from the reference's own features, so the drafter is checked on its own.
    let mut ctx = f.drafter.new_context();
    f.drafter
        .append_context(&mut ctx, &expected_features)
        .unwrap();
    let block_ids = read_ids(&st, "block_input_ids");
    let g = f.drafter.config.block_size;
    assert_eq!(block_ids.len(), g);
    assert!(block_ids[1..]
        .iter()
        .all(|&t| t == f.drafter.config.mask_token_id));
    let out = f.drafter.block_forward(&[(&ctx, block_ids[0])]).unwrap();
    let out = &out[0];
    let e_hidden = rel_err(&out.hidden, &read_f32(&st, "block_hidden"));
    assert!(e_hidden <= LIMIT, "block hidden rel err {e_hidden}");
    let e_base = rel_err(&out.base_logits, &read_f32(&st, "base_logits"));
    assert!(e_base <= LIMIT, "base logits rel err {e_base}");

    // The Markov loop along the greedy chain.
    let v = f.drafter.config.vocab_size;
    let h = f.drafter.config.hidden_size;
    let mut prev = block_ids[0];
    let mut corrected = Vec::new();
    let mut tokens = Vec::new();
    let mut confidence = Vec::new();
    for j in 0..g {
        let emb = f.drafter.markov_embedding(prev);
        let mut logits = out.base_logits[j * v..(j + 1) * v].to_vec();
        f.drafter.add_markov_bias(&emb, &mut logits);
        confidence.push(
            f.drafter
                .confidence_logit(&out.hidden[j * h..(j + 1) * h], &emb)
                .unwrap(),
        );
        prev = specula_kernels::sampling::argmax(&logits).unwrap();
        tokens.push(prev);
        corrected.extend_from_slice(&logits);
    }
    let e_markov = rel_err(&corrected, &read_f32(&st, "markov_corrected_logits"));
    assert!(
        e_markov <= LIMIT,
        "Markov-corrected logits rel err {e_markov}"
    );
    assert_eq!(tokens, read_ids(&st, "greedy_draft_tokens"));
    let e_conf = rel_err(&confidence, &read_f32(&st, "confidence_logits"));
    assert!(e_conf <= LIMIT, "confidence logits rel err {e_conf}");
    eprintln!(
        "DSpark vs DeepSpec: block hidden {e_hidden:.2e}, base logits {e_base:.2e}, \
         Markov logits {e_markov:.2e}, confidence {e_conf:.2e}, greedy tokens equal"
    );
}

struct Zero;
impl UniformSource for Zero {
    fn next_uniform(&mut self) -> f64 {
        0.5
    }
}

/// The same through the `Drafter` interface, fed with our target's features in two pieces (as the
/// engine does after prefill chunks) and batched with a second sequence: same greedy tokens, and the
/// second sequence does not change the first's drafts.
#[test]
fn drafter_interface_reproduces_the_greedy_draft() {
    let f = load();
    let st = SafeTensors::deserialize(&f.expected).unwrap();
    let prompt = read_ids(&st, "prompt_ids");
    let (features, _) = target_features(&f, &prompt);
    let anchor = read_ids(&st, "block_input_ids")[0];
    let expected = read_ids(&st, "greedy_draft_tokens");
    let w = f.drafter.feature_width();
    let mut d = DSparkDrafter::new(f.drafter);
    assert_eq!(d.tapped_target_layers(), &[0, 2]);
    let mut committed = prompt.clone();
    committed.push(anchor);
    d.add_sequence(1, &committed).unwrap();
    d.append_target_features(1, 0, &features[..5 * w]).unwrap();
    // Out of order: refused, state unchanged.
    assert!(d.append_target_features(1, 7, &features[5 * w..]).is_err());
    d.append_target_features(1, 5, &features[5 * w..]).unwrap();
    // A second, shorter sequence in the same batch.
    let mut other = prompt[..6].to_vec();
    other.push(3);
    d.add_sequence(2, &other).unwrap();
    d.append_target_features(2, 0, &features[..6 * w]).unwrap();
    let (mut u1, mut u2) = (Zero, Zero);
    let mut reqs = vec![
        DraftRequest {
            seq: 1,
            max_tokens: 7,
            sampling: SamplingParams::greedy(),
            vocab_limit: 512,
            uniforms: &mut u1,
        },
        DraftRequest {
            seq: 2,
            max_tokens: 3,
            sampling: SamplingParams::greedy(),
            vocab_limit: 512,
            uniforms: &mut u2,
        },
    ];
    let p = d.propose(&mut reqs).unwrap();
    assert_eq!(p[0].tokens, expected);
    assert_eq!(p[1].tokens.len(), 3);
    assert_eq!(d.last_trace(1).unwrap().confidence_logits.len(), 7);
    // A sequence whose features lag behind its tokens is an engine bug: refused clearly.
    d.commit(1, &[5, 6]).unwrap();
    let mut u = Zero;
    let err = d
        .propose(&mut [DraftRequest {
            seq: 1,
            max_tokens: 7,
            sampling: SamplingParams::greedy(),
            vocab_limit: 512,
            uniforms: &mut u,
        }])
        .unwrap_err();
    assert!(err.to_string().contains("context rows"), "{err}");
}

/// A pruned draft vocabulary (`d2t`): the fixture's drafter restricted to a subset S of target ids
/// that holds the greedy chain. Its logits on S equal the full drafter's, so the greedy draft is the
/// same; sampled draft distributions put no mass outside S. Both layouts of W1 (target-indexed and
/// draft-indexed) are checked.
#[test]
fn pruned_draft_vocabulary_maps_back_to_target_ids() {
    use safetensors::tensor::TensorView;
    let dir = fixture_dir();
    let expected_bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&expected_bytes).unwrap();
    let prompt = read_ids(&st, "prompt_ids");
    let anchor = read_ids(&st, "block_input_ids")[0];
    let greedy = read_ids(&st, "greedy_draft_tokens");
    let draft_bytes = std::fs::read(dir.join("dspark_draft.safetensors")).unwrap();
    let draft = SafeTensors::deserialize(&draft_bytes).unwrap();
    let mut kept: Vec<u32> = (0..512).filter(|i| i % 3 == 0).collect();
    kept.extend(greedy.iter().copied());
    kept.push(anchor);
    kept.sort_unstable();
    kept.dedup();
    let rows = |name: &str, ids: &[u32]| -> (Vec<u8>, Vec<usize>) {
        let t = draft.tensor(name).unwrap();
        let cols = t.shape()[1];
        let mut out = Vec::new();
        for &i in ids {
            out.extend_from_slice(&t.data()[i as usize * cols * 4..(i as usize + 1) * cols * 4]);
        }
        (out, vec![ids.len(), cols])
    };
    let d2t: Vec<u8> = kept
        .iter()
        .enumerate()
        .flat_map(|(i, &t)| (t as i64 - i as i64).to_le_bytes())
        .collect();
    for w1_pruned in [false, true] {
        let mut owned: Vec<(String, Vec<u8>, Vec<usize>, safetensors::Dtype)> = Vec::new();
        for (name, t) in draft.tensors() {
            let replaced = match name.as_str() {
                "lm_head.weight" | "markov_head.markov_w2.weight" => Some(rows(&name, &kept)),
                "markov_head.markov_w1.weight" if w1_pruned => Some(rows(&name, &kept)),
                _ => None,
            };
            let (data, shape) = replaced.unwrap_or_else(|| (t.data().to_vec(), t.shape().to_vec()));
            owned.push((name, data, shape, safetensors::Dtype::F32));
        }
        owned.push((
            "d2t".into(),
            d2t.clone(),
            vec![kept.len()],
            safetensors::Dtype::I64,
        ));
        let views: Vec<(String, TensorView)> = owned
            .iter()
            .map(|(n, d, s, dt)| (n.clone(), TensorView::new(*dt, s.clone(), d).unwrap()))
            .collect();
        let path = std::env::temp_dir().join(format!(
            "specula-dspark-pruned-{}-{w1_pruned}.safetensors",
            std::process::id()
        ));
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();

        let f = load();
        let dcfg = DSparkConfig::from_file(&dir.join("dspark_config.json")).unwrap();
        let src = SafetensorsSource::open(std::slice::from_ref(&path)).unwrap();
        let pruned = DSparkModel::from_source(dcfg, &src, &f.target).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(pruned.draft_vocab(), kept.len());
        assert_eq!(pruned.draft_to_target().unwrap(), kept.as_slice());
        let (features, _) = target_features(&f, &prompt);
        let mut d = DSparkDrafter::new(pruned);
        let mut committed = prompt.clone();
        committed.push(anchor);
        d.add_sequence(1, &committed).unwrap();
        d.append_target_features(1, 0, &features).unwrap();
        let mut u = Zero;
        let p = d
            .propose(&mut [DraftRequest {
                seq: 1,
                max_tokens: 7,
                sampling: SamplingParams::greedy(),
                vocab_limit: 512,
                uniforms: &mut u,
            }])
            .unwrap();
        assert_eq!(p[0].tokens, greedy, "W1 pruned: {w1_pruned}");
        let mut u = Zero;
        let p = d
            .propose(&mut [DraftRequest {
                seq: 1,
                max_tokens: 3,
                sampling: SamplingParams {
                    temperature: 1.0,
                    top_k: 0,
                    top_p: 1.0,
                },
                vocab_limit: 512,
                uniforms: &mut u,
            }])
            .unwrap();
        for (q, &t) in p[0].probs.as_ref().unwrap().iter().zip(&p[0].tokens) {
            assert_eq!(q.len(), 512);
            let mass: f64 = q.iter().map(|&v| v as f64).sum();
            assert!((mass - 1.0).abs() < 1e-5);
            assert!(q[t as usize] > 0.0 && kept.contains(&t));
            for (id, &v) in q.iter().enumerate() {
                if !kept.contains(&(id as u32)) {
                    assert_eq!(
                        v, 0.0,
                        "mass on target id {id} outside the draft vocabulary"
                    );
                }
            }
        }
    }
}
