//! A test-only Intel-like root of trust for TDX, generated per test: a root
//! CA, a PCK platform (or processor) CA, a PCK leaf with Intel's SGX
//! extension (FMSPC, CPU and PCE SVNs), and a TCB signing certificate, all
//! ECDSA P-256 as Intel signs; the collateral a DCAP verifier needs (TCB
//! info and QE identity signed by the TCB signing key, the root CA and PCK
//! CRLs); and TDX quotes (version 4, TD 1.0 body) whose QE report the PCK
//! key signs and whose attestation key signs the TD report.
//!
//! A verifier configured with [`TestIntel::root_der`] as its Intel root
//! checks these exactly as it checks Intel's; the pinned Intel root refuses
//! them.

use p256::ecdsa::signature::Signer as _;
use rand::rngs::OsRng;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, CustomExtension, DnType,
    IsCa, Issuer, KeyIdMethod, KeyUsagePurpose, PublicKeyData, RevokedCertParams, SerialNumber,
    SignatureAlgorithm, SigningKey, PKCS_ECDSA_P256_SHA256,
};
use sha2::{Digest as _, Sha256};
use time::{Duration, OffsetDateTime};

use crate::amd::certificate_pem;
use crate::mirror::MirrorServer;

/// Intel's QE vendor ID, which a DCAP verifier requires in the header.
const INTEL_QE_VENDOR_ID: [u8; 16] = [
    0x93, 0x9a, 0x72, 0x33, 0xf7, 0x9c, 0x4c, 0xa9, 0x94, 0x0a, 0x0d, 0xb3, 0x95, 0x7f, 0x06, 0x07,
];
/// TEE type of a TD quote.
const TEE_TYPE_TDX: u32 = 0x81;
/// ECDSA P-256 attestation key.
const ATTESTATION_KEY_ECDSA_P256: u16 = 2;
/// Certification data: the QE report and its certification data.
const CERT_TYPE_QE_REPORT: u16 = 6;
/// Certification data: the PCK chain, PEM.
const CERT_TYPE_PCK_CHAIN: u16 = 5;
/// QE identity of the generated TD quoting enclave.
const QE_MRSIGNER: [u8; 32] = [0x7e; 32];
const QE_ISVPRODID: u16 = 2;
const QE_ISVSVN: u16 = 4;
/// TD attribute bit 28, SEPT_VE_DISABLE, which verifiers require.
pub const TD_ATTRIBUTES: u64 = 1 << 28;
/// TD attribute bit 0: the TD is debuggable.
pub const TD_DEBUG: u64 = 1;

/// Intel's SGX extension and its fields (PCK certificate profile).
mod oid {
    pub const SGX: [u64; 7] = [1, 2, 840, 113741, 1, 13, 1];
    pub const PPID: u64 = 1;
    pub const TCB: u64 = 2;
    pub const PCEID: u64 = 3;
    pub const FMSPC: u64 = 4;
    pub const SGX_TYPE: u64 = 5;
    pub const PCESVN: u64 = 17;
    pub const CPUSVN: u64 = 18;
}

/// Generating the roots, collateral or a quote failed.
#[derive(Debug, thiserror::Error)]
pub enum IntelError {
    /// Certificate or CRL generation failed.
    #[error("certificate")]
    Certificate(#[from] rcgen::Error),
    /// A signature failed.
    #[error("signing")]
    Sign(#[from] p256::ecdsa::Error),
}

/// A P-256 key that signs certificates, CRLs, collateral and quote parts.
#[derive(Clone)]
struct EcKey {
    key: p256::ecdsa::SigningKey,
    public: Vec<u8>,
}

impl EcKey {
    fn generate() -> Self {
        let key = p256::ecdsa::SigningKey::random(&mut OsRng);
        let public = key
            .verifying_key()
            .to_encoded_point(false)
            .as_bytes()
            .to_vec();
        Self { key, public }
    }

    /// ECDSA P-256 with SHA-256 over `msg`, as `r || s` (Intel's raw form).
    fn sign_raw(&self, msg: &[u8]) -> Result<[u8; 64], IntelError> {
        let signature: p256::ecdsa::Signature = self.key.try_sign(msg)?;
        let mut raw = [0u8; 64];
        raw.copy_from_slice(&signature.to_bytes());
        Ok(raw)
    }

    /// The public point without its SEC1 prefix (`x || y`).
    fn point(&self) -> [u8; 64] {
        let mut xy = [0u8; 64];
        xy.copy_from_slice(&self.public[1..65]);
        xy
    }
}

impl PublicKeyData for EcKey {
    fn der_bytes(&self) -> &[u8] {
        &self.public
    }

    fn algorithm(&self) -> &'static SignatureAlgorithm {
        &PKCS_ECDSA_P256_SHA256
    }
}

impl SigningKey for EcKey {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        let signature: p256::ecdsa::Signature = self
            .key
            .try_sign(msg)
            .map_err(|_| rcgen::Error::RemoteKeyError)?;
        Ok(signature.to_der().as_bytes().to_vec())
    }
}

