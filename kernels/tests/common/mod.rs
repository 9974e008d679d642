//! Shared by the NVRTC test binaries.

/// True when NVRTC can compile here. Without it: a failure under CI (scripts/test.sh installs NVRTC
/// from the `nvidia-cuda-nvrtc` Python package), elsewhere a note that the test was skipped.
pub fn nvrtc_or_skip() -> bool {
    if specula_kernels::cuda::nvrtc_available() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must provide NVRTC (scripts/test.sh installs it)"
    );
    eprintln!("SKIPPED: no libnvrtc on this machine (run scripts/test.sh, which installs it)");
    false
}
