//! Fixed-seed statistical tests of `verify` itself (the uniform-driven path the engine calls):
//! - for the lossless rules, the first emitted token and the first two tokens follow the target;
//! - for every rule, the outcomes `verify` samples follow `outcome_distribution`, which ties the
//!   uniform-driven decisions to the exact enumeration in `tests/exact.rs`.
//!
//! Seeds are fixed, so the tests are deterministic; the p-value threshold 1e-4 keeps them robust to
//! a seed change while a real bias of a few tenths of a percent still fails them.

mod common;

use std::collections::BTreeMap;

use common::{cell, chi_square_p_value, gamma_q, normalised, TableModel};
use rand_chacha::{rand_core::SeedableRng, ChaCha8Rng};
use specula_verifier::{
    AcceptanceRule, DraftProbs, ScriptedUniforms, SyntheticAcceptance, VerifyError, VerifyInput,
    VerifyOutcome,
};

const P_THRESHOLD: f64 = 1e-4;

#[test]
fn chi_square_p_value_matches_known_quantiles() {
    // Chi-square survival function: df=1 at 3.841 -> 0.05; df=3 at 7.815 -> 0.05; df=10 at 29.588 -> 0.001.
    assert!((gamma_q(0.5, 3.841 / 2.0) - 0.05).abs() < 1e-4);
    assert!((gamma_q(1.5, 7.815 / 2.0) - 0.05).abs() < 1e-4);
    assert!((gamma_q(5.0, 29.588 / 2.0) - 0.001).abs() < 1e-5);
    assert!((chi_square_p_value(&[10, 0], &[1.0, 0.0]) - 1.0).abs() < 1e-12);
    assert_eq!(chi_square_p_value(&[10, 1], &[1.0, 0.0]), 0.0);
    assert!(chi_square_p_value(&[600, 400], &[0.5, 0.5]) < 1e-9);
}

/// Samples `samples` verify steps (drafts drawn from `draft`) and returns the counts of the first
/// emitted token and of the first two tokens (a one-token step is continued by the target).
fn first_tokens(
    rule: &AcceptanceRule,
    target: &TableModel,
    draft: &TableModel,
    k: usize,
    one_hot: bool,
    samples: usize,
    seed: u64,
) -> (Vec<u64>, Vec<u64>) {
    let vocab = target.vocab;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut first = vec![0u64; vocab];
    let mut pairs = vec![0u64; vocab * vocab];
    for _ in 0..samples {
        let drafts = draft.sample(&mut rng, &[], k);
        let target_rows = target.rows_along(&drafts);
        let draft_rows: Vec<Vec<f32>> = (0..k).map(|i| draft.row(&drafts[..i]).to_vec()).collect();
        let input = VerifyInput {
            draft_tokens: &drafts,
            draft_probs: if one_hot {
                DraftProbs::OneHot
            } else {
                DraftProbs::Full(&draft_rows)
            },
            target_probs: &target_rows,
        };
        let mut emitted = rule.verify(&input, &mut rng).unwrap().emitted;
        if emitted.len() < 2 {
            let next = target.sample(&mut rng, &emitted, 1);
            emitted.extend(next);
        }
        first[emitted[0] as usize] += 1;
        pairs[cell(&emitted[..2], vocab)] += 1;
    }
    (first, pairs)
}

#[test]
fn lossless_rules_sample_the_target_distribution() {
    let (vocab, k) = (4, 3);
    let mut rng = ChaCha8Rng::seed_from_u64(2024);
    let target = TableModel::random(&mut rng, vocab, k, 0.1);
    let draft = TableModel::random_draft(&mut rng, &target, k - 1);
    let expected_first = normalised(target.row(&[]));
    let mut expected_pairs = vec![0.0; vocab * vocab];
    for (seq, p) in target.continuations(&[], 2) {
        expected_pairs[cell(&seq, vocab)] = p;
    }
    for (seed, (rule, one_hot)) in [
        (AcceptanceRule::Standard, false),
        (AcceptanceRule::Standard, true),
        (AcceptanceRule::Block, false),
        (AcceptanceRule::Block, true),
    ]
    .into_iter()
    .enumerate()
    {
        let (first, pairs) = first_tokens(&rule, &target, &draft, k, one_hot, 200_000, seed as u64);
        let p_first = chi_square_p_value(&first, &expected_first);
        let p_pairs = chi_square_p_value(&pairs, &expected_pairs);
        eprintln!(
            "{} one_hot={one_hot}: p(first) = {p_first:.3e}, p(pairs) = {p_pairs:.3e}",
            rule.name()
        );
        assert!(
            p_first > P_THRESHOLD && p_pairs > P_THRESHOLD,
            "{} one_hot={one_hot}: p(first) = {p_first:e}, p(pairs) = {p_pairs:e}",
            rule.name()
        );
    }
}

