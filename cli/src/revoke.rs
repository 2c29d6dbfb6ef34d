//! `keel revoke NODE...`: put nodes on the revocation list of every
//! control plane named; every control plane the registries know must be
//! named, or be among the nodes revoked. Each node (by name, EK hash or
//! disk UUID) is looked up once, in all of their registries, and revoked
//! by its EK. Each must know the node;
//! from then on it issues no join ticket, no rejoin ticket and so no disk
//! key for the node's EK (its disk opens with that EK only). A running node keeps the key it has
//! until it reboots (docs/attestation.md says how to complete the removal).
//! The workspace records the revoked EK: `keel recover` refuses it.

use std::path::Path;
use std::time::Duration;

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, Context as _};
use keel_proto::operator::RevokeNodeRequest;

use crate::operator::{answer, distinct, on_each, Operator};
use crate::printable::printable;
use crate::registry::Registry;
use crate::upgrade::refuse_unnamed_control_planes;

use keel_verifier::keys::kind::REVOKE_NODE;

/// Runs `keel revoke`.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    nodes: &[String],
    endpoints: &[String],
    wait: Duration,
) -> anyhow::Result<()> {
    crate::operator::require_endpoints(endpoints)?;
    let operator = Operator::load(settings_path, workspace, wait)?;
    let endpoints = distinct(endpoints);
    // Every named control plane that answers is read first. One that does
    // not (down, rebooting, refused) does not hold the revocation back: it
    // is reported as failed, and takes the list from the others at its
    // next registry exchange if it reaches them.
    let mut registries = Vec::new();
    let mut reached_eks = BTreeSet::new();
    let mut endpoint_eks = BTreeMap::new();
    let mut unreached = Vec::new();
    for endpoint in &endpoints {
        match read_control_plane(&operator, endpoint).await {
            Ok(Some((ek, registry))) => {
                reached_eks.insert(ek.clone());
                endpoint_eks.insert(endpoint.clone(), ek);
                registries.push((endpoint.clone(), registry));
            }
            Ok(None) => bail!(
                "{endpoint} is not a control plane: revocations go to control planes only; \
                 nothing was revoked"
            ),
            Err(e) => unreached.push((endpoint.clone(), e)),
        }
    }
    if registries.is_empty() {
        for (endpoint, e) in &unreached {
            println!("{endpoint}: FAILED: {}", crate::printable::error_chain(e));
        }
        bail!("no control plane named could be read; nothing was revoked");
    }
    let targets = targets(nodes, &registries, reached_eks, unreached.len())?;
    for target in &targets {
        eprintln!(
            "revoking node {} (EK {})",
            printable(&target.name),
            printable(&target.ek)
        );
    }
    // Each named control plane in turn: one that could not be read fails
    // with why, the others revoke.
    let unreached: BTreeMap<String, String> = unreached
        .into_iter()
        .map(|(endpoint, e)| (endpoint, format!("{e:#}")))
        .collect();
    let what = if targets.len() == 1 {
        "revoke the node"
    } else {
        "revoke the nodes"
    };
    on_each(&endpoints, what, |endpoint| {
        let (operator, targets, unreached) = (&operator, &targets, &unreached);
        let ek = endpoint_eks.get(&endpoint);
        async move {
            if let Some(why) = unreached.get(&endpoint) {
                bail!("{why}");
            }
            // A control plane being revoked is not asked: the workspace
            // records its EK before the first request, and from then on it
            // is asked nothing (`Operator::connect`).
            if ek.is_some_and(|ek| targets.iter().any(|t| t.ek == *ek)) {
                return Ok("not asked: it is among the nodes revoked".to_owned());
            }
            let mut done = Vec::new();
            for target in targets {
                match revoke_at(operator, &endpoint, &target.ek, workspace).await {
                    Ok(line) => done.push(line),
                    Err(e) if done.is_empty() => return Err(e),
                    Err(e) => return Err(e.context(format!("after {}", done.join("; ")))),
                }
            }
            Ok(done.join("; "))
        }
    })
    .await
}

