//! Exactness by enumeration: for random context-dependent target and draft models over tiny
//! vocabularies, the exact distribution of what a rule emits, continued with the target up to a
//! fixed length, must equal the target's own joint distribution.
//!
//! The per-step outcome distribution comes from `AcceptanceRule::outcome_distribution`, which runs
//! the same rule code as `verify` down every branch of its random decisions (`tests/sampled.rs`
//! checks that `verify`'s uniform-driven answers follow those branch probabilities).

mod common;

use common::{cell, TableModel};
use rand_chacha::{rand_core::SeedableRng, ChaCha8Rng};
use specula_verifier::{AcceptanceRule, DraftProbs, SyntheticAcceptance, VerifyInput};

const TOLERANCE: f64 = 1e-9;

#[derive(Clone, Copy, Debug)]
enum DraftView {
    /// The rule sees Q_1..Q_k.
    Full,
    /// The rule is told the drafter has no distribution. The drafts are still random (drawn from
    /// the draft table), which is a deterministic drafter per draft seed; lossless rules must
    /// stay exact.
    OneHot,
}

struct Exact {
    /// Joint over the first k + 1 emitted tokens, indexed by `cell`.
    joint: Vec<f64>,
    expected_accepted: f64,
}

/// Exact distribution of a step's emitted tokens (drafts drawn from `draft`), continued by the
/// target to k + 1 tokens.
fn emitted_joint(
    rule: &AcceptanceRule,
    target: &TableModel,
    draft: &TableModel,
    k: usize,
    view: DraftView,
) -> Exact {
    let vocab = target.vocab;
    let mut joint = vec![0.0; vocab.pow(k as u32 + 1)];
    let mut expected_accepted = 0.0;
    for (drafts, draft_prob) in draft.continuations(&[], k) {
        if draft_prob == 0.0 {
            continue;
        }
        let target_rows = target.rows_along(&drafts);
        let draft_rows: Vec<Vec<f32>> = (0..k).map(|i| draft.row(&drafts[..i]).to_vec()).collect();
        let input = VerifyInput {
            draft_tokens: &drafts,
            draft_probs: match view {
                DraftView::Full => DraftProbs::Full(&draft_rows),
                DraftView::OneHot => DraftProbs::OneHot,
            },
            target_probs: &target_rows,
        };
        let outcomes = rule.outcome_distribution(&input).unwrap();
        let total: f64 = outcomes.iter().map(|(_, p)| p).sum();
        assert!((total - 1.0).abs() < 1e-12, "outcome mass {total}");
        for (outcome, prob) in outcomes {
            assert_eq!(outcome.emitted.len(), outcome.num_accepted + 1);
            assert_eq!(
                &outcome.emitted[..outcome.num_accepted],
                &drafts[..outcome.num_accepted]
            );
            let weight = draft_prob * prob;
            expected_accepted += weight * outcome.num_accepted as f64;
            let missing = k + 1 - outcome.emitted.len();
            for (seq, continuation_prob) in target.continuations(&outcome.emitted, missing) {
                joint[cell(&seq, vocab)] += weight * continuation_prob;
            }
        }
    }
    Exact {
        joint,
        expected_accepted,
    }
}

fn target_joint(target: &TableModel, k: usize) -> Vec<f64> {
    let mut joint = vec![0.0; target.vocab.pow(k as u32 + 1)];
    for (seq, prob) in target.continuations(&[], k + 1) {
        joint[cell(&seq, target.vocab)] += prob;
    }
    joint
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn standard_and_block_emit_the_target_distribution_exactly() {
    let mut cases = 0;
    for vocab in 2..=4 {
        for k in 1..=4 {
            for seed in 0..6u64 {
                let mut rng = ChaCha8Rng::seed_from_u64(seed * 1000 + vocab as u64 * 10 + k as u64);
                let target = TableModel::random(&mut rng, vocab, k, 0.15);
                let draft = TableModel::random_draft(&mut rng, &target, k - 1);
                let expected = target_joint(&target, k);
                let mut accepted = Vec::new();
                for view in [DraftView::Full, DraftView::OneHot] {
                    for rule in [AcceptanceRule::Standard, AcceptanceRule::Block] {
                        let exact = emitted_joint(&rule, &target, &draft, k, view);
                        let diff = max_abs_diff(&exact.joint, &expected);
                        assert!(
                            diff < TOLERANCE,
                            "{} {view:?} V={vocab} k={k} seed={seed}: max |joint - target| = {diff:e}",
                            rule.name()
                        );
                        accepted.push(exact.expected_accepted);
                        cases += 1;
                    }
                    // Block never accepts fewer tokens in expectation than the standard rule.
                    let (standard, block) =
                        (accepted[accepted.len() - 2], accepted[accepted.len() - 1]);
                    assert!(
                        block >= standard - 1e-12,
                        "{view:?} V={vocab} k={k} seed={seed}: block {block} < standard {standard}"
                    );
                }
            }
        }
    }
    assert_eq!(cases, 3 * 4 * 6 * 4);
}

#[test]
fn block_accepts_strictly_more_somewhere() {
    // The >= check above would pass for a block rule that just copied the standard rule; make sure
    // the random cases include real gains.
    let mut gains = 0;
    for seed in 0..10u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let target = TableModel::random(&mut rng, 3, 3, 0.0);
        let draft = TableModel::random(&mut rng, 3, 2, 0.0);
        let standard = emitted_joint(
            &AcceptanceRule::Standard,
            &target,
            &draft,
            3,
            DraftView::Full,
        );
        let block = emitted_joint(&AcceptanceRule::Block, &target, &draft, 3, DraftView::Full);
        if block.expected_accepted > standard.expected_accepted + 1e-6 {
            gains += 1;
        }
    }
    assert!(
        gains >= 5,
        "block beat standard in only {gains} of 10 random cases"
    );
}

