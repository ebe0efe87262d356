//! The three compression libraries behind one calling convention: compress into a
//! caller's slice and report "did not fit" as `None`, decompress into a caller's
//! slice and report the length produced. Contexts live as long as the codec; no
//! call allocates, not even on failure (which is why lz4 and zstd are driven
//! through their raw/`zstd_safe` layers: the friendly wrappers build an
//! `io::Error` with a heap string every time an incompressible unit does not fit).

use std::os::raw::{c_char, c_int};

use lz4::liblz4::{LZ4_compress_fast, LZ4_decompress_safe};
use zstd::zstd_safe::{self, CParameter, ResetDirective};

use crate::{Algorithm, Error};

/// lz4's own ceiling (`LZ4_ACCELERATION_MAX` in lz4.c); larger values are silently
/// clamped by the library, so we refuse them instead.
pub const LZ4_MAX_ACCELERATION: i32 = 65537;

pub(crate) enum Compressor {
    /// lz4 keeps its 16 KiB hash table on the stack: no context to hold.
    Lz4 {
        acceleration: i32,
    },
    Zstd(zstd_safe::CCtx<'static>),
    Deflate(libdeflater::Compressor),
}

impl Compressor {
    pub fn new(algorithm: Algorithm, level: i32) -> Result<Self, Error> {
        match algorithm {
            Algorithm::Lz4 => {
                if level > LZ4_MAX_ACCELERATION {
                    return Err(Error::Config(format!(
                        "lz4 acceleration {level} is above {LZ4_MAX_ACCELERATION}"
                    )));
                }
                Ok(Compressor::Lz4 {
                    acceleration: level.max(1),
                })
            }
            Algorithm::Zstd => {
                let (min, max) = (zstd_safe::min_c_level(), zstd_safe::max_c_level());
                if !(min..=max).contains(&level) {
                    return Err(Error::Config(format!(
                        "zstd level {level} is outside {min}..={max}"
                    )));
                }
                let mut cctx = zstd_safe::CCtx::try_create()
                    .ok_or_else(|| Error::Config("cannot allocate a zstd context".into()))?;
                let setup = |cctx: &mut zstd_safe::CCtx<'static>| -> zstd_safe::SafeResult {
                    cctx.set_parameter(CParameter::CompressionLevel(level))?;
                    // The unit length is known from the table: do not spend frame
                    // header bytes on it, nor on a checksum (crc32c covers the unit).
                    cctx.set_parameter(CParameter::ContentSizeFlag(false))?;
                    cctx.set_parameter(CParameter::ChecksumFlag(false))?;
                    cctx.set_parameter(CParameter::DictIdFlag(false))
                };
                setup(&mut cctx).map_err(|code| {
                    Error::Config(format!(
                        "zstd rejected level {level}: {}",
                        zstd_safe::get_error_name(code)
                    ))
                })?;
                Ok(Compressor::Zstd(cctx))
            }
            Algorithm::Deflate => {
                if !(1..=12).contains(&level) {
                    return Err(Error::Config(format!(
                        "deflate level {level} is outside 1..=12"
                    )));
                }
                let lvl = libdeflater::CompressionLvl::new(level)
                    .map_err(|_| Error::Config(format!("deflate level {level} rejected")))?;
                Ok(Compressor::Deflate(libdeflater::Compressor::new(lvl)))
            }
        }
    }

    /// Compress `src` into `dst`. `None` when the result would not fit in `dst`
    /// (the caller sizes `dst` to the largest result worth keeping, so this is
    /// also the early bail-out for incompressible data) or the library failed.
    pub fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Option<usize> {
        if dst.is_empty() {
            return None;
        }
        match self {
            Compressor::Lz4 { acceleration } => {
                // SAFETY: both pointers are valid for the lengths passed; lengths are
                // at most 2 MiB (checked by the caller), far below c_int::MAX.
                let n = unsafe {
                    LZ4_compress_fast(
                        src.as_ptr() as *const c_char,
                        dst.as_mut_ptr() as *mut c_char,
                        src.len() as c_int,
                        dst.len() as c_int,
                        *acceleration,
                    )
                };
                (n > 0).then_some(n as usize)
            }
            Compressor::Zstd(cctx) => match cctx.compress2(dst, src) {
                Ok(n) => Some(n),
                Err(_) => {
                    // A failed compress2 leaves the frame open; drop it so the
                    // next call starts clean. Parameters are kept.
                    let _ = cctx.reset(ResetDirective::SessionOnly);
                    None
                }
            },
            Compressor::Deflate(c) => c.deflate_compress(src, dst).ok(),
        }
    }
}

/// Decompression contexts, one per algorithm, made on first use: a codec decodes
/// whatever algorithm the encoding's header names, not just its own.
#[derive(Default)]
pub(crate) struct Decompressors {
    zstd: Option<zstd_safe::DCtx<'static>>,
    deflate: Option<libdeflater::Decompressor>,
}

impl Decompressors {
    /// Make sure the context for `algorithm` exists (the only allocation here).
    pub fn prepare(&mut self, algorithm: Algorithm) -> Result<(), Error> {
        match algorithm {
            Algorithm::Lz4 => {}
            Algorithm::Zstd => {
                if self.zstd.is_none() {
                    let dctx = zstd_safe::DCtx::try_create().ok_or_else(|| {
                        Error::Config("cannot allocate a zstd decompression context".into())
                    })?;
                    self.zstd = Some(dctx);
                }
            }
            Algorithm::Deflate => {
                if self.deflate.is_none() {
                    self.deflate = Some(libdeflater::Decompressor::new());
                }
            }
        }
        Ok(())
    }

    /// Decompress `src` into `dst`; the number of bytes produced, or `None` if the
    /// input is not valid for `algorithm` or would overflow `dst`.
    /// `prepare(algorithm)` must have succeeded before.
    pub fn decompress(
        &mut self,
        algorithm: Algorithm,
        src: &[u8],
        dst: &mut [u8],
    ) -> Option<usize> {
        match algorithm {
            Algorithm::Lz4 => {
                // SAFETY: LZ4_decompress_safe never reads past src.len() nor writes
                // past dst.len(), whatever the input; both fit in c_int (<= 2 MiB).
                let n = unsafe {
                    LZ4_decompress_safe(
                        src.as_ptr() as *const c_char,
                        dst.as_mut_ptr() as *mut c_char,
                        src.len() as c_int,
                        dst.len() as c_int,
                    )
                };
                (n >= 0).then_some(n as usize)
            }
            Algorithm::Zstd => self.zstd.as_mut()?.decompress(dst, src).ok(),
            Algorithm::Deflate => self.deflate.as_mut()?.deflate_decompress(src, dst).ok(),
        }
    }
}
