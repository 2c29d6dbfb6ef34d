//! The issuer side of CPU evidence: the configfs-tsm client against a
//! directory laid out like the kernel's interface, and Azure's HCL report
//! read from NV index 0x01400001 of a real swtpm holding a real report.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use keel_agent::attestation::cpu::{
    endorsement_certificate, AzureHcl, ConfigfsTsm, CpuReportError, CpuReporter,
};
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_proto::attestation::cpu_evidence;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::cpu::binding::{report_data, HclReport};
use keel_verifier::cpu::{snp, Binding, Variant};

fn data(path: &str) -> Vec<u8> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/cvm");
    std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// An SNP certificate table holding `vcek` under its GUID.
fn cert_table(vcek: &[u8]) -> Vec<u8> {
    let guid = [
        0x8d, 0x75, 0xda, 0x63, 0x64, 0xe6, 0x64, 0x45, 0xad, 0xc5, 0xf4, 0xb9, 0x3b, 0xe8, 0xac,
        0xcd,
    ];
    let mut t = guid.to_vec();
    t.extend_from_slice(&48u32.to_le_bytes());
    t.extend_from_slice(&(vcek.len() as u32).to_le_bytes());
    t.extend_from_slice(&[0; 24]);
    t.extend_from_slice(vcek);
    t
}

/// A report entry as the kernel shows it once the directory is made.
fn kernel_entry(dir: &Path, provider: &str, outblob: &[u8], auxblob: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("provider"), format!("{provider}\n")).unwrap();
    std::fs::write(dir.join("generation"), "1\n").unwrap();
    std::fs::write(dir.join("outblob"), outblob).unwrap();
    std::fs::write(dir.join("auxblob"), auxblob).unwrap();
}

