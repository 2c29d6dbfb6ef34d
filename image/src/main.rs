//! keel-measure: predicts the PCR values a keel image produces when booted
//! and writes them as a measurements file.
//!
//! ```text
//! keel-measure --uki build/image/keel.efi [--node-config FILE] [--output FILE] [--events]
//! ```

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Parser;
use keel_image::measurements::Measurements;
use keel_image::pcr::{replay, Event};
use keel_image::predict::{self, Uki};

/// Predicts PCRs 4, 9, 11 (and 12 for a node config) from a built image.
#[derive(Debug, Parser)]
#[command(name = "keel-measure", version)]
struct Args {
    /// The image's unified kernel image (build/image/keel.efi).
    #[arg(long)]
    uki: PathBuf,
    /// The node config's canonical bytes, as the agent measures them into
    /// PCR 12. Without it PCR 12 is left out.
    #[arg(long)]
    node_config: Option<PathBuf>,
    /// Where to write the measurements JSON (default: standard output).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Also print every modelled event to standard error.
    #[arg(long)]
    events: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bytes = std::fs::read(&args.uki).with_context(|| format!("read {}", args.uki.display()))?;
    let uki = Uki::parse(&bytes).with_context(|| format!("{}", args.uki.display()))?;

    let mut pcrs: Vec<(u32, Vec<Event>)> = vec![
        (predict::PCR_BOOT_LOADER_CODE, predict::pcr4(&uki)?),
        (predict::PCR_KERNEL_PARAMETERS, predict::pcr9(&uki)?),
        (predict::PCR_KERNEL_BOOT, predict::pcr11(&uki)?),
    ];
    if let Some(path) = &args.node_config {
        let config = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
        pcrs.push((predict::PCR_NODE_CONFIG, predict::pcr12(&config)));
    }

    let mut measurements = Measurements::default();
    for (pcr, events) in &pcrs {
        let value = replay(events);
        if args.events {
            eprintln!("pcr {pcr} = {}", hex::encode(value));
            for event in events {
                eprintln!("  {event}");
            }
        }
        measurements.enforce(*pcr, &value);
    }

    let json = measurements.to_json().context("encode the measurements")?;
    match &args.output {
        Some(path) => std::fs::write(path, json + "\n")
            .with_context(|| format!("write {}", path.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}
