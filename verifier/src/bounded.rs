//! Reading files whose size is bounded before their contents are parsed.

use std::io::Read as _;
use std::path::Path;

/// Reads `path` if it holds at most `limit` bytes; `Ok(None)` when it holds
/// more (only `limit + 1` bytes are ever read).
pub fn read(path: &Path, limit: u64) -> std::io::Result<Option<Vec<u8>>> {
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= limit).then_some(bytes))
}
