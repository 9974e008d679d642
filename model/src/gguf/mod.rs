//! GGUF v2/v3 reader (little-endian), with dequantisation to f32 and a small writer.
//!
//! Layout of a GGUF file, all integers little-endian:
//! - header: magic `"GGUF"`, version `u32`, tensor count `u64`, metadata key/value count `u64`;
//! - metadata: `count` pairs of (key: string, value type: `u32`, value), where a string is a
//!   `u64` byte length followed by UTF-8 bytes and an array is (element type `u32`, length `u64`,
//!   elements) — arrays may nest;
//! - tensor infos: name (string), `n_dims: u32`, `n_dims` × `u64` dims (ne0 first, the
//!   fastest-varying), ggml type id `u32`, offset `u64` relative to the data section;
//! - padding to the next multiple of `general.alignment` (default 32), then the data section.
//!
//! Every read from the file is bounds-checked and every count is checked against the bytes left
//! before anything is allocated from it: a corrupt or truncated file yields a [`GgufError`] naming
//! the file, never a panic or an absurd allocation.

pub mod dequant;
mod value;
mod writer;

pub use dequant::dequantize;
pub use value::GgufValue;
pub use writer::{encode_gguf, write_gguf, GgufTensorToWrite};

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data-section alignment used when the file has no `general.alignment` key.
pub const GGUF_DEFAULT_ALIGNMENT: u64 = 32;
/// Metadata key that overrides the data-section alignment.
pub const GGUF_ALIGNMENT_KEY: &str = "general.alignment";
/// ggml tensors have at most this many dimensions (`GGML_MAX_DIMS`).
pub const GGML_MAX_DIMS: usize = 4;

/// Metadata arrays nested deeper than this are rejected: real files nest at most one level, and
/// an unbounded recursion on a crafted file would overflow the stack.
const MAX_ARRAY_NESTING: u32 = 16;

/// Every way reading, dequantising or writing a GGUF file can fail.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a GGUF file: it starts with {}, expected the magic \"GGUF\" (47 47 55 46)", path.display(), describe_bytes(found))]
    BadMagic { path: PathBuf, found: Vec<u8> },
    #[error("{}: unsupported GGUF version {version}; this reader supports versions 2 and 3{}", path.display(), version_hint(*version))]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{}: malformed GGUF file at byte offset {offset}: {reason}", path.display())]
    Malformed {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("{}: metadata key {key:?} is missing", path.display())]
    MissingKey { path: PathBuf, key: String },
    #[error("{}: metadata key {key:?} has type {found}, expected {expected}", path.display())]
    WrongType {
        path: PathBuf,
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("{}: no tensor named {name:?} in the file", path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: unsupported quantisation type {ggml_type} in tensor {tensor}; supported: {}", path.display(), supported_types_list())]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        ggml_type: GgmlType,
    },
    #[error("{}: tensor {tensor}: {source}", path.display())]
    InTensor {
        path: PathBuf,
        tensor: String,
        #[source]
        source: Box<GgufError>,
    },
    #[error(
        "unsupported quantisation type {ggml_type}; supported: {}",
        supported_types_list()
    )]
    UnsupportedType { ggml_type: GgmlType },
    #[error("cannot dequantise {ggml_type}: {reason}")]
    InvalidDequantInput { ggml_type: GgmlType, reason: String },
    #[error("cannot write GGUF: {reason}")]
    InvalidWriteInput { reason: String },
}

fn version_hint(version: u32) -> &'static str {
    match version {
        1 => {
            " (version 1 used 32-bit counts and lengths; convert the file with a current llama.cpp)"
        }
        _ if (1..=3).contains(&version.swap_bytes()) => {
            " (the version looks byte-swapped: big-endian GGUF files are not supported)"
        }
        _ => "",
    }
}

/// Bytes as hex, plus their ASCII text when printable, e.g. `47 47 4d 4c ("GGML")`.
fn describe_bytes(bytes: &[u8]) -> String {
    let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let hex = hex.join(" ");
    if bytes.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!("{hex} ({:?})", String::from_utf8_lossy(bytes))
    } else {
        hex
    }
}

fn supported_types_list() -> String {
    let names: Vec<&str> = GgmlType::DEQUANTIZE_SUPPORTED
        .iter()
        .map(|t| t.name())
        .collect();
    names.join(", ")
}

