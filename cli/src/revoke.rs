//! `keel revoke NODE`: put a node on the revocation list of every control
//! plane named. Each must know the node (by name, EK hash or disk UUID);
//! from then on it issues no join ticket, no rejoin ticket and so no disk
//! key for the node's EK (its disk opens with that EK only). A running node keeps the key it has
//! until it reboots (docs/attestation.md says how to complete the removal).
//! The workspace records the revoked EK: `keel recover` refuses it.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _};
use keel_proto::operator::RevokeNodeRequest;

use crate::operator::{answer, on_each, Operator};
use crate::printable::printable;

use keel_verifier::keys::kind::REVOKE_NODE;

/// Runs `keel revoke`.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    node: &str,
    endpoints: &[String],
    wait: Duration,
) -> anyhow::Result<()> {
    if endpoints.is_empty() {
        bail!("name each control plane's init port with --endpoint");
    }
    let operator = Operator::load(settings_path, workspace, wait)?;
    // Every control plane is tried. One that does not know the node (or
    // is down) takes the list from the others with its next registry
    // exchange, if it reaches them; the command fails all the same, since
    // one cut off from the others keeps issuing tickets to the node.
    on_each(endpoints, "revoke the node", |endpoint| {
        let operator = &operator;
        async move { revoke_at(operator, &endpoint, node, workspace).await }
    })
    .await
}

/// Revokes `node` on the control plane at `endpoint`; returns what to print.
async fn revoke_at(
    operator: &Operator,
    endpoint: &str,
    node: &str,
    workspace: &Path,
) -> anyhow::Result<String> {
    let (mut cp, challenge, proof) = operator
        .authorise(endpoint, REVOKE_NODE, node.as_bytes())
        .await?;
    let done = answer(
        endpoint,
        cp.client.revoke_node(RevokeNodeRequest {
            node: node.to_owned(),
            challenge,
            proof,
        }),
    )
    .await?;
    // Recorded as soon as one control plane named the EK: `keel recover`
    // never sends the master secret to it.
    crate::workspace::RevokedRecord::add(workspace, &done.ek)
        .context("recording the revoked EK in the workspace")?;
    Ok(format!(
        "revoked node {} (EK {}, disk {})",
        printable(&done.name),
        printable(&done.ek),
        printable(&done.disk_uuid)
    ))
}
