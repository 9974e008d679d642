//! Engine: requests, the decode loop, metrics. Plain (non-speculative) generation lives here now;
//! the speculative loop builds on the same request/stats types.

pub mod config;
pub mod drafter_factory;
pub mod generate;
pub mod golden;
#[cfg(feature = "cuda")]
pub mod gpu_target;
pub mod scheduler;
pub mod speculative;
pub mod stats;
pub mod target;

pub use config::{
    AdditionalConfig, DecodeBackend, Device, SpecializedShapes, SpeculativeConfig,
    SpeculativeMethod,
};
pub use drafter_factory::{build_drafter, build_drafter_on, DrafterDevice};
pub use generate::{generate, FinishReason, GenerationOutput, GenerationRequest};
pub use golden::{GoldenAcceptance, GOLDEN_FORMAT};
pub use scheduler::{
    Event, RequestId, Scheduler, SchedulerConfig, SchedulerTotals, FALLBACK_CPU_DEVICE,
};
pub use speculative::{acceptance_mode, generate_batch, generate_batch_on, BatchOutput, RunStats};
pub use stats::{GenerationStats, LatencySummary, SpeculativeStats};
pub use target::{build_target, CpuTarget, TargetBackend, TargetOptions};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] specula_model::ModelError),
    #[error(transparent)]
    Sampling(#[from] specula_kernels::sampling::SamplingError),
    #[error(transparent)]
    KvCache(#[from] specula_model::kv_cache::KvCacheError),
    #[error(transparent)]
    Draft(#[from] specula_drafters::DraftError),
    #[error(transparent)]
    Verify(#[from] specula_verifier::VerifyError),
    #[error("drafter: {0}")]
    Drafter(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The chosen device cannot run here (no GPU backend in this build, no driver, no GPU).
    #[error("{0}")]
    DeviceUnavailable(String),
    /// The GPU backend failed during a step (a driver error or a kernel's reported failure).
    #[error("GPU backend: {0}")]
    Gpu(String),
}
