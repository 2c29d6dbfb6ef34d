//! The TPM's keys: the endorsement key (found or created when a [`Tpm`]
//! opens), the attestation key created under it, the policy session that
//! authorises the EK, and ActivateCredential, which succeeds only on the TPM
//! that holds both keys. Why the attestation key is `noDA`: see the
//! [`tpm`](super) module docs.

use tss_esapi::abstraction::{ek, AsymmetricAlgorithmSelection, DefaultKey};
use tss_esapi::attributes::{ObjectAttributesBuilder, SessionAttributesBuilder};
use tss_esapi::constants::{CapabilityType, SessionType};
use tss_esapi::handles::{AuthHandle, KeyHandle, PersistentTpmHandle, TpmHandle};
use tss_esapi::interface_types::algorithm::{
    AsymmetricAlgorithm, HashingAlgorithm, PublicAlgorithm,
};
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::session_handles::{AuthSession, PolicySession};
use tss_esapi::structures::{
    CapabilityData, EccPoint, EccScheme, EncryptedSecret, HashScheme, IdObject,
    KeyDerivationFunctionScheme, Public, PublicBuilder, PublicEccParametersBuilder,
    SymmetricDefinition, SymmetricDefinitionObject,
};
use tss_esapi::traits::Marshall;
use tss_esapi::Context;
use zeroize::Zeroizing;

use super::{wrapper_error, Tpm, TpmError};

/// Persistent handle of the RSA-2048 endorsement key (TCG EK profile).
const EK_PERSISTENT_HANDLE: u32 = 0x8101_0001;

/// NV index of the RSA-2048 EK certificate (TCG EK profile).
const EK_CERTIFICATE_NV_INDEX: u32 = 0x01c0_0002;

/// The endorsement key's public part and certificate.
#[derive(Clone, Debug)]
pub struct Endorsement {
    /// Marshalled TPMT_PUBLIC of the RSA-2048 EK.
    pub public: Vec<u8>,
    /// DER EK certificate from NV, if the TPM has one.
    pub certificate: Option<Vec<u8>>,
}

/// The loaded attestation key and its marshalled public area.
pub(super) struct LoadedAk {
    pub(super) handle: KeyHandle,
    pub(super) public: Vec<u8>,
}

/// The endorsement key: the persistent one at 0x81010001 when present, else
/// one created from the default template. The flag says the key is
/// transient (created here, so the [`Tpm`] flushes it).
pub(super) fn open_endorsement_key(ctx: &mut Context) -> Result<(KeyHandle, bool), TpmError> {
    let persistent =
        PersistentTpmHandle::new(EK_PERSISTENT_HANDLE).map_err(TpmError::EndorsementKey)?;
    match ctx.execute_without_session(|c| c.tr_from_tpm_public(TpmHandle::Persistent(persistent))) {
        Ok(handle) => Ok((KeyHandle::from(handle), false)),
        Err(_) => {
            let handle = ek::create_ek_object(ctx, AsymmetricAlgorithm::Rsa, DefaultKey)
                .map_err(TpmError::EndorsementKey)?;
            Ok((handle, true))
        }
    }
}

impl Tpm {
    /// The attestation key's handle, loading the key first; `error` names
    /// the operation that needs it.
    pub(super) fn loaded_ak(
        &mut self,
        error: fn(tss_esapi::Error) -> TpmError,
    ) -> Result<KeyHandle, TpmError> {
        self.live()?;
        self.attestation_key()?;
        self.ak
            .as_ref()
            .map(|ak| ak.handle)
            .ok_or(error(wrapper_error(
                tss_esapi::WrapperErrorKind::InvalidHandleState,
            )))
    }

    /// The endorsement key's public area and, if stored, its certificate
    /// (read once; neither changes while the TPM is open).
    pub fn endorsement(&mut self) -> Result<Endorsement, TpmError> {
        self.live()?;
        if let Some(e) = &self.endorsement {
            return Ok(e.clone());
        }
        let public = self.ek_public()?;
        // A TPM without the certificate's index has none; any other failure
        // is an error, not a missing certificate: it is not cached, and the
        // next call reads again.
        let certificate = if self.ek_certificate_index_exists()? {
            let nv = ek::retrieve_ek_pubcert(
                &mut self.ctx,
                AsymmetricAlgorithmSelection::Rsa(RsaKeyBits::Rsa2048),
            )
            .map_err(TpmError::EkCertificate)?;
            // The certificate alone, without any padding of its index.
            Some(keel_verifier::ek::certificate_in(&nv).to_vec())
        } else {
            None
        };
        let endorsement = Endorsement {
            public,
            certificate,
        };
        self.endorsement = Some(endorsement.clone());
        Ok(endorsement)
    }

    /// The endorsement key's marshalled TPMT_PUBLIC (read once). What names
    /// this node (its EK digest) needs no certificate, so a certificate
    /// that cannot be read now does not stop it.
    pub fn ek_public(&mut self) -> Result<Vec<u8>, TpmError> {
        self.live()?;
        if let Some(public) = &self.ek_public {
            return Ok(public.clone());
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
        self.ek_public = Some(public.clone());
        Ok(public)
    }

    /// Whether the TPM defines the RSA-2048 EK certificate's NV index
    /// (TPM2_GetCapability over NV handles, starting at that index).
    fn ek_certificate_index_exists(&mut self) -> Result<bool, TpmError> {
        let (data, _) = self
            .ctx
            .execute_without_session(|c| {
                c.get_capability(CapabilityType::Handles, EK_CERTIFICATE_NV_INDEX, 1)
            })
            .map_err(TpmError::EkCertificate)?;
        let CapabilityData::Handles(list) = data else {
            return Err(TpmError::EkCertificate(wrapper_error(
                tss_esapi::WrapperErrorKind::WrongValueFromTpm,
            )));
        };
        Ok(list
            .into_inner()
            .into_iter()
            .any(|h| u32::from(h) == EK_CERTIFICATE_NV_INDEX))
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

    /// Opens a credential made with MakeCredential for this TPM's EK and the
    /// attestation key: succeeds only on the TPM that holds both.
    pub fn activate_credential(
        &mut self,
        credential_blob: &[u8],
        encrypted_seed: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, TpmError> {
        // Only the blobs and the command itself fail as ActivateCredential:
        // the keys and the policy session are the TPM's own part.
        let ak = self.loaded_ak(TpmError::AttestationKey)?;
        let blob =
            IdObject::try_from(credential_blob.to_vec()).map_err(TpmError::ActivateCredential)?;
        let seed = EncryptedSecret::try_from(encrypted_seed.to_vec())
            .map_err(TpmError::ActivateCredential)?;
        let policy = self
            .endorsement_policy_session()
            .map_err(TpmError::EndorsementKey)?;
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

    /// Whether the TPM is in failure mode (TPM2_GetTestResult names
    /// TPM_RC_FAILURE), or cannot be asked. A self-test still running or
    /// not yet run is no failure.
    pub fn failing(&mut self) -> bool {
        use tss_esapi::constants::response_code::Tss2ResponseCodeKind;
        if self.live().is_err() {
            return true;
        }
        match self.ctx.execute_without_session(|c| c.get_test_result()) {
            Ok((_, Ok(()))) => false,
            Ok((_, Err(tss_esapi::Error::Tss2Error(rc)))) => {
                rc.kind() == Some(Tss2ResponseCodeKind::Failure)
            }
            Ok((_, Err(_))) | Err(_) => true,
        }
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
                self.with_empty_password(|c| {
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