/// The kernel's side of one request in `dir` (made by [`kernel_entry`]):
/// `inblob` and `outblob` become FIFOs; once the request's write has
/// arrived, `generation` is set to each of `generations` in turn, the last
/// one while the request reads `outblob` (`report`). Returns what the
/// request wrote.
fn kernel_serves(
    dir: &Path,
    report: Vec<u8>,
    generations: &'static [&'static str],
) -> std::thread::JoinHandle<Vec<u8>> {
    use std::io::{Read as _, Write as _};
    let (inblob, outblob, generation) = (
        dir.join("inblob"),
        dir.join("outblob"),
        dir.join("generation"),
    );
    let _ = std::fs::remove_file(&outblob);
    for fifo in [&inblob, &outblob] {
        nix::unistd::mkfifo(fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    }
    std::thread::spawn(move || {
        let mut written = Vec::new();
        std::fs::File::open(&inblob)
            .unwrap()
            .read_to_end(&mut written)
            .unwrap();
        let (last, first) = generations.split_last().unwrap();
        for count in first {
            std::fs::write(&generation, count).unwrap();
        }
        // Opening blocks until the request opens outblob for reading.
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .open(&outblob)
            .unwrap();
        std::fs::write(&generation, last).unwrap();
        out.write_all(&report).unwrap();
        written
    })
}

#[test]
fn configfs_tsm_writes_report_data_and_reads_report_and_vcek() {
    let root = tempfile::tempdir().unwrap();
    let entry = root.path().join("entry0");
    let report = data("snp/milan-virtee/report_milan.bin");
    let vcek = data("snp/milan-virtee/vcek_milan.der");
    kernel_entry(&entry, "sev_guest", &report, &cert_table(&vcek));
    let kernel = kernel_serves(&entry, report.clone(), &["2\n"]);

    let tsm = ConfigfsTsm::new(root.path(), Variant::SevSnp).unwrap();
    let rd = report_data(b"nonce", b"ak public area");
    let got = tsm.report_in(&entry, &rd).unwrap();
    assert_eq!(kernel.join().unwrap(), rd);
    assert_eq!(got.outblob, report);
    assert_eq!(endorsement_certificate(&got.auxblob).unwrap(), vcek);
    // What the node read is the real report, verifiable as such.
    snp::parse(&got.outblob).unwrap();

    // The tdx variant needs the tdx_guest provider.
    let tdx = ConfigfsTsm::new(root.path(), Variant::Tdx).unwrap();
    let err = tdx.report_in(&entry, &rd).unwrap_err();
    assert!(
        matches!(&err, CpuReportError::Provider { expected: "tdx_guest", actual } if actual == "sev_guest"),
        "{err:?}"
    );
    assert!(ConfigfsTsm::new(root.path(), Variant::Vtpm).is_none());
}

/// A config that names VMPL 2 has the node ask at that level: `privlevel`
/// is written before `inblob`, and both writes must be the only ones the
/// kernel counted.
#[test]
fn configfs_tsm_requests_at_the_configured_privilege_level() {
    let report = data("snp/milan-virtee/report_milan.bin");
    for (generations, accepted) in [(&["3\n"][..], true), (&["2\n"][..], false)] {
        let root = tempfile::tempdir().unwrap();
        let entry = root.path().join("entry0");
        kernel_entry(&entry, "sev_guest", &report, b"");
        let kernel = kernel_serves(&entry, report.clone(), generations);
        let tsm = ConfigfsTsm::new(root.path(), Variant::SevSnp)
            .unwrap()
            .with_privlevel(2);
        let got = tsm.report_in(&entry, &[7; 64]);
        assert_eq!(kernel.join().unwrap(), [7; 64]);
        assert_eq!(
            std::fs::read_to_string(entry.join("privlevel")).unwrap(),
            "2"
        );
        match got {
            Ok(got) => {
                assert!(accepted);
                assert_eq!(got.outblob, report);
            }
            Err(err) => {
                assert!(!accepted, "{err:?}");
                assert!(matches!(err, CpuReportError::Raced { .. }), "{err:?}");
            }
        }
    }
    // The default level writes nothing: the kernel's own default applies.
    let root = tempfile::tempdir().unwrap();
    let entry = root.path().join("entry0");
    kernel_entry(&entry, "sev_guest", &report, b"");
    let kernel = kernel_serves(&entry, report.clone(), &["2\n"]);
    let tsm = ConfigfsTsm::new(root.path(), Variant::SevSnp)
        .unwrap()
        .with_privlevel(0);
    tsm.report_in(&entry, &[7; 64]).unwrap();
    kernel.join().unwrap();
    assert!(!entry.join("privlevel").exists());
}

#[test]
fn configfs_tsm_refuses_oversized_blobs() {
    let root = tempfile::tempdir().unwrap();
    let entry = root.path().join("entry0");
    kernel_entry(&entry, "sev_guest", &vec![0; 64 * 1024], &[]);
    let tsm = ConfigfsTsm::new(root.path(), Variant::SevSnp).unwrap();
    let err = tsm.report_in(&entry, &[0; 64]).unwrap_err();
    assert!(matches!(err, CpuReportError::TooLarge { .. }), "{err:?}");
}

#[test]
fn configfs_tsm_request_directory_is_removed_after_a_failure() {
    let ca = EkCa::new().unwrap();
    let swtpm = Swtpm::start(&ca).unwrap();
    let mut tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    // A plain directory: the entry is made, but no kernel fills it.
    let root = tempfile::tempdir().unwrap();
    let tsm = ConfigfsTsm::new(root.path(), Variant::SevSnp).unwrap();
    let err = tsm.report(&[0; 64], &mut tpm).unwrap_err();
    assert!(
        matches!(&err, CpuReportError::Io { path, .. } if path.ends_with("provider")),
        "{err:?}"
    );
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    // No interface at all.
    let missing = ConfigfsTsm::new(root.path().join("absent"), Variant::SevSnp).unwrap();
    assert!(matches!(
        missing.report(&[0; 64], &mut tpm),
        Err(CpuReportError::Io { .. })
    ));
}

fn tpm2_tool(swtpm: &Swtpm, args: &[&str]) {
    swtpm.tool(args).unwrap();
}

#[test]
fn the_hcl_report_is_read_from_the_vtpm_nv_index() {
    let ca = EkCa::new().unwrap();
    let swtpm = Swtpm::start(&ca).unwrap();
    // A real HCL report (azure-cvm-tooling's, 2048 bytes: swtpm's largest
    // NV index), written as Azure's paravisor does, before the agent opens
    // the TPM (swtpm serves one connection at a time).
    let hcl = data("snp/azure-milan-hcl-mismatch/hcl-report-snp.bin");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("hcl.bin");
    std::fs::write(&file, &hcl).unwrap();
    let size = hcl.len().to_string();
    tpm2_tool(
        &swtpm,
        &[
            "tpm2_nvdefine",
            "0x01400001",
            "-C",
            "o",
            "-s",
            &size,
            "-a",
            "ownerread|ownerwrite|authread|authwrite",
        ],
    );
    tpm2_tool(
        &swtpm,
        &[
            "tpm2_nvwrite",
            "0x01400001",
            "-C",
            "o",
            "-i",
            file.to_str().unwrap(),
        ],
    );

    let mut tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let evidence = AzureHcl.report(&[0; 64], &mut tpm).unwrap();
    assert_eq!(evidence.binding, cpu_evidence::Binding::AzureHcl as i32);
    assert_eq!(evidence.report, hcl);
    // The bytes read are an HCL report whose SNP report_data commits to
    // its runtime data, and that names an RSA attestation key.
    let parsed = HclReport::parse(&evidence.report).unwrap();
    let report = snp::parse(parsed.report).unwrap();
    let (n, _) = parsed.attestation_key().unwrap();
    assert_eq!(n.len(), 256);
    let err = Binding::AzureHcl
        .check(&evidence.report, &report.report_data, b"not the AK", b"")
        .unwrap_err();
    assert_eq!(err, keel_verifier::cpu::BindingError::AkMismatch);

    // An index that is not defined is an error naming it.
    let err = tpm.nv_read(0x0140_0002).unwrap_err();
    assert!(err.to_string().contains("0x01400002"), "{err}");
}

/// Race: another writer changes the request between this request's write
/// and its read of the report (the kernel counts every write in
/// `generation`); the report, which may carry the other writer's
/// `report_data`, is refused. So is a report that this request's write did
/// not count: it is someone else's, from before.
#[test]
fn configfs_tsm_refuses_a_report_raced_by_another_writer() {
    let report = data("snp/milan-virtee/report_milan.bin");
    let tsm = |root: &Path| ConfigfsTsm::new(root, Variant::SevSnp).unwrap();
    for (generations, after) in [
        // Another write while the report is read.
        (&["2\n", "3\n"][..], "3"),
        // Another write right after this one, before the report is read.
        (&["3\n", "3\n"][..], "3"),
        // This write not counted.
        (&["1\n"][..], "1"),
    ] {
        let root = tempfile::tempdir().unwrap();
        let entry = root.path().join("entry0");
        kernel_entry(&entry, "sev_guest", b"", b"");
        let kernel = kernel_serves(&entry, report.clone(), generations);
        let err = tsm(root.path()).report_in(&entry, &[7; 64]).unwrap_err();
        assert_eq!(kernel.join().unwrap(), [7; 64]);
        assert!(
            matches!(&err, CpuReportError::Raced { before, after: a } if before == "1" && a == after),
            "{generations:?}: {err:?}"
        );
    }

    // A generation that is not a count is refused as such.
    let root = tempfile::tempdir().unwrap();
    let entry = root.path().join("entry0");
    kernel_entry(&entry, "sev_guest", &report, b"");
    std::fs::write(entry.join("generation"), "one\n").unwrap();
    let err = tsm(root.path()).report_in(&entry, &[7; 64]).unwrap_err();
    assert!(matches!(err, CpuReportError::Generation { .. }), "{err:?}");
}
