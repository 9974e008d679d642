//! `SPECULA_FUSED_STEP_CU` and `SPECULA_DSPARK_CU` (kernels/src/cuda/mod.rs) replace the fused step's
//! and the DSpark kernels' sources at run time, for A/Bs of candidate kernels on a GPU machine that
//! cannot rebuild the binary: a missing file is an error naming the variable and the path, and a
//! readable one is what NVRTC compiles (appended to the embedded decoder.cu / sampling.cu, like the
//! shipped source). Its own test binary, because the variables are process-wide and the other compile
//! tests must see the embedded sources (each test here sets a different variable and compiles a
//! different program, and the PTX cache is per program).
#![cfg(feature = "cuda")]

mod common;

use specula_kernels::cuda::{compile_source, DSPARK_SOURCE_ENV, FUSED_SOURCE_ENV};

/// Points `var` at a missing file (compiling `program` must fail naming both), then at `shipped` plus
/// `marker` (a kernel named `marker_entry` that uses something of the embedded base source): the PTX
/// must hold the marker and `shipped_entry`.
fn check_override(
    var: &str,
    program: &str,
    shipped: &str,
    marker: &str,
    marker_entry: &str,
    shipped_entry: &str,
) {
    let dir =
        std::env::temp_dir().join(format!("specula-override-{program}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("no-such-file.cu");
    std::env::set_var(var, &missing);
    let err = compile_source(program, "sm_90").unwrap_err().to_string();
    assert!(
        err.contains(var) && err.contains("no-such-file.cu"),
        "{err}"
    );

    let candidate = dir.join("candidate.cu");
    std::fs::write(&candidate, format!("{shipped}{marker}")).unwrap();
    std::env::set_var(var, &candidate);
    let ptx = compile_source(program, "sm_90")
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src();
    assert!(
        ptx.contains(&format!(".entry {marker_entry}(")),
        "the override was not compiled"
    );
    assert!(
        ptx.contains(&format!(".entry {shipped_entry}(")),
        "the candidate lost {shipped_entry}"
    );
    std::env::remove_var(var);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_override_is_what_compiles_and_a_missing_file_is_a_clear_error() {
    if !common::nvrtc_or_skip() {
        return;
    }
    // The marker calls a decoder.cu device function: decoder.cu still comes first.
    check_override(
        FUSED_SOURCE_ENV,
        "fused_step.cu",
        include_str!("../cuda/fused_step.cu"),
        "\nextern \"C\" __global__ void override_marker(float* x) { x[0] = bf16_to_f32(0); }\n",
        "override_marker",
        "fused_forward",
    );
}

#[test]
fn the_dspark_override_is_what_compiles_and_a_missing_file_is_a_clear_error() {
    if !common::nvrtc_or_skip() {
        return;
    }
    // The marker uses a sampling.cu macro: sampling.cu still comes first.
    check_override(
        DSPARK_SOURCE_ENV,
        "dspark.cu",
        include_str!("../cuda/dspark.cu"),
        "\nextern \"C\" __global__ void dspark_override_marker(int* x) { x[0] = SPL_PROBS_THREADS; }\n",
        "dspark_override_marker",
        "dspark_markov_loop",
    );
}