macro_rules! ggml_types {
    ($($variant:ident = $id:literal, block $block:literal, bytes $bytes:expr;)*) => {
        /// A ggml tensor element type, with its GGUF type id as discriminant.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u32)]
        pub enum GgmlType {
            $($variant = $id,)*
        }

        impl GgmlType {
            /// Every type id ggml currently defines, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant,)*];

            /// The type with this GGUF/ggml type id, if ggml currently defines it.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id {
                    $($id => Some(GgmlType::$variant),)*
                    _ => None,
                }
            }

            /// ggml's name of the type, e.g. `"Q4_K"`.
            pub fn name(self) -> &'static str {
                match self {
                    $(GgmlType::$variant => stringify!($variant),)*
                }
            }

            /// Elements per block (1 for plain float/int types, 32 or 256 for most quants).
            pub fn block_size(self) -> u64 {
                match self {
                    $(GgmlType::$variant => $block,)*
                }
            }

            /// Bytes per block.
            pub fn type_size(self) -> u64 {
                match self {
                    $(GgmlType::$variant => $bytes,)*
                }
            }
        }
    };
}

/// Elements per super-block of the K-quants and most i-quants.
const QK_K: u64 = 256;

// Block and type sizes as in ggml (`ggml.c` type traits) and gguf-py's `GGML_QUANT_SIZES`.
ggml_types! {
    F32 = 0, block 1, bytes 4;
    F16 = 1, block 1, bytes 2;
    Q4_0 = 2, block 32, bytes 2 + 16;
    Q4_1 = 3, block 32, bytes 2 + 2 + 16;
    Q5_0 = 6, block 32, bytes 2 + 4 + 16;
    Q5_1 = 7, block 32, bytes 2 + 2 + 4 + 16;
    Q8_0 = 8, block 32, bytes 2 + 32;
    Q8_1 = 9, block 32, bytes 4 + 4 + 32;
    Q2_K = 10, block 256, bytes 2 + 2 + QK_K / 16 + QK_K / 4;
    Q3_K = 11, block 256, bytes 2 + QK_K / 4 + QK_K / 8 + 12;
    Q4_K = 12, block 256, bytes 2 + 2 + QK_K / 2 + 12;
    Q5_K = 13, block 256, bytes 2 + 2 + QK_K / 2 + QK_K / 8 + 12;
    Q6_K = 14, block 256, bytes 2 + QK_K / 2 + QK_K / 4 + QK_K / 16;
    Q8_K = 15, block 256, bytes 4 + QK_K + QK_K / 8;
    IQ2_XXS = 16, block 256, bytes 2 + QK_K / 4;
    IQ2_XS = 17, block 256, bytes 2 + QK_K / 4 + QK_K / 32;
    IQ3_XXS = 18, block 256, bytes 2 + QK_K / 4 + QK_K / 8;
    IQ1_S = 19, block 256, bytes 2 + QK_K / 8 + QK_K / 16;
    IQ4_NL = 20, block 32, bytes 2 + 16;
    IQ3_S = 21, block 256, bytes 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4;
    IQ2_S = 22, block 256, bytes 2 + QK_K / 4 + QK_K / 16;
    IQ4_XS = 23, block 256, bytes 2 + 2 + QK_K / 2 + QK_K / 64;
    I8 = 24, block 1, bytes 1;
    I16 = 25, block 1, bytes 2;
    I32 = 26, block 1, bytes 4;
    I64 = 27, block 1, bytes 8;
    F64 = 28, block 1, bytes 8;
    IQ1_M = 29, block 256, bytes QK_K / 8 + QK_K / 16 + QK_K / 32;
    BF16 = 30, block 1, bytes 2;
    TQ1_0 = 34, block 256, bytes 2 + 4 * 13;
    TQ2_0 = 35, block 256, bytes 2 + 64;
    MXFP4 = 39, block 32, bytes 1 + 16;
    NVFP4 = 40, block 64, bytes 4 + 32;
    Q1_0 = 41, block 128, bytes 2 + 16;
}

impl GgmlType {
    /// The types [`dequantize`] and [`GgufFile::dequantize_f32`] handle.
    pub const DEQUANTIZE_SUPPORTED: &'static [GgmlType] = &[
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The GGUF/ggml type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Whether [`dequantize`] supports this type.
    pub fn is_dequantize_supported(self) -> bool {
        Self::DEQUANTIZE_SUPPORTED.contains(&self)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // pad, not write_str, so width/alignment specifiers work in tables.
        f.pad(self.name())
    }
}

