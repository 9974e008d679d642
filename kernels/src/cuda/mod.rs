//! CUDA backend (feature `cuda`): kernels from `kernels/cuda/*.cu`, compiled at start with NVRTC for the
//! device's architecture, through cudarc with dynamic loading so that building needs neither a CUDA toolkit
//! nor a GPU. Every entry point checks that the driver and NVRTC libraries exist before touching them
//! (cudarc panics on a missing library otherwise) and reports what is missing and that the CPU backend is
//! the fallback.

pub mod dspark;
mod gemm;
pub mod graph;
pub mod launch;
pub mod sampling;
pub use gemm::{Gemm, LinearBackend, LinearChoice, SKINNY_MAX_ROWS};
pub use graph::{capture_graph, OwnedGraph};
pub use launch::{
    co_resident_cluster_grid, co_resident_grid, launch, launch_with, required_cluster_width,
    KernelArg, LaunchOptions,
};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Every `.cu` source of the backend, by file name.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("decoder.cu", include_str!("../../cuda/decoder.cu")),
    ("sampling.cu", include_str!("../../cuda/sampling.cu")),
    // Appended to sampling.cu: the DSpark Markov loop calls its device functions (one NVRTC program,
    // since the sources are embedded strings and NVRTC cannot link device code across programs here).
    (
        "dspark.cu",
        concat!(
            include_str!("../../cuda/sampling.cu"),
            "\n",
            include_str!("../../cuda/dspark.cu")
        ),
    ),
    // Appended to decoder.cu: the persistent fused step (issue 6) runs decoder.cu's device functions
    // (norm, RoPE, split-key attention, the skinny GEMM tile) inside one kernel.
    (
        "fused_step.cu",
        concat!(
            include_str!("../../cuda/decoder.cu"),
            "\n",
            include_str!("../../cuda/fused_step.cu")
        ),
    ),
    // The same program with the in-kernel profile compiled in, for `FusedMode::Profile` only: the
    // clock reads and counter updates cost the fused step a few percent even when unused (NOTES v0.16).
    (
        FUSED_PROFILING_SOURCE,
        concat!(
            "#define FUSED_PROFILING 1\n",
            include_str!("../../cuda/decoder.cu"),
            "\n",
            include_str!("../../cuda/fused_step.cu")
        ),
    ),
];

/// The fused step's program with the in-kernel profile compiled in (`FUSED_PROFILING` 1).
pub const FUSED_PROFILING_SOURCE: &str = "fused_step_prof.cu";

/// Development knob for A/B runs of fused-step versions in one device call (a GPU machine has no
/// cargo, so the versions cannot be rebuilt there): when set to a file, that file replaces
/// `kernels/cuda/fused_step.cu` in the fused program (still appended to the embedded decoder.cu).
/// The host side stays this build's, so only versions with the same parameter layout can be swapped.
pub const FUSED_SOURCE_ENV: &str = "SPECULA_FUSED_STEP_CU";

/// The same knob for the DSpark drafter's kernels: the named file replaces `kernels/cuda/dspark.cu`
/// (still appended to the embedded sampling.cu).
pub const DSPARK_SOURCE_ENV: &str = "SPECULA_DSPARK_CU";

/// Sources a development knob may replace: (program, variable, the embedded source the replacement
/// is appended to).
const SOURCE_OVERRIDES: &[(&str, &str, &str)] = &[
    (
        "fused_step.cu",
        FUSED_SOURCE_ENV,
        include_str!("../../cuda/decoder.cu"),
    ),
    (
        FUSED_PROFILING_SOURCE,
        FUSED_SOURCE_ENV,
        concat!(
            "#define FUSED_PROFILING 1\n",
            include_str!("../../cuda/decoder.cu")
        ),
    ),
    (
        "dspark.cu",
        DSPARK_SOURCE_ENV,
        include_str!("../../cuda/sampling.cu"),
    ),
];

/// The kernels each source must export, by file name (the compile test checks every one).
pub const EXPORTED_KERNELS: &[(&str, &[&str])] = &[
    ("decoder.cu", DECODER_KERNELS),
    ("sampling.cu", sampling::SAMPLING_KERNELS),
    ("dspark.cu", dspark::DSPARK_KERNELS),
    ("fused_step.cu", FUSED_KERNELS),
    (FUSED_PROFILING_SOURCE, FUSED_KERNELS),
];

/// The kernels `fused_step.cu` must export (its program also holds every kernel of decoder.cu).
pub const FUSED_KERNELS: &[&str] = &[
    "fused_forward",
    "fused_forward_x2",
    "fused_forward_v2_m8",
    "fused_forward_v2_m16",
];

