//! The CPU forward is batch-invariant: a position's logits are bit-identical whether it is computed
//! in a 1-token step, an 8-token step, a whole prefill, or beside other sequences. Greedy speculative
//! decoding equals plain greedy decoding only because of this.

use proptest::prelude::*;
use specula_model::{ModelConfig, SafetensorsSource, SeqInput, Transformer, WeightDtype};
use std::path::Path;

fn fixture(arch: &str, dtype: WeightDtype) -> Transformer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf_parity")
        .join(arch);
    let cfg = ModelConfig::from_hf_json(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let src = SafetensorsSource::open(&[dir.join("model.safetensors")]).unwrap();
    Transformer::load(cfg, &src, dtype).unwrap()
}

/// Logits of every position of `tokens`, fed in chunks of the given sizes.
fn logits_in_chunks(model: &Transformer, tokens: &[u32], chunks: &[usize]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(512);
    let seq = cache.add_sequence();
    let mut out = Vec::new();
    let mut i = 0;
    let mut c = 0;
    while i < tokens.len() {
        let n = chunks[c % chunks.len()].min(tokens.len() - i);
        let o = model
            .forward(
                &mut cache,
                &[SeqInput {
                    seq,
                    tokens: &tokens[i..i + n],
                    num_logits: n,
                }],
                &[],
            )
            .unwrap();
        for j in 0..n {
            out.push(o.row(0, j).to_vec());
        }
        i += n;
        c += 1;
    }
    out
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn one_token_steps_equal_eight_token_steps_bitwise() {
    for (arch, dtype) in [
        ("qwen2", WeightDtype::Bf16),
        ("qwen3", WeightDtype::F32),
        ("llama", WeightDtype::Bf16),
    ] {
        let model = fixture(arch, dtype);
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 320).collect();
        let one = logits_in_chunks(&model, &tokens, &[1]);
        let eight = logits_in_chunks(&model, &tokens, &[8]);
        let prefill_then_eight = logits_in_chunks(&model, &tokens, &[17, 8]);
        assert_eq!(bits(&one), bits(&eight), "{arch}: 1-token vs 8-token steps");
        assert_eq!(
            bits(&one),
            bits(&prefill_then_eight),
            "{arch}: prefill + 8-token steps"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Random chunkings, with a second sequence of random length sharing every step.
    #[test]
    fn random_chunks_and_batch_neighbours_do_not_change_logits(
        tokens in proptest::collection::vec(0u32..320, 1..30),
        chunks in proptest::collection::vec(1usize..9, 1..5),
        other in proptest::collection::vec(0u32..320, 1..12),
    ) {
        let model = fixture("qwen2", WeightDtype::Bf16);
        let reference = bits(&logits_in_chunks(&model, &tokens, &[1]));
        let mut cache = model.new_cache(512);
        let seq = cache.add_sequence();
        let neighbour = cache.add_sequence();
        let mut got = Vec::new();
        let (mut i, mut c) = (0, 0);
        while i < tokens.len() {
            let n = chunks[c % chunks.len()].min(tokens.len() - i);
            let inputs = [
                SeqInput { seq: neighbour, tokens: &other, num_logits: 1 },
                SeqInput { seq, tokens: &tokens[i..i + n], num_logits: n },
            ];
            let o = model.forward(&mut cache, &inputs, &[]).unwrap();
            for j in 0..n {
                got.push(o.row(1, j).iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
            i += n;
            c += 1;
        }
        prop_assert_eq!(reference, got);
    }

    /// After a rollback (`truncate`) and re-feeding different tokens, the cache and logits equal a
    /// fresh forward over the committed tokens.
    #[test]
    fn truncate_then_continue_equals_fresh_forward(
        prefix in proptest::collection::vec(0u32..320, 1..20),
        rejected in proptest::collection::vec(0u32..320, 1..9),
        accepted in proptest::collection::vec(0u32..320, 1..9),
    ) {
        let model = fixture("qwen3", WeightDtype::F32);
        let mut cache = model.new_cache(512);
        let seq = cache.add_sequence();
        model.forward(&mut cache, &[SeqInput { seq, tokens: &prefix, num_logits: 1 }], &[]).unwrap();
        model.forward(&mut cache, &[SeqInput { seq, tokens: &rejected, num_logits: rejected.len() }], &[]).unwrap();
        cache.truncate(seq, prefix.len()).unwrap();
        let o = model.forward(&mut cache, &[SeqInput { seq, tokens: &accepted, num_logits: 1 }], &[]).unwrap();

        let mut fresh = model.new_cache(512);
        let s2 = fresh.add_sequence();
        let all: Vec<u32> = prefix.iter().chain(&accepted).copied().collect();
        let f = model.forward(&mut fresh, &[SeqInput { seq: s2, tokens: &all, num_logits: 1 }], &[]).unwrap();
        prop_assert_eq!(o.row(0, 0).iter().map(|x| x.to_bits()).collect::<Vec<_>>(), f.row(0, 0).iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        for layer in 0..model.config.num_layers {
            prop_assert_eq!(cache.gather(layer, seq).unwrap(), fresh.gather(layer, s2).unwrap());
        }
    }
}

#[test]
fn bad_inputs_are_errors_and_leave_the_cache_unchanged() {
    let model = fixture("qwen2", WeightDtype::F32);
    let mut cache = model.new_cache(64);
    let seq = cache.add_sequence();
    let err = model
        .forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &[5, 999],
                num_logits: 1,
            }],
            &[],
        )
        .unwrap_err();
    assert!(err.to_string().contains("999"), "{err}");
    assert!(model
        .forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &[],
                num_logits: 0
            }],
            &[]
        )
        .is_err());
    let long = vec![1u32; 600];
    let err = model
        .forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &long,
                num_logits: 1,
            }],
            &[],
        )
        .unwrap_err();
    assert!(err.to_string().contains("context"), "{err}");
    // The KV pool (64 positions) is smaller than the context: exhaustion is reported, not a panic.
    let err = model
        .forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &[1; 100],
                num_logits: 1,
            }],
            &[],
        )
        .unwrap_err();
    assert!(err.to_string().contains("KV cache full"), "{err}");
    assert_eq!(cache.len(seq).unwrap(), 0);
    model
        .forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &[1, 2, 3],
                num_logits: 1,
            }],
            &[],
        )
        .unwrap();
    assert_eq!(cache.len(seq).unwrap(), 3);
}
