//! The TPM's dictionary-attack state ([`LockoutState`]), read from its
//! variable properties.

use tss_esapi::constants::{CapabilityType, PropertyTag};
use tss_esapi::structures::CapabilityData;

use super::{wrapper_error, Tpm, TpmError};

/// TPM_PT_PERMANENT, the first variable TPM property.
const PT_VARIABLE_FIRST: u32 = 0x200;
/// TPM_PT_PERMANENT up to TPM_PT_LOCKOUT_RECOVERY.
const PT_VARIABLE_COUNT: u32 = 0x12;
/// TPMA_PERMANENT.inLockout.
const PERMANENT_IN_LOCKOUT: u32 = 1 << 9;
/// TPMA_STARTUP_CLEAR.orderly.
const STARTUP_CLEAR_ORDERLY: u32 = 1 << 31;

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

impl Tpm {
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
}
