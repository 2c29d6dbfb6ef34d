//! The parts of a PE/COFF image that measured boot depends on: the header
//! fields Authenticode skips, and the section table.
//!
//! Only what is needed is parsed, with every offset bounds-checked: the
//! input is a file from disk and is treated as untrusted.

use thiserror::Error;

/// Offset of `e_lfanew` (the PE header's file offset) in the DOS header.
const DOS_LFANEW: usize = 0x3c;
/// Size of the COFF file header that follows the `PE\0\0` signature.
const COFF_HEADER_LEN: usize = 20;
/// Size of one section table entry.
const SECTION_HEADER_LEN: usize = 40;
/// Offset of `CheckSum` in the optional header (PE32 and PE32+ alike).
const OPT_CHECKSUM: usize = 64;
/// Offset of `SizeOfHeaders` in the optional header.
const OPT_SIZE_OF_HEADERS: usize = 60;
/// Index of the certificate table in the data directories.
const CERT_TABLE_INDEX: usize = 4;
/// Largest `VirtualSize` taken: [`PeFile::loaded_data`] allocates that much.
pub const MAX_VIRTUAL_SIZE: u32 = 1 << 30;

/// A PE/COFF parse failure.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeError {
    /// The file ends before a structure that must be present.
    #[error("file truncated: {what} needs bytes {start}..{end}, file has {len}")]
    Truncated {
        /// The structure being read.
        what: &'static str,
        /// First byte of the structure.
        start: usize,
        /// One past its last byte.
        end: usize,
        /// The file length.
        len: usize,
    },
    /// No `MZ` DOS header.
    #[error("not a PE image: missing MZ signature")]
    DosSignature,
    /// No `PE\0\0` signature at `e_lfanew`.
    #[error("not a PE image: missing PE signature at offset {0:#x}")]
    PeSignature(usize),
    /// The optional header is neither PE32 nor PE32+.
    #[error("unknown optional header magic {0:#x}")]
    OptionalMagic(u16),
    /// `SizeOfHeaders` lies outside the file or inside the header fields.
    #[error("SizeOfHeaders {0:#x} is out of bounds")]
    SizeOfHeaders(usize),
    /// `SizeOfHeaders` ends inside the section table, whose rest no hash
    /// covers.
    #[error(
        "SizeOfHeaders {size_of_headers:#x} ends before the section table does ({table_end:#x})"
    )]
    SectionTableOutsideHeaders {
        /// `SizeOfHeaders`.
        size_of_headers: usize,
        /// One past the section table's last byte.
        table_end: usize,
    },
    /// A section's `VirtualSize` is above [`MAX_VIRTUAL_SIZE`].
    #[error("section {name:?} VirtualSize {size:#x} is above {MAX_VIRTUAL_SIZE:#x}")]
    VirtualSize {
        /// The section.
        name: String,
        /// Its `VirtualSize`.
        size: u32,
    },
    /// Two sections' memory ranges overlap.
    #[error("sections {first:?} and {second:?} overlap in memory")]
    OverlappingSections {
        /// One section.
        first: String,
        /// The other.
        second: String,
    },
}

/// One section table entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    /// The name, without trailing NULs (e.g. `.linux`).
    pub name: String,
    /// Size of the section once loaded in memory.
    pub virtual_size: u32,
    /// Relative virtual address of the section.
    pub virtual_address: u32,
    /// Size of the section's data in the file (file-aligned).
    pub size_of_raw_data: u32,
    /// File offset of the section's data.
    pub pointer_to_raw_data: u32,
}

/// A parsed PE image, borrowing the file bytes.
#[derive(Debug)]
pub struct PeFile<'a> {
    bytes: &'a [u8],
    checksum_offset: usize,
    cert_entry_offset: Option<usize>,
    cert_table: Option<(usize, usize)>,
    size_of_headers: usize,
    sections: Vec<Section>,
}

