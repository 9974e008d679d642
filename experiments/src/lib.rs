//! Benchmarks and experiments.
