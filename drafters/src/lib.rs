//! Drafters: the `Drafter` trait and its implementations (issue 3).