/// The nodes `selectors` name, each looked up once in all of
/// `registries` (each named control plane's that answered; `reached_eks`
/// their EKs, `unread` how many named ones did not answer) and revoked by
/// its EK everywhere: a name or disk UUID that means another node to
/// another control plane (two holders of one name, a node named like
/// another's disk) revokes nothing. Two selectors of one node name it
/// once. Refused while the registries know control planes that are
/// neither named nor among the nodes, past those the unread ones may be.
fn targets(
    selectors: &[String],
    registries: &[(String, Registry)],
    reached_eks: BTreeSet<String>,
    unread: usize,
) -> anyhow::Result<Vec<Target>> {
    if selectors.is_empty() {
        bail!("name the node to revoke");
    }
    let mut targets: Vec<Target> = Vec::new();
    for selector in selectors {
        by_ek_while_some_unread(selector, unread)?;
        let target = resolve(selector, registries)?;
        if !targets.iter().any(|t| t.ek == target.ek) {
            targets.push(target);
        }
    }
    // A control plane left out would go on issuing tickets to the nodes;
    // one being revoked need not be named (a compromised control plane,
    // and control planes it made up, answer no one), and each named one
    // that could not be read may be any one the registries know, but a
    // node being revoked that is a named control plane that did not
    // answer.
    let unanswering_targets = targets
        .iter()
        .filter(|t| t.control_plane && !reached_eks.contains(&t.ek))
        .count();
    let allowance = unread.saturating_sub(unanswering_targets);
    let mut named = reached_eks;
    named.extend(targets.iter().map(|t| t.ek.clone()));
    refuse_unnamed_control_planes(
        registries,
        &named,
        allowance,
        "Each must revoke the node, or it goes on issuing it tickets (and disk keys) until \
         it merges another's list",
    )?;
    Ok(targets)
}

/// The EK and registry of the control plane at `endpoint`; `None` if it
/// is not a control plane.
async fn read_control_plane(
    operator: &Operator,
    endpoint: &str,
) -> anyhow::Result<Option<(String, Registry)>> {
    let member = operator.connect(endpoint).await?;
    if !member.is_control_plane() {
        return Ok(None);
    }
    let registry = crate::status::registry_of(operator, endpoint).await?;
    Ok(Some((member.ek.to_string(), registry)))
}

/// The node a selector names, as the control planes' registries know it.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    /// Its EK (`sha256:` and hex).
    ek: String,
    /// Its name, as the first registry that knows it has it.
    name: String,
    /// Whether a registry records it as a control plane.
    control_plane: bool,
}

/// Shortest EK hash prefix (hex digits) a selector may give.
const MIN_EK_PREFIX: usize = 8;

/// The EK hash (whole or a prefix of at least [`MIN_EK_PREFIX`] hex
/// digits, with or without `sha256:`) `selector` gives, lower case; `None`
/// for a name or a disk UUID.
fn ek_prefix(selector: &str) -> Option<String> {
    let digits = selector.strip_prefix("sha256:").unwrap_or(selector);
    (digits.len() >= MIN_EK_PREFIX
        && digits.len() <= 64
        && digits.bytes().all(|b| b.is_ascii_hexdigit()))
    .then(|| digits.to_ascii_lowercase())
}

/// Refuses anything but a whole EK hash while `unread` named control
/// planes could not be read. A name, a disk UUID or an EK prefix resolves
/// to whatever EK the control planes that answered say: a compromised one
/// answering alone could map a name to an honest node's EK, which the
/// workspace then records as revoked (and `keel recover` refuses), or
/// complete its own EK's prefix with digits of its choice, so that the
/// workspace records an EK that never was and its own stays unrevoked.
/// A whole EK hash is the operator's own choice.
fn by_ek_while_some_unread(selector: &str, unread: usize) -> anyhow::Result<()> {
    let whole_ek = ek_prefix(selector.trim()).is_some_and(|digits| digits.len() == 64);
    if unread > 0 && !whole_ek {
        bail!(
            "{unread} control plane(s) named could not be read, and a name, disk UUID or EK \
             prefix is resolved by the ones that answered: name the node by its whole EK hash \
             (`keel status -o json` shows it) to revoke it now; nothing was revoked"
        );
    }
    Ok(())
}