/// Names of type ids ggml once had and has since removed, so an old file gets a useful message.
fn removed_type_name(id: u32) -> Option<&'static str> {
    match id {
        4 => Some("Q4_2"),
        5 => Some("Q4_3"),
        31 => Some("Q4_0_4_4"),
        32 => Some("Q4_0_4_8"),
        33 => Some("Q4_0_8_8"),
        36 => Some("IQ4_NL_4_4"),
        37 => Some("IQ4_NL_4_8"),
        38 => Some("IQ4_NL_8_8"),
        _ => None,
    }
}

/// One tensor's entry in the tensor-info section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// GGUF/ggml order: `dims[0]` is ne0, the fastest-varying (innermost) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the tensor's data, relative to the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements (product of the dims; 1 for a 0-dimensional tensor).
    ///
    /// Infos read by [`GgufFile::open`] were checked not to overflow; for others this saturates.
    pub fn n_elements(&self) -> u64 {
        checked_element_count(&self.dims).unwrap_or(u64::MAX)
    }

    /// Size of the tensor's data in bytes (saturating, like [`Self::n_elements`]).
    pub fn n_bytes(&self) -> u64 {
        checked_byte_count(self.ggml_type, self.n_elements()).unwrap_or(u64::MAX)
    }

    /// The dims outermost first, as PyTorch and numpy write shapes (the reverse of `dims`).
    pub fn shape_outermost_first(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

fn checked_element_count(dims: &[u64]) -> Option<u64> {
    dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

fn checked_byte_count(ggml_type: GgmlType, n_elements: u64) -> Option<u64> {
    (n_elements / ggml_type.block_size()).checked_mul(ggml_type.type_size())
}

/// A GGUF file opened for reading; tensor data stays in the memory map until asked for.
///
/// The file must not be modified while it is open (a property of every memory-mapped reader).
/// `tensors` and `metadata` are public for convenience: they were validated at open, so treat
/// them as read-only.
pub struct GgufFile {
    path: PathBuf,
    mmap: Option<Mmap>,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor infos in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Data-section alignment in bytes (`general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute byte offset of the data section in the file.
    pub data_offset: u64,
    tensor_index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file, validating the header, metadata and every tensor info
    /// (type, shape, alignment, data range inside the file).
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io_error = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_error)?;
        let file_len = file.metadata().map_err(io_error)?.len();
        // memmap2 refuses zero-length maps on some platforms; an empty file is simply too short.
        let mmap = if file_len == 0 {
            None
        } else {
            // SAFETY: the map is read-only; like every mmap-based reader we rely on the file not
            // being truncated or rewritten while it is open (documented on `GgufFile`).
            Some(unsafe { Mmap::map(&file) }.map_err(io_error)?)
        };
        let bytes: &[u8] = mmap.as_deref().unwrap_or(&[]);
        let parsed = parse(path, bytes)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            tensor_index: parsed.tensor_index,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn file_bytes(&self) -> &[u8] {
        self.mmap.as_deref().unwrap_or(&[])
    }

    /// Whether the file has a tensor with this name.
    pub fn contains_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    /// The info of the tensor with this name.
    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .and_then(|&i| self.tensors.get(i))
            .ok_or_else(|| GgufError::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })
    }

    /// The raw bytes of a tensor (quantised blocks as stored).
    ///
    /// `info` should be one of this file's `tensors`, whose ranges were checked at open; for an
    /// info whose range does not lie inside this file's data section the result is empty.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        let byte_count =
            checked_element_count(&info.dims).and_then(|n| checked_byte_count(info.ggml_type, n));
        let range = byte_count.and_then(|len| {
            let start = self.data_offset.checked_add(info.offset)?;
            let end = start.checked_add(len)?;
            Some(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
        });
        range
            .and_then(|range| self.file_bytes().get(range))
            .unwrap_or(&[])
    }

    /// The tensor's values as f32, in ggml memory order (row-major with ne0 fastest-varying).
    pub fn dequantize_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self.tensor_info(name)?;
        if !info.ggml_type.is_dequantize_supported() {
            return Err(GgufError::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: info.name.clone(),
                ggml_type: info.ggml_type,
            });
        }
        let in_tensor = |source| GgufError::InTensor {
            path: self.path.clone(),
            tensor: info.name.clone(),
            source: Box::new(source),
        };
        let n_elements = usize::try_from(info.n_elements()).map_err(|_| {
            in_tensor(GgufError::InvalidDequantInput {
                ggml_type: info.ggml_type,
                reason: format!(
                    "{} elements do not fit in this platform's address space",
                    info.n_elements()
                ),
            })
        })?;
        // vec! of zeros comes from calloc: fresh pages, no separate zeroing pass.
        let mut values = vec![0f32; n_elements];
        dequantize(
            info.ggml_type,
            self.tensor_bytes(info),
            n_elements,
            &mut values,
        )
        .map_err(in_tensor)?;
        Ok(values)
    }

    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Result<&GgufValue, GgufError> {
        self.metadata.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &GgufValue) -> GgufError {
        let found = match found {
            GgufValue::Array(items) => match items.first() {
                Some(first) => format!("array of {} {}", items.len(), first.type_name()),
                None => "empty array".to_string(),
            },
            other => format!("{} (value {other})", other.type_name()),
        };
        GgufError::WrongType {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
            found,
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let value = self.get(key)?;
        value
            .as_str()
            .ok_or_else(|| self.wrong_type(key, "string", value))
    }

    /// A non-negative integer value of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let value = self.get(key)?;
        match value {
            GgufValue::Bool(_) => Err(self.wrong_type(key, "non-negative integer", value)),
            _ => value
                .as_u64()
                .ok_or_else(|| self.wrong_type(key, "non-negative integer", value)),
        }
    }

    /// A signed integer value of any width.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        let value = self.get(key)?;
        match value {
            GgufValue::Bool(_) => Err(self.wrong_type(key, "integer", value)),
            _ => value
                .as_i64()
                .ok_or_else(|| self.wrong_type(key, "integer", value)),
        }
    }

    /// A numeric value (float or integer) as f64.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let value = self.get(key)?;
        match value {
            GgufValue::Bool(_) => Err(self.wrong_type(key, "number", value)),
            _ => value
                .as_f64()
                .ok_or_else(|| self.wrong_type(key, "number", value)),
        }
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let value = self.get(key)?;
        value
            .as_bool()
            .ok_or_else(|| self.wrong_type(key, "bool", value))
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Result<&[GgufValue], GgufError> {
        let value = self.get(key)?;
        value
            .as_array()
            .ok_or_else(|| self.wrong_type(key, "array", value))
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let value = self.get(key)?;
        value
            .as_array()
            .and_then(|items| {
                items
                    .iter()
                    .map(GgufValue::as_str)
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| self.wrong_type(key, "array of string", value))
    }
}

/// Everything [`parse`] extracts; the byte source stays with the caller.
struct ParsedGguf {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

/// A parse failure before the file path is attached: where and why.
struct Failure {
    offset: u64,
    reason: String,
}

impl Failure {
    /// Prefixes the reason with what was being read, e.g. `metadata key "general.name"`.
    fn context(self, what: impl fmt::Display) -> Failure {
        Failure {
            offset: self.offset,
            reason: format!("{what}: {}", self.reason),
        }
    }
}

/// A bounds-checked little-endian reader over the whole file.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn fail(&self, reason: impl Into<String>) -> Failure {
        Failure {
            offset: self.pos as u64,
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Failure> {
        if n > self.remaining() {
            return Err(self.fail(format!(
                "unexpected end of file: needed {n} bytes, only {} left (file truncated?)",
                self.remaining()
            )));
        }
        let taken = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Failure> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, Failure> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, Failure> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, Failure> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, Failure> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Checks that `count` items of at least `min_item_bytes` each can fit in what is left, so
    /// that a corrupt count is reported instead of driving an allocation or a long loop.
    fn check_count(&self, count: u64, min_item_bytes: u64, what: &str) -> Result<usize, Failure> {
        let fits = count
            .checked_mul(min_item_bytes)
            .is_some_and(|needed| needed <= self.remaining() as u64);
        if !fits {
            return Err(self.fail(format!(
                "{what} count {count} cannot fit in the {} bytes left in the file (each needs at least {min_item_bytes} bytes)",
                self.remaining()
            )));
        }
        // Fits in the file, so fits in usize.
        Ok(count as usize)
    }

    fn string(&mut self) -> Result<String, Failure> {
        let start = self.pos;
        let len = self.u64()?;
        if len > self.remaining() as u64 {
            return Err(self.fail(format!(
                "string length {len} exceeds the {} bytes left in the file",
                self.remaining()
            )));
        }
        let raw = self.take(len as usize)?;
        String::from_utf8(raw.to_vec()).map_err(|e| Failure {
            offset: start as u64,
            reason: format!("string of {len} bytes is not valid UTF-8 ({e})"),
        })
    }

    fn value(&mut self, type_id: u32, depth: u32) -> Result<GgufValue, Failure> {
        Ok(match type_id {
            0 => GgufValue::U8(self.u8()?),
            1 => GgufValue::I8(self.u8()? as i8),
            2 => GgufValue::U16(self.u16()?),
            3 => GgufValue::I16(self.u16()? as i16),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(self.u32()? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32()?)),
            7 => match self.u8()? {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                other => {
                    self.pos -= 1;
                    return Err(self.fail(format!("bool value {other} is neither 0 nor 1")));
                }
            },
            8 => GgufValue::String(self.string()?),
            9 => self.array_value(depth)?,
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(self.u64()? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64()?)),
            other => {
                return Err(self.fail(format!(
                    "unknown metadata value type id {other} (known: 0..=12)"
                )))
            }
        })
    }

    fn array_value(&mut self, depth: u32) -> Result<GgufValue, Failure> {
        if depth >= MAX_ARRAY_NESTING {
            return Err(self.fail(format!(
                "metadata arrays nested more than {MAX_ARRAY_NESTING} deep"
            )));
        }
        let element_type = self.u32()?;
        let min_element_bytes = match element_type {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12, // element type u32 + length u64
            other => {
                return Err(self.fail(format!(
                    "unknown array element type id {other} (known: 0..=12)"
                )))
            }
        };
        let count = self.u64()?;
        let count = self.check_count(count, min_element_bytes, "array element")?;
        // Grow as elements arrive: `count` is bounded by the file size, but a GgufValue is much
        // larger than one byte of file.
        let mut items = Vec::with_capacity(count.min(1 << 16));
        for index in 0..count {
            let item = self.value(element_type, depth + 1);
            // Name the element only at the outermost level, so a nested failure reads
            // "array element 3: ..." once rather than once per level.
            items.push(match item {
                Err(f) if depth == 0 => {
                    return Err(f.context(format_args!("array element {index}")))
                }
                other => other?,
            });
        }
        Ok(GgufValue::Array(items))
    }
}

/// Parses header, metadata and tensor infos from the whole file's bytes and validates every
/// tensor's data range.
fn parse(path: &Path, bytes: &[u8]) -> Result<ParsedGguf, GgufError> {
    let malformed = |f: Failure| GgufError::Malformed {
        path: path.to_path_buf(),
        offset: f.offset,
        reason: f.reason,
    };
    let mut reader = Reader { bytes, pos: 0 };

    if bytes.len() < 4 || bytes[..4] != GGUF_MAGIC {
        if bytes.len() < 4 {
            return Err(malformed(Failure {
                offset: 0,
                reason: format!(
                    "file is only {} bytes long, too short for a GGUF header",
                    bytes.len()
                ),
            }));
        }
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
            found: bytes[..4].to_vec(),
        });
    }
    reader.pos = 4;
    let version = reader.u32().map_err(|f| malformed(f.context("header")))?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let tensor_count = reader.u64().map_err(|f| malformed(f.context("header")))?;
    let kv_count = reader.u64().map_err(|f| malformed(f.context("header")))?;

    // Smallest possible key/value: empty key (8) + type (4) + one-byte value.
    let kv_count = reader
        .check_count(kv_count, 8 + 4 + 1, "metadata key/value")
        .map_err(|f| malformed(f.context("header")))?;
    let mut metadata = BTreeMap::new();
    for index in 0..kv_count {
        let kv_start = reader.pos;
        let key = reader
            .string()
            .map_err(|f| malformed(f.context(format_args!("key of metadata entry {index}"))))?;
        let value = reader
            .u32()
            .and_then(|type_id| reader.value(type_id, 0))
            .map_err(|f| malformed(f.context(format_args!("metadata key {key:?}"))))?;
        if metadata.contains_key(&key) {
            return Err(malformed(Failure {
                offset: kv_start as u64,
                reason: format!("duplicate metadata key {key:?}"),
            }));
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get(GGUF_ALIGNMENT_KEY) {
        None => GGUF_DEFAULT_ALIGNMENT,
        Some(value) => match value.as_u64() {
            Some(a) if a.is_power_of_two() && !matches!(value, GgufValue::Bool(_)) => a,
            _ => {
                return Err(malformed(Failure {
                    offset: reader.pos as u64,
                    reason: format!(
                        "{GGUF_ALIGNMENT_KEY} is {value} ({}); it must be a power-of-two integer",
                        value.type_name()
                    ),
                }))
            }
        },
    };

    // Smallest possible tensor info: empty name (8) + n_dims (4) + type (4) + offset (8).
    let tensor_count = reader
        .check_count(tensor_count, 8 + 4 + 4 + 8, "tensor")
        .map_err(|f| malformed(f.context("header")))?;
    let mut tensors = Vec::with_capacity(tensor_count);
    let mut info_offsets = Vec::with_capacity(tensor_count);
    let mut tensor_index = HashMap::with_capacity(tensor_count);
    for index in 0..tensor_count {
        let info_start = reader.pos as u64;
        let info = read_tensor_info(&mut reader, index, alignment).map_err(malformed)?;
        if tensor_index.insert(info.name.clone(), index).is_some() {
            return Err(malformed(Failure {
                offset: info_start,
                reason: format!("duplicate tensor name {:?}", info.name),
            }));
        }
        tensors.push(info);
        info_offsets.push(info_start);
    }

    let infos_end = reader.pos as u64;
    // alignment is a power of two and infos_end is below the file size, so this cannot overflow
    // for any real file; checked anyway.
    let data_offset = infos_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| {
            malformed(Failure {
                offset: infos_end,
                reason: "data section offset overflows".to_string(),
            })
        })?;
    let file_len = bytes.len() as u64;
    for (info, &info_start) in tensors.iter().zip(&info_offsets) {
        // n_bytes cannot saturate here: read_tensor_info checked the element and byte counts.
        let range = data_offset
            .checked_add(info.offset)
            .and_then(|start| Some((start, start.checked_add(info.n_bytes())?)));
        match range {
            Some((_, end)) if end <= file_len => {}
            _ => {
                return Err(malformed(Failure {
                    offset: info_start,
                    reason: format!(
                        "data of tensor {:?} ({} bytes at data offset {}, i.e. file offset {}) extends past the end of the file ({file_len} bytes; truncated?)",
                        info.name,
                        info.n_bytes(),
                        info.offset,
                        data_offset as u128 + info.offset as u128,
                    ),
                }))
            }
        }
    }

    Ok(ParsedGguf {
        version,
        metadata,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}

fn read_tensor_info(
    reader: &mut Reader<'_>,
    index: usize,
    alignment: u64,
) -> Result<GgufTensorInfo, Failure> {
    let name = reader
        .string()
        .map_err(|f| f.context(format_args!("name of tensor info {index}")))?;
    let in_tensor = |f: Failure| f.context(format_args!("tensor {name:?}"));
    let n_dims = reader.u32().map_err(in_tensor)?;
    if n_dims as usize > GGML_MAX_DIMS {
        return Err(in_tensor(reader.fail(format!(
            "{n_dims} dimensions, ggml supports at most {GGML_MAX_DIMS}"
        ))));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        let dim = reader.u64().map_err(in_tensor)?;
        // ggml stores dims as int64_t.
        if dim > i64::MAX as u64 {
            return Err(in_tensor(
                reader.fail(format!("dimension {dim} is larger than 2^63 - 1")),
            ));
        }
        dims.push(dim);
    }
    let type_id = reader.u32().map_err(in_tensor)?;
    let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
        let hint = match removed_type_name(type_id) {
            Some(old) => format!(" ({old}, which ggml has removed; re-convert the model)"),
            None => format!(
                " (known ids: 0..={}, minus removed ones; the file may need a newer reader)",
                GgmlType::ALL.iter().map(|t| t.id()).max().unwrap_or(0)
            ),
        };
        in_tensor(reader.fail(format!("unknown ggml type id {type_id}{hint}")))
    })?;
    let offset = reader.u64().map_err(in_tensor)?;

    let n_elements = checked_element_count(&dims).ok_or_else(|| {
        in_tensor(reader.fail(format!(
            "dims {dims:?} give an element count that overflows 64 bits"
        )))
    })?;
    let row_length = dims.first().copied().unwrap_or(1);
    if !row_length.is_multiple_of(ggml_type.block_size()) {
        return Err(in_tensor(reader.fail(format!(
            "type {ggml_type} stores blocks of {} elements, but the row length ne0 = {row_length} is not a multiple of it",
            ggml_type.block_size()
        ))));
    }
    if checked_byte_count(ggml_type, n_elements).is_none() {
        return Err(in_tensor(reader.fail(format!(
            "{n_elements} elements of {ggml_type} give a byte size that overflows 64 bits"
        ))));
    }
    if !offset.is_multiple_of(alignment) {
        return Err(in_tensor(reader.fail(format!(
            "data offset {offset} is not a multiple of the alignment {alignment}"
        ))));
    }
    Ok(GgufTensorInfo {
        name,
        dims,
        ggml_type,
        offset,
    })
}
