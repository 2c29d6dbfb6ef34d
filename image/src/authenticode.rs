//! The Authenticode image hash, as UEFI firmware (EDK2's
//! `DxeTpm2MeasureBootLib`) computes it before measuring an EFI application
//! into PCR 4.
//!
//! The hash covers, in order: the headers up to `SizeOfHeaders` without the
//! optional header's `CheckSum` field and without the certificate-table data
//! directory entry; each section's raw data, sections sorted by
//! `PointerToRawData` and empty ones skipped; then any data after the last
//! section, minus the certificate table's size. Signing an image therefore
//! does not change its hash.

use sha2::{Digest as _, Sha256};
use thiserror::Error;

use crate::pe::{read, PeError, PeFile};

/// An Authenticode hash failure.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthenticodeError {
    /// A section's data lies outside the file.
    #[error("section {name:?} data is out of bounds")]
    SectionData {
        /// The section's name.
        name: String,
        /// The bounds failure.
        #[source]
        source: PeError,
    },
}

/// The SHA-256 Authenticode hash of `pe`.
pub fn sha256(pe: &PeFile<'_>) -> Result<[u8; 32], AuthenticodeError> {
    let bytes = pe.bytes();
    let mut hash = Sha256::new();

    // Headers, skipping CheckSum and (when present) the certificate entry.
    let checksum = pe.checksum_offset();
    hash.update(&bytes[..checksum]);
    match pe.cert_entry_offset() {
        Some(entry) => {
            hash.update(&bytes[checksum + 4..entry]);
            hash.update(&bytes[entry + 8..pe.size_of_headers()]);
        }
        None => hash.update(&bytes[checksum + 4..pe.size_of_headers()]),
    }
    let mut hashed = pe.size_of_headers();

    // Section data in file order.
    let mut sections: Vec<_> = pe
        .sections()
        .iter()
        .filter(|s| s.size_of_raw_data != 0)
        .collect();
    sections.sort_by_key(|s| s.pointer_to_raw_data);
    for section in sections {
        let data = pe
            .raw_data(section)
            .map_err(|source| AuthenticodeError::SectionData {
                name: section.name.clone(),
                source,
            })?;
        hash.update(data);
        hashed += data.len();
    }

    // Trailing data, without the certificate table.
    let cert_size = pe.cert_table().map_or(0, |(_, size)| size);
    if bytes.len() > hashed + cert_size {
        let extra = bytes.len() - hashed - cert_size;
        if let Ok(tail) = read(bytes, hashed, extra, "trailing data") {
            hash.update(tail);
        }
    }
    Ok(hash.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testpe::{self, SectionSpec, CERT_ENTRY_OFFSET, CHECKSUM_OFFSET, HEADERS_LEN};

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn digest(bytes: &[u8]) -> Result<[u8; 32], Box<dyn std::error::Error>> {
        Ok(sha256(&PeFile::parse(bytes)?)?)
    }

    /// Two sections listed in the table in reverse file order.
    fn sample(checksum: u32, cert: &[u8]) -> Vec<u8> {
        testpe::build(
            &[
                SectionSpec::new(".second", &[2u8; 0x100], 0x400),
                SectionSpec::new(".first", &[1u8; 0x200], 0x200),
            ],
            b"trailing",
            cert,
            checksum,
        )
    }

    /// Headers without CheckSum and the certificate entry, section data in
    /// file order, then the trailer without the certificate table.
    fn documented_concatenation(image: &[u8]) -> [u8; 32] {
        let mut expected = Sha256::new();
        expected.update(&image[..CHECKSUM_OFFSET]);
        expected.update(&image[CHECKSUM_OFFSET + 4..CERT_ENTRY_OFFSET]);
        expected.update(&image[CERT_ENTRY_OFFSET + 8..HEADERS_LEN]);
        expected.update([1u8; 0x200]); // .first: lower PointerToRawData
        expected.update([2u8; 0x100]);
        expected.update(b"trailing");
        expected.finalize().into()
    }

    #[test]
    fn hash_is_the_documented_concatenation() -> TestResult {
        let image = sample(0x1234, b"certificate");
        assert_eq!(digest(&image)?, documented_concatenation(&image));
        Ok(())
    }

    #[test]
    fn sections_are_hashed_in_file_order_whatever_the_table_order() -> TestResult {
        let table_in_file_order = testpe::build(
            &[
                SectionSpec::new(".first", &[1u8; 0x200], 0x200),
                SectionSpec::new(".second", &[2u8; 0x100], 0x400),
            ],
            b"trailing",
            b"",
            0,
        );
        for image in [table_in_file_order, sample(0, b"")] {
            assert_eq!(digest(&image)?, documented_concatenation(&image));
        }
        Ok(())
    }

    #[test]
    fn checksum_and_signature_do_not_change_the_hash() -> TestResult {
        let unsigned = sample(0, b"");
        let signed = sample(0xdead_beef, b"a PKCS#7 signature blob");
        assert_ne!(unsigned, signed);
        assert_eq!(digest(&unsigned)?, digest(&signed)?);
        Ok(())
    }

    #[test]
    fn section_header_and_trailer_bytes_change_the_hash() -> TestResult {
        let base = digest(&sample(0, b""))?;
        let mut section = sample(0, b"");
        section[0x210] ^= 1;
        assert_ne!(digest(&section)?, base);
        let mut header = sample(0, b"");
        header[HEADERS_LEN - 1] ^= 1;
        assert_ne!(digest(&header)?, base);
        let mut trailer = sample(0, b"");
        let last = trailer.len() - 1;
        trailer[last] ^= 1;
        assert_ne!(digest(&trailer)?, base);
        Ok(())
    }

    #[test]
    fn section_beyond_the_file_is_an_error() -> TestResult {
        let mut image = sample(0, b"");
        // PointerToRawData of the first table entry (.second) far past the end.
        let entry = testpe::OPT_OFFSET + testpe::OPT_LEN;
        image[entry + 20..entry + 24].copy_from_slice(&0x10_0000u32.to_le_bytes());
        let pe = PeFile::parse(&image)?;
        assert!(matches!(
            sha256(&pe),
            Err(AuthenticodeError::SectionData { ref name, .. }) if name == ".second"
        ));
        Ok(())
    }
}