/// The one node `selector` names in `registries` (each control plane's
/// registry): by name, by disk UUID, or by EK hash, whole (with or
/// without `sha256:`) or a prefix of at least 8 hex digits (`keel status`
/// shows 16). Node records and revocations both count, so revoking again
/// finds a node already revoked somewhere. Refused when no registry knows
/// it, or when the registries name more than one EK by it.
fn resolve(selector: &str, registries: &[(String, Registry)]) -> anyhow::Result<Target> {
    let wanted = selector.trim();
    let hex_prefix = ek_prefix(wanted);
    let matches = |entry: &Entry<'_>| {
        let ek_hex = entry.ek.strip_prefix("sha256:").unwrap_or("");
        entry.name == wanted
            || (!entry.disk_uuid.is_empty() && entry.disk_uuid.eq_ignore_ascii_case(wanted))
            || hex_prefix
                .as_deref()
                .is_some_and(|prefix| !ek_hex.is_empty() && ek_hex.starts_with(prefix))
    };
    let mut found: BTreeMap<String, (String, bool)> = BTreeMap::new();
    for (_, registry) in registries {
        let nodes = registry.nodes.values().map(|n| Entry {
            name: &n.name,
            ek: &n.ek,
            disk_uuid: &n.disk_uuid,
            control_plane: n.role == "control-plane",
        });
        let revoked = registry.revoked.iter().map(|r| Entry {
            name: &r.name,
            ek: &r.ek,
            disk_uuid: &r.disk_uuid,
            control_plane: false,
        });
        // An entry without an EK names no node to revoke.
        for entry in nodes
            .chain(revoked)
            .filter(|e| !e.ek.is_empty() && matches(e))
        {
            let found = found
                .entry(entry.ek.to_owned())
                .or_insert((entry.name.to_owned(), false));
            found.1 |= entry.control_plane;
        }
    }
    let mut found = found.into_iter();
    match (found.next(), found.next()) {
        (Some((ek, (name, control_plane))), None) => Ok(Target {
            ek,
            name,
            control_plane,
        }),
        (None, _) => bail!(
            "no control plane named knows a node {} (by name, disk UUID or EK hash); \
             nothing was revoked",
            printable(wanted)
        ),
        (Some(first), Some(second)) => {
            let all: Vec<String> = [first, second]
                .into_iter()
                .chain(found)
                .map(|(ek, (name, _))| format!("{} ({})", printable(&name), printable(&ek)))
                .collect();
            bail!(
                "{} names more than one node: {}; name the EK hash of the one to revoke; \
                 nothing was revoked",
                printable(wanted),
                all.join(", ")
            )
        }
    }
}

/// A node record or revocation, as [`resolve`] matches it.
struct Entry<'a> {
    name: &'a str,
    ek: &'a str,
    disk_uuid: &'a str,
    /// Whether it records a control plane.
    control_plane: bool,
}