#[test]
fn the_sampled_check_detects_a_biased_rule() {
    // Synthetic acceptance that always accepts emits the draft's distribution: must be rejected.
    let (vocab, k) = (4, 3);
    let mut rng = ChaCha8Rng::seed_from_u64(2024);
    let target = TableModel::random(&mut rng, vocab, k, 0.0);
    let draft = TableModel::random(&mut rng, vocab, k - 1, 0.0);
    let rule =
        AcceptanceRule::Synthetic(SyntheticAcceptance::from_conditional_rates(&[1.0; 3]).unwrap());
    let (first, _) = first_tokens(&rule, &target, &draft, k, false, 20_000, 9);
    assert!(chi_square_p_value(&first, &normalised(target.row(&[]))) < 1e-9);
}

/// Chi-square of `verify`'s outcomes on one fixed input against `outcome_distribution`.
fn check_verify_matches_enumeration(rule: &AcceptanceRule, input: &VerifyInput, seed: u64) {
    let exact = rule.outcome_distribution(input).unwrap();
    // Greedy is deterministic (one outcome); the random rules must offer a real choice.
    if *rule != AcceptanceRule::Greedy {
        assert!(
            exact.len() >= 4,
            "{}: too few outcomes to test",
            rule.name()
        );
    }
    let index: BTreeMap<VerifyOutcome, usize> = exact
        .iter()
        .enumerate()
        .map(|(i, (o, _))| (o.clone(), i))
        .collect();
    let expected: Vec<f64> = exact.iter().map(|(_, p)| *p).collect();
    let mut counts = vec![0u64; exact.len()];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for _ in 0..100_000 {
        let outcome = rule.verify(input, &mut rng).unwrap();
        match index.get(&outcome) {
            Some(&i) => counts[i] += 1,
            None => panic!(
                "{}: verify produced {outcome:?}, impossible per enumeration",
                rule.name()
            ),
        }
    }
    let p = chi_square_p_value(&counts, &expected);
    eprintln!("{}: p = {p:.3e} over {} outcomes", rule.name(), exact.len());
    assert!(
        p > P_THRESHOLD,
        "{}: p = {p:e} over {} outcomes",
        rule.name(),
        exact.len()
    );
}

#[test]
fn verify_follows_the_exact_outcome_distribution() {
    let (vocab, k) = (4, 3);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // Dense rows, so every slot can be accepted or rejected and every outcome has real mass.
    let target = TableModel::dense(&mut rng, vocab, k);
    let draft = TableModel::dense(&mut rng, vocab, k - 1);
    let drafts = draft.sample(&mut rng, &[], k);
    let target_rows = target.rows_along(&drafts);
    let draft_rows: Vec<Vec<f32>> = (0..k).map(|i| draft.row(&drafts[..i]).to_vec()).collect();
    let rules = [
        AcceptanceRule::Greedy,
        AcceptanceRule::Standard,
        AcceptanceRule::Block,
        AcceptanceRule::Synthetic(
            SyntheticAcceptance::from_conditional_rates(&[0.8, 0.5, 0.3]).unwrap(),
        ),
    ];
    for (seed, rule) in rules.iter().enumerate() {
        for one_hot in [false, true] {
            let input = VerifyInput {
                draft_tokens: &drafts,
                draft_probs: if one_hot {
                    DraftProbs::OneHot
                } else {
                    DraftProbs::Full(&draft_rows)
                },
                target_probs: &target_rows,
            };
            check_verify_matches_enumeration(rule, &input, 100 + seed as u64);
        }
    }
}

