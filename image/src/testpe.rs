//! A synthetic PE32+ image builder for tests: a DOS header, PE and COFF
//! headers, an optional header with 16 data directories, a section table
//! and section data, optionally followed by a certificate table.

/// Offset of the PE signature in images built here.
pub const PE_OFFSET: usize = 0x40;
/// Offset of the optional header.
pub const OPT_OFFSET: usize = PE_OFFSET + 4 + 20;
/// Size of the optional header (PE32+ with 16 data directories).
pub const OPT_LEN: usize = 112 + 16 * 8;
/// Offset of the CheckSum field.
pub const CHECKSUM_OFFSET: usize = OPT_OFFSET + 64;
/// Offset of the certificate-table directory entry.
pub const CERT_ENTRY_OFFSET: usize = OPT_OFFSET + 112 + 4 * 8;
/// SizeOfHeaders of images built here: room for a section table of at
/// most four entries (a longer one ends past it and is refused).
pub const HEADERS_LEN: usize = 0x200;
/// A `.cmdline` with everything a prediction requires of it
/// ([`crate::predict::check_cmdline`]).
pub const SAFE_CMDLINE: &str = "console=ttyS0 systemd.import_credentials=no systemd.gpt_auto=0 \
     efi=noruntime roothash=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\n";

/// One section to lay out: name, data, and the file offset of its data.
pub struct SectionSpec {
    pub name: &'static str,
    pub data: Vec<u8>,
    pub file_offset: usize,
    pub virtual_size: u32,
}

impl SectionSpec {
    /// A section whose virtual size is its data length.
    pub fn new(name: &'static str, data: &[u8], file_offset: usize) -> Self {
        Self {
            name,
            data: data.to_vec(),
            file_offset,
            virtual_size: u32::try_from(data.len()).unwrap_or(u32::MAX),
        }
    }
}

/// Builds the image; the section table lists `sections` in the given order
/// (which need not be file order). `trailer` is appended after the last
/// section; `cert` after that, referenced by the certificate directory.
pub fn build(sections: &[SectionSpec], trailer: &[u8], cert: &[u8], checksum: u32) -> Vec<u8> {
    let end = sections
        .iter()
        .map(|s| s.file_offset + s.data.len())
        .max()
        .unwrap_or(HEADERS_LEN)
        .max(HEADERS_LEN);
    let mut b = vec![0u8; end];
    b[0..2].copy_from_slice(b"MZ");
    put32(&mut b, 0x3c, PE_OFFSET as u32);
    b[PE_OFFSET..PE_OFFSET + 4].copy_from_slice(b"PE\0\0");
    let coff = PE_OFFSET + 4;
    put16(&mut b, coff, 0x8664);
    put16(&mut b, coff + 2, sections.len() as u16);
    put16(&mut b, coff + 16, OPT_LEN as u16);
    put16(&mut b, OPT_OFFSET, 0x20b);
    put32(&mut b, OPT_OFFSET + 60, HEADERS_LEN as u32);
    put32(&mut b, CHECKSUM_OFFSET, checksum);
    put32(&mut b, OPT_OFFSET + 108, 16);
    // A byte in the headers after the directories, so it is hashed.
    b[HEADERS_LEN - 1] = 0xa5;
    let table = OPT_OFFSET + OPT_LEN;
    for (i, s) in sections.iter().enumerate() {
        let at = table + i * 40;
        b[at..at + s.name.len()].copy_from_slice(s.name.as_bytes());
        put32(&mut b, at + 8, s.virtual_size);
        put32(&mut b, at + 12, 0x1000 * (i as u32 + 1));
        put32(&mut b, at + 16, s.data.len() as u32);
        put32(&mut b, at + 20, s.file_offset as u32);
        b[s.file_offset..s.file_offset + s.data.len()].copy_from_slice(&s.data);
    }
    b.extend_from_slice(trailer);
    if !cert.is_empty() {
        let at = b.len();
        put32(&mut b, CERT_ENTRY_OFFSET, at as u32);
        put32(&mut b, CERT_ENTRY_OFFSET + 4, cert.len() as u32);
        b.extend_from_slice(cert);
    }
    b
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// The `.sdmagic` of the stub the image carries (bookworm-backports'
/// systemd-stub 254).
pub const STUB_254_MAGIC: &[u8] = b"#### LoaderInfo: systemd-stub 254.26-1~bpo12+1 ####\0";

/// A UKI with a kernel, a command line ([`SAFE_CMDLINE`]), an initrd and
/// systemd-stub 254's `.sdmagic`.
pub fn synthetic_uki() -> Vec<u8> {
    let kernel = build(
        &[SectionSpec::new(".text", b"kernel code", 0x200)],
        b"",
        b"",
        0,
    );
    build(
        &[
            SectionSpec::new(".linux", &kernel, 0x200),
            SectionSpec::new(".cmdline", SAFE_CMDLINE.as_bytes(), 0x600),
            SectionSpec::new(".initrd", b"initrd", 0x800),
            SectionSpec::new(".sdmagic", STUB_254_MAGIC, 0xa00),
        ],
        b"",
        b"",
        0,
    )
}
