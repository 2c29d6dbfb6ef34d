//! The image phase of `keel upgrade`: stage a new image's signed
//! measurements on every control plane, and finish the rollout.
//!
//! The measurements file must carry a detached signature by the key the
//! settings name (`measurements_signing_key`, the one sent at init); the
//! CLI checks it, and that the file enforces what every set must, before
//! any node is contacted, and each control plane checks both again. Each
//! control plane is validated as for `keel push-measurements` (a member of
//! exactly the workspace's cluster) and each request carries the
//! operator's proof for a challenge of that node.

use std::path::Path;

use anyhow::{bail, Context as _};
use keel_proto::operator::{FinishImageUpgradeRequest, StageImageMeasurementsRequest};

use super::{every_control_plane_named, Cluster, Roles};
use crate::operator::{answer, on_each, on_each_recorded, Operator};
use crate::settings::{read_bounded, Settings};
use keel_verifier::signature::{
    detached_signature_path, SignedMeasurements, SignedMeasurementsError,
};

use keel_verifier::keys::kind::FINISH_IMAGE_UPGRADE;
use keel_verifier::keys::kind::STAGE_IMAGE_MEASUREMENTS;

/// Reads `file` and its signature (`signature`, default `file` + `.sig`)
/// and checks them with the key the settings at `settings` name, as every
/// control plane checks them again (`SignedMeasurements::verify`).
pub fn load_signed(
    settings: &Path,
    file: &Path,
    signature: Option<&Path>,
) -> anyhow::Result<SignedMeasurements> {
    let settings = Settings::load(settings)?;
    let Some(key) = settings.signing_key()? else {
        bail!(
            "the settings name no measurements_signing_key: image upgrades need the \
             measurements signing key the cluster was initialised with"
        );
    };
    let body = read_bounded(file)?;
    let signature_path = signature.map_or_else(|| detached_signature_path(file), Path::to_owned);
    let signature = read_bounded(&signature_path).with_context(|| {
        format!(
            "no signature for {} (keel-measure --signing-key writes {})",
            file.display(),
            signature_path.display()
        )
    })?;
    SignedMeasurements::verify(&key, &body, &signature).map_err(|e| match e {
        SignedMeasurementsError::Signature(e) => anyhow::Error::new(e).context(format!(
            "{} is not signed with the measurements signing key ({}); nothing was sent",
            file.display(),
            signature_path.display()
        )),
        other => anyhow::Error::new(other)
            .context(format!("{} is not a measurements file", file.display())),
    })
}

/// Stages `image` on every control plane of `roles`, reporting each.
pub async fn stage(
    operator: &Operator,
    roles: &Roles,
    image: &SignedMeasurements,
    workspace: &Path,
) -> anyhow::Result<()> {
    let control_planes = named_control_planes(roles)?;
    println!(
        "image: staging measurements sha256:{} (epoch {}) on {} control plane(s)",
        hex::encode(image.measurements().digest()),
        image.epoch(),
        control_planes.len()
    );
    on_each(
        control_planes,
        "stage the image measurements",
        |endpoint| async move {
            let (mut node, challenge, proof) = operator
                .authorise(&endpoint, STAGE_IMAGE_MEASUREMENTS, image.body())
                .await?;
            answer(
                &endpoint,
                node.client
                    .stage_image_measurements(StageImageMeasurementsRequest {
                        measurements: image.body().to_vec(),
                        signature: image.signature().to_vec(),
                        challenge,
                        proof,
                    }),
            )
            .await
            .map(|done| {
                if done.staged_digest == done.current_digest {
                    format!(
                        "sha256:{} is the current image; no other image is staged",
                        hex::encode(done.current_digest)
                    )
                } else {
                    format!(
                        "image measurements staged (sha256:{}); current sha256:{} still accepted",
                        hex::encode(done.staged_digest),
                        hex::encode(done.current_digest)
                    )
                }
            })
        },
    )
    .await?;
    // A control plane of the staged image may be recovered meanwhile; the
    // current set's own file withdraws the staged one.
    let staged = hex::encode(image.measurements().digest());
    crate::workspace::ImageRecord::update(workspace, |record| {
        record.staged = (staged != record.digest).then_some(staged);
    })
    .context("recording the staged image in the workspace")?;
    println!(
        "image: nodes of the old and the new image join; once every node runs the new \
         image, point the settings' measurements at <the same file> and run `keel upgrade \
         finish --image-measurements <the same file>`"
    );
    Ok(())
}

/// Finishes the rollout of `image` on every control plane of `cluster`:
/// each makes it its only accepted set if it is the set staged there.
/// Refused before any change while a control plane the named ones know is
/// not named: it would go on accepting the old image.
pub async fn finish(cluster: &Cluster, image: &SignedMeasurements) -> anyhow::Result<()> {
    let settings = Settings::load(&cluster.settings)?;
    let operator = &Operator::new(&settings, &cluster.workspace, cluster.wait())?;
    let roles = Roles::of(operator, &cluster.endpoints).await?;
    let control_planes = named_control_planes(&roles)?;
    every_control_plane_named(operator, &roles).await?;
    let digest = &image.measurements().digest();
    println!(
        "image: finishing the rollout of measurements sha256:{} on {} control plane(s)",
        hex::encode(digest),
        control_planes.len()
    );
    // What `keel recover` holds its settings to from now on, recorded as
    // soon as one control plane accepts only the new image, before the
    // next is asked: a workspace that still named the old one would have
    // a node of the retired image recovered (the node would refuse it,
    // but only once it holds the master secret). Rerunning the command
    // finishes the others.
    on_each_recorded(
        control_planes,
        "finish the image upgrade",
        |endpoint| async move {
            let (mut node, challenge, proof) = operator
                .authorise(&endpoint, FINISH_IMAGE_UPGRADE, digest)
                .await?;
            let done = answer(
                &endpoint,
                node.client.finish_image_upgrade(FinishImageUpgradeRequest {
                    challenge,
                    proof,
                    staged_digest: digest.to_vec(),
                }),
            )
            .await?;
            Ok(format!(
                "image upgrade finished; only sha256:{} is accepted",
                hex::encode(done.digest)
            ))
        },
        || {
            // Under the record's lock, as a push or a staging changes it:
            // a run at the same time neither loses this nor has it lost.
            crate::workspace::ImageRecord::update_or_create(&cluster.workspace, |record| {
                record.digest = hex::encode(digest);
                record.epoch = image.epoch();
                record.staged = None;
            })
            .context("recording the finished image in the workspace")?;
            Ok(Some(
                "image: recorded in the workspace; `keel recover` now takes only this image's \
                 measurements"
                    .to_owned(),
            ))
        },
    )
    .await
}

/// The control planes of `roles`, which stage and finish an image's
/// measurements; refused, with nothing changed, when none is named.
fn named_control_planes(roles: &Roles) -> anyhow::Result<&[String]> {
    if roles.control_planes.is_empty() {
        bail!(
            "no control plane named: the image's measurements are a control plane's; nothing \
             was changed"
        );
    }
    Ok(&roles.control_planes)
}