/// A DER element: `tag`, definite length, `content`.
fn der(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes: Vec<u8> = len
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
    out.extend_from_slice(content);
    out
}

fn der_oid(arcs: &[u64]) -> Vec<u8> {
    let mut body = vec![(arcs[0] * 40 + arcs[1]) as u8];
    for &arc in &arcs[2..] {
        let mut groups = vec![(arc & 0x7f) as u8];
        let mut rest = arc >> 7;
        while rest > 0 {
            groups.push(0x80 | (rest & 0x7f) as u8);
            rest >>= 7;
        }
        body.extend(groups.into_iter().rev());
    }
    der(0x06, &body)
}

fn der_uint(value: u16) -> Vec<u8> {
    let bytes = value.to_be_bytes();
    let mut content: Vec<u8> = bytes.into_iter().skip_while(|b| *b == 0).collect();
    if content.first().is_none_or(|b| b & 0x80 != 0) {
        content.insert(0, 0);
    }
    der(0x02, &content)
}

/// One `SEQUENCE { OID sgx.<path>, value }` of the SGX extension.
fn sgx_entry(path: &[u64], value: Vec<u8>) -> Vec<u8> {
    let mut arcs = oid::SGX.to_vec();
    arcs.extend_from_slice(path);
    der(0x30, &[der_oid(&arcs), value].concat())
}

/// What one generated platform is: its FMSPC and TCB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Platform {
    /// Family-model-stepping-platform-custom SKU.
    pub fmspc: [u8; 6],
    /// CPU SVN (the PCK certificate's and the TCB info's SGX components).
    pub cpu_svn: [u8; 16],
    /// PCE SVN.
    pub pce_svn: u16,
    /// TEE TCB SVN (the TD report's and the TCB info's TDX components).
    pub tee_tcb_svn: [u8; 16],
}

