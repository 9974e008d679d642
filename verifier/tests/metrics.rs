//! AcceptanceCounter on hand-made step histories (reference.md section 3).

use specula_verifier::{AcceptanceCounter, VerifyError, VerifyOutcome};

#[test]
fn empty_counter_has_no_rates() {
    let counter = AcceptanceCounter::new();
    assert_eq!(counter.steps(), 0);
    assert_eq!(counter.mean_acceptance_length(), None);
    assert!(counter.unconditional_rates().is_empty());
}

#[test]
fn fixed_k_history() {
    // k = 3; accepted 3, 0, 1, 2.
    let mut counter = AcceptanceCounter::new();
    for accepted in [3, 0, 1, 2] {
        counter.record(3, accepted).unwrap();
    }
    assert_eq!(counter.steps(), 4);
    assert_eq!(counter.accepted_tokens(), 6);
    assert_eq!(counter.drafted_tokens(), 12);
    assert_eq!(counter.emitted_tokens(), 10);
    assert_eq!(counter.mean_acceptance_length(), Some(2.5)); // 1 + 6 / 4, bonus included
    assert_eq!(counter.mean_accepted(), Some(1.5)); // AL - 1
                                                    // Reaching slot 1: 3 of 4; slot 2: 2 of 4; slot 3: 1 of 4.
    assert_eq!(counter.unconditional_rates(), vec![0.75, 0.5, 0.25]);
    // Given the previous slot: 3/4, 2/3, 1/2.
    assert_eq!(
        counter.conditional_rates(),
        vec![Some(0.75), Some(2.0 / 3.0), Some(0.5)]
    );
}

#[test]
fn mixed_k_counts_a_slot_only_over_steps_that_drafted_it() {
    let mut counter = AcceptanceCounter::new();
    counter.record(1, 1).unwrap(); // drafted slot 1 only, reached it
    counter.record(3, 1).unwrap(); // drafted 1..3, reached slot 1
    counter.record(2, 2).unwrap(); // drafted 1..2, reached both
    counter.record(0, 0).unwrap(); // no drafts: a plain step
    assert_eq!(counter.steps(), 4);
    assert_eq!(counter.mean_acceptance_length(), Some(1.0 + 4.0 / 4.0));
    assert_eq!(counter.num_slots(), 3);
    // slot 1: drafted by 3 steps, reached by 3; slot 2: drafted by 2, reached by 1;
    // slot 3: drafted by 1, reached by 0.
    assert_eq!(counter.unconditional_rates(), vec![1.0, 0.5, 0.0]);
    // slot 2 offered (slot 1 reached) in both steps that drafted it; slot 3 offered only if
    // slot 2 was reached, which its one drafting step did not.
    assert_eq!(
        counter.conditional_rates(),
        vec![Some(1.0), Some(0.5), None]
    );
}

#[test]
fn merge_equals_recording_everything_in_one_counter() {
    let history = [(4, 2), (2, 2), (4, 0), (1, 1), (3, 3)];
    let mut all = AcceptanceCounter::new();
    let mut first = AcceptanceCounter::new();
    let mut second = AcceptanceCounter::new();
    for (i, &(k, accepted)) in history.iter().enumerate() {
        all.record(k, accepted).unwrap();
        if i % 2 == 0 { &mut first } else { &mut second }
            .record(k, accepted)
            .unwrap();
    }
    second.merge(&first);
    assert_eq!(second.steps(), all.steps());
    assert_eq!(second.unconditional_rates(), all.unconditional_rates());
    assert_eq!(second.conditional_rates(), all.conditional_rates());
    assert_eq!(
        second.mean_acceptance_length(),
        all.mean_acceptance_length()
    );
}

#[test]
fn impossible_step_is_rejected_and_not_counted() {
    let mut counter = AcceptanceCounter::new();
    assert_eq!(
        counter.record(2, 3),
        Err(VerifyError::AcceptedExceedsDrafted {
            accepted: 3,
            drafts: 2
        })
    );
    assert_eq!(counter.steps(), 0);
    let outcome = VerifyOutcome {
        num_accepted: 1,
        emitted: vec![5, 6],
    };
    counter.record_outcome(2, &outcome).unwrap();
    assert_eq!(counter.unconditional_rates(), vec![1.0, 0.0]);
}
