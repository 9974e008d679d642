//! A small GGUF v3 writer (alignment 32), for tests and for building test models.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use super::{
    checked_byte_count, checked_element_count, GgmlType, GgufError, GgufValue, GGML_MAX_DIMS,
    GGUF_ALIGNMENT_KEY, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC,
};

/// The GGUF version this writer produces.
const WRITTEN_VERSION: u32 = 3;
/// Alignment of the data section and of each tensor's data.
const ALIGNMENT: u64 = GGUF_DEFAULT_ALIGNMENT;

/// One tensor to write: raw data already in the ggml layout of `ggml_type`.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorToWrite {
    pub name: String,
    /// GGUF order: `dims[0]` = ne0, the fastest-varying dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    pub data: Vec<u8>,
}

/// Writes a GGUF v3 file with alignment 32: the metadata in the given order, then the tensor
/// infos and data in the given order.
///
/// Empty metadata arrays are written with element type u8 (any type reads back the same).
/// A `general.alignment` entry is allowed only if it says 32.
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, GgufValue)],
    tensors: &[GgufTensorToWrite],
) -> Result<(), GgufError> {
    validate(metadata, tensors)?;
    let io_error = |source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::create(path).map_err(io_error)?;
    let mut out = CountingWriter {
        inner: BufWriter::new(file),
        written: 0,
    };
    write_all_sections(&mut out, metadata, tensors).map_err(io_error)?;
    out.inner.flush().map_err(io_error)
}

/// The bytes [`write_gguf`] would write (handy for tests that then corrupt them).
pub fn encode_gguf(
    metadata: &[(String, GgufValue)],
    tensors: &[GgufTensorToWrite],
) -> Result<Vec<u8>, GgufError> {
    validate(metadata, tensors)?;
    let mut out = CountingWriter {
        inner: Vec::new(),
        written: 0,
    };
    write_all_sections(&mut out, metadata, tensors).map_err(|e| GgufError::InvalidWriteInput {
        reason: e.to_string(),
    })?;
    Ok(out.inner)
}

fn invalid(reason: String) -> GgufError {
    GgufError::InvalidWriteInput { reason }
}

fn validate(
    metadata: &[(String, GgufValue)],
    tensors: &[GgufTensorToWrite],
) -> Result<(), GgufError> {
    let mut keys = HashSet::new();
    for (key, value) in metadata {
        if !keys.insert(key.as_str()) {
            return Err(invalid(format!("duplicate metadata key {key:?}")));
        }
        validate_value(key, value)?;
        if key == GGUF_ALIGNMENT_KEY && value.as_u64() != Some(ALIGNMENT) {
            return Err(invalid(format!(
                "{GGUF_ALIGNMENT_KEY} is {value}, but this writer always aligns to {ALIGNMENT}"
            )));
        }
    }
    let mut names = HashSet::new();
    for tensor in tensors {
        let name = &tensor.name;
        if !names.insert(name.as_str()) {
            return Err(invalid(format!("duplicate tensor name {name:?}")));
        }
        if tensor.dims.len() > GGML_MAX_DIMS {
            return Err(invalid(format!(
                "tensor {name:?} has {} dims, at most {GGML_MAX_DIMS} allowed",
                tensor.dims.len()
            )));
        }
        if tensor.dims.iter().any(|&d| d > i64::MAX as u64) {
            return Err(invalid(format!("tensor {name:?} has a dim above 2^63 - 1")));
        }
        let ty = tensor.ggml_type;
        let row_length = tensor.dims.first().copied().unwrap_or(1);
        if !row_length.is_multiple_of(ty.block_size()) {
            return Err(invalid(format!(
                "tensor {name:?}: row length {row_length} is not a multiple of the {ty} block size {}",
                ty.block_size()
            )));
        }
        let n_bytes = checked_element_count(&tensor.dims)
            .and_then(|n| checked_byte_count(ty, n))
            .ok_or_else(|| invalid(format!("tensor {name:?}: size overflows 64 bits")))?;
        if tensor.data.len() as u64 != n_bytes {
            return Err(invalid(format!(
                "tensor {name:?}: dims {:?} of {ty} need {n_bytes} bytes, data has {}",
                tensor.dims,
                tensor.data.len()
            )));
        }
    }
    Ok(())
}

fn validate_value(key: &str, value: &GgufValue) -> Result<(), GgufError> {
    if let GgufValue::Array(items) = value {
        if let Some(first) = items.first() {
            let element_type = first.gguf_type_id();
            if items.iter().any(|item| item.gguf_type_id() != element_type) {
                return Err(invalid(format!(
                    "metadata key {key:?}: array elements must all have one type"
                )));
            }
        }
        for item in items {
            validate_value(key, item)?;
        }
    }
    Ok(())
}

/// Counts bytes written so padding can be computed without seeking.
struct CountingWriter<W: Write> {
    inner: W,
    written: u64,
}

impl<W: Write> CountingWriter<W> {
    fn bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.inner.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn u32(&mut self, v: u32) -> io::Result<()> {
        self.bytes(&v.to_le_bytes())
    }

    fn u64(&mut self, v: u64) -> io::Result<()> {
        self.bytes(&v.to_le_bytes())
    }

    fn string(&mut self, s: &str) -> io::Result<()> {
        self.u64(s.len() as u64)?;
        self.bytes(s.as_bytes())
    }

    fn pad_to_alignment(&mut self) -> io::Result<()> {
        let padding = self.written.next_multiple_of(ALIGNMENT) - self.written;
        self.bytes(&[0u8; ALIGNMENT as usize][..padding as usize])
    }

    /// The value's payload, without its type id.
    fn value(&mut self, value: &GgufValue) -> io::Result<()> {
        match value {
            GgufValue::U8(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I8(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::U16(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I16(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::U32(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I32(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::U64(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::I64(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::F32(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::F64(v) => self.bytes(&v.to_le_bytes()),
            GgufValue::Bool(v) => self.bytes(&[*v as u8]),
            GgufValue::String(s) => self.string(s),
            GgufValue::Array(items) => {
                let element_type = items.first().map_or(0, GgufValue::gguf_type_id);
                self.u32(element_type)?;
                self.u64(items.len() as u64)?;
                items.iter().try_for_each(|item| self.value(item))
            }
        }
    }
}

fn write_all_sections<W: Write>(
    out: &mut CountingWriter<W>,
    metadata: &[(String, GgufValue)],
    tensors: &[GgufTensorToWrite],
) -> io::Result<()> {
    out.bytes(&GGUF_MAGIC)?;
    out.u32(WRITTEN_VERSION)?;
    out.u64(tensors.len() as u64)?;
    out.u64(metadata.len() as u64)?;
    for (key, value) in metadata {
        out.string(key)?;
        out.u32(value.gguf_type_id())?;
        out.value(value)?;
    }
    let mut data_offset = 0u64;
    for tensor in tensors {
        out.string(&tensor.name)?;
        out.u32(tensor.dims.len() as u32)?;
        for &dim in &tensor.dims {
            out.u64(dim)?;
        }
        out.u32(tensor.ggml_type.id())?;
        out.u64(data_offset)?;
        data_offset += (tensor.data.len() as u64).next_multiple_of(ALIGNMENT);
    }
    out.pad_to_alignment()?;
    for tensor in tensors {
        out.bytes(&tensor.data)?;
        out.pad_to_alignment()?;
    }
    Ok(())
}
