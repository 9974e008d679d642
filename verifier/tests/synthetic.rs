//! Synthetic acceptance: the configured pattern, measured through `verify` and `AcceptanceCounter`.

mod common;

use common::TableModel;
use rand_chacha::{rand_core::SeedableRng, ChaCha8Rng};
use specula_verifier::{
    AcceptanceCounter, AcceptanceRule, DraftProbs, ScriptedUniforms, SyntheticAcceptance,
    VerifyError, VerifyInput,
};

fn assert_close(actual: &[f64], expected: &[f64], tolerance: f64) {
    assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
    for (a, e) in actual.iter().zip(expected) {
        assert!((a - e).abs() <= tolerance, "{actual:?} vs {expected:?}");
    }
}

/// Runs `steps` synthetic verify steps with k drafts on random inputs and counts acceptance.
fn measure(rule: &AcceptanceRule, k: usize, steps: usize, seed: u64) -> AcceptanceCounter {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let target = TableModel::random(&mut rng, 3, k, 0.2);
    let draft = TableModel::random(&mut rng, 3, k.saturating_sub(1), 0.2);
    let mut counter = AcceptanceCounter::new();
    for _ in 0..steps {
        let drafts = draft.sample(&mut rng, &[], k);
        let target_rows = target.rows_along(&drafts);
        let input = VerifyInput {
            draft_tokens: &drafts,
            draft_probs: DraftProbs::OneHot,
            target_probs: &target_rows,
        };
        let outcome = rule.verify(&input, &mut rng).unwrap();
        assert_eq!(
            &outcome.emitted[..outcome.num_accepted],
            &drafts[..outcome.num_accepted]
        );
        counter.record_outcome(k, &outcome).unwrap();
    }
    counter
}

#[test]
fn mean_length_3_78_over_7_slots() {
    let config = SyntheticAcceptance::from_mean_length(3.78, 7).unwrap();
    let expected = [1.0, 1.0, 0.78, 0.0, 0.0, 0.0, 0.0];
    assert_close(&config.unconditional_rates(), &expected, 1e-12);
    assert_close(config.conditional_rates(), &expected, 1e-12);
    assert!((config.expected_length() - 3.78).abs() < 1e-12);

    let rule = AcceptanceRule::Synthetic(config);
    assert!(!rule.is_lossless());
    assert_eq!(rule.name(), "synthetic");
    let counter = measure(&rule, 7, 100_000, 1);
    let al = counter.mean_acceptance_length().unwrap();
    assert!((al - 3.78).abs() < 0.02, "AL = {al}");
    // Minimum variance: every step accepts exactly 2 or 3 drafts.
    assert_close(&counter.unconditional_rates()[..2], &[1.0, 1.0], 0.0);
    assert_close(&counter.unconditional_rates()[3..], &[0.0; 4], 0.0);
}

#[test]
fn measured_rates_match_configured_unconditional_rates() {
    let rates = [0.9, 0.7, 0.7, 0.4, 0.1];
    let config = SyntheticAcceptance::from_unconditional_rates(&rates).unwrap();
    assert_close(&config.unconditional_rates(), &rates, 1e-12);
    assert_close(
        config.conditional_rates(),
        &[0.9, 0.7 / 0.9, 1.0, 0.4 / 0.7, 0.25],
        1e-12,
    );
    assert!((config.expected_length() - 3.8).abs() < 1e-12);
    let counter = measure(&AcceptanceRule::Synthetic(config.clone()), 5, 100_000, 2);
    assert_close(&counter.unconditional_rates(), &rates, 0.01);
    let conditional: Vec<f64> = counter
        .conditional_rates()
        .into_iter()
        .map(Option::unwrap)
        .collect();
    assert_close(&conditional, config.conditional_rates(), 0.01);
    let al = counter.mean_acceptance_length().unwrap();
    assert!((al - 3.8).abs() < 0.02, "AL = {al}");
}

#[test]
fn from_conditional_rates_round_trips() {
    let config = SyntheticAcceptance::from_conditional_rates(&[0.5, 1.0, 0.5]).unwrap();
    assert_close(&config.unconditional_rates(), &[0.5, 0.5, 0.25], 1e-15);
    assert_eq!(config.num_slots(), 3);
    let again =
        SyntheticAcceptance::from_unconditional_rates(&config.unconditional_rates()).unwrap();
    assert_close(again.conditional_rates(), config.conditional_rates(), 1e-15);
    // After an unreachable slot the conditional rate is moot and stored as 0.
    let cut = SyntheticAcceptance::from_unconditional_rates(&[0.5, 0.0, 0.0]).unwrap();
    assert_eq!(cut.conditional_rates(), &[0.5, 0.0, 0.0]);
}

