//! The TPM wrapper against a real swtpm, and pure-Rust quote verification.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use keel_agent::tpm::{TctiSpec, Tpm};
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::batch::leaf;
use keel_verifier::measurement::{extend, Digest32};
use keel_verifier::quote::{qualifying_data, verify_quote, QuoteError};
use keel_verifier::tpm_wire::{attr, Public};

fn tpm() -> (EkCa, Swtpm, Tpm) {
    let ca = EkCa::new().unwrap();
    let swtpm = Swtpm::start(&ca).unwrap();
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    (ca, swtpm, tpm)
}

#[test]
fn reads_and_extends_pcrs() {
    let (_ca, _sw, mut tpm) = tpm();
    let all = tpm.pcr_read_all().unwrap();
    assert_eq!(all.len(), 24);
    assert_eq!(all[&12], [0; 32]);
    let digest = [0xab; 32];
    tpm.pcr_extend(12, &digest).unwrap();
    let after = tpm.pcr_read(&[12]).unwrap();
    assert_eq!(after[&12], extend(&[0; 32], &digest));
    assert!(tpm.pcr_read(&[24]).is_err());
}

#[test]
fn endorsement_key_has_certificate_from_the_ca() {
    let (_ca, _sw, mut tpm) = tpm();
    let ek = tpm.endorsement().unwrap();
    let public = Public::parse(&ek.public).unwrap();
    assert!(public.attributes & attr::RESTRICTED != 0);
    assert!(public.attributes & attr::DECRYPT != 0);
    assert!(ek.certificate.is_some_and(|c| !c.is_empty()));
}

