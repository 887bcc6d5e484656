//! Image dimensions from the file header, without decoding pixels: PNG, JPEG,
//! WebP (lossy, lossless, extended) and GIF.
//!
//! Bounded: PNG, GIF and WebP sizes sit in the first 30 bytes; a JPEG's frame
//! header (SOFn) comes after its metadata segments, which are skipped by length
//! without reading them, and the scan gives up after [`MAX_JPEG_SEGMENTS`].
//! Sizes are the encoded ones (EXIF orientation is not applied), as the engines'
//! processors see them before any transpose.

/// Segments a JPEG scan reads before giving up.
pub const MAX_JPEG_SEGMENTS: usize = 256;

/// Width and height in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageSize {
    /// Pixels across.
    pub width: u32,
    /// Pixels down.
    pub height: u32,
}

/// The image format, by its magic bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// PNG.
    Png,
    /// JPEG (JFIF / EXIF).
    Jpeg,
    /// WebP.
    WebP,
    /// GIF 87a / 89a.
    Gif,
}

/// Why no size could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DimsError {
    /// The magic bytes are not PNG, JPEG, WebP or GIF.
    #[error("not a PNG, JPEG, WebP or GIF image")]
    UnknownFormat,
    /// The header ends before the size.
    #[error("{0:?} header is truncated")]
    Truncated(ImageFormat),
    /// The header is malformed.
    #[error("{0:?} header is malformed")]
    Malformed(ImageFormat),
    /// A zero width or height.
    #[error("{0:?} image has a zero dimension")]
    Empty(ImageFormat),
}

/// Detects the format from the first bytes.
pub fn format(bytes: &[u8]) -> Option<ImageFormat> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(ImageFormat::Png)
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some(ImageFormat::Jpeg)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some(ImageFormat::WebP)
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some(ImageFormat::Gif)
    } else {
        None
    }
}

