//! keel-measure: predicts the PCR values a keel image produces when booted
//! and writes them as a measurements file.
//!
//! ```text
//! keel-measure --uki build/image/keel.efi --node-config FILE [--output FILE] [--events]
//! ```

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Parser;
use keel_image::pcr::{replay, Event};
use keel_image::predict::{self, Uki};
use keel_verifier::config::NodeConfig;

/// Predicts PCRs 4, 9, 11 and 12 from a built image and a node config.
#[derive(Debug, Parser)]
#[command(name = "keel-measure", version)]
struct Args {
    /// The image's unified kernel image (build/image/keel.efi).
    #[arg(long)]
    uki: PathBuf,
    /// A node config document, as given to the VM (fw_cfg
    /// `opt/keel/node-config`) or installed in the image. It is read and
    /// validated as the agent does, and PCR 12 predicted from its canonical
    /// form. Required: verifiers refuse a measurements file that does not
    /// enforce PCR 12.
    #[arg(long)]
    node_config: PathBuf,
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
    // The agent's own loader: same size bound, validation and canonical form.
    let path = &args.node_config;
    let (config, _) =
        NodeConfig::load(Some(path)).with_context(|| format!("node config {}", path.display()))?;

    if args.events {
        let pcrs: [(u32, Vec<Event>); 3] = [
            (predict::PCR_BOOT_LOADER_CODE, predict::pcr4(&uki)?),
            (predict::PCR_KERNEL_PARAMETERS, predict::pcr9(&uki)?),
            (predict::PCR_KERNEL_BOOT, predict::pcr11(&uki)?),
        ];
        for (pcr, events) in &pcrs {
            eprintln!("pcr {pcr} = {}", hex::encode(replay(events)));
            for event in events {
                eprintln!("  {event}");
            }
        }
        eprintln!(
            "pcr {} = {}",
            predict::PCR_NODE_CONFIG,
            hex::encode(predict::pcr12(&config))
        );
        eprintln!("  keel-agent node-config event for {}", path.display());
    }
    let measurements = predict::measurements(&uki, &config)?;

    let json = measurements.to_json();
    match &args.output {
        Some(path) => std::fs::write(path, json + "\n")
            .with_context(|| format!("write {}", path.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}