#[test]
fn greedy_reproduces_greedy_decoding_of_the_target() {
    for vocab in 2..=4 {
        for k in 1..=4 {
            let mut rng = ChaCha8Rng::seed_from_u64(77 + vocab as u64 * 10 + k as u64);
            // A greedy caller passes one-hot target rows.
            let target = TableModel::random(&mut rng, vocab, k, 1.0);
            let draft = TableModel::random(&mut rng, vocab, k - 1, 0.3);
            let expected = target_joint(&target, k);
            let exact = emitted_joint(
                &AcceptanceRule::Greedy,
                &target,
                &draft,
                k,
                DraftView::OneHot,
            );
            assert!(max_abs_diff(&exact.joint, &expected) < TOLERANCE);
        }
    }
}

#[test]
fn the_check_detects_a_rule_that_is_not_lossless() {
    // Synthetic acceptance ignores P, so the same check must fail on it: evidence the comparison
    // has teeth.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let target = TableModel::random(&mut rng, 3, 2, 0.0);
    let draft = TableModel::random(&mut rng, 3, 1, 0.0);
    let rule = AcceptanceRule::Synthetic(
        SyntheticAcceptance::from_conditional_rates(&[0.9, 0.9]).unwrap(),
    );
    let exact = emitted_joint(&rule, &target, &draft, 2, DraftView::Full);
    assert!(max_abs_diff(&exact.joint, &target_joint(&target, 2)) > 1e-3);
}

/// Context-free toy case from reference.md (Sun et al. 2024): P = [1/3, 2/3], Q = [2/3, 1/3], k = 2.
#[test]
fn toy_case_expected_accepted_tokens() {
    let p = vec![1.0f32 / 3.0, 2.0 / 3.0];
    let q = vec![2.0f32 / 3.0, 1.0 / 3.0];
    let mut target = TableModel {
        vocab: 2,
        depth: 2,
        rows: Default::default(),
    };
    let mut draft = TableModel {
        vocab: 2,
        depth: 1,
        rows: Default::default(),
    };
    for prefix in [
        vec![],
        vec![0],
        vec![1],
        vec![0, 0],
        vec![0, 1],
        vec![1, 0],
        vec![1, 1],
    ] {
        if prefix.len() <= 1 {
            draft.rows.insert(prefix.clone(), q.clone());
        }
        target.rows.insert(prefix, p.clone());
    }
    // f32 cannot hold 1/3 exactly; 1e-6 covers that rounding, and nothing else.
    let standard = emitted_joint(
        &AcceptanceRule::Standard,
        &target,
        &draft,
        2,
        DraftView::Full,
    );
    let block = emitted_joint(&AcceptanceRule::Block, &target, &draft, 2, DraftView::Full);
    assert!(
        (standard.expected_accepted - 10.0 / 9.0).abs() < 1e-6,
        "{}",
        standard.expected_accepted
    );
    assert!(
        (block.expected_accepted - 11.0 / 9.0).abs() < 1e-6,
        "{}",
        block.expected_accepted
    );
    // The first emitted token follows P exactly (with the rows as the rules read them).
    for exact in [standard, block] {
        let first_is_zero: f64 = exact.joint[..4].iter().sum();
        let expected = common::normalised(&p)[0];
        assert!((first_is_zero - expected).abs() < 1e-12);
    }
}
