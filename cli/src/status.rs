//! `keel status`: each control plane's view of the cluster's nodes: role,
//! EK hash, disk UUID, verdict of the continuous attestation, time of the
//! last evidence, reason of the last failure, reported Kubernetes version,
//! and the revocation list. The registry's times are on the control
//! plane's clock: their ages are counted to its clock when it answered
//! (`served_at`), not to this machine's.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use keel_proto::operator::NodeStatusRequest;
use serde::Serialize;

use crate::operator::{answer, Operator};
use crate::registry::{NodeRecord, Registry};
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
            }) => views.push(View::Answered {
                endpoint,
                // null where the control plane did not say (an earlier
                // version).
                served_at: (served_at != 0).then_some(served_at),
                registry,
            }),
            Err(e) => {
                views.push(View::Failed {
                    endpoint,
                    error: format!("{e:#}"),
                });
                failed.push(endpoint.as_str());
            }
        }
    }
    match output {
        Output::Json => println!(
            "{}",
            crate::printable::json_pretty(&Views {
                control_planes: views
            })?
        ),
        Output::Text => {
            for view in &views {
                print!("{}", view_text(view, local_now));
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} control planes failed: {}",
            failed.len(),
            endpoints.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// What `keel status -o json` prints.
#[derive(Serialize)]
struct Views<'a> {
    control_planes: Vec<View<'a>>,
}

/// One control plane's view, or why there is none.
#[derive(Serialize)]
#[serde(untagged)]
enum View<'a> {
    Answered {
        endpoint: &'a str,
        served_at: Option<u64>,
        registry: Registry,
    },
    Failed {
        endpoint: &'a str,
        error: String,
    },
}

/// A control plane's answer to `NodeStatus`.
pub struct ControlPlaneStatus {
    /// Its node registry (every string in it is the node's to choose).
    pub registry: Registry,
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
    let registry = Registry::parse(&response.registry)
        .with_context(|| format!("{endpoint} sent a registry that does not parse"))?;
    Ok(ControlPlaneStatus {
        registry,
        served_at: response.served_at,
    })
}

/// The node registry of the control plane at `endpoint` ([`status_of`]).
pub async fn registry_of(operator: &Operator, endpoint: &str) -> anyhow::Result<Registry> {
    Ok(status_of(operator, endpoint).await?.registry)
}

