//! Where weights come from. A `TensorSource` answers by canonical (HF transformers) tensor name, so the
//! model builder is the same for safetensors and GGUF; each source translates names and layouts.

use crate::error::ModelError;
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// How weight matrices are stored in memory after loading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// f32 checkpoints stay f32 (exact reference); everything else becomes bf16.
    #[default]
    Auto,
    F32,
    Bf16,
}

impl std::str::FromStr for WeightDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(WeightDtype::Auto),
            "f32" => Ok(WeightDtype::F32),
            "bf16" => Ok(WeightDtype::Bf16),
            other => Err(format!("unknown weight dtype {other:?} (auto, f32, bf16)")),
        }
    }
}

/// Tensor values as read, before the dtype policy is applied.
pub enum TensorValues {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl TensorValues {
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            TensorValues::F32(v) => v,
            TensorValues::Bf16(v) => v.into_iter().map(|x| x.to_f32()).collect(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TensorValues::F32(v) => v.len(),
            TensorValues::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub trait TensorSource {
    /// Shape in row-major order (outermost first), or None if the tensor is absent.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Values in row-major order. `prefer_bf16` lets a bf16 source skip the widening to f32.
    fn read(&self, name: &str, prefer_bf16: bool) -> Result<TensorValues, ModelError>;
    /// Human-readable description of the source (for errors and reports).
    fn describe(&self) -> String;
    /// An integer tensor (index maps such as a pruned draft vocabulary's `d2t`), widened to i64.
    fn read_integers(&self, name: &str) -> Result<Vec<i64>, ModelError> {
        Err(ModelError::Config(format!(
            "{}: integer tensor {name} cannot be read from this source",
            self.describe()
        )))
    }
}

struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    metadata: Metadata,
}

/// One or many memory-mapped `*.safetensors` files (sharded checkpoints).
pub struct SafetensorsSource {
    files: Vec<SafetensorsFile>,
    index: BTreeMap<String, usize>,
}

impl SafetensorsSource {
    pub fn open(paths: &[PathBuf]) -> Result<SafetensorsSource, ModelError> {
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for path in paths {
            let file = File::open(path).map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the file is opened read-only; like every mmap-based loader we assume it is not
            // modified while the model is loading.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
                    path: path.clone(),
                    msg: format!("corrupt or truncated safetensors file: {e}"),
                })?;
            for name in metadata.tensors().keys() {
                if index.insert(name.clone(), files.len()).is_some() {
                    return Err(ModelError::Safetensors {
                        path: path.clone(),
                        msg: format!("tensor {name} appears in more than one file"),
                    });
                }
            }
            files.push(SafetensorsFile {
                path: path.clone(),
                mmap,
                data_start: 8 + header_len,
                metadata,
            });
        }
        Ok(SafetensorsSource { files, index })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
}

impl TensorSource for SafetensorsSource {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let f = &self.files[*self.index.get(name)?];
        f.metadata.info(name).map(|i| i.shape.clone())
    }

    fn read(&self, name: &str, prefer_bf16: bool) -> Result<TensorValues, ModelError> {
        let fi = *self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let f = &self.files[fi];
        let info = f.metadata.info(name).expect("indexed from this metadata");
        let (a, b) = info.data_offsets;
        // read_metadata validated that offsets are contiguous and lie inside the buffer.
        let bytes = &f.mmap[f.data_start + a..f.data_start + b];
        let err = |msg: String| ModelError::Safetensors {
            path: f.path.clone(),
            msg,
        };
        Ok(match info.dtype {
            Dtype::F32 => TensorValues::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::BF16 => {
                let v: Vec<bf16> = bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect();
                if prefer_bf16 {
                    TensorValues::Bf16(v)
                } else {
                    TensorValues::F32(v.into_iter().map(|x| x.to_f32()).collect())
                }
            }
            Dtype::F16 => TensorValues::F32(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                    .collect(),
            ),
            other => {
                return Err(err(format!(
                    "tensor {name} has dtype {other:?}; supported: F32, F16, BF16"
                )))
            }
        })
    }

    fn read_integers(&self, name: &str) -> Result<Vec<i64>, ModelError> {
        let fi = *self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let f = &self.files[fi];
        let info = f.metadata.info(name).expect("indexed from this metadata");
        let (a, b) = info.data_offsets;
        let bytes = &f.mmap[f.data_start + a..f.data_start + b];
        Ok(match info.dtype {
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
            Dtype::I32 => bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                .collect(),
            Dtype::BOOL | Dtype::U8 => bytes.iter().map(|&v| v as i64).collect(),
            other => {
                return Err(ModelError::Safetensors {
                    path: f.path.clone(),
                    msg: format!("tensor {name} has dtype {other:?}; expected an integer tensor"),
                })
            }
        })
    }

    fn describe(&self) -> String {
        match self.files.as_slice() {
            [one] => one.path.display().to_string(),
            many => format!(
                "{} ({} safetensors shards)",
                many[0].path.parent().unwrap_or(Path::new(".")).display(),
                many.len()
            ),
        }
    }
}
