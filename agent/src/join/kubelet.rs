//! The kubelet's client identity: the key and CSR a joining node makes,
//! the checks and signature the join service applies to the CSR, and the
//! check the node makes of the certificate it gets back.
//!
//! The subject is always `O=system:nodes, CN=system:node:<name>`; the
//! service signs a certificate from that subject and the CSR's key only.

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use x509_parser::prelude::{FromDer as _, X509Certificate, X509CertificationRequest};
use zeroize::Zeroizing;

/// Largest accepted kubelet CSR (PEM).
pub const MAX_CSR_BYTES: usize = 16 * 1024;
/// Lifetime of a kubelet certificate.
pub const KUBELET_CERT_DAYS: i64 = 365;

/// The kubelet's key and its CSR (`O=system:nodes, CN=system:node:<name>`).
pub struct KubeletKey {
    key: rcgen::KeyPair,
    csr_pem: String,
}

impl KubeletKey {
    /// A fresh P-256 key and its CSR for `node_name`.
    pub fn generate(node_name: &str) -> Result<Self, rcgen::Error> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = subject(node_name);
        let csr_pem = params.serialize_request(&key)?.pem()?;
        Ok(Self { key, csr_pem })
    }

    /// The CSR (PEM).
    pub fn csr_pem(&self) -> &str {
        &self.csr_pem
    }

    /// DER SubjectPublicKeyInfo of the key.
    pub fn spki(&self) -> Vec<u8> {
        rcgen::PublicKeyData::subject_public_key_info(&self.key)
    }

    /// The private key (PEM).
    pub fn private_pem(&self) -> Zeroizing<String> {
        Zeroizing::new(self.key.serialize_pem())
    }
}

/// Why a kubelet CSR was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CsrError {
    /// Larger than [`MAX_CSR_BYTES`].
    #[error("the kubelet CSR is larger than {MAX_CSR_BYTES} bytes")]
    TooLarge,
    /// Not a PEM `CERTIFICATE REQUEST`.
    #[error("the kubelet CSR is not a PEM certificate request")]
    Pem,
    /// The DER does not parse (or has trailing bytes).
    #[error("the kubelet CSR does not parse")]
    Parse,
    /// The self-signature does not verify.
    #[error("the kubelet CSR's signature does not verify")]
    Signature,
    /// The subject is not exactly `O=system:nodes, CN=system:node:<name>`.
    #[error("the kubelet CSR's subject must be exactly O=system:nodes, CN=system:node:{0}")]
    Subject(String),
    /// The CSR's key type is not supported for signing.
    #[error("the kubelet CSR's key type is not supported")]
    KeyType,
}

/// Why a kubelet certificate was not signed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignCsrError {
    /// The CSR was refused.
    #[error(transparent)]
    Csr(#[from] CsrError),
    /// Signing failed.
    #[error("signing the kubelet certificate failed")]
    Sign(#[source] rcgen::Error),
}

/// Checks a PEM CSR (size, signature, subject) and returns its
/// SubjectPublicKeyInfo DER.
pub fn check_csr(csr_pem: &[u8], node_name: &str) -> Result<Vec<u8>, CsrError> {
    if csr_pem.len() > MAX_CSR_BYTES {
        return Err(CsrError::TooLarge);
    }
    let (_, pem) = x509_parser::pem::parse_x509_pem(csr_pem).map_err(|_| CsrError::Pem)?;
    if pem.label != "CERTIFICATE REQUEST" {
        return Err(CsrError::Pem);
    }
    let (rest, csr) =
        X509CertificationRequest::from_der(&pem.contents).map_err(|_| CsrError::Parse)?;
    if !rest.is_empty() {
        return Err(CsrError::Parse);
    }
    csr.verify_signature().map_err(|_| CsrError::Signature)?;
    let info = &csr.certification_request_info;
    let expected_cn = format!("system:node:{node_name}");
    let subject_ok = {
        let attributes: Vec<_> = info.subject.iter_attributes().collect();
        let cn = info.subject.iter_common_name().collect::<Vec<_>>();
        let o = info.subject.iter_organization().collect::<Vec<_>>();
        attributes.len() == 2
            && matches!(cn.as_slice(), [c] if c.as_str().ok() == Some(expected_cn.as_str()))
            && matches!(o.as_slice(), [o] if o.as_str().ok() == Some("system:nodes"))
    };
    if !subject_ok {
        return Err(CsrError::Subject(node_name.escape_debug().to_string()));
    }
    Ok(info.subject_pki.raw.to_vec())
}

/// `O=system:nodes, CN=system:node:<node_name>`.
fn subject(node_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "system:nodes");
    dn.push(DnType::CommonName, format!("system:node:{node_name}"));
    dn
}

