//! Benchmarks and experiments. Shared helpers for result files: every result states its config,
//! model hashes, machine, date and git revision.

pub mod acceptance;
pub mod e2e_bench;
pub mod plots;
pub mod prompts;
#[cfg(feature = "cuda")]
pub mod step_bench;

use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Errors of the experiment runners; bad input names the file (and line) it came from.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bad prompt line {0} (use --on-bad-line skip to leave such lines out)")]
    BadLine(prompts::BadLine),
    #[error("{0}")]
    Config(String),
    #[error("refusing to resume into {}: it holds results of a different configuration ({difference}); use another output directory or delete this one", dir.display())]
    ConfigMismatch { dir: PathBuf, difference: String },
    #[error("loading {}: {source}", path.display())]
    Load {
        path: PathBuf,
        source: specula_model::ModelError,
    },
    #[error(transparent)]
    Model(#[from] specula_model::ModelError),
    #[error(transparent)]
    Engine(#[from] specula_engine::EngineError),
    #[error("golden export: {0}")]
    Golden(String),
    #[error("plot {}: {message}", path.display())]
    Plot { path: PathBuf, message: String },
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

#[derive(Debug, Clone, Serialize)]
pub struct Provenance {
    pub date_utc: String,
    pub git_revision: String,
    pub git_dirty: bool,
    pub machine: String,
    pub cpu: String,
    pub cores: usize,
    /// The CPU matmul kernel of this process (`CpuKernel::detect`: portable, avx2 or avx512), so
    /// a result says which arithmetic produced it.
    pub cpu_kernel: String,
}

fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl Provenance {
    pub fn collect() -> Provenance {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        Provenance {
            date_utc: command_output("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]).unwrap_or_default(),
            git_revision: command_output("git", &["rev-parse", "HEAD"])
                .unwrap_or_else(|| "unknown".into()),
            git_dirty: command_output("git", &["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty()),
            machine: command_output("uname", &["-srm"]).unwrap_or_default(),
            cpu,
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_kernel: specula_kernels::cpu::CpuKernel::detect().name().into(),
        }
    }
}

/// A kernel source this process loaded from a file instead of the embedded one, through a
/// development knob (`SPECULA_FUSED_STEP_CU`, `SPECULA_DSPARK_CU`: `specula_kernels::cuda`). A result
/// measured with one must say so, since the binary's git revision then does not name the kernel that ran.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct KernelOverride {
    pub variable: String,
    pub path: String,
    /// The file's SHA-256, or why it could not be read.
    pub sha256: String,
}

#[cfg(feature = "cuda")]
const KERNEL_SOURCE_ENVS: &[&str] = &[
    specula_kernels::cuda::FUSED_SOURCE_ENV,
    specula_kernels::cuda::DSPARK_SOURCE_ENV,
];
// Without CUDA no kernel source is compiled, so none can be replaced.
#[cfg(not(feature = "cuda"))]
const KERNEL_SOURCE_ENVS: &[&str] = &[];

/// The kernel sources replaced in this process's environment (empty: every kernel is this build's).
pub fn kernel_overrides() -> Vec<KernelOverride> {
    kernel_overrides_from(KERNEL_SOURCE_ENVS, |v| std::env::var(v).ok())
}

fn kernel_overrides_from(
    variables: &[&str],
    get: impl Fn(&str) -> Option<String>,
) -> Vec<KernelOverride> {
    variables
        .iter()
        .filter_map(|&v| {
            let path = get(v)?;
            let sha256 =
                sha256_file(Path::new(&path)).unwrap_or_else(|e| format!("unreadable: {e}"));
            Some(KernelOverride {
                variable: v.to_string(),
                path,
                sha256,
            })
        })
        .collect()
}

/// One Markdown paragraph naming the replaced kernel sources; empty when there are none.
pub fn kernel_overrides_markdown(overrides: &[KernelOverride]) -> String {
    if overrides.is_empty() {
        return String::new();
    }
    let list: Vec<String> = overrides
        .iter()
        .map(|o| format!("`{}` = `{}` (sha256 {})", o.variable, o.path, o.sha256))
        .collect();
    format!(
        "**Kernel sources replaced in this run** (not this revision's embedded kernels): {}.\n\n",
        list.join("; ")
    )
}

/// Resident and peak resident memory of this process in MiB (Linux `/proc/self/status`).
pub fn memory_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// `sha256_file`, remembered across runs by path, size and modification time in
/// `$XDG_CACHE_HOME/specula/sha256.json` (or `~/.cache/...`), since hashing a multi-GB checkpoint
/// on every run costs seconds. Without a cache directory it just hashes.
pub fn sha256_file_cached(path: &Path) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let absolute = std::fs::canonicalize(path)?;
    let key = format!("{}|{}|{}", absolute.display(), meta.len(), mtime);
    let cache_file = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|d| d.join("specula").join("sha256.json"));
    let mut cache: BTreeMap<String, String> = cache_file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    if let Some(h) = cache.get(&key) {
        return Ok(h.clone());
    }
    let h = sha256_file(path)?;
    if let Some(f) = cache_file {
        cache.insert(key, h.clone());
        // The cache only saves time; failing to write it is not an error.
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::write(&f, serde_json::to_string_pretty(&cache).unwrap_or_default());
    }
    Ok(h)
}

/// sha256 of every regular file of a model: the file itself, or each file of a model directory.
pub fn hash_model_files(path: &Path) -> Result<BTreeMap<String, String>, ExperimentError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e| ExperimentError::Io { path: p, source: e }
    };
    let mut out = BTreeMap::new();
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io(path))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        entries.sort();
        for p in entries {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.insert(name, sha256_file_cached(&p).map_err(io(&p))?);
        }
    } else {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.insert(name, sha256_file_cached(path).map_err(io(path))?);
    }
    Ok(out)
}

