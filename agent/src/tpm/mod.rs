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
//!
//! * this file: [`TctiSpec`] (where the TPM is) and [`Tpm`] itself:
//!   opening it, the objects it owns, [`Tpm::shutdown`];
//! * [`keys`]: the endorsement and attestation keys, the EK's policy
//!   session, ActivateCredential;
//! * [`pcr`]: reading and extending PCRs;
//! * [`quote`]: quotes with the attestation key;
//! * [`lockout`]: the dictionary-attack state;
//! * [`nv`]: reading NV indices (Azure's HCL report);
//! * [`error`] holds [`TpmError`].

pub mod error;
pub mod keys;
pub mod lockout;
pub mod nv;
pub mod pcr;
pub mod quote;

use std::str::FromStr;

use tss_esapi::constants::StartupType;
use tss_esapi::handles::{KeyHandle, ObjectHandle, SessionHandle};
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::tcti_ldr::{DeviceConfig, NetworkTPMConfig, TctiNameConf};
use tss_esapi::Context;

pub use error::TpmError;
pub use keys::Endorsement;
pub use lockout::LockoutState;
pub use pcr::PCR_COUNT;
pub use quote::Quote;

use keys::LoadedAk;

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

    /// The device node it names, if it names one.
    fn device_path(&self) -> Option<&str> {
        self.0.strip_prefix("device:")
    }

    /// The TSS's form of it. A device path is taken as it is; a swtpm's
    /// settings go through the TSS's parser for them alone, other TCTIs
    /// through its parser for names too. Both compile regular expressions
    /// on every call (the name parser up to four more), which a node's device
    /// path does not need.
    fn name_conf(&self) -> Result<TctiNameConf, tss_esapi::Error> {
        if let Some(path) = self.device_path() {
            return Ok(TctiNameConf::Device(DeviceConfig::from_str(path)?));
        }
        match self.0.strip_prefix("swtpm:") {
            Some(settings) => Ok(TctiNameConf::Swtpm(NetworkTPMConfig::from_str(settings)?)),
            None => TctiNameConf::from_str(&self.0),
        }
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

/// An open TPM with its endorsement and attestation keys.
pub struct Tpm {
    ctx: Context,
    ek: KeyHandle,
    ek_transient: bool,
    ek_public: Option<Vec<u8>>,
    endorsement: Option<Endorsement>,
    ak: Option<LoadedAk>,
    shut_down: bool,
}

impl Tpm {
    /// Opens the TPM and its endorsement key: the persistent one at
    /// 0x81010001 when present, else one created from the default template.
    pub fn open(tcti: &TctiSpec) -> Result<Self, TpmError> {
        let conf = tcti.name_conf().map_err(|source| TpmError::Tcti {
            tcti: tcti.as_str().into(),
            source,
        })?;
        // The TSS's own error for a missing node is a bare I/O failure.
        if let Some(path) = tcti.device_path() {
            // An empty path is the TSS's default device.
            let path = if path.is_empty() { "/dev/tpm0" } else { path };
            if !std::path::Path::new(path).exists() {
                return Err(TpmError::NoDevice { path: path.into() });
            }
        }
        // tpm2-tss opens its connections close-on-exec (scripts/build-tss.sh
        // patches it so): no program the agent runs inherits one.
        let mut ctx = Context::new(conf).map_err(|source| TpmError::Open {
            tcti: tcti.as_str().into(),
            source,
        })?;
        let (ek, ek_transient) = keys::open_endorsement_key(&mut ctx)?;
        Ok(Self {
            ctx,
            ek,
            ek_transient,
            ek_public: None,
            endorsement: None,
            ak: None,
            shut_down: false,
        })
    }

    /// Runs `f` with the empty password as the authorisation of its one
    /// authorised handle. For handles whose auth value is empty (the AK, the
    /// PCRs, the endorsement hierarchy): an HMAC session keyed by an empty,
    /// unsalted secret is something anyone on the TPM's bus can compute too,
    /// so it protects nothing more, and it costs two extra commands
    /// (TPM2_StartAuthSession and TPM2_FlushContext) per call. A quote's
    /// integrity rests on its signature, an extend's on the quote that
    /// covers the PCR, a residency proof on the EK's encryption.
    fn with_empty_password<T>(
        &mut self,
        f: impl FnOnce(&mut Context) -> tss_esapi::Result<T>,
    ) -> tss_esapi::Result<T> {
        self.ctx
            .execute_with_session(Some(AuthSession::Password), f)
    }

    /// Fails once [`Tpm::shutdown`] ran.
    fn live(&self) -> Result<(), TpmError> {
        if self.shut_down {
            Err(TpmError::ShutDown)
        } else {
            Ok(())
        }
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

fn wrapper_error(kind: tss_esapi::WrapperErrorKind) -> tss_esapi::Error {
    tss_esapi::Error::WrapperError(kind)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Each TCTI string becomes the config the TSS's own parser would make
    /// of it (the device and swtpm forms skip parts of that parser), and
    /// reaches the TSS as the string given here: the settings parsed out
    /// and written back, defaults filled in.
    #[test]
    fn tcti_specs_become_the_tss_configs_and_strings_its_parser_would_make() {
        let cases = [
            ("device:/dev/tpmrm0", "device:/dev/tpmrm0"),
            ("/dev/tpm0", "device:/dev/tpm0"),
            ("device:", "device:/dev/tpm0"),
            (
                "swtpm:host=127.0.0.1,port=2331",
                "swtpm:host=127.0.0.1,port=2331",
            ),
            ("swtpm:port=2341,host=::1", "swtpm:host=::1,port=2341"),
            ("swtpm:port=2341", "swtpm:host=localhost,port=2341"),
            ("swtpm:", "swtpm:host=localhost,port=2321"),
            (
                "mssim:host=localhost,port=2321",
                "mssim:host=localhost,port=2321",
            ),
            (
                "mssim:host=tpm.local,port=2351",
                "mssim:host=tpm.local,port=2351",
            ),
            (
                "tabrmd:bus_type=session,bus_name=com.example.Tabrmd",
                "tabrmd:bus_name=com.example.Tabrmd,bus_type=session",
            ),
        ];
        for (spec, tss) in cases {
            let spec = TctiSpec::from_str(spec).unwrap();
            let conf = spec.name_conf().unwrap();
            assert_eq!(
                conf,
                TctiNameConf::from_str(spec.as_str()).unwrap(),
                "{spec:?}"
            );
            assert_eq!(std::ffi::CString::try_from(conf).unwrap().to_str(), Ok(tss));
        }
        assert_eq!(
            TctiSpec::swtpm(2321).name_conf().unwrap(),
            TctiNameConf::from_str("swtpm:host=127.0.0.1,port=2321").unwrap()
        );
        for bad in [
            "swtpm:port=23a1",
            "swtpm:port=65536",
            "swtpm:host=no host",
            "tabrmd:bus_name=tabrmd",
            "tabrmd:bus_type=bus",
            "tpm0",
            "nonsense",
        ] {
            let spec = TctiSpec::from_str(bad).unwrap();
            assert!(spec.name_conf().is_err(), "{bad}");
        }
    }
}