impl<'a> PeFile<'a> {
    /// Parses the headers and the section table of `bytes`.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, PeError> {
        if read(bytes, 0, 2, "DOS header")? != b"MZ" {
            return Err(PeError::DosSignature);
        }
        let pe = le_u32(bytes, DOS_LFANEW, "e_lfanew")? as usize;
        if read(bytes, pe, 4, "PE signature")? != b"PE\0\0" {
            return Err(PeError::PeSignature(pe));
        }
        let coff = pe + 4;
        let number_of_sections = usize::from(le_u16(bytes, coff + 2, "NumberOfSections")?);
        let size_of_optional = usize::from(le_u16(bytes, coff + 16, "SizeOfOptionalHeader")?);
        let opt = coff + COFF_HEADER_LEN;
        read(bytes, opt, size_of_optional, "optional header")?;
        let (rva_count_offset, dirs_offset) = match le_u16(bytes, opt, "optional header magic")? {
            0x10b => (92, 96),   // PE32
            0x20b => (108, 112), // PE32+
            magic => return Err(PeError::OptionalMagic(magic)),
        };
        let checksum_offset = opt + OPT_CHECKSUM;
        read(bytes, checksum_offset, 4, "CheckSum")?;
        let size_of_headers = le_u32(bytes, opt + OPT_SIZE_OF_HEADERS, "SizeOfHeaders")? as usize;

        let rva_count = le_u32(bytes, opt + rva_count_offset, "NumberOfRvaAndSizes")? as usize;
        let (cert_entry_offset, cert_table) = if rva_count > CERT_TABLE_INDEX {
            let entry = opt + dirs_offset + CERT_TABLE_INDEX * 8;
            let offset = le_u32(bytes, entry, "certificate table entry")? as usize;
            let size = le_u32(bytes, entry + 4, "certificate table entry")? as usize;
            (Some(entry), (size != 0).then_some((offset, size)))
        } else {
            (None, None)
        };
        let header_fields_end = cert_entry_offset.map_or(checksum_offset + 4, |e| e + 8);
        if size_of_headers > bytes.len() || size_of_headers < header_fields_end {
            return Err(PeError::SizeOfHeaders(size_of_headers));
        }

