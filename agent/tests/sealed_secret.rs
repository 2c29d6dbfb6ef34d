//! Secrets sealed in pure Rust (MakeCredential) open only in the TPM that
//! holds the endorsement key and the attestation key they were sealed to.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_agent::attestation::credential::{open, OpenError};
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::credential::{seal, CredentialError};
use keel_verifier::tpm_wire::Public;

fn open_tpm(swtpm: &Swtpm) -> Tpm {
    Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap()
}

#[test]
fn sealed_secret_opens_only_in_its_tpm() {
    let ca = EkCa::new().unwrap();
    let sw1 = Swtpm::start(&ca).unwrap();
    let sw2 = Swtpm::start(&ca).unwrap();
    let mut tpm1 = open_tpm(&sw1);
    let mut tpm2 = open_tpm(&sw2);

    let ek1 = Public::parse(&tpm1.endorsement().unwrap().public).unwrap();
    let ak1 = Public::parse(&tpm1.attestation_key().unwrap()).unwrap();
    let sealed = seal(&ek1, &ak1.name, b"the master secret").unwrap();
    assert_eq!(
        open(&mut tpm1, &sealed).unwrap().as_slice(),
        b"the master secret"
    );

    // Another TPM cannot activate it.
    assert!(matches!(
        open(&mut tpm2, &sealed),
        Err(OpenError::Sealed(CredentialError::Open))
    ));

    // Sealed to tpm1's EK but another AK's name (e.g. a software key that
    // signed a forged quote): tpm1 refuses to activate it.
    let ak2 = Public::parse(&tpm2.attestation_key().unwrap()).unwrap();
    let wrong_ak = seal(&ek1, &ak2.name, b"x").unwrap();
    assert!(matches!(
        open(&mut tpm1, &wrong_ak),
        Err(OpenError::Sealed(CredentialError::Open))
    ));

    // A changed ciphertext fails authentication.
    let mut tampered = sealed.clone();
    tampered.ciphertext[0] ^= 1;
    assert!(matches!(
        open(&mut tpm1, &tampered),
        Err(OpenError::Sealed(CredentialError::Open))
    ));

    // The TPM is still usable after refused activations (sessions flushed).
    for _ in 0..5 {
        assert!(open(&mut tpm2, &sealed).is_err());
    }
    assert_eq!(
        open(&mut tpm1, &sealed).unwrap().as_slice(),
        b"the master secret"
    );

    // A TPM that fails as a device (its connection gone) says so, rather
    // than calling the secret wrong: the caller may ask again instead of
    // blaming whoever sealed it.
    drop(sw1);
    assert!(matches!(open(&mut tpm1, &sealed), Err(OpenError::Tpm)));
}