/// The kernels `decoder.cu` must export (checked at load so a rename fails at start, not mid-step).
pub const DECODER_KERNELS: &[&str] = &[
    "embed_rows",
    "rms_norm",
    "head_rms_norm",
    "f32_to_bf16_rows",
    "add_bias_rows",
    "add_in_place",
    "rope_neox",
    "kv_append",
    "attention",
    "swiglu",
    "argmax_rows",
    "fill_random_bf16",
    "fill_random_f32",
    "rms_norm_bf16",
    "rope_kv_append",
    "attention_gqa",
    "swiglu_bf16",
    "skinny_linear_m8",
    "skinny_linear_m16",
    "skinny_linear_m32",
    "skinny_linear_m64",
    "skinny_linear_swiglu_m8",
    "skinny_linear_swiglu_m16",
    "skinny_linear_swiglu_m32",
    "skinny_linear_swiglu_m64",
    "interleave_gate_up",
    "swiglu_bf16_paired",
    "attention_split",
];

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver library (libcuda) found: this machine has no usable NVIDIA driver; use the CPU backend")]
    NoDriver,
    #[error("the CUDA driver reports no GPU; use the CPU backend")]
    NoDevice,
    #[error("no NVRTC library (libnvrtc) found: install the CUDA runtime compiler (e.g. `pip install nvidia-cuda-nvrtc` and add its lib directory to LD_LIBRARY_PATH); use the CPU backend meanwhile")]
    NoNvrtc,
    #[error("GPU architecture {0} is not one this backend compiles for (sm_80, sm_86, sm_89, sm_90, sm_90a, sm_100a, sm_103a)")]
    UnsupportedArch(String),
    #[error("NVRTC failed to compile {file} for {arch}: {log}")]
    Compile {
        file: String,
        arch: String,
        log: String,
    },
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("{0}")]
    Shape(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}

/// True when libcuda can be loaded.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// True when libnvrtc can be loaded.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC wants a `&'static str` architecture; map the ones we build for.
pub fn arch_name(arch: &str) -> Result<&'static str, CudaError> {
    Ok(match arch {
        "sm_80" => "sm_80",
        "sm_86" => "sm_86",
        "sm_89" => "sm_89",
        "sm_90" => "sm_90",
        "sm_90a" => "sm_90a",
        "sm_100a" => "sm_100a",
        "sm_103a" => "sm_103a",
        other => return Err(CudaError::UnsupportedArch(other.to_string())),
    })
}

/// Compiles every kernel source for `arch` (e.g. "sm_90"). Used at start on the GPU machine and by CI
/// without a GPU so the sources cannot rot.
pub fn compile_all(arch: &str) -> Result<Vec<(&'static str, Ptx)>, CudaError> {
    KERNEL_SOURCES
        .iter()
        .map(|(file, _)| compile_source(file, arch).map(|ptx| (*file, ptx)))
        .collect()
}

/// Compiles one source of [`KERNEL_SOURCES`] by file name for `arch`. The PTX is kept for the life
/// of the process, so later devices and models (the GPU check binaries build several) do not pay
/// NVRTC again (seconds per source; the fused step's program is the largest).
pub fn compile_source(file: &str, arch: &str) -> Result<Ptx, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<(String, String), Ptx>>> = OnceLock::new();
    let key = (file.to_string(), arch.to_string());
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(ptx) = cache.lock().map_err(|_| poisoned())?.get(&key) {
        return Ok(ptx.clone());
    }
    let ptx = compile_uncached(file, arch)?;
    cache
        .lock()
        .map_err(|_| poisoned())?
        .insert(key, ptx.clone());
    Ok(ptx)
}

/// Compiles the fused program with `fused_step` (the text of a `fused_step.cu`) in place of the embedded
/// one, appended to the embedded decoder.cu as [`FUSED_SOURCE_ENV`] does for a whole process, with
/// `FUSED_PROFILING` 1 when `profiling`: for A/Bs of several kernel versions in one process, whose
/// host side (this build's) they must match. `label` names the program in NVRTC's messages. Kept for the
/// life of the process by (text, arch, profiling).
pub fn compile_fused_variant(
    fused_step: &str,
    label: &str,
    arch: &str,
    profiling: bool,
) -> Result<Ptx, CudaError> {
    type Key = (String, String, bool);
    static CACHE: OnceLock<Mutex<HashMap<Key, Ptx>>> = OnceLock::new();
    let key = (fused_step.to_string(), arch.to_string(), profiling);
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(ptx) = cache.lock().map_err(|_| poisoned())?.get(&key) {
        return Ok(ptx.clone());
    }
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let program = if profiling {
        FUSED_PROFILING_SOURCE
    } else {
        "fused_step.cu"
    };
    let base = SOURCE_OVERRIDES
        .iter()
        .find(|(name, _, _)| *name == program)
        .map(|&(_, _, base)| base)
        .ok_or_else(|| CudaError::Shape(format!("no fused program named {program}")))?;
    let ptx = compile_text(&format!("{base}\n{fused_step}"), label, arch_name(arch)?)?;
    cache
        .lock()
        .map_err(|_| poisoned())?
        .insert(key, ptx.clone());
    Ok(ptx)
}

