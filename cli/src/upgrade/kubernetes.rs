//! The Kubernetes phase of `keel upgrade apply`: every node moves to the
//! target version, control planes first and one at a time, then workers.
//!
//! Before any node switches, every control plane authorises the target's
//! components, so the evidence of nodes already upgraded is judged against
//! them. The first control plane named runs `kubeadm upgrade apply`, every
//! other node `kubeadm upgrade node`. Each request carries the node's own
//! operator proof over the exact plan bytes; each node checks the skew
//! policy itself and refuses a downgrade or a jump of more than one minor
//! version before it changes anything. A node that fails switches back and
//! keeps serving; a failed control plane stops the rollout, a failed worker
//! is reported and the others go on.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use keel_proto::components::Components;
use keel_proto::operator::upgrade_response::Event;
use keel_proto::operator::{UpgradePlan, UpgradeRequest, UpgradeStep};
use prost::Message as _;

use super::Roles;
use crate::operator::{answer, refused, Member, Operator};
use crate::printable::printable;
use crate::settings::Settings;

use keel_verifier::keys::kind::UPGRADE;

/// The target of the phase, checked before any node is contacted.
pub struct Target {
    version: String,
    components: Option<Components>,
    /// The components file and its signature, where the settings name a
    /// measurements signing key (nodes then take no other components).
    signed: Option<(Vec<u8>, Vec<u8>)>,
    /// Longest one node's upgrade may take ([`NODE_TIMEOUT`]).
    node_limit: Duration,
}

impl Target {
    /// `version` (`vX.Y` or the pinned `vX.Y.Z`), with the components of
    /// `components_file` (default: the versions table's). Where the
    /// settings at `settings` name a measurements signing key, the file's
    /// signature (`signature`, default the file + `.sig`) must verify with
    /// it.
    pub fn new(
        settings: &Path,
        version: &str,
        components_file: Option<&Path>,
        signature: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let entry = keel_installer::resolve(version)?;
        let mut target = Self {
            version: entry.version().to_string(),
            components: None,
            signed: None,
            node_limit: NODE_TIMEOUT,
        };
        let Some(file) = components_file else {
            return Ok(target);
        };
        let key = Settings::load(settings)?.signing_key()?;
        let read =
            crate::settings::read_components(file, entry.version(), signature, key.as_ref())?;
        target.components = Some(read.components);
        target.signed = read.signed;
        Ok(target)
    }

    fn plan(&self, step: UpgradeStep) -> Vec<u8> {
        let (components_file, components_signature) = self.signed.clone().unwrap_or_default();
        UpgradePlan {
            kubernetes_version: self.version.clone(),
            components: self.components.clone(),
            step: step.into(),
            components_file,
            components_signature,
        }
        .encode_to_vec()
    }
}

/// Moves every node named to `target`, in the turn its attested role gives
/// it (`roles`), printing each node's progress.
pub async fn run(operator: &Operator, roles: &Roles, target: &Target) -> anyhow::Result<()> {
    let Roles {
        control_planes,
        workers,
        ..
    } = roles;
    if control_planes.is_empty() {
        bail!("name at least one control plane with --endpoint: the first one runs kubeadm upgrade apply");
    }
    println!(
        "kubernetes: upgrading {} control plane(s), then {} worker(s), to {}",
        control_planes.len(),
        workers.len(),
        target.version
    );
    for endpoint in control_planes {
        let member = operator.connect(endpoint).await?;
        request(member, target, UpgradeStep::Authorise).await?;
        println!("{endpoint}: components of {} authorised", target.version);
    }
    for (i, endpoint) in control_planes.iter().enumerate() {
        let step = if i == 0 {
            UpgradeStep::Apply
        } else {
            UpgradeStep::Node
        };
        let member = operator.connect(endpoint).await?;
        request(member, target, step)
            .await
            .with_context(|| format!("{endpoint}: the rollout stops at this control plane"))?;
    }
    let mut failed = Vec::new();
    for endpoint in workers {
        let result = match operator.connect(endpoint).await {
            Ok(member) => request(member, target, UpgradeStep::Node).await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            println!("{endpoint}: FAILED: {}", crate::printable::error_chain(&e));
            failed.push(endpoint.clone());
        }
    }
    workers_failed(&failed)?;
    println!("kubernetes: every node runs {}", target.version);
    Ok(())
}

