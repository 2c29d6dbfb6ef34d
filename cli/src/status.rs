//! `keel status`: each control plane's view of the cluster's nodes: role,
//! EK hash, disk UUID, verdict of the continuous attestation, time of the
//! last evidence, reason of the last failure, reported Kubernetes version,
//! and the revocation list. The registry's times are on the control
//! plane's clock: their ages are counted to its clock when it answered
//! (`served_at`), not to this machine's.

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
    crate::operator::require_endpoints(endpoints)?;
    let operator = Operator::load(settings_path, workspace, wait)?;
    // One control plane that does not answer (down, cut off, refused)
    // does not hide the others' views: that is when they matter most.
    let mut views = Vec::new();
    let mut failed = Vec::new();
    for endpoint in endpoints {
        match status_of(&operator, endpoint).await {
            Ok(ControlPlaneStatus {
                registry,
                served_at,
            }) => {
                // null where the control plane did not say (an earlier
                // version).
                let served_at = (served_at != 0).then_some(served_at);
                views.push(serde_json::json!({
                    "endpoint": endpoint,
                    "served_at": served_at,
                    "registry": registry,
                }));
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

/// A control plane's answer to `NodeStatus`.
pub struct ControlPlaneStatus {
    /// Its node registry (JSON, as it sent it: every string in it is the
    /// node's to choose).
    pub registry: Value,
    /// Its registry clock when it answered (Unix seconds); 0 from a
    /// control plane of an earlier version.
    pub served_at: u64,
}

/// The node registry of the control plane at `endpoint` and the time it
/// answered on its clock.
pub async fn status_of(operator: &Operator, endpoint: &str) -> anyhow::Result<ControlPlaneStatus> {
    let (mut cp, challenge, proof) = operator.authorise(endpoint, NODE_STATUS, &[]).await?;
    let response = answer(
        endpoint,
        cp.client
            .node_status(NodeStatusRequest { challenge, proof }),
    )
    .await?;
    let registry = serde_json::from_slice(&response.registry)
        .with_context(|| format!("{endpoint} sent a registry that does not parse"))?;
    Ok(ControlPlaneStatus {
        registry,
        served_at: response.served_at,
    })
}

/// The node registry of the control plane at `endpoint` ([`status_of`]).
pub async fn registry_of(operator: &Operator, endpoint: &str) -> anyhow::Result<Value> {
    Ok(status_of(operator, endpoint).await?.registry)
}

/// The string at `key`, escaped for the terminal: it comes from a node.
fn text(v: &Value, key: &str) -> String {
    crate::printable::printable(v.get(key).and_then(Value::as_str).unwrap_or("")).to_string()
}

/// This machine's clock (Unix seconds).
fn local_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The time a registry's ages are counted to: `served_at`, the control
/// plane's clock when it answered (the clock its times are on), or, where
/// it did not say (0: a control plane of an earlier version), `local`.
fn ages_counted_to(served_at: Option<u64>, local: impl FnOnce() -> u64) -> u64 {
    served_at.filter(|&t| t != 0).unwrap_or_else(local)
}

/// "12 s ago" for a Unix time `t` counted to `now`, "never" for none; a
/// time after `now` (the control plane's clock stepped back) is "0 s ago".
fn age(t: &Value, now: u64) -> String {
    t.as_u64().map_or_else(
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
    let served_at = view["served_at"].as_u64();
    if served_at.is_none() {
        println!(
            "  (an earlier version, which does not say its clock: ages are on this machine's)"
        );
    }
    let now = ages_counted_to(served_at, local_now);
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
            age(&node["last_evidence_at"], now),
            text(node, "kubernetes_version"),
            reason(node),
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

/// A node record's reason, saying so where its drift rests on the
/// control plane's clock alone (which its `revoke` policy leaves to the
/// operator).
fn reason(node: &Value) -> String {
    let reason = text(node, "reason");
    if node["on_clock"] == Value::Bool(true) && text(node, "verdict") == "drifted" {
        format!("{reason} (only at this control plane's time: check its clock and collateral; not revoked by policy)")
    } else {
        reason
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

    #[test]
    fn a_drift_on_the_clock_is_named_as_such() {
        let drift = serde_json::json!({ "verdict": "drifted", "reason": "EK certificate is not valid at this time" });
        assert_eq!(reason(&drift), "EK certificate is not valid at this time");
        let mut on_clock = drift.clone();
        on_clock["on_clock"] = Value::Bool(true);
        assert!(
            reason(&on_clock).ends_with("not revoked by policy)"),
            "{}",
            reason(&on_clock)
        );
    }

    /// Ages are counted on the control plane's clock when it says it, on
    /// this machine's otherwise; a time after it is no negative age.
    #[test]
    fn ages_are_counted_to_the_control_planes_clock() {
        let local = || 5_000;
        let served = ages_counted_to(Some(1_000), local);
        assert_eq!(served, 1_000);
        assert_eq!(age(&serde_json::json!(988), served), "12 s ago");
        // An earlier version (no served_at, or 0): this machine's clock.
        let earlier = ages_counted_to(None, local);
        assert_eq!(earlier, 5_000);
        assert_eq!(ages_counted_to(Some(0), local), 5_000);
        assert_eq!(age(&serde_json::json!(988), earlier), "4012 s ago");
        // After served_at (the control plane's clock stepped back between
        // the evidence and the answer).
        assert_eq!(age(&serde_json::json!(1_030), served), "0 s ago");
        assert_eq!(age(&Value::Null, served), "never");
    }
}