        let table = opt + size_of_optional;
        let table_end = table + number_of_sections * SECTION_HEADER_LEN;
        if size_of_headers < table_end {
            return Err(PeError::SectionTableOutsideHeaders {
                size_of_headers,
                table_end,
            });
        }
        let sections = (0..number_of_sections)
            .map(|i| parse_section(bytes, table + i * SECTION_HEADER_LEN))
            .collect::<Result<Vec<_>, _>>()?;
        check_memory_layout(&sections)?;
        Ok(Self {
            bytes,
            checksum_offset,
            cert_entry_offset,
            cert_table,
            size_of_headers,
            sections,
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// File offset of the optional header's `CheckSum` field.
    pub fn checksum_offset(&self) -> usize {
        self.checksum_offset
    }

    /// File offset of the certificate-table data directory entry, if the
    /// optional header has one.
    pub fn cert_entry_offset(&self) -> Option<usize> {
        self.cert_entry_offset
    }

    /// The certificate table (file offset, size), if the image is signed.
    pub fn cert_table(&self) -> Option<(usize, usize)> {
        self.cert_table
    }

    /// `SizeOfHeaders`: the length of the headers in the file.
    pub fn size_of_headers(&self) -> usize {
        self.size_of_headers
    }

    /// The section table, in table order.
    pub fn sections(&self) -> &[Section] {
        &self.sections
    }

    /// The first section called `name`.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// The section's raw data as stored in the file (`SizeOfRawData` bytes).
    pub fn raw_data(&self, section: &Section) -> Result<&'a [u8], PeError> {
        read(
            self.bytes,
            section.pointer_to_raw_data as usize,
            section.size_of_raw_data as usize,
            "section data",
        )
    }

    /// The section as the loader maps it: `VirtualSize` bytes, its file data
    /// truncated or zero-padded to that size. This is what systemd-stub
    /// measures and what it hands to the kernel.
    pub fn loaded_data(&self, section: &Section) -> Result<Vec<u8>, PeError> {
        let raw = self.raw_data(section)?;
        let size = section.virtual_size as usize;
        let mut data = raw[..raw.len().min(size)].to_vec();
        data.resize(size, 0);
        Ok(data)
    }
}

/// Refuses a `VirtualSize` above [`MAX_VIRTUAL_SIZE`] and sections whose
/// `[VirtualAddress, VirtualAddress + VirtualSize)` ranges overlap.
fn check_memory_layout(sections: &[Section]) -> Result<(), PeError> {
    if let Some(s) = sections.iter().find(|s| s.virtual_size > MAX_VIRTUAL_SIZE) {
        return Err(PeError::VirtualSize {
            name: s.name.clone(),
            size: s.virtual_size,
        });
    }
    let range = |s: &Section| {
        let start = u64::from(s.virtual_address);
        start..start + u64::from(s.virtual_size)
    };
    let mut placed: Vec<&Section> = sections.iter().filter(|s| s.virtual_size != 0).collect();
    placed.sort_by_key(|s| s.virtual_address);
    for pair in placed.windows(2) {
        if let [first, second] = pair {
            if range(first).end > range(second).start {
                return Err(PeError::OverlappingSections {
                    first: first.name.clone(),
                    second: second.name.clone(),
                });
            }
        }
    }
    Ok(())
}

fn parse_section(bytes: &[u8], at: usize) -> Result<Section, PeError> {
    let header = read(bytes, at, SECTION_HEADER_LEN, "section header")?;
    let name_bytes = &header[..8];
    let name_len = name_bytes.iter().position(|&b| b == 0).unwrap_or(8);
    Ok(Section {
        name: String::from_utf8_lossy(&name_bytes[..name_len]).into_owned(),
        virtual_size: le_u32(bytes, at + 8, "VirtualSize")?,
        virtual_address: le_u32(bytes, at + 12, "VirtualAddress")?,
        size_of_raw_data: le_u32(bytes, at + 16, "SizeOfRawData")?,
        pointer_to_raw_data: le_u32(bytes, at + 20, "PointerToRawData")?,
    })
}

/// `bytes[start..start + len]`, or a [`PeError::Truncated`] naming `what`.
pub(crate) fn read<'b>(
    bytes: &'b [u8],
    start: usize,
    len: usize,
    what: &'static str,
) -> Result<&'b [u8], PeError> {
    let end = start.saturating_add(len);
    bytes.get(start..end).ok_or(PeError::Truncated {
        what,
        start,
        end,
        len: bytes.len(),
    })
}

fn le_u16(bytes: &[u8], at: usize, what: &'static str) -> Result<u16, PeError> {
    let b = read(bytes, at, 2, what)?;
    Ok(u16::from_le_bytes([b[0], b[1]]))
}