#[test]
fn extreme_mean_lengths() {
    assert_eq!(
        SyntheticAcceptance::from_mean_length(1.0, 4)
            .unwrap()
            .unconditional_rates(),
        vec![0.0; 4]
    );
    assert_eq!(
        SyntheticAcceptance::from_mean_length(5.0, 4)
            .unwrap()
            .unconditional_rates(),
        vec![1.0; 4]
    );
    assert_eq!(
        SyntheticAcceptance::from_mean_length(3.0, 4)
            .unwrap()
            .unconditional_rates(),
        vec![1.0, 1.0, 0.0, 0.0]
    );
    assert!(SyntheticAcceptance::from_mean_length(1.0, 0)
        .unwrap()
        .unconditional_rates()
        .is_empty());
}

#[test]
fn invalid_configurations_are_errors() {
    for length in [0.99, 8.01, f64::NAN, f64::INFINITY, -1.0] {
        assert!(
            matches!(
                SyntheticAcceptance::from_mean_length(length, 7),
                Err(VerifyError::InvalidMeanLength { .. })
            ),
            "L = {length}"
        );
    }
    assert!(SyntheticAcceptance::from_mean_length(1.5, 0).is_err());
    assert_eq!(
        SyntheticAcceptance::from_unconditional_rates(&[0.5, 0.6]),
        Err(VerifyError::IncreasingRates {
            slot: 1,
            previous: 0.5,
            value: 0.6
        })
    );
    for bad in [-0.1, 1.1, f64::NAN] {
        assert!(matches!(
            SyntheticAcceptance::from_unconditional_rates(&[1.0, bad]),
            Err(VerifyError::InvalidRate { slot: 1, .. })
        ));
        assert!(matches!(
            SyntheticAcceptance::from_conditional_rates(&[bad]),
            Err(VerifyError::InvalidRate { slot: 0, .. })
        ));
    }
}

#[test]
fn emits_real_drafts_then_the_targets_token_at_the_rejected_slot() {
    // One-hot target rows (a greedy caller): the correction is the target's argmax at that slot,
    // even where the target disagrees with the accepted drafts.
    let target = vec![
        vec![1.0f32, 0.0, 0.0],
        vec![0.0, 1.0, 0.0],
        vec![0.0, 0.0, 1.0],
        vec![1.0, 0.0, 0.0],
    ];
    let rule = AcceptanceRule::Synthetic(
        SyntheticAcceptance::from_conditional_rates(&[0.5, 0.5, 0.5, 0.5]).unwrap(),
    );
    let input = VerifyInput {
        draft_tokens: &[2, 2, 1],
        draft_probs: DraftProbs::OneHot,
        target_probs: &target,
    };
    let run = |script: Vec<f64>| {
        let mut u = ScriptedUniforms::new(script);
        let outcome = rule.verify(&input, &mut u).unwrap();
        (outcome.emitted, u.consumed())
    };
    assert_eq!(run(vec![0.7, 0.3]), (vec![0], 2));
    assert_eq!(run(vec![0.1, 0.7, 0.3]), (vec![2, 1], 3));
    assert_eq!(run(vec![0.1, 0.2, 0.7, 0.3]), (vec![2, 2, 2], 4));
    assert_eq!(run(vec![0.1, 0.2, 0.3, 0.9]), (vec![2, 2, 1, 0], 4));
}

#[test]
fn step_with_more_drafts_than_configured_slots_is_an_error() {
    let rule =
        AcceptanceRule::Synthetic(SyntheticAcceptance::from_conditional_rates(&[1.0]).unwrap());
    let target = vec![vec![1.0f32, 0.0]; 3];
    let input = VerifyInput {
        draft_tokens: &[0, 0],
        draft_probs: DraftProbs::OneHot,
        target_probs: &target,
    };
    assert_eq!(
        rule.verify(&input, &mut ScriptedUniforms::new(vec![0.5; 3])),
        Err(VerifyError::TooFewSyntheticRates {
            configured: 1,
            drafts: 2
        })
    );
    // Fewer drafts than slots uses the leading rates.
    let input = VerifyInput {
        draft_tokens: &[],
        draft_probs: DraftProbs::OneHot,
        target_probs: &target[..1],
    };
    assert_eq!(
        rule.verify(&input, &mut ScriptedUniforms::new(vec![0.5]))
            .unwrap()
            .emitted,
        vec![0]
    );
}
