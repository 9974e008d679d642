//! Verifier: acceptance rules and the verify pass (issue 3).
