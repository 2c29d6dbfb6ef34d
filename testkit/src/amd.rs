//! A test-only AMD-like root of trust, generated per test: an ARK and an
//! ASK (RSA, RSASSA-PSS with SHA-384 as AMD signs), a VCEK (P-384) with
//! AMD's hwID and TCB extensions, and SEV-SNP reports (version 2, Milan
//! TCB layout; for a chain under Turin's names, version 3 in Turin's)
//! signed by that VCEK, and CRLs signed by the ARK as AMD signs its own. A verifier configured with [`TestAmd::roots_pem`] as its roots
//! checks them exactly as it checks AMD's; the pinned AMD roots refuse them.

use p384::ecdsa::signature::hazmat::PrehashSigner as _;
use rand::rngs::OsRng;
use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DnType, IsCa, Issuer, KeyUsagePurpose,
    PublicKeyData, SignatureAlgorithm, SigningKey, PKCS_ECDSA_P384_SHA384, PKCS_RSA_SHA384,
};
use rsa::pkcs1::EncodeRsaPublicKey as _;
use rsa::signature::{RandomizedSigner as _, SignatureEncoding as _};
use sha2::{Digest as _, Sha384};

/// `sha384WithRSAEncryption` as rcgen writes it; its last OID byte (0x0c)
/// becomes RSASSA-PSS (0x0a) in the outer signature algorithm.
const SHA384_WITH_RSA: [u8; 15] = [
    0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0c, 0x05, 0x00,
];

/// Generating the roots failed.
#[derive(Debug, thiserror::Error)]
pub enum AmdError {
    /// RSA key generation or encoding failed.
    #[error("RSA: {0}")]
    Rsa(String),
    /// Certificate generation failed.
    #[error("certificate")]
    Certificate(#[from] rcgen::Error),
    /// Signing the report failed.
    #[error("signing the report")]
    Sign(#[from] p384::ecdsa::Error),
}

/// An RSA key that signs with RSASSA-PSS SHA-384 (salt 48), presented to
/// rcgen as `sha384WithRSAEncryption` and patched afterwards.
struct RsaPss {
    key: rsa::RsaPrivateKey,
    public: Vec<u8>,
}

impl RsaPss {
    fn generate() -> Result<Self, AmdError> {
        let key =
            rsa::RsaPrivateKey::new(&mut OsRng, 2048).map_err(|e| AmdError::Rsa(e.to_string()))?;
        let public = key
            .to_public_key()
            .to_pkcs1_der()
            .map_err(|e| AmdError::Rsa(e.to_string()))?
            .as_bytes()
            .to_vec();
        Ok(Self { key, public })
    }
}

impl PublicKeyData for RsaPss {
    fn der_bytes(&self) -> &[u8] {
        &self.public
    }

    fn algorithm(&self) -> &'static SignatureAlgorithm {
        &PKCS_RSA_SHA384
    }
}

impl SigningKey for RsaPss {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        let signer = rsa::pss::BlindedSigningKey::<Sha384>::new(self.key.clone());
        Ok(signer.sign_with_rng(&mut OsRng, msg).to_vec())
    }
}

/// A P-384 public key (SEC1 point) as a certificate's subject key.
struct P384Public(Vec<u8>);

impl PublicKeyData for P384Public {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static SignatureAlgorithm {
        &PKCS_ECDSA_P384_SHA384
    }
}

/// Marks the outer signature algorithm as RSASSA-PSS (the signature is one).
fn pss(mut der: Vec<u8>) -> Vec<u8> {
    if let Some(at) = der
        .windows(SHA384_WITH_RSA.len())
        .rposition(|w| w == SHA384_WITH_RSA)
    {
        der[at + 12] = 0x0a;
    }
    der
}

/// CRL parameters revoking the certificates with the serial numbers (DER
/// integer contents) in `revoked`, valid from `this_update` to
/// `next_update`.
fn crl_params(
    revoked: &[Vec<u8>],
    this_update: time::OffsetDateTime,
    next_update: time::OffsetDateTime,
) -> rcgen::CertificateRevocationListParams {
    rcgen::CertificateRevocationListParams {
        this_update,
        next_update,
        crl_number: rcgen::SerialNumber::from(1u64),
        issuing_distribution_point: None,
        revoked_certs: revoked
            .iter()
            .map(|serial| rcgen::RevokedCertParams {
                serial_number: rcgen::SerialNumber::from_slice(serial),
                revocation_time: this_update,
                reason_code: None,
                invalidity_date: None,
            })
            .collect(),
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    }
}

