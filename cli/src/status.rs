//! `keel status`: each control plane's view of the cluster's nodes: role,
//! EK hash, disk UUID, verdict of the continuous attestation, time of the
//! last evidence, reason of the last failure, reported Kubernetes version,
//! and the revocation list.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use keel_proto::operator::NodeStatusRequest;
use serde_json::Value;

use crate::operator::{answer, Operator};
use crate::verify::Output;

use keel_verifier::keys::kind::NODE_STATUS;

/// Runs `keel status`.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    endpoints: &[String],
    output: Output,
    wait: Duration,
) -> anyhow::Result<()> {
    if endpoints.is_empty() {
        bail!("name each control plane's init port with --endpoint");
    }
    let operator = Operator::load(settings_path, workspace, wait)?;
    // One control plane that does not answer (down, cut off, refused)
    // does not hide the others' views: that is when they matter most.
    let mut views = Vec::new();
    let mut failed = Vec::new();
    for endpoint in endpoints {
        match registry_of(&operator, endpoint).await {
            Ok(registry) => {
                views.push(serde_json::json!({ "endpoint": endpoint, "registry": registry }));
            }
            Err(e) => {
                views.push(serde_json::json!({ "endpoint": endpoint, "error": format!("{e:#}") }));
                failed.push(endpoint.as_str());
            }
        }
    }
    match output {
        Output::Json => println!(
            "{}",
            crate::printable::json_pretty(&serde_json::json!({ "control_planes": views }))?
        ),
        Output::Text => {
            for view in &views {
                print_view(view);
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} control planes did not answer: {}",
            failed.len(),
            endpoints.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// The node registry of the control plane at `endpoint` (JSON, as it sent
/// it: every string in it is the node's to choose).
pub async fn registry_of(operator: &Operator, endpoint: &str) -> anyhow::Result<Value> {
    let (mut cp, challenge, proof) = operator.authorise(endpoint, NODE_STATUS, &[]).await?;
    let registry = answer(
        endpoint,
        cp.client
            .node_status(NodeStatusRequest { challenge, proof }),
    )
    .await?
    .registry;
    serde_json::from_slice(&registry)
        .with_context(|| format!("{endpoint} sent a registry that does not parse"))
}

/// The string at `key`, escaped for the terminal: it comes from a node.
fn text(v: &Value, key: &str) -> String {
    crate::printable::printable(v.get(key).and_then(Value::as_str).unwrap_or("")).to_string()
}

/// "12 s ago" for a Unix time, "never" for none.
fn age(v: &Value) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    v.as_u64().map_or_else(
        || "never".into(),
        |t| format!("{} s ago", now.saturating_sub(t)),
    )
}

fn print_view(view: &Value) {
    let registry = &view["registry"];
    println!("control plane {}", text(view, "endpoint"));
    if view.get("error").is_some() {
        println!("  did not answer: {}", text(view, "error"));
        return;
    }
    println!(
        "  {:<16} {:<14} {:<16} {:<36} {:<10} {:<14} {:<10} reason",
        "node", "role", "EK (SHA-256)", "disk", "verdict", "last evidence", "k8s"
    );
    let revoked = registry["revoked"].as_array().cloned().unwrap_or_default();
    for node in registry["nodes"]
        .as_object()
        .into_iter()
        .flat_map(|m| m.values())
    {
        // The first 16 hex digits of the EK's hash (64 bits); `keel
        // revoke` takes the whole hash, which the JSON output and the
        // revocation lines below show.
        let ek = text(node, "ek");
        let hex = ek.strip_prefix("sha256:").unwrap_or(&ek);
        let is_revoked = revoked.iter().any(|r| r["ek"] == node["ek"]);
        println!(
            "  {:<16} {:<14} {:<16} {:<36} {:<10} {:<14} {:<10} {}",
            text(node, "name"),
            text(node, "role"),
            hex.get(..16).unwrap_or(hex),
            text(node, "disk_uuid"),
            if is_revoked {
                "revoked".to_owned()
            } else {
                text(node, "verdict")
            },
            age(&node["last_evidence_at"]),
            text(node, "kubernetes_version"),
            text(node, "reason"),
        );
    }
    for r in &revoked {
        println!(
            "  revoked: {} (EK {}, disk {}): {}",
            text(r, "name"),
            text(r, "ek"),
            text(r, "disk_uuid"),
            text(r, "reason")
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn node_text_reaches_the_terminal_escaped() {
        let record = serde_json::json!({ "name": "w-1\u{1b}[2J\u{202e}fake\nline", "reason": "PCR 12: \"x\"" });
        assert_eq!(text(&record, "name"), "w-1\\u{1b}[2J\\u{202e}fake\\nline");
        // Printable text stays as it is (no backslashes before quotes).
        assert_eq!(text(&record, "reason"), "PCR 12: \"x\"");
        assert_eq!(text(&record, "missing"), "");
    }
}
