//! Fetching tickets: mutual aTLS to a join service, the request, and
//! opening the sealed secrets with this node's TPM. The checks of what
//! comes back are in [`super::ticket`].

use std::sync::Arc;
use std::time::Duration;

use keel_atls::{AtlsClient, Attested};
use keel_proto::join::join_service_client::JoinServiceClient;
use keel_proto::join::{IssueJoinTicketRequest, IssueJoinTicketResponse, IssueRejoinTicketRequest};
use keel_verifier::config::Role;
use keel_verifier::ek::EkDigest;
use keel_verifier::signature::SigningPublicKey;
use keel_verifier::validator::{Validator, Verified};
use tonic::transport::Endpoint;

use super::ticket::{
    check_service, parse_join_ticket, JoinTicket, OpenedSecrets, RawTicket, RejoinTicket,
    TicketError, TicketSource, MAX_TICKET_BYTES,
};
use crate::attestation::credential;
use crate::attestation::issuer::TpmIssuer;
use crate::grpc::answer_within;
use crate::measured::SharedTpm;
use keel_verifier::keys;

/// Requests and opens tickets over mutual aTLS: attests with the node's TPM,
/// validates the service with the validator it is given (see
/// [`super::settings::service_validator`]).
#[derive(Clone)]
pub struct TicketClient {
    atls: AtlsClient<Verified>,
    tpm: SharedTpm,
    timeout: Duration,
    is_control_plane: bool,
    measurements_key: Option<SigningPublicKey>,
}

impl TicketClient {
    /// A client attesting with `tpm` and validating services with
    /// `validator`, for a worker.
    pub fn new(tpm: SharedTpm, validator: Validator, timeout: Duration) -> Self {
        let issuer = Arc::new(TpmIssuer::new(tpm.clone()));
        let atls = AtlsClient::mutual(issuer, Arc::new(validator)).with_timeout(timeout);
        Self {
            atls,
            tpm,
            timeout,
            is_control_plane: false,
            measurements_key: None,
        }
    }

    /// The same client for a node of role `role`: a control plane's rejoin
    /// ticket must carry the master secret, a worker's must not.
    pub fn for_role(mut self, role: Role) -> Self {
        self.is_control_plane = role == Role::ControlPlane;
        self
    }

    /// The same client connecting from `address` (see
    /// [`AtlsClient::with_local_address`]).
    pub fn with_local_address(mut self, address: std::net::IpAddr) -> Self {
        self.atls = self.atls.with_local_address(address);
        self
    }

    /// The same client checking the signed measurements of a control
    /// plane's ticket with `key` (the node config's).
    pub fn with_measurements_key(mut self, key: Option<SigningPublicKey>) -> Self {
        self.measurements_key = key;
        self
    }

    async fn connect(
        &self,
        endpoint: &str,
    ) -> Result<
        (
            JoinServiceClient<tonic::transport::Channel>,
            Arc<Attested<Verified>>,
        ),
        TicketError,
    > {
        let uri = Endpoint::from_shared(format!("http://{endpoint}"))
            .map_err(|_| TicketError::Endpoint(endpoint.to_owned()))?
            .timeout(self.timeout);
        let bound = self
            .atls
            .bind_channel(uri)
            .await
            .map_err(TicketError::Connect)?;
        let service = bound.attested.ok_or(TicketError::ServiceNotAttested)?;
        let client =
            JoinServiceClient::new(bound.channel).max_decoding_message_size(MAX_TICKET_BYTES);
        Ok((client, service))
    }

    /// Asks `endpoint` for a join ticket; returns it unopened.
    pub async fn request_join_ticket(
        &self,
        endpoint: &str,
        request: IssueJoinTicketRequest,
    ) -> Result<RawTicket<IssueJoinTicketResponse>, TicketError> {
        let (mut client, service) = self.connect(endpoint).await?;
        let response = answer_within(self.timeout, client.issue_join_ticket(request))
            .await
            .map_err(TicketError::Refused)?;
        Ok(RawTicket { response, service })
    }

    /// Opens the secrets of a ticket with this TPM.
    pub async fn open(
        &self,
        sealed: Option<keel_proto::attestation::SealedSecret>,
    ) -> Result<OpenedSecrets, TicketError> {
        let sealed = sealed.ok_or(TicketError::NoSecrets)?;
        let tpm = self.tpm.clone();
        let payload = tokio::task::spawn_blocking(move || {
            let mut guard = tpm.lock().map_err(|_| TicketError::Tpm)?;
            credential::open(guard.tpm(), &sealed).map_err(|e| match e {
                credential::OpenError::Tpm => TicketError::Tpm,
                credential::OpenError::Sealed(e) => TicketError::Open(e),
            })
        })
        .await
        .map_err(|_| TicketError::Tpm)??;
        OpenedSecrets::decode(&payload)
    }

    /// Asks `endpoint` for a join ticket, opens it, checks the service
    /// against the ticket's cluster and every field. `kubelet_spki` is the
    /// DER SubjectPublicKeyInfo of the key the CSR was made for.
    pub async fn join_ticket(
        &self,
        endpoint: &str,
        request: IssueJoinTicketRequest,
        kubelet_spki: &[u8],
    ) -> Result<JoinTicket, TicketError> {
        let is_control_plane = request.is_control_plane;
        let asked_at = crate::registry::now();
        let raw = self.request_join_ticket(endpoint, request).await?;
        let mut response = raw.response;
        let secrets = self.open(response.secrets.take()).await?;
        let cluster_id = keys::cluster_id(&secrets.measurement_secret, &response.measurement_salt)
            .map_err(TicketError::ClusterId)?;
        check_service(raw.service.claims(), &cluster_id)?;
        parse_join_ticket(
            response,
            &secrets,
            cluster_id,
            kubelet_spki,
            is_control_plane,
            self.measurements_key.as_ref(),
            TicketSource {
                issuer: EkDigest::of_public(&raw.service.claims().ek),
                asked_at,
            },
        )
    }

    /// Asks `endpoint` for the rejoin ticket of the disk `disk_uuid`, opens
    /// it and checks the service against the ticket's cluster.
    pub async fn rejoin_ticket(
        &self,
        endpoint: &str,
        disk_uuid: &str,
    ) -> Result<RejoinTicket, TicketError> {
        let asked_at = crate::registry::now();
        let (mut client, service) = self.connect(endpoint).await?;
        let request = IssueRejoinTicketRequest {
            disk_uuid: disk_uuid.to_owned(),
        };
        let mut response = answer_within(self.timeout, client.issue_rejoin_ticket(request))
            .await
            .map_err(TicketError::Refused)?;
        let secrets = self.open(response.secrets.take()).await?;
        let cluster_id = keys::cluster_id(&secrets.measurement_secret, &response.measurement_salt)
            .map_err(TicketError::ClusterId)?;
        check_service(service.claims(), &cluster_id)?;
        RejoinTicket::parse(
            &secrets,
            response,
            cluster_id,
            self.is_control_plane,
            self.measurements_key.as_ref(),
            TicketSource {
                issuer: EkDigest::of_public(&service.claims().ek),
                asked_at,
            },
        )
    }
}
