//! keel-measure: predicts the PCR values a keel image produces when booted
//! and writes them as a measurements file.
//!
//! ```text
//! keel-measure --uki build/image/keel.efi [--node-config FILE] [--output FILE] [--events]
//! ```

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Parser;
use keel_agent::attestation::measurements::Measurements;
use keel_agent::config::NodeConfig;
use keel_image::pcr::{replay, Event};
use keel_image::predict::{self, Uki};

/// Predicts PCRs 4, 9, 11 (and 12 for a node config) from a built image.
#[derive(Debug, Parser)]
#[command(name = "keel-measure", version)]
struct Args {
    /// The image's unified kernel image (build/image/keel.efi).
    #[arg(long)]
    uki: PathBuf,
    /// A node config document, as given to the VM (fw_cfg
    /// `opt/keel/node-config`) or installed in the image. It is read and
    /// validated as the agent does, and PCR 12 predicted from its canonical
    /// form. Without it PCR 12 is left out.
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

    let pcrs: [(u32, Vec<Event>); 3] = [
        (predict::PCR_BOOT_LOADER_CODE, predict::pcr4(&uki)?),
        (predict::PCR_KERNEL_PARAMETERS, predict::pcr9(&uki)?),
        (predict::PCR_KERNEL_BOOT, predict::pcr11(&uki)?),
    ];
    let mut measurements = Measurements::default();
    for (pcr, events) in &pcrs {
        let value = replay(events);
        if args.events {
            eprintln!("pcr {pcr} = {}", hex::encode(value));
            for event in events {
                eprintln!("  {event}");
            }
        }
        measurements.insert(*pcr, value, false);
    }
    if let Some(path) = &args.node_config {
        // The agent's own loader: same size bound, validation and canonical form.
        let (config, _) = NodeConfig::load(Some(path))
            .with_context(|| format!("node config {}", path.display()))?;
        let value = predict::pcr12(&config);
        if args.events {
            eprintln!("pcr {} = {}", predict::PCR_NODE_CONFIG, hex::encode(value));
            eprintln!("  keel-agent node-config event for {}", path.display());
        }
        measurements.insert(predict::PCR_NODE_CONFIG, value, false);
    }

    let json = measurements.to_json();
    match &args.output {
        Some(path) => std::fs::write(path, json + "\n")
            .with_context(|| format!("write {}", path.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}