/// The phase's end where the workers at `failed` did not report a finished
/// upgrade. Each one's FAILED line says where it stands: switched back,
/// nothing switched, half switched, or unknown (no result in time, or the
/// connection lost while its upgrade goes on at the node).
fn workers_failed(failed: &[String]) -> anyhow::Result<()> {
    if !failed.is_empty() {
        bail!(
            "{} worker(s) did not report a finished upgrade (each FAILED line above says where \
             it stands): {}",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// Sends the plan for `step` to `member` and prints its progress; fails
/// unless it reports done.
async fn request(mut member: Member, target: &Target, step: UpgradeStep) -> anyhow::Result<()> {
    let started = Instant::now();
    let plan = target.plan(step);
    let (challenge, proof) = member.prove(UPGRADE, &plan).await?;
    let endpoint = member.endpoint.clone();
    let mut stream = answer(
        &endpoint,
        member.client.upgrade(UpgradeRequest {
            plan,
            challenge,
            proof,
        }),
    )
    .await?;
    let limit = target.node_limit;
    let followed = tokio::time::timeout(limit, follow(&mut stream, &endpoint, step, started)).await;
    followed.unwrap_or_else(|_| {
        bail!(
            "{endpoint}: no result within {} s; the node may still be upgrading: \
             `keel status` shows the version it runs once it is done",
            limit.as_secs()
        )
    })
}

/// Longest one node's upgrade may take (components downloaded, kubeadm,
/// the kubelet restarted), its answer included.
const NODE_TIMEOUT: Duration = Duration::from_secs(1800);

/// Prints the node's progress until its result; fails unless it reports
/// done.
async fn follow(
    stream: &mut tonic::Streaming<keel_proto::operator::UpgradeResponse>,
    endpoint: &str,
    step: UpgradeStep,
    started: Instant,
) -> anyhow::Result<()> {
    while let Some(message) = stream.message().await.map_err(|s| refused(endpoint, &s))? {
        match message.event {
            Some(Event::Log(line)) if step != UpgradeStep::Authorise => {
                println!("{endpoint}: {}", printable(&line));
            }
            Some(Event::Done(done)) => {
                if step != UpgradeStep::Authorise {
                    if done.previous_version == done.kubernetes_version {
                        println!(
                            "{endpoint}: runs Kubernetes {} already (nothing to do)",
                            printable(&done.kubernetes_version)
                        );
                    } else {
                        println!(
                            "{endpoint}: runs Kubernetes {} (was {}), {:.1} s",
                            printable(&done.kubernetes_version),
                            printable(&done.previous_version),
                            started.elapsed().as_secs_f64()
                        );
                    }
                }
                return Ok(());
            }
            Some(Event::Failed(failed)) => {
                bail!(
                    "{endpoint}: upgrade failed: {}; {}",
                    printable(&failed.error),
                    match (failed.switched, failed.rolled_back) {
                        (_, true) => format!(
                            "switched back, runs Kubernetes {}",
                            printable(&failed.running_version)
                        ),
                        (false, false) => format!(
                            "nothing switched, runs Kubernetes {}",
                            printable(&failed.running_version)
                        ),
                        (true, false) => "switched, and not rolled back in full: the node \
                                          needs attention (the error above and its console say \
                                          what failed)"
                            .to_owned(),
                    }
                )
            }
            Some(Event::Log(_)) | None => {}
        }
    }
    bail!("{endpoint}: the upgrade stream ended without a result")
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_proto::operator as op;
    use keel_proto::operator::operator_service_server::{OperatorService, OperatorServiceServer};

    /// A node that answers challenges and takes an upgrade (its answer's
    /// headers sent), then never says a word of it.
    struct Stalls;

    #[tonic::async_trait]
    impl OperatorService for Stalls {
        type UpgradeStream = tokio_stream::Pending<Result<op::UpgradeResponse, tonic::Status>>;

        async fn challenge(
            &self,
            _: tonic::Request<op::ChallengeRequest>,
        ) -> Result<tonic::Response<op::ChallengeResponse>, tonic::Status> {
            Ok(tonic::Response::new(op::ChallengeResponse {
                challenge: vec![0x66; 32],
            }))
        }

        async fn upgrade(
            &self,
            _: tonic::Request<op::UpgradeRequest>,
        ) -> Result<tonic::Response<Self::UpgradeStream>, tonic::Status> {
            Ok(tonic::Response::new(tokio_stream::pending()))
        }

        async fn node_status(
            &self,
            _: tonic::Request<op::NodeStatusRequest>,
        ) -> Result<tonic::Response<op::NodeStatusResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }

        async fn revoke_node(
            &self,
            _: tonic::Request<op::RevokeNodeRequest>,
        ) -> Result<tonic::Response<op::RevokeNodeResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }

        async fn set_join_measurements(
            &self,
            _: tonic::Request<op::SetJoinMeasurementsRequest>,
        ) -> Result<tonic::Response<op::SetJoinMeasurementsResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }

        async fn stage_image_measurements(
            &self,
            _: tonic::Request<op::StageImageMeasurementsRequest>,
        ) -> Result<tonic::Response<op::StageImageMeasurementsResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }

        async fn finish_image_upgrade(
            &self,
            _: tonic::Request<op::FinishImageUpgradeRequest>,
        ) -> Result<tonic::Response<op::FinishImageUpgradeResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }

        async fn admin_kubeconfig(
            &self,
            _: tonic::Request<op::AdminKubeconfigRequest>,
        ) -> Result<tonic::Response<op::AdminKubeconfigResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }
    }

    /// A node that takes the upgrade and then sends nothing is given up on
    /// once the node's limit has passed, with the reason.
    #[tokio::test]
    async fn a_node_silent_after_taking_the_upgrade_is_given_up_on() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(OperatorServiceServer::new(Stalls))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let target = Target {
            version: "v1.31.0".into(),
            components: None,
            signed: None,
            node_limit: Duration::from_secs(1),
        };
        let member = Member::unattested(&endpoint, channel);
        let started = Instant::now();
        // Without the node's limit, the CLI would wait for ever.
        let given_up = tokio::time::timeout(
            Duration::from_secs(30),
            request(member, &target, UpgradeStep::Node),
        )
        .await
        .expect("the CLI waited on a silent node past its limit");
        let e = given_up.unwrap_err();
        assert!(
            e.to_string().starts_with(&format!(
                "{endpoint}: no result within 1 s; the node may still be upgrading"
            )),
            "{e}"
        );
        assert!(started.elapsed() >= Duration::from_secs(1));
        server.abort();
    }

    /// A worker given up on may still be upgrading, or be half switched:
    /// the phase's end claims no version for the workers that failed.
    #[test]
    fn failed_workers_are_not_said_to_run_their_previous_version() {
        assert!(workers_failed(&[]).is_ok());
        let e = workers_failed(&["w-0:9000".into(), "w-1:9000".into()]).unwrap_err();
        let e = e.to_string();
        assert!(!e.contains("previous version"), "{e}");
        assert!(
            e.starts_with("2 worker(s) did not report a finished upgrade"),
            "{e}"
        );
        assert!(e.ends_with(": w-0:9000, w-1:9000"), "{e}");
    }
}
