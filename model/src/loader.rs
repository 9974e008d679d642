//! `load(path)`: one entry point that detects the checkpoint format.
//!
//! - a `.gguf` file (detected by its magic, not its name): weights, config and tokenizer from one file;
//! - an HF directory: `config.json`, one or many `*.safetensors` (memory-mapped), `tokenizer.json`;
//! - a single `*.safetensors` file: as above, with `config.json` beside it.

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::gguf_source::GgufSource;
use crate::source::{SafetensorsSource, WeightDtype};
use crate::tokenizer::{GgufTokenizerSpec, Tokenizer};
use crate::transformer::Transformer;
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointFormat {
    Gguf,
    Safetensors,
}

pub struct LoadedModel {
    pub model: Transformer,
    /// None when the checkpoint carries no tokenizer (token-id-only use still works).
    pub tokenizer: Option<Tokenizer>,
    pub format: CheckpointFormat,
    /// The files the weights came from (for hashes in result files).
    pub weight_files: Vec<PathBuf>,
    pub path: PathBuf,
}

impl LoadedModel {
    pub fn tokenizer(&self) -> Result<&Tokenizer, ModelError> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| ModelError::MissingTokenizer(self.path.display().to_string()))
    }

    /// Token ids that end generation: the tokenizer's plus the config's.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.model.config.eos_token_ids.clone();
        if let Some(t) = &self.tokenizer {
            ids.extend_from_slice(t.eos_token_ids());
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn is_gguf(path: &Path) -> Result<bool, ModelError> {
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    match f.read_exact(&mut magic) {
        Ok(()) => Ok(&magic == b"GGUF"),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(io(path)(e)),
    }
}

pub fn load(path: &Path, dtype: WeightDtype) -> Result<LoadedModel, ModelError> {
    let meta = std::fs::metadata(path).map_err(io(path))?;
    if meta.is_dir() {
        return load_hf_dir(path, None, dtype);
    }
    if is_gguf(path)? {
        return load_gguf(path, dtype);
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        return load_hf_dir(dir, Some(vec![path.to_path_buf()]), dtype);
    }
    Err(ModelError::UnknownFormat(format!(
        "{}: not a GGUF file (no GGUF magic), a .safetensors file, or a model directory",
        path.display()
    )))
}

fn load_gguf(path: &Path, dtype: WeightDtype) -> Result<LoadedModel, ModelError> {
    let file = GgufFile::open(path)?;
    let tokenizer = if file.metadata.contains_key("tokenizer.ggml.tokens") {
        Some(Tokenizer::from_gguf_spec(
            &GgufTokenizerSpec::from_gguf_metadata(&file.metadata)?,
        )?)
    } else {
        None
    };
    let (source, config) = GgufSource::new(file)?;
    let model = Transformer::load(config, &source, dtype)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        format: CheckpointFormat::Gguf,
        weight_files: vec![path.to_path_buf()],
        path: path.to_path_buf(),
    })
}

/// The safetensors files of an HF directory: those named by `model.safetensors.index.json` if present,
/// else every `*.safetensors` file, sorted.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: invalid JSON: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                ModelError::Config(format!("{}: no weight_map object", index.display()))
            })?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|f| f.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let p = entry.map_err(io(dir))?.path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(ModelError::UnknownFormat(format!(
            "{}: no *.safetensors files",
            dir.display()
        )));
    }
    Ok(files)
}

fn load_hf_dir(
    dir: &Path,
    files: Option<Vec<PathBuf>>,
    dtype: WeightDtype,
) -> Result<LoadedModel, ModelError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(io(&config_path))?;
    let config = ModelConfig::from_hf_json(&text)?;
    let files = match files {
        Some(f) => f,
        None => safetensors_files(dir)?,
    };
    let source = SafetensorsSource::open(&files)?;
    let model = Transformer::load(config, &source, dtype)?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.exists() {
        Some(Tokenizer::from_file(&tok_path)?)
    } else {
        None
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        format: CheckpointFormat::Safetensors,
        weight_files: files,
        path: dir.to_path_buf(),
    })
}
