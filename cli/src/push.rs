//! `keel push-measurements`: roll a measurements file out to every control
//! plane, so all join services accept the same boot chain.
//!
//! Each control plane is validated first: its boot chain and config by the
//! settings' measurements, and its event log must lock it into exactly the
//! cluster of the workspace. Then the CLI asks it for a challenge and sends
//! the file with the operator's proof for that challenge (made with the
//! node's operator key, derived from the master secret for the EK the node
//! attested; the secret itself never leaves this machine).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _};
use keel_proto::operator::SetJoinMeasurementsRequest;
use keel_verifier::measurements::Measurements;

use crate::operator::{refused, Operator};
use crate::settings::read_bounded;

use keel_verifier::keys::kind::SET_JOIN_MEASUREMENTS;

/// Runs `keel push-measurements`.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    file: &Path,
    endpoints: &[String],
    wait: Duration,
) -> anyhow::Result<()> {
    if endpoints.is_empty() {
        bail!("name each control plane's init port with --endpoint");
    }
    let body = read_bounded(file)?;
    // The control planes refuse what does not parse; refuse it here first.
    Measurements::parse(&body)
        .with_context(|| format!("{} is not a measurements file", file.display()))?;
    let operator = Operator::load(settings_path, workspace, wait)?;
    for endpoint in endpoints {
        let (mut cp, challenge, proof) = operator
            .authorise(endpoint, SET_JOIN_MEASUREMENTS, &body)
            .await?;
        let done = cp
            .client
            .set_join_measurements(SetJoinMeasurementsRequest {
                measurements: body.clone(),
                challenge,
                proof,
            })
            .await
            .map_err(|s| refused(endpoint, &s))?
            .into_inner();
        println!(
            "{endpoint}: join measurements replaced (sha256:{})",
            hex::encode(done.digest)
        );
    }
    Ok(())
}