/// Reads the size from an image's header bytes (the whole file, or a prefix long
/// enough to hold the header).
pub fn image_size(bytes: &[u8]) -> Result<ImageSize, DimsError> {
    let fmt = format(bytes).ok_or(DimsError::UnknownFormat)?;
    let (width, height) = match fmt {
        ImageFormat::Png => png(bytes)?,
        ImageFormat::Jpeg => jpeg(bytes)?,
        ImageFormat::WebP => webp(bytes)?,
        ImageFormat::Gif => {
            let b = bytes.get(6..10).ok_or(DimsError::Truncated(fmt))?;
            (
                u32::from(u16::from_le_bytes([b[0], b[1]])),
                u32::from(u16::from_le_bytes([b[2], b[3]])),
            )
        }
    };
    if width == 0 || height == 0 {
        return Err(DimsError::Empty(fmt));
    }
    Ok(ImageSize { width, height })
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn png(bytes: &[u8]) -> Result<(u32, u32), DimsError> {
    let f = ImageFormat::Png;
    let ihdr = bytes.get(8..24).ok_or(DimsError::Truncated(f))?;
    if &ihdr[4..8] != b"IHDR" {
        return Err(DimsError::Malformed(f));
    }
    Ok((be32(&ihdr[8..12]), be32(&ihdr[12..16])))
}

fn webp(bytes: &[u8]) -> Result<(u32, u32), DimsError> {
    let f = ImageFormat::WebP;
    let chunk = bytes.get(12..16).ok_or(DimsError::Truncated(f))?;
    match chunk {
        b"VP8 " => {
            // Frame tag (3 bytes), start code 9d 01 2a, then 14-bit sizes.
            let b = bytes.get(23..30).ok_or(DimsError::Truncated(f))?;
            if b[..3] != [0x9d, 0x01, 0x2a] {
                return Err(DimsError::Malformed(f));
            }
            let w = u16::from_le_bytes([b[3], b[4]]) & 0x3fff;
            let h = u16::from_le_bytes([b[5], b[6]]) & 0x3fff;
            Ok((u32::from(w), u32::from(h)))
        }
        b"VP8L" => {
            let b = bytes.get(20..25).ok_or(DimsError::Truncated(f))?;
            if b[0] != 0x2f {
                return Err(DimsError::Malformed(f));
            }
            let bits = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
            Ok((1 + (bits & 0x3fff), 1 + ((bits >> 14) & 0x3fff)))
        }
        b"VP8X" => {
            let b = bytes.get(24..30).ok_or(DimsError::Truncated(f))?;
            let w = u32::from_le_bytes([b[0], b[1], b[2], 0]) + 1;
            let h = u32::from_le_bytes([b[3], b[4], b[5], 0]) + 1;
            Ok((w, h))
        }
        _ => Err(DimsError::Malformed(f)),
    }
}

fn jpeg(bytes: &[u8]) -> Result<(u32, u32), DimsError> {
    let f = ImageFormat::Jpeg;
    let mut i = 2; // after SOI
    for _ in 0..MAX_JPEG_SEGMENTS {
        // Markers start with 0xFF, possibly repeated as fill bytes.
        if *bytes.get(i).ok_or(DimsError::Truncated(f))? != 0xFF {
            return Err(DimsError::Malformed(f));
        }
        while bytes.get(i) == Some(&0xFF) {
            i += 1;
        }
        let marker = *bytes.get(i).ok_or(DimsError::Truncated(f))?;
        i += 1;
        match marker {
            // Standalone markers: TEM, RSTn.
            0x01 | 0xD0..=0xD7 => continue,
            // EOI or SOS before any frame header.
            0xD9 | 0xDA => return Err(DimsError::Malformed(f)),
            _ => {}
        }
        let len_bytes = bytes.get(i..i + 2).ok_or(DimsError::Truncated(f))?;
        let len = usize::from(u16::from_be_bytes([len_bytes[0], len_bytes[1]]));
        if len < 2 {
            return Err(DimsError::Malformed(f));
        }
        let is_sof = matches!(marker, 0xC0..=0xCF) && !matches!(marker, 0xC4 | 0xC8 | 0xCC);
        if is_sof {
            // length(2) precision(1) height(2) width(2)
            let b = bytes.get(i + 3..i + 7).ok_or(DimsError::Truncated(f))?;
            let h = u16::from_be_bytes([b[0], b[1]]);
            let w = u16::from_be_bytes([b[2], b[3]]);
            return Ok((u32::from(w), u32::from(h)));
        }
        i += len;
    }
    Err(DimsError::Malformed(f))
}

/// Test images, built byte by byte (shared with other modules' tests).
#[cfg(test)]
pub(crate) mod samples {
    /// A PNG header of the given size (signature + IHDR; enough for [`super::image_size`]).
    pub fn png(w: u32, h: u32) -> Vec<u8> {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend_from_slice(&w.to_be_bytes());
        b.extend_from_slice(&h.to_be_bytes());
        b.extend_from_slice(&[8, 6, 0, 0, 0]);
        b
    }

    /// A JPEG with an APP0 and a DQT segment before its SOF0.
    pub fn jpeg(w: u16, h: u16) -> Vec<u8> {
        let mut b = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x10];
        b.extend_from_slice(b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
        b.extend_from_slice(&[0xFF, 0xDB, 0x00, 0x04, 0x00, 0x01]);
        b.extend_from_slice(&[0xFF, 0xFF, 0xC0, 0x00, 0x11, 0x08]);
        b.extend_from_slice(&h.to_be_bytes());
        b.extend_from_slice(&w.to_be_bytes());
        b.extend_from_slice(&[3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn riff(chunk: &[u8], body: &[u8]) -> Vec<u8> {
        let mut b = b"RIFF\0\0\0\0WEBP".to_vec();
        b.extend_from_slice(chunk);
        b.extend_from_slice(&(body.len() as u32).to_le_bytes());
        b.extend_from_slice(body);
        b
    }

    #[test]
    fn reads_each_format() {
        let size = |w, h| {
            Ok(ImageSize {
                width: w,
                height: h,
            })
        };
        assert_eq!(image_size(&samples::png(640, 480)), size(640, 480));
        assert_eq!(image_size(&samples::jpeg(1024, 768)), size(1024, 768));
        let mut gif = b"GIF89a".to_vec();
        gif.extend_from_slice(&[0x20, 0x03, 0x58, 0x02, 0, 0, 0]);
        assert_eq!(image_size(&gif), size(800, 600));
        // VP8: frame tag, start code, 14-bit sizes with scale bits set.
        let mut vp8 = vec![0x30, 0x01, 0x00, 0x9d, 0x01, 0x2a];
        vp8.extend_from_slice(&(400u16 | 0x4000).to_le_bytes());
        vp8.extend_from_slice(&300u16.to_le_bytes());
        assert_eq!(image_size(&riff(b"VP8 ", &vp8)), size(400, 300));
        // VP8L: signature, then (w-1) and (h-1) in 14 bits each.
        let bits: u32 = (123 - 1) | ((45 - 1) << 14);
        let mut vp8l = vec![0x2f];
        vp8l.extend_from_slice(&bits.to_le_bytes());
        assert_eq!(image_size(&riff(b"VP8L", &vp8l)), size(123, 45));
        // VP8X: flags, reserved, 24-bit (w-1) and (h-1).
        let vp8x = [0x10, 0, 0, 0, 0xFF, 0x0F, 0x00, 0x37, 0x04, 0x00];
        assert_eq!(image_size(&riff(b"VP8X", &vp8x)), size(4096, 1080));
    }

    #[test]
    fn bad_headers_are_errors() {
        assert_eq!(image_size(b"hello"), Err(DimsError::UnknownFormat));
        assert_eq!(
            image_size(&samples::png(1, 1)[..20]),
            Err(DimsError::Truncated(ImageFormat::Png))
        );
        assert_eq!(
            image_size(&samples::png(0, 5)),
            Err(DimsError::Empty(ImageFormat::Png))
        );
        let j = samples::jpeg(10, 10);
        assert_eq!(
            image_size(&j[..j.len() - 12]),
            Err(DimsError::Truncated(ImageFormat::Jpeg))
        );
        // SOS before any frame header.
        assert_eq!(
            image_size(&[0xFF, 0xD8, 0xFF, 0xDA, 0, 2]),
            Err(DimsError::Malformed(ImageFormat::Jpeg))
        );
        // A segment length pointing past the data never panics.
        assert_eq!(
            image_size(&[0xFF, 0xD8, 0xFF, 0xE1, 0xFF, 0xFF]),
            Err(DimsError::Truncated(ImageFormat::Jpeg))
        );
    }
}