/// A CRL that names the CA certificate `ca_der` (DER) as its issuer and
/// revokes `revoked`, current from a day ago for a week, but is signed by
/// a key of its own: what anyone holding only the CA's public certificate
/// can make.
pub fn crl_in_the_name_of(ca_der: &[u8], revoked: &[Vec<u8>]) -> Result<Vec<u8>, AmdError> {
    let issuer = Issuer::from_ca_cert_der(&ca_der.to_vec().into(), rcgen::KeyPair::generate()?)?;
    let now = time::OffsetDateTime::now_utc();
    let params = crl_params(
        revoked,
        now - time::Duration::days(1),
        now + time::Duration::days(7),
    );
    Ok(params.signed_by(&issuer)?.der().to_vec())
}

/// A DER certificate as PEM.
pub fn certificate_pem(der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let body: Vec<&str> = b64
        .as_bytes()
        .chunks(64)
        .filter_map(|c| std::str::from_utf8(c).ok())
        .collect();
    format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        body.join("\n")
    )
}

fn ca_params(name: &str) -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

/// The fields a test chooses in a report.
#[derive(Clone, Debug)]
pub struct ReportFields {
    /// Guest policy (0x30000: no debug, no migration agent).
    pub policy: u64,
    /// The 64 guest-chosen bytes.
    pub report_data: [u8; 64],
    /// Launch measurement.
    pub measurement: [u8; 48],
    /// Host data.
    pub host_data: [u8; 32],
    /// The VMPL the report was requested for (0: the guest's most
    /// privileged level).
    pub vmpl: u32,
}

impl ReportFields {
    /// A guest's report at VMPL 0 under policy 0x30000, with no host data.
    pub fn guest(report_data: [u8; 64], measurement: [u8; 48]) -> Self {
        Self {
            policy: 0x30000,
            report_data,
            measurement,
            host_data: [0; 32],
            vmpl: 0,
        }
    }
}

/// What the launch (an ID block, the author key) and the platform put in a
/// report, beyond [`ReportFields`]; the default is a guest launched without
/// an ID block on a platform reporting no features.
#[derive(Clone, Debug)]
pub struct LaunchFields {
    /// The guest SVN the ID block set.
    pub guest_svn: u32,
    /// The platform info (bit 0 SMT enabled, 1 TSME, 2 ECC, 3 RAPL
    /// disabled, 4 ciphertext hiding, 5 alias check complete).
    pub platform_info: u64,
    /// SHA-384 of the ID key that signed the ID block.
    pub id_key_digest: [u8; 48],
    /// SHA-384 of the author key; `Some` also sets `AUTHOR_KEY_EN`.
    pub author_key_digest: Option<[u8; 48]>,
    /// The signing key `key_info` names (0 VCEK, 1 VLEK), whatever key
    /// signs the report: what no firmware writes. `None`: the key that
    /// signs it.
    pub signing_key: Option<u8>,
}

impl Default for LaunchFields {
    fn default() -> Self {
        Self {
            guest_svn: 0,
            platform_info: 0,
            id_key_digest: [0; 48],
            author_key_digest: None,
            signing_key: None,
        }
    }
}

/// Validity periods of a generated chain's ARK and ASK (or ASVK); `None`
/// keeps rcgen's default (1975 to 4096).
#[derive(Clone, Copy, Debug, Default)]
pub struct RootValidity {
    /// The ARK's `notBefore` and `notAfter`.
    pub ark: Option<(time::OffsetDateTime, time::OffsetDateTime)>,
    /// The ASK's (or ASVK's) `notBefore` and `notAfter`.
    pub ask: Option<(time::OffsetDateTime, time::OffsetDateTime)>,
}