/// Checks the CSR ([`check_csr`]) and signs a kubelet client certificate
/// for its key and `node_name` with the cluster CA `ca`. Nothing else of
/// the CSR (requested extensions) is used.
pub fn sign_csr(
    ca: &Issuer<'_, KeyPair>,
    csr_pem: &[u8],
    node_name: &str,
) -> Result<String, SignCsrError> {
    let spki = check_csr(csr_pem, node_name)?;
    let key = rcgen::SubjectPublicKeyInfo::from_der(&spki).map_err(|_| CsrError::KeyType)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = subject(node_name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + time::Duration::days(KUBELET_CERT_DAYS);
    let mut serial = [0u8; 16];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut serial);
    serial[0] &= 0x7f;
    params.serial_number = Some(SerialNumber::from_slice(&serial));
    let cert = params.signed_by(&key, ca).map_err(SignCsrError::Sign)?;
    Ok(cert.pem())
}

/// The kubelet certificate must be for this node's key and signed by the CA.
pub fn check_cert(cert_pem: &str, ca_pem: &str, spki: &[u8]) -> Result<(), &'static str> {
    let (_, cert) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|_| "kubelet certificate PEM")?;
    let (_, cert) = X509Certificate::from_der(&cert.contents).map_err(|_| "kubelet certificate")?;
    let (_, ca) = x509_parser::pem::parse_x509_pem(ca_pem.as_bytes()).map_err(|_| "CA PEM")?;
    let (_, ca) = X509Certificate::from_der(&ca.contents).map_err(|_| "CA certificate")?;
    if cert.public_key().raw != spki {
        return Err("the kubelet certificate is for another key");
    }
    cert.verify_signature(Some(ca.public_key()))
        .map_err(|_| "the kubelet certificate is not signed by the cluster CA")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn csr(cn: &str, o: Option<&str>) -> String {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        if let Some(o) = o {
            dn.push(DnType::OrganizationName, o);
        }
        dn.push(DnType::CommonName, cn);
        params.distinguished_name = dn;
        params.serialize_request(&key).unwrap().pem().unwrap()
    }

    #[test]
    fn csr_subject_and_signature_are_checked() {
        let good = csr("system:node:w-1", Some("system:nodes"));
        assert!(check_csr(good.as_bytes(), "w-1").is_ok());
        assert!(matches!(
            check_csr(good.as_bytes(), "w-2"),
            Err(CsrError::Subject(_))
        ));
        for bad in [
            csr("system:node:w-1", None),
            csr("system:node:w-1", Some("system:masters")),
            csr("system:admin", Some("system:nodes")),
        ] {
            assert!(matches!(
                check_csr(bad.as_bytes(), "w-1"),
                Err(CsrError::Subject(_))
            ));
        }
        // A flipped bit in the signature.
        let (_, pem) = x509_parser::pem::parse_x509_pem(good.as_bytes()).unwrap();
        let mut der = pem.contents.clone();
        *der.last_mut().unwrap() ^= 1;
        let tampered = pem_encode("CERTIFICATE REQUEST", &der);
        assert!(matches!(
            check_csr(tampered.as_bytes(), "w-1"),
            Err(CsrError::Signature)
        ));
        assert!(matches!(check_csr(b"junk", "w-1"), Err(CsrError::Pem)));
        let huge = vec![b'a'; MAX_CSR_BYTES + 1];
        assert!(matches!(check_csr(&huge, "w-1"), Err(CsrError::TooLarge)));
    }

    fn pem_encode(label: &str, der: &[u8]) -> String {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        )
    }
}
