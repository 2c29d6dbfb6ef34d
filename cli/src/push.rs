//! `keel push-measurements`: roll a measurements file out to every control
//! plane, so all join services accept the same boot chain.
//!
//! Each control plane is validated first: its boot chain and config by the
//! settings' measurements, and its event log must lock it into exactly the
//! cluster of the workspace. Then the CLI asks it for a challenge and sends
//! the file with the operator's proof for that challenge (made with the
//! node's operator key, derived from the master secret for the EK the node
//! attested; the secret itself never leaves this machine).
//!
//! The file travels with its detached signature, found as `keel upgrade
//! apply` finds it (`--signature`, default `FILE.sig`): where the settings
//! name a `measurements_signing_key`, the signature is required and checked
//! before any node is contacted; a control plane whose config names the key
//! refuses a file without a valid one. Where the settings name no key, a
//! signature file present is sent as it is, for the nodes to check.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _};
use keel_proto::operator::SetJoinMeasurementsRequest;
use keel_verifier::measurements::Measurements;

use crate::operator::{answer, on_each_recorded, Operator};
use crate::settings::{read_bounded, Settings};
use crate::upgrade::image::load_signed;
use crate::upgrade::{every_control_plane_named, Roles};

use keel_verifier::keys::kind::SET_JOIN_MEASUREMENTS;

/// Runs `keel push-measurements`: `file` (signed by `signature`, default
/// `FILE.sig`) to each of `endpoints`.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    file: &Path,
    signature: Option<&Path>,
    endpoints: &[String],
    wait: Duration,
) -> anyhow::Result<()> {
    crate::operator::require_endpoints(endpoints)?;
    let (body, signature) = load(settings_path, file, signature)?;
    let operator = Operator::load(settings_path, workspace, wait)?;
    // A control plane left out would go on accepting what the file
    // retires, under its lower rollback floor: refused before any change.
    let roles = Roles::of(&operator, endpoints).await?;
    if let Some(worker) = roles.workers.first() {
        bail!("{worker} is a worker: join measurements go to control planes only; nothing was changed");
    }
    every_control_plane_named(&operator, &roles).await?;
    let (pushed, epoch) = Measurements::parse_file(&body)
        .with_context(|| format!("{} is not a measurements file", file.display()))?;
    // Every control plane is tried. The pushed set is the current one for
    // `keel recover` as soon as one control plane took it (recorded even
    // where no rollout made a record yet, and whatever the others answer):
    // a retired image's node is not sent the master secret because the
    // settings still name it.
    on_each_recorded(
        endpoints,
        "replace their join measurements",
        |endpoint| {
            let (operator, body, signature) = (&operator, &body, &signature);
            async move {
                let (mut cp, challenge, proof) = operator
                    .authorise(&endpoint, SET_JOIN_MEASUREMENTS, body)
                    .await?;
                let done = answer(
                    &endpoint,
                    cp.client.set_join_measurements(SetJoinMeasurementsRequest {
                        measurements: body.clone(),
                        challenge,
                        proof,
                        signature: signature.clone(),
                    }),
                )
                .await?;
                Ok(format!(
                    "join measurements replaced (sha256:{})",
                    hex::encode(done.digest)
                ))
            }
        },
        || {
            crate::workspace::ImageRecord::update_or_create(workspace, |record| {
                record.digest = hex::encode(pushed.digest());
                record.epoch = record.epoch.max(epoch);
            })
            .context("recording the pushed measurements in the workspace")?;
            Ok(None)
        },
    )
    .await
}

/// The file's exact bytes and its signature (empty: none): checked with
/// the settings' signing key when they name one, else read if present.
fn load(
    settings_path: &Path,
    file: &Path,
    signature: Option<&Path>,
) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    if Settings::load(settings_path)?.signing_key()?.is_some() {
        let signed = load_signed(settings_path, file, signature)?;
        return Ok((signed.body().to_vec(), signed.signature().to_vec()));
    }
    let body = read_bounded(file)?;
    // The control planes refuse what does not parse; refuse it here first.
    Measurements::parse(&body)
        .with_context(|| format!("{} is not a measurements file", file.display()))?;
    let signature = match signature {
        Some(path) => read_bounded(path)?,
        None => {
            let path = keel_verifier::signature::detached_signature_path(file);
            if path.exists() {
                read_bounded(&path)?
            } else {
                Vec::new()
            }
        }
    };
    Ok((body, signature))
}