/// A generated AMD-like chain and the chip whose VCEK it certifies (or,
/// from [`TestAmd::vlek`], the VLEK a cloud provider loaded).
pub struct TestAmd {
    roots_pem: String,
    ark: RsaPss,
    ark_params: CertificateParams,
    ask_der: Vec<u8>,
    vcek_der: Vec<u8>,
    vcek: p384::ecdsa::SigningKey,
    chip_id: [u8; 64],
    tcb: [u8; 4],
    fmc: Option<u8>,
    vlek: bool,
}

impl TestAmd {
    /// Generates ARK, ASK and a VCEK for a random chip with TCB
    /// bootloader 3, TEE 0, SNP 8, microcode 115, for the product line
    /// `Test` (`ARK-Test`, `SEV-Test`).
    pub fn new() -> Result<Self, AmdError> {
        Self::for_line("Test")
    }

    /// As [`TestAmd::new`], with AMD's names for the product line `line`
    /// (`ARK-Milan`, `SEV-Milan`): a look-alike of AMD's chain that only
    /// its keys tell apart. For `Turin`, as Turin's: an 8-byte chip ID (the
    /// report's 64 bytes end in 56 zeros), an FMC SVN of 1 in the VCEK, and
    /// version 3 reports of a family 0x1A CPU in Turin's TCB layout.
    pub fn for_line(line: &str) -> Result<Self, AmdError> {
        Self::generate(line, false, RootValidity::default())
    }

    /// As [`TestAmd::new`] (with a VLEK if `vlek`), its ARK and ASK valid
    /// only within `validity`.
    pub fn with_root_validity(vlek: bool, validity: RootValidity) -> Result<Self, AmdError> {
        Self::generate("Test", vlek, validity)
    }

    /// As [`TestAmd::new`], with a VLEK in place of the VCEK: the ARK
    /// certifies an ASVK (`SEV-VLEK-Test`), which certifies the VLEK
    /// (without a chip ID), and reports name the VLEK as their signing key
    /// and carry a zero chip ID (version 3, of a Milan CPU).
    /// [`TestAmd::vcek_der`] and [`TestAmd::ask_der`] are then the VLEK
    /// and the ASVK.
    pub fn vlek() -> Result<Self, AmdError> {
        Self::vlek_for_line("Test")
    }

    /// As [`TestAmd::vlek`], with AMD's names for the product line `line`
    /// (`ARK-Milan`, `SEV-VLEK-Milan`).
    pub fn vlek_for_line(line: &str) -> Result<Self, AmdError> {
        Self::generate(line, true, RootValidity::default())
    }

    fn generate(line: &str, vlek: bool, validity: RootValidity) -> Result<Self, AmdError> {
        let tcb = [3, 0, 8, 115];
        let turin = line == "Turin";
        let fmc = turin.then_some(1u8);
        let mut chip_id = [0u8; 64];
        let id_len = if turin { 8 } else { 64 };
        if !vlek {
            rand::RngCore::fill_bytes(&mut OsRng, &mut chip_id[..id_len]);
        }

        let ark = RsaPss::generate()?;
        let mut ark_params = ca_params(&format!("ARK-{line}"))?;
        if let Some((not_before, not_after)) = validity.ark {
            (ark_params.not_before, ark_params.not_after) = (not_before, not_after);
        }
        let ark_der = pss(ark_params.self_signed(&ark)?.der().to_vec());

        let ask = RsaPss::generate()?;
        let intermediate = if vlek { "SEV-VLEK-" } else { "SEV-" };
        let mut ask_params = ca_params(&format!("{intermediate}{line}"))?;
        if let Some((not_before, not_after)) = validity.ask {
            (ask_params.not_before, ask_params.not_after) = (not_before, not_after);
        }
        let ask_der = pss(ask_params
            .signed_by(&ask, &Issuer::new(ark_params.clone(), &ark))?
            .der()
            .to_vec());

        let vcek = p384::ecdsa::SigningKey::random(&mut OsRng);
        let point = vcek
            .verifying_key()
            .to_encoded_point(false)
            .as_bytes()
            .to_vec();
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(
            DnType::CommonName,
            if vlek { "SEV-VLEK" } else { "SEV-VCEK" },
        );
        let amd = |arc: &[u64]| [&[1u64, 3, 6, 1, 4, 1, 3704, 1][..], arc].concat();
        // Milan's and Genoa's VCEKs carry the chip ID bare, Turin's as an
        // OCTET STRING: the verifier reads both.
        let hw_id = if turin {
            [&[0x04, 8][..], &chip_id[..8]].concat()
        } else {
            chip_id.to_vec()
        };
        if !vlek {
            params.custom_extensions = vec![CustomExtension::from_oid_content(&amd(&[4]), hw_id)];
        }
        let svns = [(1u64, tcb[0]), (2, tcb[1]), (3, tcb[2]), (8, tcb[3])];
        for (arc, value) in svns.into_iter().chain(fmc.map(|f| (9, f))) {
            let der = if value < 0x80 {
                vec![0x02, 1, value]
            } else {
                vec![0x02, 2, 0, value]
            };
            params
                .custom_extensions
                .push(CustomExtension::from_oid_content(&amd(&[3, arc]), der));
        }
        let vcek_der = pss(params
            .signed_by(&P384Public(point), &Issuer::new(ask_params, &ask))?
            .der()
            .to_vec());
        Ok(Self {
            roots_pem: format!("{}{}", certificate_pem(&ask_der), certificate_pem(&ark_der)),
            ark,
            ark_params,
            ask_der,
            vcek_der,
            vcek,
            chip_id,
            tcb,
            fmc,
            vlek,
        })
    }