impl Default for Platform {
    fn default() -> Self {
        Self {
            fmspc: [0x0b, 0x0c, 0x6f, 0, 0, 0x01],
            cpu_svn: [2, 2, 2, 2, 3, 1, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0],
            pce_svn: 11,
            tee_tcb_svn: [5, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        }
    }
}

/// How the collateral judges the platform.
#[derive(Clone, Debug)]
pub struct CollateralOptions {
    /// TCB status of the level the platform matches (`UpToDate`,
    /// `OutOfDate`, ...); a lower level is always `OutOfDate`.
    pub platform_status: String,
    /// Advisories of that level.
    pub advisories: Vec<String>,
    /// The PCK CRL lists the platform's PCK certificate.
    pub revoke_pck: bool,
    /// Start of every validity window (TCB info, QE identity, CRLs).
    pub issued: OffsetDateTime,
    /// End of every validity window.
    pub next_update: OffsetDateTime,
}

impl Default for CollateralOptions {
    fn default() -> Self {
        let now = OffsetDateTime::now_utc();
        Self {
            platform_status: "UpToDate".into(),
            advisories: Vec::new(),
            revoke_pck: false,
            issued: now - Duration::hours(1),
            next_update: now + Duration::days(30),
        }
    }
}

/// Collateral for one FMSPC, in the parts Intel's PCS serves.
#[derive(Clone, Debug)]
pub struct TdxCollateral {
    /// The TCB info object's exact JSON text (what is signed).
    pub tcb_info: String,
    /// Its signature, raw `r || s`.
    pub tcb_info_signature: Vec<u8>,
    /// The QE identity object's exact JSON text.
    pub qe_identity: String,
    /// Its signature, raw `r || s`.
    pub qe_identity_signature: Vec<u8>,
    /// TCB signing certificate then root, PEM (for both signed objects).
    pub tcb_info_issuer_chain: String,
    /// PCK platform CA then root, PEM.
    pub pck_crl_issuer_chain: String,
    /// The PCK platform CA's CRL, DER.
    pub pck_crl: Vec<u8>,
    /// The root CA's CRL, DER.
    pub root_ca_crl: Vec<u8>,
}

impl TdxCollateral {
    /// The collateral as `dcap-qvl`'s `QuoteCollateralV3` JSON: the form
    /// of a collateral cache file.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "pck_crl_issuer_chain": self.pck_crl_issuer_chain,
            "root_ca_crl": hex::encode(&self.root_ca_crl),
            "pck_crl": hex::encode(&self.pck_crl),
            "tcb_info_issuer_chain": self.tcb_info_issuer_chain,
            "tcb_info": self.tcb_info,
            "tcb_info_signature": hex::encode(&self.tcb_info_signature),
            "qe_identity_issuer_chain": self.tcb_info_issuer_chain,
            "qe_identity": self.qe_identity,
            "qe_identity_signature": hex::encode(&self.qe_identity_signature),
        })
        .to_string()
    }
}

/// The parts of a TDX collateral as Intel's PCS serves them, for a stand-in
/// PCS on a [`MirrorServer`].
#[derive(Clone, Debug)]
pub struct PcsParts {
    /// The TCB info object's JSON text.
    pub tcb_info: String,
    /// Its signature, hex.
    pub tcb_info_signature: String,
    /// The QE identity object's JSON text.
    pub qe_identity: String,
    /// Its signature, hex.
    pub qe_identity_signature: String,
    /// The TCB signing chain, PEM (for both signed objects).
    pub tcb_chain: String,
    /// The PCK CRL's issuer chain, PEM.
    pub pck_crl_chain: String,
    /// The PCK CRL, DER.
    pub pck_crl: Vec<u8>,
    /// The root CA's CRL, DER.
    pub root_ca_crl: Vec<u8>,
}

impl PcsParts {
    /// From a `QuoteCollateralV3` JSON document's fields (a cache file, or
    /// [`TdxCollateral::to_json`]); `None` if a field is missing, or a CRL
    /// is not hex.
    pub fn from_collateral_json(json: &serde_json::Value) -> Option<Self> {
        let s = |k: &str| json[k].as_str().map(str::to_owned);
        let bytes = |k: &str| hex::decode(s(k)?).ok();
        Some(Self {
            tcb_info: s("tcb_info")?,
            tcb_info_signature: s("tcb_info_signature")?,
            qe_identity: s("qe_identity")?,
            qe_identity_signature: s("qe_identity_signature")?,
            tcb_chain: s("tcb_info_issuer_chain")?,
            pck_crl_chain: s("pck_crl_issuer_chain")?,
            pck_crl: bytes("pck_crl")?,
            root_ca_crl: bytes("root_ca_crl")?,
        })
    }

    /// Serves them on `mirror` at PCS v4's paths for `fmspc`, with the PCK
    /// CRL of `ca` (`platform` or `processor`), each signed object's
    /// issuer chain in its URL-encoded response header, and the root CA's
    /// CRL at `/IntelSGXRootCA.der`.
    pub fn serve(&self, mirror: &MirrorServer, fmspc: &str, ca: &str) {
        let tcb_chain = url_encoded(&self.tcb_chain);
        mirror.serve_with_headers(
            &format!("/tdx/certification/v4/tcb?fmspc={fmspc}"),
            format!(
                r#"{{"tcbInfo":{},"signature":"{}"}}"#,
                self.tcb_info, self.tcb_info_signature
            ),
            &[("TCB-Info-Issuer-Chain", &tcb_chain)],
        );
        mirror.serve_with_headers(
            "/tdx/certification/v4/qe/identity",
            format!(
                r#"{{"enclaveIdentity":{},"signature":"{}"}}"#,
                self.qe_identity, self.qe_identity_signature
            ),
            &[("SGX-Enclave-Identity-Issuer-Chain", &tcb_chain)],
        );
        mirror.serve_with_headers(
            &format!("/sgx/certification/v4/pckcrl?ca={ca}&encoding=der"),
            self.pck_crl.clone(),
            &[(
                "SGX-PCK-CRL-Issuer-Chain",
                &url_encoded(&self.pck_crl_chain),
            )],
        );
        mirror.serve("/IntelSGXRootCA.der", self.root_ca_crl.clone());
    }
}