/// Revokes the node of `ek` on the control plane at `endpoint`; returns
/// what to print.
async fn revoke_at(
    operator: &Operator,
    endpoint: &str,
    ek: &str,
    workspace: &Path,
) -> anyhow::Result<String> {
    let (mut cp, challenge, proof) = operator
        .authorise(endpoint, REVOKE_NODE, ek.as_bytes())
        .await?;
    // Recorded before it is sent, and as the EK asked for (not as a
    // control plane names it): `keel recover` never sends the master
    // secret to it, whatever becomes of the request.
    crate::workspace::RevokedRecord::add(workspace, ek)
        .context("recording the revoked EK in the workspace; nothing was revoked")?;
    let done = answer(
        endpoint,
        cp.client.revoke_node(RevokeNodeRequest {
            node: ek.to_owned(),
            challenge,
            proof,
        }),
    )
    .await?;
    if done.ek != ek {
        bail!(
            "the control plane at {endpoint} reports revoking EK {}, not the EK {} asked for",
            printable(&done.ek),
            printable(ek)
        );
    }
    Ok(format!(
        "revoked node {} (EK {}, disk {})",
        printable(&done.name),
        printable(&done.ek),
        printable(&done.disk_uuid)
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    const EK_A: &str = "sha256:aaaaaaaa11111111111111111111111111111111111111111111111111111111";
    const EK_B: &str = "sha256:bbbbbbbb22222222222222222222222222222222222222222222222222222222";
    const DISK_A: &str = "0a1b2c3d-0000-4000-8000-00000000000a";

    fn registry(nodes: &[(&str, &str, &str)], revoked: &[(&str, &str)]) -> Registry {
        let nodes: serde_json::Map<String, serde_json::Value> = nodes
            .iter()
            .map(|(name, ek, disk)| {
                (
                    ek.to_string(),
                    json!({"name": name, "ek": ek, "disk_uuid": disk, "role": "worker"}),
                )
            })
            .collect();
        let revoked: Vec<serde_json::Value> = revoked
            .iter()
            .map(|(name, ek)| json!({"name": name, "ek": ek, "disk_uuid": ""}))
            .collect();
        serde_json::from_value(json!({"nodes": nodes, "revoked": revoked})).unwrap()
    }

    fn at(registries: Vec<Registry>) -> Vec<(String, Registry)> {
        registries
            .into_iter()
            .enumerate()
            .map(|(i, r)| (format!("cp-{i}"), r))
            .collect()
    }

    #[test]
    fn a_node_is_found_by_name_disk_or_ek_in_any_form() {
        let registries = at(vec![
            registry(&[("w-1", EK_A, DISK_A)], &[]),
            registry(&[("w-2", EK_B, "")], &[]),
        ]);
        let a = Target {
            ek: EK_A.into(),
            name: "w-1".into(),
            control_plane: false,
        };
        for selector in [
            "w-1",
            DISK_A,
            &DISK_A.to_uppercase(),
            EK_A,
            &EK_A[7..],
            &EK_A[7..23],
            "sha256:AAAAAAAA",
        ] {
            assert_eq!(resolve(selector, &registries).unwrap(), a, "{selector}");
        }
        assert_eq!(resolve("w-2", &registries).unwrap().ek, EK_B);
        // Too short a prefix, or a name nobody holds, finds nothing.
        for selector in ["aaaa", "w-9", ""] {
            let e = resolve(selector, &registries).unwrap_err().to_string();
            assert!(e.contains("no control plane named knows"), "{e}");
        }
    }

    /// Attacker's move: a node takes another node's disk UUID as its name
    /// (names allow the characters of a UUID), so that, at a control plane
    /// that has not recorded that disk, `keel revoke <the UUID>` revokes
    /// the attacker and spares the victim. Or two EKs hold one name (their
    /// control planes admitted one each before their registries merged).
    /// Either way the selector names two EKs, and nothing is revoked.
    #[test]
    fn a_selector_naming_two_nodes_revokes_nothing() {
        let uuid_named = at(vec![
            registry(&[(DISK_A, EK_B, "")], &[]),
            registry(&[("w-1", EK_A, DISK_A)], &[]),
        ]);
        let two_holders = at(vec![
            registry(&[("w-1", EK_A, "")], &[]),
            registry(&[("w-1", EK_B, "")], &[]),
        ]);
        for (selector, registries) in [(DISK_A, uuid_named), ("w-1", two_holders)] {
            let e = resolve(selector, &registries).unwrap_err().to_string();
            assert!(e.contains("names more than one node"), "{e}");
            assert!(e.contains(EK_A) && e.contains(EK_B), "{e}");
        }
    }

    /// Attacker's move, as a compromised control plane that alone answers
    /// (the others down or cut off): map the name the operator gives to an
    /// honest node's EK, which the workspace would then record as revoked.
    /// While a named control plane could not be read, only a whole EK
    /// hash is taken.
    #[test]
    fn a_name_is_resolved_only_when_every_named_control_plane_answered() {
        for selector in [
            "w-1",
            "0b9c1e2a-0000-4000-8000-000000000001",
            &EK_A[7..23],
            "0123abcd",
            &EK_A[..70],
        ] {
            let e = by_ek_while_some_unread(selector, 1)
                .unwrap_err()
                .to_string();
            assert!(e.contains("name the node by its whole EK hash"), "{e}");
            by_ek_while_some_unread(selector, 0).unwrap();
        }
        let upper = EK_A[7..].to_uppercase();
        for selector in [EK_A, &EK_A[7..], upper.as_str()] {
            by_ek_while_some_unread(selector, 2).unwrap();
        }
    }

    /// Attacker's move, as a compromised control plane that alone answers:
    /// complete the prefix of its own EK the operator gives with digits of
    /// its choice, so that the workspace records an EK that never was as
    /// revoked, and its own, still unrevoked, later receives the master
    /// secret from `keel recover`. While a named control plane could not
    /// be read, a prefix resolves nothing.
    #[test]
    fn a_prefix_is_not_resolved_while_a_named_control_plane_is_unread() {
        let made_up = format!("{}{}", &EK_A[..23], "99".repeat(24));
        let registries = at(vec![registry(&[("cp-2", &made_up, "")], &[])]);
        let reached = BTreeSet::from([EK_B.to_owned()]);
        let e = targets(&[EK_A[7..23].to_owned()], &registries, reached.clone(), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("name the node by its whole EK hash"), "{e}");
        // Named in full, the operator's own EK is what is looked up, and
        // the made-up record does not match it.
        let e = targets(&[EK_A.to_owned()], &registries, reached, 1).unwrap_err();
        assert!(
            e.to_string().contains("no control plane named knows"),
            "{e}"
        );
    }

    #[test]
    fn a_node_already_revoked_somewhere_is_found_by_its_revocation() {
        let registries = at(vec![registry(&[], &[("w-1", EK_A)]), registry(&[], &[])]);
        assert_eq!(resolve("w-1", &registries).unwrap().ek, EK_A);
    }
    /// Attacker's move, as a control plane compromised before it is
    /// revoked: serve records of control planes that never were, so that
    /// its own revocation waits on control planes that answer no one. All
    /// of them are revoked together; each node once, however it is named;
    /// a real control plane left unnamed still refuses the revocation.
    #[test]
    fn a_control_plane_and_the_control_planes_it_made_up_are_revoked_together() {
        let ek = |b: &str| format!("sha256:{}", b.repeat(32));
        let cp = |name: &str, e: &str| json!({"name": name, "role": "control-plane", "ek": ek(e)});
        let honest = || -> Registry {
            serde_json::from_value(json!({"nodes": {
                "cp-0": cp("cp-0", "aa"),
                "cp-1": cp("cp-1", "bb"),
                "liar": cp("cp-2", "cc"),
                "x1": cp("cp-x1", "d1"),
                "x2": cp("cp-x2", "d2"),
            }}))
            .unwrap()
        };
        let registries = vec![
            ("cp-0:9000".to_owned(), honest()),
            ("cp-1:9000".to_owned(), honest()),
        ];
        let reached: BTreeSet<String> = [ek("aa"), ek("bb")].into();
        let selectors = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();

        let e = targets(&selectors(&["cp-2"]), &registries, reached.clone(), 0).unwrap_err();
        assert!(
            e.to_string().contains("cp-x1") && e.to_string().contains("cp-x2"),
            "{e}"
        );
        let e = targets(
            &selectors(&["cp-2", "cp-x1"]),
            &registries,
            reached.clone(),
            0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("cp-x2"), "{e}");

        let all = targets(
            &selectors(&["cp-2", "cp-x1", &ek("d2"), &ek("cc")[7..23]]),
            &registries,
            reached.clone(),
            0,
        )
        .unwrap();
        let eks: Vec<&str> = all.iter().map(|t| t.ek.as_str()).collect();
        assert_eq!(eks, [ek("cc"), ek("d1"), ek("d2")]);
        assert!(all.iter().all(|t| t.control_plane));

        // cp-1 is real and not named: the revocation still waits on it.
        let only_cp0: BTreeSet<String> = [ek("aa")].into();
        let e = targets(
            &selectors(&["cp-2", "cp-x1", "cp-x2"]),
            &registries[..1],
            only_cp0,
            0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("cp-1"), "{e}");
        // Nothing to revoke is no revocation.
        assert!(targets(&[], &registries, reached, 0).is_err());
    }
}