    /// The ASK then the ARK, PEM: what a verifier takes as its roots.
    pub fn roots_pem(&self) -> &str {
        &self.roots_pem
    }

    /// The VCEK (the VLEK of [`TestAmd::vlek`]), DER.
    pub fn vcek_der(&self) -> &[u8] {
        &self.vcek_der
    }

    /// The ASK (the ASVK of [`TestAmd::vlek`]), DER.
    pub fn ask_der(&self) -> &[u8] {
        &self.ask_der
    }

    /// A CRL of the ARK revoking the certificates with the serial numbers
    /// (DER integer contents) in `revoked`, valid from `this_update` to
    /// `next_update`, signed by the ARK with RSASSA-PSS SHA-384.
    pub fn crl(
        &self,
        revoked: &[Vec<u8>],
        this_update: time::OffsetDateTime,
        next_update: time::OffsetDateTime,
    ) -> Result<Vec<u8>, AmdError> {
        let issuer = Issuer::new(self.ark_params.clone(), &self.ark);
        let crl = crl_params(revoked, this_update, next_update).signed_by(&issuer)?;
        Ok(pss(crl.der().to_vec()))
    }

    /// The TCB the VCEK certifies: bootloader, TEE, SNP, microcode.
    pub fn tcb(&self) -> [u8; 4] {
        self.tcb
    }

    /// The chip ID the reports carry.
    pub fn chip_id(&self) -> [u8; 64] {
        self.chip_id
    }

    /// The report's eight TCB bytes for this chip's TCB: Milan's layout, or
    /// Turin's (FMC first).
    pub fn tcb_bytes(&self) -> [u8; 8] {
        let [bl, tee, snp, ucode] = self.tcb;
        match self.fmc {
            Some(fmc) => [fmc, bl, tee, snp, 0, 0, 0, ucode],
            None => [bl, tee, 0, 0, 0, 0, snp, ucode],
        }
    }

    /// A report with `fields`, signed by the VCEK: version 2, or 3 for
    /// Turin.
    pub fn report(&self, fields: &ReportFields) -> Result<Vec<u8>, AmdError> {
        self.report_claiming(fields, &self.chip_id, self.tcb_bytes())
    }

    /// [`TestAmd::report`] claiming `chip_id` and the TCB bytes `tcb` (in
    /// every TCB field), signed by this chip's VCEK all the same: what a
    /// verifier must hold to the VCEK's extensions.
    pub fn report_claiming(
        &self,
        fields: &ReportFields,
        chip_id: &[u8; 64],
        tcb: [u8; 8],
    ) -> Result<Vec<u8>, AmdError> {
        self.report_of_cpu(fields, chip_id, tcb, self.cpu())
    }

