//! `keel-mini`: the local cluster (see `keel_e2e::mini`).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use keel_e2e::mini::cluster::{self, Tools};
use keel_e2e::mini::{procs, Cluster, MiniError, UpOptions};

/// A local confidential cluster: two control-plane VMs and a worker VM of
/// the built keel image under QEMU + OVMF, each with its own swtpm (EK
/// certificate from a CA in build/mini/ca), a LUKS2 state disk and its node
/// config by fw_cfg; on the host the component mirror (stand-in kubeadm,
/// kubelet, kubectl) and `keel init` / `keel verify` over aTLS. All traffic
/// stays on this machine (QEMU user networking, host loopback ports).
///
/// Files, logs and the kept cluster's record are in build/mini/.
/// Environment: KEEL_IMAGE_DIR (image to boot, default build/image),
/// KEEL_VM_ACCEL=kvm|tcg (default: KVM if a probe VM boots the firmware
/// with it, else TCG), KEEL_MINI_PATIENCE_S (bound on each wait for a VM,
/// default 600).
#[derive(Parser)]
#[command(name = "keel-mini", about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build, boot the three VMs, `keel init` the first control plane, wait
    /// for the second control plane and the worker to join (each control
    /// plane then serves joins), verify all and print a summary with phase
    /// times.
    /// Everything started is stopped at the end unless --keep.
    Up {
        /// Leave the cluster running (PIDs and ports in build/mini/state.json)
        /// for `keel-mini status` and `keel-mini down`.
        #[arg(long)]
        keep: bool,
        /// Do not run `make agent image`: boot the image as it is (the host
        /// tools are still built if stale).
        #[arg(long)]
        no_build: bool,
    },
    /// Stop a cluster left running by `up --keep` (each process by its ID).
    Down,
    /// Report a kept cluster: its processes, and `keel verify` of each node.
    Status,
}

fn run(cli: Cli) -> Result<ExitCode, MiniError> {
    let opts = UpOptions::from_env()?;
    match cli.command {
        Command::Up { keep, no_build } => {
            let opts = UpOptions {
                build: !no_build,
                ..opts
            };
            let cluster = Cluster::up(&opts)?;
            if keep {
                let state = cluster.keep()?;
                eprintln!(
                    "keel-mini: --keep: the cluster runs on (record {}); `keel-mini status`, `keel-mini down`",
                    state.display()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Down => {
            let stopped = procs::down(&opts.dir)?;
            eprintln!("keel-mini: stopped {stopped} process(es)");
            Ok(ExitCode::SUCCESS)
        }
        Command::Status => {
            let healthy = cluster::status(&opts.dir, &Tools::locate(&opts.root))?;
            Ok(if healthy {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                message.push_str(&format!(": {s}"));
                source = s.source();
            }
            eprintln!("keel-mini: error: {message}");
            ExitCode::FAILURE
        }
    }
}