#[test]
fn a_tpm_without_the_certificate_index_has_no_certificate() {
    let sw = Swtpm::start_bare().unwrap();
    let mut tpm = Tpm::open(&sw.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let ek = tpm.endorsement().unwrap();
    assert!(!ek.public.is_empty());
    assert!(ek.certificate.is_none());
}

#[test]
fn a_certificate_index_that_cannot_be_read_is_an_error_not_a_missing_certificate() {
    // The index exists, but reading it needs a password the agent does not
    // give: the read fails as a busy or faulty TPM's would. Before, any such
    // failure became "no certificate" for the life of the process, and every
    // document after it was refused.
    let sw = Swtpm::start_bare().unwrap();
    sw.tool(&[
        "tpm2_nvdefine",
        "0x1c00002",
        "-C",
        "o",
        "-s",
        "16",
        "-a",
        "authread|authwrite",
        "-p",
        "index-password",
    ])
    .unwrap();
    let mut tpm = Tpm::open(&sw.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let err = tpm.endorsement().unwrap_err();
    assert!(
        matches!(err, keel_agent::tpm::TpmError::EkCertificate(_)),
        "{err:?}"
    );
    // Not cached: the next call reads again (and fails again).
    assert!(tpm.endorsement().is_err());
    // What names the node (its EK's public area, its digest) needs no
    // certificate and is still there.
    assert!(!tpm.ek_public().unwrap().is_empty());
    assert!(keel_agent::attestation::own_ek_digest(&mut tpm).is_ok());
}

struct Quoted {
    ak: Vec<u8>,
    attest: Vec<u8>,
    signature: Vec<u8>,
    values: BTreeMap<u32, Digest32>,
    qualifying: Digest32,
}

fn quote(tpm: &mut Tpm, nonce: &[u8]) -> Quoted {
    tpm.pcr_extend(12, &[1; 32]).unwrap();
    let pcrs = [4, 9, 11, 12, 13, 15];
    let qualifying = qualifying_data(&leaf(nonce, b"user data").unwrap());
    let q = tpm.quote(&qualifying, &pcrs).unwrap();
    Quoted {
        ak: tpm.attestation_key().unwrap(),
        attest: q.attest,
        signature: q.signature,
        values: tpm.pcr_read(&pcrs).unwrap(),
        qualifying,
    }
}

fn verify(q: &Quoted) -> Result<(), QuoteError> {
    verify_quote(
        &Public::parse(&q.ak).unwrap(),
        &q.attest,
        &q.signature,
        &q.qualifying,
        &q.values,
    )
    .map(|_| ())
}

#[test]
fn quote_verifies_and_each_tampering_fails_distinctly() {
    let (_ca, _sw, mut tpm) = tpm();
    let good = quote(&mut tpm, b"nonce-1");
    verify(&good).unwrap();

    let mut other_nonce = quote(&mut tpm, b"nonce-1");
    other_nonce.qualifying = qualifying_data(&leaf(b"nonce-2", b"user data").unwrap());
    assert_eq!(verify(&other_nonce), Err(QuoteError::QualifyingData));

    let mut changed_pcr = quote(&mut tpm, b"nonce-1");
    changed_pcr.values.insert(12, [9; 32]);
    assert_eq!(verify(&changed_pcr), Err(QuoteError::PcrDigest));

    let mut flipped = quote(&mut tpm, b"nonce-1");
    let last = flipped.signature.len() - 1;
    flipped.signature[last] ^= 1;
    assert_eq!(verify(&flipped), Err(QuoteError::Signature));

    let mut forged_attest = quote(&mut tpm, b"nonce-1");
    let n = forged_attest.attest.len() - 1;
    forged_attest.attest[n] ^= 1;
    assert_eq!(verify(&forged_attest), Err(QuoteError::Signature));

    let mut missing = quote(&mut tpm, b"nonce-1");
    missing.values.remove(&15);
    assert!(matches!(
        verify(&missing),
        Err(QuoteError::PcrSelection { .. })
    ));

    let mut unrestricted = quote(&mut tpm, b"nonce-1");
    // TPMT_PUBLIC: type(2) nameAlg(2) objectAttributes(4): clear `restricted`.
    let attrs = u32::from_be_bytes(unrestricted.ak[4..8].try_into().unwrap()) & !attr::RESTRICTED;
    unrestricted.ak[4..8].copy_from_slice(&attrs.to_be_bytes());
    assert_eq!(
        verify(&unrestricted),
        Err(QuoteError::AkAttributes("not restricted"))
    );
}

#[test]
fn quote_with_another_tpms_key_fails() {
    let (_ca1, _sw1, mut tpm1) = tpm();
    let (_ca2, _sw2, mut tpm2) = tpm();
    let mut q = quote(&mut tpm1, b"n");
    q.ak = tpm2.attestation_key().unwrap();
    assert_eq!(verify(&q), Err(QuoteError::Signature));
}

/// A program started while TPM commands run inherits no TPM connection:
/// tpm2-tss opens them close-on-exec (scripts/build-tss.sh). Otherwise a
/// child holds the connection of the command in flight, and swtpm, which
/// serves one connection at a time, never answers the next command.
#[test]
fn programs_started_during_tpm_commands_inherit_no_tpm_connection() {
    let (_ca, swtpm, mut tpm) = tpm();
    let port = swtpm.port();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let commands = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tpm.pcr_read(&[0]).unwrap();
                n += 1;
            }
            n
        }
    });
    // Each child lists the sockets it inherited and looks each up among
    // the TCP connections to the TPM's port.
    let script = format!(
        "for fd in /proc/self/fd/*; do readlink \"$fd\"; done | \
         sed -n 's/^socket:\\[\\([0-9]*\\)\\]$/\\1/p' | while read inode; do \
         awk -v i=\"$inode\" '$10 == i {{ print $3 }}' /proc/net/tcp; done | \
         grep -ci ':{port:04X}$' || true"
    );
    let mut inherited = 0;
    for _ in 0..200 {
        let out = std::process::Command::new("sh")
            .args(["-c", &script])
            .output()
            .unwrap();
        inherited += String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u32>()
            .unwrap_or(0);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let commands = commands.join().unwrap();
    assert!(commands > 50, "only {commands} TPM commands ran meanwhile");
    assert_eq!(inherited, 0, "children inherited a TPM connection");
}