    /// [`TestAmd::report_claiming`] as a version 3 report of the CPU
    /// family and model `cpu`, or as version 2 (`None`: the TCB layout is
    /// then read from the chip ID).
    pub fn report_of_cpu(
        &self,
        fields: &ReportFields,
        chip_id: &[u8; 64],
        tcb: [u8; 8],
        cpu: Option<(u8, u8)>,
    ) -> Result<Vec<u8>, AmdError> {
        self.build(fields, &LaunchFields::default(), chip_id, tcb, cpu)
    }

    /// [`TestAmd::report`] with the launch and platform facts `launch`.
    pub fn report_launched(
        &self,
        fields: &ReportFields,
        launch: &LaunchFields,
    ) -> Result<Vec<u8>, AmdError> {
        self.build(fields, launch, &self.chip_id, self.tcb_bytes(), self.cpu())
    }

    /// The CPU family and model a version 3 report names: Turin's family
    /// and a model for Turin, Milan's for a VLEK's report (whose zero chip
    /// ID cannot tell a version 2 report's TCB layout), none (a version 2
    /// report) otherwise.
    fn cpu(&self) -> Option<(u8, u8)> {
        match (self.fmc, self.vlek) {
            (Some(_), _) => Some((0x1a, 0x02)),
            (None, true) => Some((0x19, 0x01)),
            (None, false) => None,
        }
    }

    /// A report of `fields` and `launch` claiming `chip_id` and `tcb`, as
    /// version 3 of the CPU `cpu` or version 2, signed by the VCEK.
    fn build(
        &self,
        fields: &ReportFields,
        launch: &LaunchFields,
        chip_id: &[u8; 64],
        tcb: [u8; 8],
        cpu: Option<(u8, u8)>,
    ) -> Result<Vec<u8>, AmdError> {
        let mut r = vec![0u8; 1184];
        let version: u32 = if cpu.is_some() { 3 } else { 2 };
        r[0..4].copy_from_slice(&version.to_le_bytes());
        if let Some((family, model)) = cpu {
            r[0x188] = family;
            r[0x189] = model;
        }
        r[0x04..0x08].copy_from_slice(&launch.guest_svn.to_le_bytes());
        r[0x08..0x10].copy_from_slice(&fields.policy.to_le_bytes());
        r[0x30..0x34].copy_from_slice(&fields.vmpl.to_le_bytes());
        r[0x34..0x38].copy_from_slice(&1u32.to_le_bytes()); // ECDSA P-384 SHA-384
        r[0x38..0x40].copy_from_slice(&tcb); // current_tcb
        r[0x40..0x48].copy_from_slice(&launch.platform_info.to_le_bytes());
        let signing_key = launch.signing_key.unwrap_or(u8::from(self.vlek));
        r[0x48] |= (signing_key & 0x7) << 2; // key_info.SIGNING_KEY
        if let Some(author) = launch.author_key_digest {
            r[0x48] |= 1; // key_info.AUTHOR_KEY_EN
            r[0x110..0x140].copy_from_slice(&author);
        }
        r[0x50..0x90].copy_from_slice(&fields.report_data);
        r[0x90..0xc0].copy_from_slice(&fields.measurement);
        r[0xc0..0xe0].copy_from_slice(&fields.host_data);
        r[0xe0..0x110].copy_from_slice(&launch.id_key_digest);
        r[0x180..0x188].copy_from_slice(&tcb); // reported_tcb
        r[0x1a0..0x1e0].copy_from_slice(chip_id);
        r[0x1e0..0x1e8].copy_from_slice(&tcb); // committed_tcb
        r[0x1f0..0x1f8].copy_from_slice(&tcb); // launch_tcb
        let signature: p384::ecdsa::Signature =
            self.vcek.sign_prehash(&Sha384::digest(&r[..0x2a0]))?;
        let (sig_r, sig_s) = signature.split_bytes();
        for (at, scalar) in [(0x2a0, sig_r), (0x2a0 + 72, sig_s)] {
            for (i, b) in scalar.iter().rev().enumerate() {
                r[at + i] = *b;
            }
        }
        Ok(r)
    }
}
