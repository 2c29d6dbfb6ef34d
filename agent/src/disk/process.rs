//! Running the disk tools: the key, if any, written to the program's
//! standard input and never to its arguments; the end of its standard error
//! kept in the error when it fails.

use std::ffi::OsStr;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use super::DiskError;

/// Most stderr kept in an error.
const MAX_STDERR: usize = 2048;

/// Runs a keyless tool on `device` and requires it to succeed.
pub(super) fn run_tool<I, S>(
    program: &Path,
    operation: &'static str,
    args: I,
    device: &Path,
) -> Result<(), DiskError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = run_program(program, operation, args, None)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(failed_named(operation, device, &out))
    }
}

/// Runs `program` with `args`, writing `stdin` (the key) to its standard
/// input and closing it; collects its output.
pub(super) fn run_program<I, S>(
    program: &Path,
    operation: &'static str,
    args: I,
    stdin: Option<&[u8]>,
) -> Result<std::process::Output, DiskError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let spawn_err = |source| DiskError::Spawn {
        operation,
        program: program.to_owned(),
        source,
    };
    let started = std::time::Instant::now();
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        match pipe.write_all(bytes) {
            // The program may exit before reading (a missing device): its
            // exit status says why.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(DiskError::WriteKey { operation, source });
            }
            Ok(()) => {}
        }
        // Dropping the pipe closes it: cryptsetup reads the key to EOF.
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    // First-boot disk set-up is a handful of these; their times show where
    // a slow one went.
    tracing::info!(
        operation,
        elapsed_ms = started.elapsed().as_millis() as u64,
        status = %out.status,
        "disk tool finished"
    );
    Ok(out)
}

pub(super) fn failed_named(
    operation: &'static str,
    device: &Path,
    out: &std::process::Output,
) -> DiskError {
    let text = String::from_utf8_lossy(&out.stderr);
    let text = text.trim();
    let start = text.len().saturating_sub(MAX_STDERR);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    DiskError::Failed {
        operation,
        device: device.to_owned(),
        status: out.status,
        stderr: text.get(start..).unwrap_or_default().to_owned(),
    }
}