#[test]
fn greedy_is_deterministic_argmax_matching() {
    let rows = [
        vec![0.1f32, 0.6, 0.3],
        vec![0.5, 0.0, 0.5], // tie: lowest index wins
        vec![0.0, 0.0, 1.0],
        vec![0.2, 0.2, 0.6],
    ];
    let rule = AcceptanceRule::Greedy;
    let verify = |drafts: &[u32]| {
        let input = VerifyInput {
            draft_tokens: drafts,
            draft_probs: DraftProbs::OneHot,
            target_probs: &rows[..drafts.len() + 1],
        };
        let mut none = ScriptedUniforms::new(vec![]);
        let outcome = rule.verify(&input, &mut none).unwrap();
        assert_eq!(none.consumed(), 0, "greedy must not draw uniforms");
        outcome
    };
    assert_eq!(verify(&[1, 0, 2]).emitted, vec![1, 0, 2, 2]);
    assert_eq!(verify(&[1, 0, 2]).num_accepted, 3);
    assert_eq!(verify(&[1, 2, 2]).emitted, vec![1, 0]);
    assert_eq!(verify(&[2, 0, 2]).emitted, vec![1]);
    assert_eq!(verify(&[1, 0, 0]).emitted, vec![1, 0, 2]);
    assert_eq!(verify(&[]).emitted, vec![1]);
    assert!(rule.is_lossless());
}

#[test]
fn standard_decisions_follow_scripted_uniforms() {
    // a = min(1, 0.25 / 0.5) = 0.5: accept iff u < 0.5; the residual max(P - Q, 0) = [0, 0.25].
    let target = vec![vec![0.25f32, 0.75], vec![0.5, 0.5]];
    let draft = vec![vec![0.5f32, 0.5]];
    let input = VerifyInput {
        draft_tokens: &[0],
        draft_probs: DraftProbs::Full(&draft),
        target_probs: &target,
    };
    let run = |script: Vec<f64>| {
        let mut u = ScriptedUniforms::new(script);
        let outcome = AcceptanceRule::Standard.verify(&input, &mut u).unwrap();
        (outcome.emitted, u.consumed())
    };
    assert_eq!(run(vec![0.49, 0.3]), (vec![0, 0], 2));
    assert_eq!(run(vec![0.49, 0.6]), (vec![0, 1], 2));
    assert_eq!(run(vec![0.5, 0.0]), (vec![1], 2));
    assert_eq!(run(vec![0.99, 0.99]), (vec![1], 2));
    // A script that runs dry is an error, not an invented value.
    let mut short = ScriptedUniforms::new(vec![0.1]);
    assert!(matches!(
        AcceptanceRule::Standard.verify(&input, &mut short),
        Err(VerifyError::BadUniform(u)) if u.is_nan()
    ));
    let mut out_of_range = ScriptedUniforms::new(vec![1.0, 0.5]);
    assert_eq!(
        AcceptanceRule::Standard.verify(&input, &mut out_of_range),
        Err(VerifyError::BadUniform(1.0))
    );
}

#[test]
fn block_decisions_follow_scripted_uniforms() {
    // Toy case P = [1/3, 2/3], Q = [2/3, 1/3], k = 2.
    let p = vec![1.0f32 / 3.0, 2.0 / 3.0];
    let q = vec![2.0f32 / 3.0, 1.0 / 3.0];
    let target = vec![p.clone(), p.clone(), p.clone()];
    let draft = vec![q.clone(), q.clone()];
    let run = |drafts: &[u32], script: Vec<f64>| {
        let input = VerifyInput {
            draft_tokens: drafts,
            draft_probs: DraftProbs::Full(&draft),
            target_probs: &target,
        };
        let mut u = ScriptedUniforms::new(script);
        let outcome = AcceptanceRule::Block.verify(&input, &mut u).unwrap();
        assert_eq!(u.consumed(), 3, "block draws u_1..u_k plus one");
        outcome.emitted
    };
    // x = [0, 0]: p_1 = 1/2, p_2 = 1/4, Z_1 = 0 so h_1 = 0, h_2 = 1/4.
    assert_eq!(run(&[0, 0], vec![0.9, 0.2, 0.5]), vec![0, 0, 1]); // tau = 2, bonus from P
    assert_eq!(run(&[0, 0], vec![0.9, 0.2, 0.2]), vec![0, 0, 0]);
    assert_eq!(run(&[0, 0], vec![0.01, 0.3, 0.1]), vec![1]); // tau = 0, residual [0, 1/3]
                                                             // x = [1, 0]: p_1 = 1, Z_1 = 1/3 so h_1 = 1; p_2 = h_2 = 1/2.
    assert_eq!(run(&[1, 0], vec![0.99, 0.6, 0.1]), vec![1, 1]); // tau = 1, residual [0, 1/3]
    assert_eq!(run(&[1, 0], vec![0.99, 0.4, 0.1]), vec![1, 0, 0]); // tau = 2
}