/// max |ours - reference| / max |reference|: error relative to the scale of the whole tensor, so
/// near-zero entries do not turn rounding noise into huge ratios. The metric of every parity report.
pub fn max_relative_error(ours: &[f32], reference: &[f32]) -> f64 {
    let scale = reference
        .iter()
        .fold(0f64, |m, &v| m.max(v.abs() as f64))
        .max(1e-30);
    ours.iter()
        .zip(reference)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()))
        / scale
}

/// A tiny model config of the given architecture for the GPU checks (3 layers of 128, 4/2 heads of 64,
/// FFN 352, vocab 1000) on top of a real preset's switches (llama3 RoPE scaling, qwen2 qkv bias, tied
/// embeddings); qwen3 adds q/k norm, head_dim 32 and an untied head; `attention_bias` adds q/k/v and
/// o biases.
pub fn tiny_check_config(
    arch: specula_model::Arch,
    attention_bias: bool,
) -> Result<specula_model::ModelConfig, specula_model::ModelError> {
    use specula_model::Arch;
    let mut c = specula_model::random::preset(match arch {
        Arch::Llama => "llama3.2-1b",
        _ => "qwen2.5-coder-1.5b",
    })?;
    c.arch = arch;
    c.hidden_size = 128;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.intermediate_size = 352;
    c.vocab_size = 1000;
    if attention_bias {
        c.qkv_bias = true;
        c.o_bias = true;
    }
    if arch == Arch::Qwen3 {
        c.qkv_bias = false;
        c.qk_norm = true;
        c.head_dim = 32;
        c.tie_word_embeddings = false;
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_overrides_name_each_set_variable_with_its_file_hash() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fused_step.cu");
        std::fs::write(&file, b"abc").unwrap();
        let file_text = file.display().to_string();
        let missing = dir.path().join("gone.cu").display().to_string();
        let env = |v: &str| match v {
            "A" => Some(file_text.clone()),
            "C" => Some(missing.clone()),
            _ => None,
        };
        let got = kernel_overrides_from(&["A", "B", "C"], env);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].variable, "A");
        assert_eq!(got[0].path, file_text);
        // SHA-256 of "abc" (FIPS 180-2's first example).
        assert_eq!(
            got[0].sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(got[1].variable, "C");
        assert!(
            got[1].sha256.starts_with("unreadable: "),
            "{}",
            got[1].sha256
        );
        let md = kernel_overrides_markdown(&got);
        assert!(
            md.contains("`A` = `") && md.contains("sha256 ba7816bf"),
            "{md}"
        );
        assert!(kernel_overrides_markdown(&[]).is_empty());
    }
}