/// A header value as Intel's PCS sends certificate chains: URL-encoded.
fn url_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The fields a test chooses in a TD report.
#[derive(Clone, Debug)]
pub struct TdFields {
    /// TD attributes ([`TD_ATTRIBUTES`], with [`TD_DEBUG`] for a debug TD).
    pub td_attributes: u64,
    /// MRTD.
    pub mrtd: [u8; 48],
    /// RTMR 0-3.
    pub rtmr: [[u8; 48]; 4],
    /// The 64 TD-chosen bytes.
    pub report_data: [u8; 64],
}

/// Which of Intel's two PCK CAs issued a platform's PCK certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PckIssuer {
    /// The PCK Platform CA.
    Platform,
    /// The PCK Processor CA.
    Processor,
}

impl PckIssuer {
    /// The name PCS's URLs give it (`platform`, `processor`).
    pub fn id(self) -> &'static str {
        match self {
            Self::Platform => "platform",
            Self::Processor => "processor",
        }
    }
}

/// The root and TCB signer of a generated PKI.
struct Pki {
    root: EcKey,
    root_params: CertificateParams,
    root_der: Vec<u8>,
    tcb_signer: EcKey,
    tcb_signer_der: Vec<u8>,
}

/// A generated Intel-like PKI and one platform it certifies.
pub struct TestIntel {
    root: EcKey,
    root_params: CertificateParams,
    root_der: Vec<u8>,
    pck_ca: EcKey,
    pck_ca_params: CertificateParams,
    pck_ca_der: Vec<u8>,
    ca: PckIssuer,
    tcb_signer: EcKey,
    tcb_signer_der: Vec<u8>,
    pck: EcKey,
    pck_der: Vec<u8>,
    pck_serial: SerialNumber,
    attestation_key: EcKey,
    platform: Platform,
}

fn ca_params(name: &str, constraint: BasicConstraints) -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "Keel Test");
    params.is_ca = IsCa::Ca(constraint);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut params);
    Ok(params)
}

fn leaf_params(name: &str) -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "Keel Test");
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::ContentCommitment,
    ];
    validity(&mut params);
    Ok(params)
}

fn validity(params: &mut CertificateParams) {
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::days(1);
    params.not_after = now + Duration::days(3650);
}

impl TestIntel {
    /// Generates the PKI for a platform with [`Platform::default`].
    pub fn new() -> Result<Self, IntelError> {
        Self::for_platform(Platform::default())
    }

    /// Generates the PKI for `platform`, its PCK certificate issued by
    /// the platform CA.
    pub fn for_platform(platform: Platform) -> Result<Self, IntelError> {
        let root = EcKey::generate();
        let root_params = ca_params("Keel Test SGX Root CA", BasicConstraints::Unconstrained)?;
        let root_der = root_params.self_signed(&root)?.der().to_vec();
        let tcb_signer = EcKey::generate();
        let tcb_signer_der = leaf_params("Keel Test SGX TCB Signing")?
            .signed_by(&tcb_signer, &Issuer::from_params(&root_params, &root))?
            .der()
            .to_vec();
        let pki = Pki {
            root,
            root_params,
            root_der,
            tcb_signer,
            tcb_signer_der,
        };
        Self::issued(pki, platform, PckIssuer::Platform)
    }

