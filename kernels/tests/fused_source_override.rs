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

#[test]
fn the_override_is_what_compiles_and_a_missing_file_is_a_clear_error() {
    if !common::nvrtc_or_skip() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("specula-fused-override-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("no-such-file.cu");
    std::env::set_var(FUSED_SOURCE_ENV, &missing);
    let err = compile_source("fused_step.cu", "sm_90")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(FUSED_SOURCE_ENV) && err.contains("no-such-file.cu"),
        "{err}"
    );

    // A candidate: the shipped source plus one marker kernel that calls a decoder.cu device function,
    // so the PTX shows both that the file was read and that decoder.cu still comes first.
    let candidate = dir.join("candidate.cu");
    let marker =
        "\nextern \"C\" __global__ void override_marker(float* x) { x[0] = bf16_to_f32(0); }\n";
    std::fs::write(
        &candidate,
        format!("{}{marker}", include_str!("../cuda/fused_step.cu")),
    )
    .unwrap();
    std::env::set_var(FUSED_SOURCE_ENV, &candidate);
    let ptx = compile_source("fused_step.cu", "sm_90")
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src();
    assert!(
        ptx.contains(".entry override_marker("),
        "the override was not compiled"
    );
    assert!(
        ptx.contains(".entry fused_forward("),
        "the candidate lost the fused kernel"
    );
    std::env::remove_var(FUSED_SOURCE_ENV);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_dspark_override_is_what_compiles_and_a_missing_file_is_a_clear_error() {
    if !common::nvrtc_or_skip() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("specula-dspark-override-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("no-such-file.cu");
    std::env::set_var(DSPARK_SOURCE_ENV, &missing);
    let err = compile_source("dspark.cu", "sm_90")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(DSPARK_SOURCE_ENV) && err.contains("no-such-file.cu"),
        "{err}"
    );

    // The shipped source plus a marker kernel that uses a sampling.cu macro (sampling.cu first).
    let candidate = dir.join("candidate.cu");
    let marker = "\nextern \"C\" __global__ void dspark_override_marker(int* x) { x[0] = SPL_PROBS_THREADS; }\n";
    std::fs::write(
        &candidate,
        format!("{}{marker}", include_str!("../cuda/dspark.cu")),
    )
    .unwrap();
    std::env::set_var(DSPARK_SOURCE_ENV, &candidate);
    let ptx = compile_source("dspark.cu", "sm_90")
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src();
    assert!(
        ptx.contains(".entry dspark_override_marker("),
        "the override was not compiled"
    );
    assert!(
        ptx.contains(".entry dspark_markov_loop("),
        "the candidate lost the Markov loop"
    );
    std::env::remove_var(DSPARK_SOURCE_ENV);
    std::fs::remove_dir_all(&dir).ok();
}