fn le_u32(bytes: &[u8], at: usize, what: &'static str) -> Result<u32, PeError> {
    let b = read(bytes, at, 4, what)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testpe::{self, SectionSpec};

    fn sample() -> Vec<u8> {
        testpe::build(
            &[
                SectionSpec::new(".linux", b"kernel", 0x200),
                SectionSpec {
                    virtual_size: 3,
                    ..SectionSpec::new(".cmdline", b"abcdef", 0x400)
                },
                SectionSpec {
                    virtual_size: 8,
                    ..SectionSpec::new(".osrel", b"ID=x", 0x600)
                },
            ],
            b"",
            b"",
            0,
        )
    }

    #[test]
    fn parses_the_section_table() -> Result<(), PeError> {
        let bytes = sample();
        let pe = PeFile::parse(&bytes)?;
        let names: Vec<_> = pe.sections().iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, [".linux", ".cmdline", ".osrel"]);
        assert_eq!(pe.size_of_headers(), testpe::HEADERS_LEN);
        assert_eq!(pe.checksum_offset(), testpe::CHECKSUM_OFFSET);
        assert_eq!(pe.cert_table(), None);
        Ok(())
    }

    #[test]
    fn loaded_data_is_cut_or_zero_padded_to_the_virtual_size() -> Result<(), PeError> {
        let bytes = sample();
        let pe = PeFile::parse(&bytes)?;
        let cmdline = pe.section(".cmdline").ok_or(PeError::DosSignature)?;
        assert_eq!(pe.loaded_data(cmdline)?, b"abc");
        let osrel = pe.section(".osrel").ok_or(PeError::DosSignature)?;
        assert_eq!(pe.loaded_data(osrel)?, b"ID=x\0\0\0\0");
        Ok(())
    }

    #[test]
    fn rejects_what_is_not_a_pe_image() {
        assert_eq!(
            PeFile::parse(b"").err(),
            Some(PeError::Truncated {
                what: "DOS header",
                start: 0,
                end: 2,
                len: 0
            })
        );
        let mut bytes = sample();
        bytes[0] = b'X';
        assert_eq!(PeFile::parse(&bytes).err(), Some(PeError::DosSignature));
        let mut bytes = sample();
        bytes[testpe::PE_OFFSET] = b'X';
        assert_eq!(
            PeFile::parse(&bytes).err(),
            Some(PeError::PeSignature(testpe::PE_OFFSET))
        );
        let mut bytes = sample();
        bytes[testpe::OPT_OFFSET] = 0x0b;
        bytes[testpe::OPT_OFFSET + 1] = 0x03;
        assert_eq!(
            PeFile::parse(&bytes).err(),
            Some(PeError::OptionalMagic(0x30b))
        );
    }

    /// Sets a 32-bit field of the `index`th section table entry.
    fn set_section_field(bytes: &mut [u8], index: usize, field: usize, value: u32) {
        let at = testpe::OPT_OFFSET + testpe::OPT_LEN + index * SECTION_HEADER_LEN + field;
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }

    #[test]
    fn rejects_a_section_table_that_ends_past_size_of_headers() {
        let bytes = sample();
        let table_end = testpe::OPT_OFFSET + testpe::OPT_LEN + 3 * SECTION_HEADER_LEN;
        let mut short = bytes.clone();
        let field = testpe::OPT_OFFSET + OPT_SIZE_OF_HEADERS;
        short[field..field + 4].copy_from_slice(&(table_end as u32 - 8).to_le_bytes());
        assert_eq!(
            PeFile::parse(&short).err(),
            Some(PeError::SectionTableOutsideHeaders {
                size_of_headers: table_end - 8,
                table_end
            })
        );
        let mut exact = bytes;
        exact[field..field + 4].copy_from_slice(&(table_end as u32).to_le_bytes());
        assert!(PeFile::parse(&exact).is_ok());
    }

    #[test]
    fn rejects_overlapping_or_huge_sections_in_memory() {
        // .cmdline (VirtualAddress 0x2000) grown into .osrel (0x3000).
        let mut overlap = sample();
        set_section_field(&mut overlap, 1, 8, 0x1001);
        assert_eq!(
            PeFile::parse(&overlap).err(),
            Some(PeError::OverlappingSections {
                first: ".cmdline".into(),
                second: ".osrel".into()
            })
        );
        // Up to the next section: taken.
        let mut adjacent = sample();
        set_section_field(&mut adjacent, 1, 8, 0x1000);
        assert!(PeFile::parse(&adjacent).is_ok());
        // Two sections at one address.
        let mut same = sample();
        set_section_field(&mut same, 2, 12, 0x1000);
        assert!(matches!(
            PeFile::parse(&same),
            Err(PeError::OverlappingSections { .. })
        ));
        // The last section, far above the bound.
        let mut huge = sample();
        set_section_field(&mut huge, 2, 8, 0xffff_ffff);
        assert_eq!(
            PeFile::parse(&huge).err(),
            Some(PeError::VirtualSize {
                name: ".osrel".into(),
                size: 0xffff_ffff
            })
        );
    }

    #[test]
    fn rejects_truncated_section_tables() {
        let bytes = sample();
        let cut = &bytes[..testpe::OPT_OFFSET + testpe::OPT_LEN + 50];
        assert!(matches!(
            PeFile::parse(cut),
            Err(PeError::SizeOfHeaders(_) | PeError::Truncated { .. })
        ));
    }
}