/// `text` escaped for the terminal: it comes from a node.
fn text(text: &str) -> String {
    crate::printable::printable(text).to_string()
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
fn age(t: Option<u64>, now: u64) -> String {
    t.map_or_else(
        || "never".into(),
        |t| format!("{} s ago", now.saturating_sub(t)),
    )
}

/// The lines `keel status` prints for `view`; ages are on this machine's
/// clock (`local`) where the control plane does not say its own.
fn view_text(view: &View<'_>, local: impl FnOnce() -> u64) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut line = |l: std::fmt::Arguments<'_>| {
        let _ = writeln!(out, "{l}");
    };
    let (endpoint, registry, served_at) = match view {
        View::Failed { endpoint, error } => {
            line(format_args!("control plane {}", text(endpoint)));
            line(format_args!("  failed: {}", text(error)));
            return out;
        }
        View::Answered {
            endpoint,
            served_at,
            registry,
        } => (endpoint, registry, served_at),
    };
    line(format_args!("control plane {}", text(endpoint)));
    if served_at.is_none() {
        line(format_args!(
            "  (an earlier version, which does not say its clock: ages are on this machine's)"
        ));
    }
    let now = ages_counted_to(*served_at, local);
    line(format_args!(
        "  {:<16} {:<14} {:<16} {:<36} {:<10} {:<14} {:<10} reason",
        "node", "role", "EK (SHA-256)", "disk", "verdict", "last evidence", "k8s"
    ));
    let revoked: BTreeSet<&str> = registry.revoked.iter().map(|r| r.ek.as_str()).collect();
    for node in registry.nodes.values() {
        // The first 16 hex digits of the EK's hash (64 bits); `keel
        // revoke` takes the whole hash, which the JSON output and the
        // revocation lines below show.
        let ek = text(&node.ek);
        let hex = ek.strip_prefix("sha256:").unwrap_or(&ek);
        line(format_args!(
            "  {:<16} {:<14} {:<16} {:<36} {:<10} {:<14} {:<10} {}",
            text(&node.name),
            text(&node.role),
            hex.get(..16).unwrap_or(hex),
            text(&node.disk_uuid),
            if revoked.contains(node.ek.as_str()) {
                "revoked".to_owned()
            } else {
                text(&node.verdict)
            },
            age(node.last_evidence_at, now),
            text(&node.kubernetes_version),
            reason(node),
        ));
    }
    for r in &registry.revoked {
        line(format_args!(
            "  revoked: {} (EK {}, disk {}): {}",
            text(&r.name),
            text(&r.ek),
            text(&r.disk_uuid),
            text(&r.reason)
        ));
    }
    out
}

/// A node record's reason, saying so where its drift rests on the
/// control plane's clock alone (which its `revoke` policy leaves to the
/// operator).
fn reason(node: &NodeRecord) -> String {
    let reason = text(node.reason.as_deref().unwrap_or(""));
    if node.on_clock && node.verdict == "drifted" {
        format!("{reason} (only at this control plane's time: check its clock and collateral; not revoked by policy)")
    } else {
        reason
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ek(digit: char) -> String {
        format!("sha256:{}", digit.to_string().repeat(64))
    }

    /// A registry as a control plane writes it (the agent's own type):
    /// a trusted control plane, a worker drifted on the clock that holds
    /// another name, a node whose name carries a bidirectional control,
    /// and a revoked one.
    fn written_registry() -> Vec<u8> {
        use serde_json::json;
        let record = |name: &str, role: &str, e: char, verdict: &str| {
            json!({
                "name": name,
                "role": role,
                "ek": ek(e),
                "disk_uuid": format!("0a1b2c3d-0000-4000-8000-00000000000{e}"),
                "verdict": verdict,
                "registered_at": 900,
                "last_evidence_at": (verdict != "registered").then_some(990),
                "verdict_at": 950,
                "reason": (verdict == "drifted").then_some("EK certificate is not valid at this time"),
                "kubernetes_version": "v1.33.1",
                "measurements": "ab".repeat(32),
            })
        };
        let mut drifted = record("w-1", "worker", 'b', "drifted");
        drifted["other_names"] = json!(["w-1b"]);
        drifted["on_clock"] = json!(true);
        let nodes: serde_json::Map<String, serde_json::Value> = [
            record("cp-0", "control-plane", 'a', "trusted"),
            drifted,
            record("w-2\u{202e}fake", "worker", 'c', "registered"),
            record("w-3", "worker", 'd', "silent"),
        ]
        .into_iter()
        .map(|r| (r["ek"].as_str().unwrap().to_owned(), r))
        .collect();
        let revoked = json!([{
            "name": "w-3", "ek": ek('d'), "disk_uuid": "", "reason": "by the operator", "at": 999,
        }]);
        let document = json!({ "nodes": nodes, "revoked": revoked });
        keel_agent::registry::Registry::parse(&serde_json::to_vec(&document).unwrap())
            .unwrap()
            .to_json()
    }

    /// `keel status -o json` prints a registry as the control plane wrote
    /// it, as it did when it held the document as a JSON value.
    #[test]
    fn a_written_registry_prints_as_its_json_value_did() {
        let document = written_registry();
        let value: serde_json::Value = serde_json::from_slice(&document).unwrap();
        let registry = Registry::parse(&document).unwrap();
        assert_eq!(registry.nodes.len(), 4);
        let as_value = serde_json::json!({ "control_planes": [
            { "endpoint": "cp-0:9000", "served_at": 1_000, "registry": value.clone() },
            { "endpoint": "cp-1:9000", "served_at": null, "registry": value },
            { "endpoint": "cp-2:9000", "error": "cp-2:9000 did not answer within 300 s" },
        ]});
        let views = Views {
            control_planes: vec![
                View::Answered {
                    endpoint: "cp-0:9000",
                    registry: registry.clone(),
                    served_at: Some(1_000),
                },
                View::Answered {
                    endpoint: "cp-1:9000",
                    registry,
                    served_at: None,
                },
                View::Failed {
                    endpoint: "cp-2:9000",
                    error: "cp-2:9000 did not answer within 300 s".into(),
                },
            ],
        };
        assert_eq!(
            crate::printable::json_pretty(&views).unwrap(),
            crate::printable::json_pretty(&as_value).unwrap()
        );
    }

    /// The text of a control plane's view: the nodes in EK order, the
    /// revoked one marked so, node text escaped.
    #[test]
    fn a_written_registry_prints_as_lines() {
        let registry = Registry::parse(&written_registry()).unwrap();
        let view = View::Answered {
            endpoint: "cp-0:9000",
            registry,
            served_at: Some(1_000),
        };
        let expected = [
            "control plane cp-0:9000",
            "  node             role           EK (SHA-256)     disk                                 verdict    last evidence  k8s        reason",
            "  cp-0             control-plane  aaaaaaaaaaaaaaaa 0a1b2c3d-0000-4000-8000-00000000000a trusted    10 s ago       v1.33.1    ",
            "  w-1              worker         bbbbbbbbbbbbbbbb 0a1b2c3d-0000-4000-8000-00000000000b drifted    10 s ago       v1.33.1    EK certificate is not valid at this time (only at this control plane's time: check its clock and collateral; not revoked by policy)",
            "  w-2\\u{202e}fake  worker         cccccccccccccccc 0a1b2c3d-0000-4000-8000-00000000000c registered never          v1.33.1    ",
            "  w-3              worker         dddddddddddddddd 0a1b2c3d-0000-4000-8000-00000000000d revoked    10 s ago       v1.33.1    ",
            &format!("  revoked: w-3 (EK {}, disk ): by the operator", ek('d')),
            "",
        ]
        .join("\n");
        assert_eq!(view_text(&view, || 5_000), expected);
        let earlier = View::Answered {
            endpoint: "cp-1:9000",
            registry: Registry::default(),
            served_at: None,
        };
        assert!(view_text(&earlier, || 5_000)
            .contains("(an earlier version, which does not say its clock"));
        let failed = View::Failed {
            endpoint: "cp-2:9000",
            error: "refused\n".into(),
        };
        assert_eq!(
            view_text(&failed, || 5_000),
            "control plane cp-2:9000\n  failed: refused\\n\n"
        );
    }

    #[test]
    fn node_text_reaches_the_terminal_escaped() {
        assert_eq!(
            text("w-1\u{1b}[2J\u{202e}fake\nline"),
            "w-1\\u{1b}[2J\\u{202e}fake\\nline"
        );
        // Printable text stays as it is (no backslashes before quotes).
        assert_eq!(text("PCR 12: \"x\""), "PCR 12: \"x\"");
    }

    #[test]
    fn a_drift_on_the_clock_is_named_as_such() {
        let drift = NodeRecord {
            verdict: "drifted".into(),
            reason: Some("EK certificate is not valid at this time".into()),
            ..NodeRecord::default()
        };
        assert_eq!(reason(&drift), "EK certificate is not valid at this time");
        let on_clock = NodeRecord {
            on_clock: true,
            ..drift
        };
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
        assert_eq!(age(Some(988), served), "12 s ago");
        // An earlier version (no served_at, or 0): this machine's clock.
        let earlier = ages_counted_to(None, local);
        assert_eq!(earlier, 5_000);
        assert_eq!(ages_counted_to(Some(0), local), 5_000);
        assert_eq!(age(Some(988), earlier), "4012 s ago");
        // After served_at (the control plane's clock stepped back between
        // the evidence and the answer).
        assert_eq!(age(Some(1_030), served), "0 s ago");
        assert_eq!(age(None, served), "never");
    }
}
