//! The one TPM wrapper: the only module that talks to tss-esapi.
//!
//! A [`Tpm`] owns an ESAPI context and the transient objects it creates (the
//! endorsement key when it is not persistent, and the attestation key), and
//! flushes them on drop. Every session it starts is flushed before the call
//! returns, so it works on a TPM without a resource manager (the swtpm
//! socket) as well as on `/dev/tpmrm0`. Only the SHA-256 PCR bank is used.
//!
//! Dictionary-attack protection: the attestation key is created with
//! `noDA`. Its authorisation value is empty and what it may do is bounded by
//! its `restricted` attribute, so DA protection would guard nothing; with it,
//! every unorderly shutdown after the key was used (a killed VM, a host
//! crash) counted as a failed authorisation at the next boot, and a few in a
//! row locked the TPM out. The endorsement key keeps the TCG template (its
//! public area must match its certificate); it is only ever authorised by
//! its policy (PolicySecret of the endorsement hierarchy, which is exempt),
//! never by an auth value, so it does not touch the DA counter either.
//! [`Tpm::shutdown`] sends TPM2_Shutdown(CLEAR) when the agent stops cleanly.

use std::collections::BTreeMap;
use std::str::FromStr;

use keel_verifier::measurement::Digest32;
use tss_esapi::abstraction::{ek, AsymmetricAlgorithmSelection, DefaultKey};
use tss_esapi::attributes::{ObjectAttributesBuilder, SessionAttributesBuilder};
use tss_esapi::constants::{CapabilityType, PropertyTag, SessionType, StartupType};
use tss_esapi::handles::{
    AuthHandle, KeyHandle, ObjectHandle, PcrHandle, PersistentTpmHandle, SessionHandle, TpmHandle,
};
use tss_esapi::interface_types::algorithm::{
    AsymmetricAlgorithm, HashingAlgorithm, PublicAlgorithm,
};
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::session_handles::{AuthSession, PolicySession};
use tss_esapi::structures::{
    CapabilityData, Data, Digest, DigestValues, EccPoint, EccScheme, EncryptedSecret, HashScheme,
    IdObject, KeyDerivationFunctionScheme, PcrSelectionList, PcrSlot, Public, PublicBuilder,
    PublicEccParametersBuilder, SignatureScheme, SymmetricDefinition, SymmetricDefinitionObject,
};
use tss_esapi::tcti_ldr::TctiNameConf;
use tss_esapi::traits::Marshall;
use tss_esapi::Context;
use zeroize::Zeroizing;

/// Persistent handle of the RSA-2048 endorsement key (TCG EK profile).
const EK_PERSISTENT_HANDLE: u32 = 0x8101_0001;
/// Number of PCRs in a bank.
pub const PCR_COUNT: u32 = 24;
/// The TPM returns at most 8 digests per PCR_Read.
const PCRS_PER_READ: usize = 8;
/// TPM_PT_PERMANENT, the first variable TPM property.
const PT_VARIABLE_FIRST: u32 = 0x200;
/// TPM_PT_PERMANENT up to TPM_PT_LOCKOUT_RECOVERY.
const PT_VARIABLE_COUNT: u32 = 0x12;
/// TPMA_PERMANENT.inLockout.
const PERMANENT_IN_LOCKOUT: u32 = 1 << 9;
/// TPMA_STARTUP_CLEAR.orderly.
const STARTUP_CLEAR_ORDERLY: u32 = 1 << 31;