fn poisoned() -> CudaError {
    CudaError::Shape("the PTX cache lock was poisoned by a panic".into())
}

fn compile_uncached(file: &str, arch: &str) -> Result<Ptx, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let arch = arch_name(arch)?;
    let embedded = KERNEL_SOURCES
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, src)| *src)
        .ok_or_else(|| CudaError::Shape(format!("no kernel source named {file}")))?;
    let knob = SOURCE_OVERRIDES
        .iter()
        .find(|(name, _, _)| *name == file)
        .and_then(|&(_, var, base)| std::env::var_os(var).map(|path| (var, base, path)));
    let overridden = match knob {
        Some((var, base, path)) => {
            let replacement = std::fs::read_to_string(&path)
                .map_err(|e| CudaError::Shape(format!("{var}={}: {e}", path.to_string_lossy())))?;
            tracing::warn!("{var}: {file} replaced by {}", path.to_string_lossy());
            Some(format!("{base}\n{replacement}"))
        }
        None => None,
    };
    compile_text(overridden.as_deref().unwrap_or(embedded), file, arch)
}

/// NVRTC with the backend's options; `file` names the program in messages.
fn compile_text(src: &str, file: &str, arch: &'static str) -> Result<Ptx, CudaError> {
    let opts = CompileOptions {
        arch: Some(arch),
        // Keep IEEE division/sqrt and no FMA contraction surprises beyond what the source asks:
        // parity with the CPU reference matters more than the last percent.
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        name: Some(file.to_string()),
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts).map_err(|e| CudaError::Compile {
        file: file.to_string(),
        arch: arch.to_string(),
        log: e.to_string(),
    })
}

/// A GPU ready to run the decoder kernels: context, stream, and the compiled module.
pub struct GpuDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub module: Arc<CudaModule>,
    pub name: String,
    pub arch: String,
    /// Programmatic dependent launch for the step's own kernels (sm_90+ and `SPECULA_PDL=1`).
    pub pdl: bool,
    /// Whether the device can do programmatic dependent launch at all (sm_90+).
    pub pdl_capable: bool,
    /// Modules of fused-step variants loaded so far, by (text, profiling): an A/B that switches
    /// between kernels at every shape loads (and JIT-compiles) each once.
    fused_variants: Mutex<HashMap<(String, bool), Arc<CudaModule>>>,
}

impl GpuDevice {
    /// Opens GPU `ordinal`, compiles the kernels for its architecture, and checks every kernel exists.
    pub fn new(ordinal: usize) -> Result<GpuDevice, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        if CudaContext::device_count()? <= ordinal as i32 {
            return Err(CudaError::NoDevice);
        }
        let ctx = CudaContext::new(ordinal)?;
        // CUDA-graph capture needs this before any allocation (otherwise capture fails with
        // CUDA_ERROR_STREAM_CAPTURE_ISOLATION).
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let module = ctx.load_module(compile_source("decoder.cu", &arch)?)?;
        for k in DECODER_KERNELS {
            module.load_function(k)?;
        }
        // A stream of its own: the legacy default stream cannot be captured into a CUDA graph.
        let stream = ctx.new_stream()?;
        Ok(GpuDevice {
            pdl: launch::pdl_supported(major),
            pdl_capable: major >= 9,
            fused_variants: Mutex::new(HashMap::new()),
            name: ctx.name()?,
            ctx,
            stream,
            module,
            arch,
        })
    }

    pub fn function(&self, name: &str) -> Result<CudaFunction, CudaError> {
        Ok(self.module.load_function(name)?)
    }

    /// Compiles another source of [`KERNEL_SOURCES`] (e.g. `fused_step.cu`) for this device and loads
    /// it as a module of its own (the standard step's module stays as it is).
    pub fn load_source(&self, file: &str) -> Result<Arc<CudaModule>, CudaError> {
        Ok(self.ctx.load_module(compile_source(file, &self.arch)?)?)
    }

    /// Compiles and loads the fused program with another `fused_step.cu` text
    /// ([`compile_fused_variant`]), once per (text, profiling) for the life of the device.
    pub fn load_fused_variant(
        &self,
        fused_step: &str,
        label: &str,
        profiling: bool,
    ) -> Result<Arc<CudaModule>, CudaError> {
        let key = (fused_step.to_string(), profiling);
        if let Some(m) = self
            .fused_variants
            .lock()
            .map_err(|_| poisoned())?
            .get(&key)
        {
            return Ok(m.clone());
        }
        let module = self.ctx.load_module(compile_fused_variant(
            fused_step, label, &self.arch, profiling,
        )?)?;
        self.fused_variants
            .lock()
            .map_err(|_| poisoned())?
            .insert(key, module.clone());
        Ok(module)
    }
}
