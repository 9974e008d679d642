//! Every CUDA kernel source compiles with NVRTC for Hopper (sm_90, measured on the lent H200) and GB300
//! (sm_103a, compile-only), without a GPU. CI installs NVRTC from the `nvidia-cuda-nvrtc` Python
//! package (scripts/test.sh); there a missing NVRTC is a failure, elsewhere the test says it was skipped.
#![cfg(feature = "cuda")]

mod common;

use specula_kernels::cuda::{compile_all, nvrtc_available, EXPORTED_KERNELS, KERNEL_SOURCES};

#[test]
fn kernels_compile_for_hopper_and_blackwell() {
    if !common::nvrtc_or_skip() {
        return;
    }
    for arch in ["sm_90", "sm_103a"] {
        let ptx = compile_all(arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ptx.len(), KERNEL_SOURCES.len());
        for (file, ptx) in &ptx {
            let src = ptx.to_src();
            assert!(
                src.contains(&format!(".target {arch}")),
                "{arch} {file}: PTX targets something else"
            );
            let (_, kernels) = EXPORTED_KERNELS
                .iter()
                .find(|(name, _)| name == file)
                .unwrap_or_else(|| panic!("{file} has no list of exported kernels"));
            for k in *kernels {
                assert!(
                    src.contains(&format!(".entry {k}(")),
                    "{arch}: kernel {k} missing from the PTX of {file}"
                );
            }
        }
    }
}

#[test]
fn a_broken_kernel_is_a_clear_error_and_unknown_arches_are_refused() {
    assert!(compile_all("sm_12").is_err());
    if !nvrtc_available() {
        return;
    }
    let err = cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void k() { undefined_fn(); }")
        .unwrap_err();
    assert!(format!("{err:?}").contains("undefined"), "{err:?}");
}

#[test]
fn no_gpu_is_a_clear_error_naming_the_cpu_fallback() {
    use specula_kernels::cuda::{driver_available, GpuDevice};
    if driver_available() {
        eprintln!(
            "SKIPPED: this machine has a CUDA driver; the no-driver path cannot be exercised here"
        );
        return;
    }
    let err = GpuDevice::new(0)
        .err()
        .expect("no driver: opening a GPU must fail");
    let msg = err.to_string();
    assert!(
        msg.contains("driver") && msg.contains("CPU backend"),
        "{msg}"
    );
}

#[test]
fn a_fused_step_variant_compiles_from_its_text_and_a_broken_one_names_its_label() {
    use specula_kernels::cuda::{compile_fused_variant, CudaError, FUSED_KERNELS};
    if !common::nvrtc_or_skip() {
        return;
    }
    // The shipped kernel's own text, as an A/B in one process would pass a candidate's.
    let text = include_str!("../cuda/fused_step.cu");
    let ptx = compile_fused_variant(text, "shipped.cu", "sm_90", false)
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src();
    for k in FUSED_KERNELS {
        assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing");
    }
    match compile_fused_variant("this is not CUDA;", "broken.cu", "sm_90", false) {
        Err(CudaError::Compile { file, arch, .. }) => {
            assert_eq!((file.as_str(), arch.as_str()), ("broken.cu", "sm_90"));
        }
        other => panic!("a broken variant compiled or failed otherwise: {other:?}"),
    }
    assert!(matches!(
        compile_fused_variant(text, "shipped.cu", "sm_12", false),
        Err(CudaError::UnsupportedArch(_))
    ));
}