/// A TPM operation that failed; each variant names the operation and keeps
/// the TSS error as its source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TpmError {
    /// The TCTI string could not be parsed.
    #[error("invalid TCTI {tcti:?}")]
    Tcti {
        /// The TCTI string.
        tcti: String,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
    /// The TPM could not be opened.
    #[error("cannot open TPM through {tcti:?}")]
    Open {
        /// The TCTI string.
        tcti: String,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
    /// A PCR index outside 0..=23.
    #[error("PCR {0} does not exist (0 to 23)")]
    NoSuchPcr(u32),
    /// Reading PCRs failed.
    #[error("reading PCRs failed")]
    PcrRead(#[source] tss_esapi::Error),
    /// Extending a PCR failed.
    #[error("extending PCR {pcr} failed")]
    PcrExtend {
        /// The PCR.
        pcr: u32,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
    /// Loading or creating the endorsement key failed.
    #[error("endorsement key unavailable")]
    EndorsementKey(#[source] tss_esapi::Error),
    /// Creating or loading the attestation key failed.
    #[error("creating the attestation key failed")]
    AttestationKey(#[source] tss_esapi::Error),
    /// The quote command failed.
    #[error("quote failed")]
    Quote(#[source] tss_esapi::Error),
    /// ActivateCredential failed: the credential was not made for this TPM's EK and AK.
    #[error("credential activation failed (not sealed to this TPM)")]
    ActivateCredential(#[source] tss_esapi::Error),
    /// Reading the TPM's properties (TPM2_GetCapability) failed.
    #[error("reading TPM properties failed")]
    Properties(#[source] tss_esapi::Error),
    /// TPM2_Shutdown failed.
    #[error("TPM2_Shutdown failed")]
    Shutdown(#[source] tss_esapi::Error),
    /// The TPM was shut down with [`Tpm::shutdown`]; it takes no more commands
    /// through this handle.
    #[error("the TPM was shut down")]
    ShutDown,
    /// A structure could not be marshalled or converted.
    #[error("marshalling {what} failed")]
    Marshal {
        /// What was marshalled.
        what: &'static str,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
}

/// Where the TPM is: a device node or a TCTI string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TctiSpec(String);

impl TctiSpec {
    /// The kernel's resource-managed TPM device.
    pub fn default_device() -> Self {
        Self("device:/dev/tpmrm0".into())
    }

    /// A swtpm listening on `127.0.0.1:port` (control channel on `port + 1`).
    pub fn swtpm(port: u16) -> Self {
        Self(format!("swtpm:host=127.0.0.1,port={port}"))
    }

    /// The TCTI string as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for TctiSpec {
    type Err = std::convert::Infallible;

    /// A `device:` / `swtpm:` TCTI string, or a bare device path.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.starts_with('/') {
            Ok(Self(format!("device:{s}")))
        } else {
            Ok(Self(s.to_owned()))
        }
    }
}

/// The endorsement key's public part and certificate.
#[derive(Clone, Debug)]
pub struct Endorsement {
    /// Marshalled TPMT_PUBLIC of the RSA-2048 EK.
    pub public: Vec<u8>,
    /// DER EK certificate from NV, if the TPM has one.
    pub certificate: Option<Vec<u8>>,
}

/// A quote and its signature, both marshalled.
#[derive(Clone, Debug)]
pub struct Quote {
    /// TPMS_ATTEST.
    pub attest: Vec<u8>,
    /// TPMT_SIGNATURE.
    pub signature: Vec<u8>,
}

/// The TPM's dictionary-attack state, and how its previous cycle ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockoutState {
    /// Failed authorisations counted so far (TPM_PT_LOCKOUT_COUNTER).
    pub failed_tries: u32,
    /// Failures at which the TPM locks out (TPM_PT_MAX_AUTH_FAIL).
    pub max_tries: u32,
    /// Seconds after which one counted failure is forgotten
    /// (TPM_PT_LOCKOUT_INTERVAL).
    pub recovery_seconds: u32,
    /// Seconds before lockoutAuth may be tried again after it failed
    /// (TPM_PT_LOCKOUT_RECOVERY).
    pub lockout_recovery_seconds: u32,
    /// DA-protected objects are refused (TPMA_PERMANENT.inLockout).
    pub in_lockout: bool,
    /// This cycle's TPM2_Startup followed a TPM2_Shutdown
    /// (TPMA_STARTUP_CLEAR.orderly); false after a crash or a killed VM.
    pub orderly_startup: bool,
}

/// An open TPM with its endorsement and attestation keys.
pub struct Tpm {
    ctx: Context,
    ek: KeyHandle,
    ek_transient: bool,
    endorsement: Option<Endorsement>,
    ak: Option<LoadedAk>,
    shut_down: bool,
}

struct LoadedAk {
    handle: KeyHandle,
    public: Vec<u8>,
}

impl Tpm {
    /// Opens the TPM and its endorsement key: the persistent one at
    /// 0x81010001 when present, else one created from the default template.
    pub fn open(tcti: &TctiSpec) -> Result<Self, TpmError> {
        let conf = TctiNameConf::from_str(tcti.as_str()).map_err(|source| TpmError::Tcti {
            tcti: tcti.as_str().into(),
            source,
        })?;
        let mut ctx = Context::new(conf).map_err(|source| TpmError::Open {
            tcti: tcti.as_str().into(),
            source,
        })?;
        let persistent =
            PersistentTpmHandle::new(EK_PERSISTENT_HANDLE).map_err(TpmError::EndorsementKey)?;
        let (ek, ek_transient) = match ctx
            .execute_without_session(|c| c.tr_from_tpm_public(TpmHandle::Persistent(persistent)))
        {
            Ok(handle) => (KeyHandle::from(handle), false),
            Err(_) => {
                let handle = ek::create_ek_object(&mut ctx, AsymmetricAlgorithm::Rsa, DefaultKey)
                    .map_err(TpmError::EndorsementKey)?;
                (handle, true)
            }
        };
        Ok(Self {
            ctx,
            ek,
            ek_transient,
            endorsement: None,
            ak: None,
            shut_down: false,
        })
    }

    /// Fails once [`Tpm::shutdown`] ran.
    fn live(&self) -> Result<(), TpmError> {
        if self.shut_down {
            Err(TpmError::ShutDown)
        } else {
            Ok(())
        }
    }

    /// Reads SHA-256 PCR values.
    pub fn pcr_read(&mut self, pcrs: &[u32]) -> Result<BTreeMap<u32, Digest32>, TpmError> {
        self.live()?;
        let mut out = BTreeMap::new();
        let mut wanted: Vec<u32> = pcrs.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        for chunk in wanted.chunks(PCRS_PER_READ) {
            let slots = chunk
                .iter()
                .map(|&p| pcr_slot(p))
                .collect::<Result<Vec<_>, _>>()?;
            let selection = PcrSelectionList::builder()
                .with_selection(HashingAlgorithm::Sha256, &slots)
                .build()
                .map_err(TpmError::PcrRead)?;
            let (_, _, digests) = self
                .ctx
                .execute_without_session(|c| c.pcr_read(selection))
                .map_err(TpmError::PcrRead)?;
            // The TPM returns the selected PCRs in ascending order.
            for (&pcr, digest) in chunk.iter().zip(digests.value()) {
                let mut value = [0u8; 32];
                if digest.len() != 32 {
                    return Err(TpmError::PcrRead(wrapper_error(
                        tss_esapi::WrapperErrorKind::WrongValueFromTpm,
                    )));
                }
                value.copy_from_slice(digest.value());
                out.insert(pcr, value);
            }
        }
        Ok(out)
    }

    /// Reads all 24 SHA-256 PCRs.
    pub fn pcr_read_all(&mut self) -> Result<BTreeMap<u32, Digest32>, TpmError> {
        let all: Vec<u32> = (0..PCR_COUNT).collect();
        self.pcr_read(&all)
    }

    /// Extends `pcr` of the SHA-256 bank with `digest`.
    pub fn pcr_extend(&mut self, pcr: u32, digest: &Digest32) -> Result<(), TpmError> {
        self.live()?;
        let handle = pcr_handle(pcr)?;
        let err = |source| TpmError::PcrExtend { pcr, source };
        let mut values = DigestValues::new();
        values.set(
            HashingAlgorithm::Sha256,
            Digest::try_from(digest.to_vec()).map_err(err)?,
        );
        self.ctx
            .execute_with_nullauth_session(|c| c.pcr_extend(handle, values))
            .map_err(err)
    }

    /// The endorsement key's public area and, if stored, its certificate
    /// (read once; neither changes while the TPM is open).
    pub fn endorsement(&mut self) -> Result<Endorsement, TpmError> {
        self.live()?;
        if let Some(e) = &self.endorsement {
            return Ok(e.clone());
        }
        let ek = self.ek;
        let (public, _, _) = self
            .ctx
            .execute_without_session(|c| c.read_public(ek))
            .map_err(TpmError::EndorsementKey)?;
        let public = public.marshall().map_err(|source| TpmError::Marshal {
            what: "EK public",
            source,
        })?;
        let certificate = ek::retrieve_ek_pubcert(
            &mut self.ctx,
            AsymmetricAlgorithmSelection::Rsa(RsaKeyBits::Rsa2048),
        )
        .ok();
        let endorsement = Endorsement {
            public,
            certificate,
        };
        self.endorsement = Some(endorsement.clone());
        Ok(endorsement)
    }

    /// Creates (once per [`Tpm`]) the attestation key under the EK, a
    /// restricted ECC P-256 ECDSA-SHA256 signing key with `noDA`, and returns
    /// its marshalled TPMT_PUBLIC.
    pub fn attestation_key(&mut self) -> Result<Vec<u8>, TpmError> {
        self.live()?;
        if let Some(ak) = &self.ak {
            return Ok(ak.public.clone());
        }
        let template = ak_template().map_err(TpmError::AttestationKey)?;
        let ek = self.ek;
        // The EK's policy is PolicySecret(endorsement): each command that
        // uses it as the parent needs a freshly satisfied policy session.
        let created = self
            .with_endorsement_policy(|c| c.create(ek, template, None, None, None, None))
            .map_err(TpmError::AttestationKey)?;
        let public = created
            .out_public
            .marshall()
            .map_err(|source| TpmError::Marshal {
                what: "AK public",
                source,
            })?;
        let handle = self
            .with_endorsement_policy(|c| c.load(ek, created.out_private, created.out_public))
            .map_err(TpmError::AttestationKey)?;
        self.ak = Some(LoadedAk {
            handle,
            public: public.clone(),
        });
        Ok(public)
    }

    /// Quotes the SHA-256 `pcrs` with the attestation key over `qualifying_data`.
    pub fn quote(&mut self, qualifying_data: &Digest32, pcrs: &[u32]) -> Result<Quote, TpmError> {
        self.live()?;
        self.attestation_key()?;
        let ak = self
            .ak
            .as_ref()
            .map(|ak| ak.handle)
            .ok_or(TpmError::Quote(wrapper_error(
                tss_esapi::WrapperErrorKind::InvalidHandleState,
            )))?;
        let slots = pcrs
            .iter()
            .map(|&p| pcr_slot(p))
            .collect::<Result<Vec<_>, _>>()?;
        let selection = PcrSelectionList::builder()
            .with_selection(HashingAlgorithm::Sha256, &slots)
            .build()
            .map_err(TpmError::Quote)?;
        let data = Data::try_from(qualifying_data.to_vec()).map_err(TpmError::Quote)?;
        let (attest, signature) = self
            .ctx
            .execute_with_nullauth_session(|c| c.quote(ak, data, SignatureScheme::Null, selection))
            .map_err(TpmError::Quote)?;
        Ok(Quote {
            attest: attest.marshall().map_err(|source| TpmError::Marshal {
                what: "quote",
                source,
            })?,
            signature: signature.marshall().map_err(|source| TpmError::Marshal {
                what: "signature",
                source,
            })?,
        })
    }

    /// Opens a credential made with MakeCredential for this TPM's EK and the
    /// attestation key: succeeds only on the TPM that holds both.
    pub fn activate_credential(
        &mut self,
        credential_blob: &[u8],
        encrypted_seed: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, TpmError> {
        self.live()?;
        self.attestation_key()?;
        let ak = self
            .ak
            .as_ref()
            .map(|ak| ak.handle)
            .ok_or(TpmError::ActivateCredential(wrapper_error(
                tss_esapi::WrapperErrorKind::InvalidHandleState,
            )))?;
        let blob =
            IdObject::try_from(credential_blob.to_vec()).map_err(TpmError::ActivateCredential)?;
        let seed = EncryptedSecret::try_from(encrypted_seed.to_vec())
            .map_err(TpmError::ActivateCredential)?;
        let policy = self
            .endorsement_policy_session()
            .map_err(TpmError::ActivateCredential)?;
        let ek = self.ek;
        let result = self
            .ctx
            .execute_with_sessions((Some(AuthSession::Password), Some(policy), None), |c| {
                c.activate_credential(ak, ek, blob, seed)
            });
        self.flush_session(policy);
        let digest = result.map_err(TpmError::ActivateCredential)?;
        Ok(Zeroizing::new(digest.value().to_vec()))
    }

    /// A policy session satisfying the EK's policy: PolicySecret(endorsement).
    fn endorsement_policy_session(&mut self) -> Result<AuthSession, tss_esapi::Error> {
        let session = self
            .ctx
            .start_auth_session(
                None,
                None,
                None,
                SessionType::Policy,
                SymmetricDefinition::AES_128_CFB,
                HashingAlgorithm::Sha256,
            )?
            .ok_or_else(|| wrapper_error(tss_esapi::WrapperErrorKind::WrongValueFromTpm))?;
        let (attributes, mask) = SessionAttributesBuilder::new()
            .with_decrypt(true)
            .with_encrypt(true)
            .build();
        let outcome = self
            .ctx
            .tr_sess_set_attributes(session, attributes, mask)
            .and_then(|()| {
                let policy = PolicySession::try_from(session)?;
                self.ctx.execute_with_nullauth_session(|c| {
                    c.policy_secret(
                        policy,
                        AuthHandle::Endorsement,
                        Default::default(),
                        Default::default(),
                        Default::default(),
                        None,
                    )
                })
            });
        match outcome {
            Ok(_) => Ok(session),
            Err(e) => {
                self.flush_session(session);
                Err(e)
            }
        }
    }

    /// The TPM's dictionary-attack counters and whether its previous cycle
    /// ended with TPM2_Shutdown.
    pub fn lockout_state(&mut self) -> Result<LockoutState, TpmError> {
        self.live()?;
        let (data, _) = self
            .ctx
            .execute_without_session(|c| {
                c.get_capability(
                    CapabilityType::TpmProperties,
                    PT_VARIABLE_FIRST,
                    PT_VARIABLE_COUNT,
                )
            })
            .map_err(TpmError::Properties)?;
        let CapabilityData::TpmProperties(list) = data else {
            return Err(TpmError::Properties(wrapper_error(
                tss_esapi::WrapperErrorKind::WrongValueFromTpm,
            )));
        };
        let get = |tag: PropertyTag| {
            list.find(tag).map(|p| p.value()).ok_or_else(|| {
                TpmError::Properties(wrapper_error(
                    tss_esapi::WrapperErrorKind::WrongValueFromTpm,
                ))
            })
        };
        Ok(LockoutState {
            failed_tries: get(PropertyTag::LockoutCounter)?,
            max_tries: get(PropertyTag::MaxAuthFail)?,
            recovery_seconds: get(PropertyTag::LockoutInterval)?,
            lockout_recovery_seconds: get(PropertyTag::LockoutRecovery)?,
            in_lockout: get(PropertyTag::Permanent)? & PERMANENT_IN_LOCKOUT != 0,
            orderly_startup: get(PropertyTag::StartupClear)? & STARTUP_CLEAR_ORDERLY != 0,
        })
    }

    /// Runs `f` with a satisfied EK policy session as the only
    /// authorisation (for commands whose one authorised handle is the EK),
    /// and flushes the session whatever the outcome.
    fn with_endorsement_policy<T>(
        &mut self,
        f: impl FnOnce(&mut Context) -> Result<T, tss_esapi::Error>,
    ) -> Result<T, tss_esapi::Error> {
        let policy = self.endorsement_policy_session()?;
        let result = self
            .ctx
            .execute_with_sessions((Some(policy), None, None), f);
        self.flush_session(policy);
        result
    }

    /// Flushes the transient objects and sends TPM2_Shutdown(CLEAR): the
    /// next TPM2_Startup then finds an orderly shutdown. For the agent's
    /// clean exit only; afterwards every call on this handle fails with
    /// [`TpmError::ShutDown`]. Dropping a [`Tpm`] flushes its objects but
    /// does not shut the TPM down (other users, such as a diagnostic command
    /// next to the running agent, must not end the TPM's cycle).
    pub fn shutdown(&mut self) -> Result<(), TpmError> {
        self.live()?;
        self.flush_objects();
        self.shut_down = true;
        self.ctx
            .execute_without_session(|c| c.shutdown(StartupType::Clear))
            .map_err(TpmError::Shutdown)
    }

    fn flush_objects(&mut self) {
        if let Some(ak) = self.ak.take() {
            if let Err(e) = self.ctx.flush_context(ak.handle.into()) {
                tracing::warn!(error = %e, "flushing the attestation key failed");
            }
        }
        if self.ek_transient {
            self.ek_transient = false;
            if let Err(e) = self.ctx.flush_context(self.ek.into()) {
                tracing::warn!(error = %e, "flushing the endorsement key failed");
            }
        }
    }

    fn flush_session(&mut self, session: AuthSession) {
        let handle = SessionHandle::from(session);
        if let Err(e) = self.ctx.flush_context(ObjectHandle::from(handle)) {
            tracing::warn!(error = %e, "flushing a TPM session failed");
        }
    }
}

impl Drop for Tpm {
    fn drop(&mut self) {
        self.flush_objects();
    }
}

/// The attestation key's template: a restricted ECC NIST P-256 signing key
/// with the ECDSA-SHA256 scheme, fixedTPM, fixedParent,
/// sensitiveDataOrigin, userWithAuth (empty auth value) and noDA.
fn ak_template() -> Result<Public, tss_esapi::Error> {
    let attributes = ObjectAttributesBuilder::new()
        .with_fixed_tpm(true)
        .with_fixed_parent(true)
        .with_sensitive_data_origin(true)
        .with_user_with_auth(true)
        .with_restricted(true)
        .with_sign_encrypt(true)
        .with_decrypt(false)
        .with_no_da(true)
        .build()?;
    let parameters = PublicEccParametersBuilder::new()
        .with_symmetric(SymmetricDefinitionObject::Null)
        .with_ecc_scheme(EccScheme::EcDsa(HashScheme::new(HashingAlgorithm::Sha256)))
        .with_curve(EccCurve::NistP256)
        .with_key_derivation_function_scheme(KeyDerivationFunctionScheme::Null)
        .with_is_signing_key(true)
        .with_is_decryption_key(false)
        .with_restricted(true)
        .build()?;
    PublicBuilder::new()
        .with_public_algorithm(PublicAlgorithm::Ecc)
        .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
        .with_object_attributes(attributes)
        .with_ecc_parameters(parameters)
        .with_ecc_unique_identifier(EccPoint::default())
        .build()
}

fn wrapper_error(kind: tss_esapi::WrapperErrorKind) -> tss_esapi::Error {
    tss_esapi::Error::WrapperError(kind)
}

fn pcr_slot(pcr: u32) -> Result<PcrSlot, TpmError> {
    if pcr >= PCR_COUNT {
        return Err(TpmError::NoSuchPcr(pcr));
    }
    PcrSlot::try_from(1u32 << pcr).map_err(|_| TpmError::NoSuchPcr(pcr))
}

fn pcr_handle(pcr: u32) -> Result<PcrHandle, TpmError> {
    const HANDLES: [PcrHandle; PCR_COUNT as usize] = [
        PcrHandle::Pcr0,
        PcrHandle::Pcr1,
        PcrHandle::Pcr2,
        PcrHandle::Pcr3,
        PcrHandle::Pcr4,
        PcrHandle::Pcr5,
        PcrHandle::Pcr6,
        PcrHandle::Pcr7,
        PcrHandle::Pcr8,
        PcrHandle::Pcr9,
        PcrHandle::Pcr10,
        PcrHandle::Pcr11,
        PcrHandle::Pcr12,
        PcrHandle::Pcr13,
        PcrHandle::Pcr14,
        PcrHandle::Pcr15,
        PcrHandle::Pcr16,
        PcrHandle::Pcr17,
        PcrHandle::Pcr18,
        PcrHandle::Pcr19,
        PcrHandle::Pcr20,
        PcrHandle::Pcr21,
        PcrHandle::Pcr22,
        PcrHandle::Pcr23,
    ];
    HANDLES
        .get(pcr as usize)
        .copied()
        .ok_or(TpmError::NoSuchPcr(pcr))
}