    /// A platform of the same FMSPC and TCB under the same root and TCB
    /// signer, whose PCK certificate the processor CA issued (as Intel
    /// certifies some platforms of an FMSPC by one CA, some by the other).
    pub fn under_processor_ca(&self) -> Result<Self, IntelError> {
        let pki = Pki {
            root: self.root.clone(),
            root_params: self.root_params.clone(),
            root_der: self.root_der.clone(),
            tcb_signer: self.tcb_signer.clone(),
            tcb_signer_der: self.tcb_signer_der.clone(),
        };
        Self::issued(pki, self.platform, PckIssuer::Processor)
    }

    /// `pki` with a PCK CA of kind `ca` and a PCK certificate it issued
    /// for `platform`.
    fn issued(pki: Pki, platform: Platform, ca: PckIssuer) -> Result<Self, IntelError> {
        let root_issuer = Issuer::from_params(&pki.root_params, &pki.root);
        let pck_ca = EcKey::generate();
        // Verifiers tell the CAs apart by the word in the issuer's name.
        let name = match ca {
            PckIssuer::Platform => "Keel Test SGX PCK Platform CA",
            PckIssuer::Processor => "Keel Test SGX PCK Processor CA",
        };
        let pck_ca_params = ca_params(name, BasicConstraints::Constrained(0))?;
        let pck_ca_der = pck_ca_params
            .signed_by(&pck_ca, &root_issuer)?
            .der()
            .to_vec();

        let pck = EcKey::generate();
        let pck_serial = SerialNumber::from(u64::from(rand::random::<u32>()) + 1);
        let mut pck_params = leaf_params("Keel Test SGX PCK Certificate")?;
        pck_params.serial_number = Some(pck_serial.clone());
        pck_params.custom_extensions = vec![CustomExtension::from_oid_content(
            &oid::SGX,
            sgx_extension(&platform),
        )];
        let pck_der = pck_params
            .signed_by(&pck, &Issuer::from_params(&pck_ca_params, &pck_ca))?
            .der()
            .to_vec();

        Ok(Self {
            root: pki.root,
            root_params: pki.root_params,
            root_der: pki.root_der,
            pck_ca,
            pck_ca_params,
            pck_ca_der,
            ca,
            tcb_signer: pki.tcb_signer,
            tcb_signer_der: pki.tcb_signer_der,
            pck,
            pck_der,
            pck_serial,
            attestation_key: EcKey::generate(),
            platform,
        })
    }

    /// The CA that issued this platform's PCK certificate.
    pub fn pck_issuer(&self) -> PckIssuer {
        self.ca
    }

    /// The root CA, DER: what a verifier takes as its Intel root.
    pub fn root_der(&self) -> &[u8] {
        &self.root_der
    }

    /// The platform this PKI certifies.
    pub fn platform(&self) -> Platform {
        self.platform
    }

    /// The FMSPC as a collateral cache names it (12 upper-case hex digits).
    pub fn fmspc_hex(&self) -> String {
        hex::encode_upper(self.platform.fmspc)
    }

    /// The PCK leaf, its platform CA and the root, PEM (the quote's
    /// certification data).
    pub fn pck_chain_pem(&self) -> String {
        [&self.pck_der, &self.pck_ca_der, &self.root_der]
            .iter()
            .map(|der| certificate_pem(der))
            .collect()
    }

    /// Collateral for this platform, judged as `options` says.
    pub fn collateral(&self, options: &CollateralOptions) -> Result<TdxCollateral, IntelError> {
        let date = |t: OffsetDateTime| {
            format!(
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
                t.year(),
                u8::from(t.month()),
                t.day(),
                t.hour(),
                t.minute(),
                t.second()
            )
        };
        let (issued, next) = (date(options.issued), date(options.next_update));
        let p = &self.platform;
        let svns = |v: &[u8]| {
            v.iter()
                .map(|svn| serde_json::json!({ "svn": svn }))
                .collect::<Vec<_>>()
        };
        let lower = |v: &[u8; 16]| {
            let mut v = *v;
            v[0] = v[0].saturating_sub(1);
            v
        };
        let tcb_info = serde_json::json!({
            "id": "TDX",
            "version": 3,
            "issueDate": issued,
            "nextUpdate": next,
            "fmspc": hex::encode_upper(p.fmspc),
            "pceId": "0000",
            "tcbType": 0,
            "tcbEvaluationDataNumber": 17,
            "tdxModule": {
                "mrsigner": hex::encode_upper([0u8; 48]),
                "attributes": "0000000000000000",
                "attributesMask": "FFFFFFFFFFFFFFFF",
            },
            "tcbLevels": [
                {
                    "tcb": {
                        "sgxtcbcomponents": svns(&p.cpu_svn),
                        "pcesvn": p.pce_svn,
                        "tdxtcbcomponents": svns(&p.tee_tcb_svn),
                    },
                    "tcbDate": "2025-01-01T00:00:00Z",
                    "tcbStatus": options.platform_status,
                    "advisoryIDs": options.advisories,
                },
                {
                    "tcb": {
                        "sgxtcbcomponents": svns(&lower(&p.cpu_svn)),
                        "pcesvn": p.pce_svn,
                        "tdxtcbcomponents": svns(&lower(&p.tee_tcb_svn)),
                    },
                    "tcbDate": "2023-01-01T00:00:00Z",
                    "tcbStatus": "OutOfDate",
                    "advisoryIDs": ["INTEL-SA-00000"],
                },
            ],
        })
        .to_string();
        let qe_identity = serde_json::json!({
            "id": "TD_QE",
            "version": 2,
            "issueDate": issued,
            "nextUpdate": next,
            "tcbEvaluationDataNumber": 17,
            "miscselect": "00000000",
            "miscselectMask": "FFFFFFFF",
            "attributes": "11000000000000000000000000000000",
            "attributesMask": "FBFFFFFFFFFFFFFF0000000000000000",
            "mrsigner": hex::encode_upper(QE_MRSIGNER),
            "isvprodid": QE_ISVPRODID,
            "tcbLevels": [{
                "tcb": { "isvsvn": QE_ISVSVN },
                "tcbDate": "2025-01-01T00:00:00Z",
                "tcbStatus": "UpToDate",
            }],
        })
        .to_string();

        let crl = |revoked: Vec<RevokedCertParams>| CertificateRevocationListParams {
            this_update: options.issued,
            next_update: options.next_update,
            crl_number: SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: revoked,
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let root_ca_crl = crl(Vec::new())
            .signed_by(&Issuer::from_params(&self.root_params, &self.root))?
            .der()
            .to_vec();
        let revoked = if options.revoke_pck {
            vec![RevokedCertParams {
                serial_number: self.pck_serial.clone(),
                revocation_time: options.issued,
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            }]
        } else {
            Vec::new()
        };
        let pck_crl = crl(revoked)
            .signed_by(&Issuer::from_params(&self.pck_ca_params, &self.pck_ca))?
            .der()
            .to_vec();

        Ok(TdxCollateral {
            tcb_info_signature: self.tcb_signer.sign_raw(tcb_info.as_bytes())?.to_vec(),
            qe_identity_signature: self.tcb_signer.sign_raw(qe_identity.as_bytes())?.to_vec(),
            tcb_info,
            qe_identity,
            tcb_info_issuer_chain: format!(
                "{}{}",
                certificate_pem(&self.tcb_signer_der),
                certificate_pem(&self.root_der)
            ),
            pck_crl_issuer_chain: format!(
                "{}{}",
                certificate_pem(&self.pck_ca_der),
                certificate_pem(&self.root_der)
            ),
            pck_crl,
            root_ca_crl,
        })
    }

    /// A version 4 TD quote with `fields`: the TD report signed by the
    /// attestation key, the QE report (binding that key) signed by the PCK
    /// key, and the PCK chain.
    pub fn quote(&self, fields: &TdFields) -> Result<Vec<u8>, IntelError> {
        let mut quote = Vec::with_capacity(6 * 1024);
        // Header (48 bytes).
        quote.extend_from_slice(&4u16.to_le_bytes());
        quote.extend_from_slice(&ATTESTATION_KEY_ECDSA_P256.to_le_bytes());
        quote.extend_from_slice(&TEE_TYPE_TDX.to_le_bytes());
        quote.extend_from_slice(&QE_ISVSVN.to_le_bytes());
        quote.extend_from_slice(&self.platform.pce_svn.to_le_bytes());
        quote.extend_from_slice(&INTEL_QE_VENDOR_ID);
        quote.extend_from_slice(&[0u8; 20]);
        // TD report, TDX 1.0 (584 bytes).
        quote.extend_from_slice(&self.platform.tee_tcb_svn);
        quote.extend_from_slice(&[0x11; 48]); // MRSEAM
        quote.extend_from_slice(&[0u8; 48]); // MRSIGNERSEAM
        quote.extend_from_slice(&[0u8; 8]); // SEAMATTRIBUTES
        quote.extend_from_slice(&fields.td_attributes.to_le_bytes());
        quote.extend_from_slice(&0x0006_02e7u64.to_le_bytes()); // XFAM
        quote.extend_from_slice(&fields.mrtd);
        quote.extend_from_slice(&[0u8; 48 * 3]); // MRCONFIGID, MROWNER, MROWNERCONFIG
        for rtmr in &fields.rtmr {
            quote.extend_from_slice(rtmr);
        }
        quote.extend_from_slice(&fields.report_data);
        let signature = self.attestation_key.sign_raw(&quote)?;

        // The QE report binds the attestation key: SHA-256(key || auth data).
        let auth_data = [0x5au8; 32];
        let mut qe_report = vec![0u8; 384];
        qe_report[..16].copy_from_slice(&self.platform.cpu_svn);
        qe_report[48] = 0x11; // attributes: INIT, MODE64BIT; not DEBUG
        qe_report[128..160].copy_from_slice(&QE_MRSIGNER);
        qe_report[256..258].copy_from_slice(&QE_ISVPRODID.to_le_bytes());
        qe_report[258..260].copy_from_slice(&QE_ISVSVN.to_le_bytes());
        let mut hash = Sha256::new();
        hash.update(self.attestation_key.point());
        hash.update(auth_data);
        qe_report[320..352].copy_from_slice(&hash.finalize());
        let qe_signature = self.pck.sign_raw(&qe_report)?;

        let chain = self.pck_chain_pem().into_bytes();
        let mut inner = qe_report;
        inner.extend_from_slice(&qe_signature);
        inner.extend_from_slice(&(auth_data.len() as u16).to_le_bytes());
        inner.extend_from_slice(&auth_data);
        inner.extend_from_slice(&CERT_TYPE_PCK_CHAIN.to_le_bytes());
        inner.extend_from_slice(&(chain.len() as u32).to_le_bytes());
        inner.extend_from_slice(&chain);

        let mut signature_data = signature.to_vec();
        signature_data.extend_from_slice(&self.attestation_key.point());
        signature_data.extend_from_slice(&CERT_TYPE_QE_REPORT.to_le_bytes());
        signature_data.extend_from_slice(&(inner.len() as u32).to_le_bytes());
        signature_data.extend_from_slice(&inner);

        quote.extend_from_slice(&(signature_data.len() as u32).to_le_bytes());
        quote.extend_from_slice(&signature_data);
        Ok(quote)
    }
}

/// Intel's SGX extension of a PCK certificate for `platform`.
fn sgx_extension(platform: &Platform) -> Vec<u8> {
    let mut tcb: Vec<u8> = platform
        .cpu_svn
        .iter()
        .zip(1u64..)
        .flat_map(|(svn, arc)| sgx_entry(&[oid::TCB, arc], der_uint(u16::from(*svn))))
        .collect();
    tcb.extend(sgx_entry(
        &[oid::TCB, oid::PCESVN],
        der_uint(platform.pce_svn),
    ));
    tcb.extend(sgx_entry(
        &[oid::TCB, oid::CPUSVN],
        der(0x04, &platform.cpu_svn),
    ));
    let entries = [
        sgx_entry(&[oid::PPID], der(0x04, &[0x42; 16])),
        sgx_entry(&[oid::TCB], der(0x30, &tcb)),
        sgx_entry(&[oid::PCEID], der(0x04, &[0, 0])),
        sgx_entry(&[oid::FMSPC], der(0x04, &platform.fmspc)),
        sgx_entry(&[oid::SGX_TYPE], der(0x0a, &[0])),
    ]
    .concat();
    der(0x30, &entries)
}
