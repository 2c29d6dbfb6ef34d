//! kubeadm configuration files and runs, against the `keel-standin`
//! program installed from the loopback mirror as `kubeadm` (real Kubernetes
//! cannot run here; the stand-in checks the configuration a real kubeadm
//! needs and writes what kubeadm writes).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use keel_agent::files::write_private;
use keel_agent::kubeadm::{
    BootstrapToken, CaCertHash, ConfigError, ControlPlaneJoin, Discovery, DiscoveryKubeconfig,
    InitConfig, JoinConfig, Kubeadm, KubeadmError, ParseSecretError,
};
use keel_installer::{Component, Installer, InstallerConfig, KubernetesVersion, NoProgress};
use keel_testkit::components::{stand_in_set_with, KubeExecutables};
use keel_testkit::mirror::MirrorServer;
use serde_yaml::Value;

const TOKEN: &str = "abcdef.0123456789abcdef";
const HASH: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000001";

fn version(v: &str) -> KubernetesVersion {
    v.parse().unwrap()
}

fn init_config(root: &Path, v: &str) -> InitConfig {
    InitConfig {
        node_name: "cp-0".into(),
        advertise_address: "10.0.0.5".parse().unwrap(),
        cluster_name: "keel".into(),
        kubernetes_version: version(v),
        cert_sans: vec!["192.0.2.10".into(), "api.keel.example".into()],
        service_cidr: "10.96.0.0/12".into(),
        pod_cidr: "10.244.0.0/16".into(),
        patches_dir: root.join("opt/kubernetes/patches"),
        bootstrap_token: TOKEN.parse().unwrap(),
        control_plane_endpoint: None,
    }
}

fn join_config(root: &Path, v: &str) -> JoinConfig {
    JoinConfig {
        node_name: "worker-1".into(),
        node_ip: "10.0.0.6".parse().unwrap(),
        kubernetes_version: version(v),
        api_server_endpoint: "10.0.0.5:6443".into(),
        discovery: Discovery::Token {
            token: TOKEN.parse().unwrap(),
            ca_cert_hashes: vec![HASH.parse().unwrap()],
        },
        control_plane: None,
        patches_dir: root.join("opt/kubernetes/patches"),
    }
}

fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn field<'a>(doc: &'a Value, path: &[&str]) -> &'a Value {
    path.iter()
        .fold(doc, |v, k| v.get(*k).unwrap_or_else(|| panic!("{path:?}")))
}

#[test]
fn init_config_uses_v1beta4_from_1_31_and_v1beta3_for_1_30() {
    let root = Path::new("/");
    let yaml = init_config(root, "v1.31.13").to_yaml().unwrap();
    let d = docs(&yaml);
    assert_eq!(d.len(), 2);
    assert_eq!(field(&d[0], &["apiVersion"]), "kubeadm.k8s.io/v1beta4");
    assert_eq!(field(&d[0], &["kind"]), "InitConfiguration");
    assert_eq!(field(&d[1], &["kind"]), "ClusterConfiguration");
    assert_eq!(field(&d[1], &["kubernetesVersion"]), "v1.31.13");
    assert_eq!(field(&d[1], &["controlPlaneEndpoint"]), "10.0.0.5:6443");
    assert_eq!(
        field(&d[1], &["networking", "serviceSubnet"]),
        "10.96.0.0/12"
    );
    assert_eq!(field(&d[1], &["networking", "podSubnet"]), "10.244.0.0/16");
    assert_eq!(
        field(&d[1], &["apiServer", "certSANs"]),
        &serde_yaml::from_str::<Value>("[10.0.0.5, 192.0.2.10, api.keel.example]").unwrap()
    );
    assert_eq!(field(&d[0], &["bootstrapTokens"])[0]["token"], TOKEN);
    assert_eq!(
        field(&d[0], &["patches", "directory"]),
        "/opt/kubernetes/patches"
    );
    // v1beta4: extra arguments are a list of {name, value}.
    let args = field(&d[0], &["nodeRegistration", "kubeletExtraArgs"]);
    assert_eq!(args[0]["name"], "node-ip");
    assert_eq!(args[0]["value"], "10.0.0.5");
    // The cluster's keys are ECDSA P-256, in each version's way.
    assert_eq!(field(&d[1], &["encryptionAlgorithm"]), "ECDSA-P256");

    let d = docs(&init_config(root, "v1.30.14").to_yaml().unwrap());
    assert_eq!(field(&d[0], &["apiVersion"]), "kubeadm.k8s.io/v1beta3");
    assert_eq!(field(&d[1], &["apiVersion"]), "kubeadm.k8s.io/v1beta3");
    // v1beta3: a map.
    assert_eq!(
        field(&d[0], &["nodeRegistration", "kubeletExtraArgs", "node-ip"]),
        "10.0.0.5"
    );
    assert_eq!(
        field(&d[1], &["featureGates", "PublicKeysECDSA"]),
        &Value::Bool(true)
    );
    assert!(d[1].get("encryptionAlgorithm").is_none());
}

#[test]
fn join_config_has_discovery_and_an_optional_control_plane_section() {
    let root = Path::new("/");
    let d = docs(&join_config(root, "v1.32.9").to_yaml().unwrap());
    assert_eq!(d.len(), 1);
    assert_eq!(field(&d[0], &["kind"]), "JoinConfiguration");
    assert_eq!(
        field(&d[0], &["discovery", "bootstrapToken", "token"]),
        TOKEN
    );
    assert_eq!(
        field(&d[0], &["discovery", "bootstrapToken", "apiServerEndpoint"]),
        "10.0.0.5:6443"
    );
    assert_eq!(
        field(&d[0], &["discovery", "bootstrapToken", "caCertHashes"])[0],
        HASH
    );
    assert!(d[0].get("controlPlane").is_none());

    let mut cp = join_config(root, "v1.32.9");
    cp.control_plane = Some(ControlPlaneJoin {
        advertise_address: "10.0.0.7".parse().unwrap(),
        certificate_key: Some("ab".repeat(32).parse().unwrap()),
    });
    let d = docs(&cp.to_yaml().unwrap());
    assert_eq!(
        field(
            &d[0],
            &["controlPlane", "localAPIEndpoint", "advertiseAddress"]
        ),
        "10.0.0.7"
    );
    assert_eq!(
        field(&d[0], &["controlPlane", "certificateKey"]),
        &Value::from("ab".repeat(32))
    );
    // Secrets stay out of Debug output.
    let debug = format!("{cp:?}");
    assert!(
        !debug.contains("0123456789abcdef") && !debug.contains(&"ab".repeat(32)),
        "{debug}"
    );
}

/// With the config's endpoint of every control plane, kubeadm's
/// kubeconfigs name it rather than the first control plane's address, and
/// the API server certificates carry it.
#[test]
fn init_config_points_kubeconfigs_at_the_clusters_endpoint() {
    let root = Path::new("/");
    for (endpoint, san) in [
        ("api.cluster.example:6443", "api.cluster.example"),
        ("10.0.0.100:443", "10.0.0.100"),
        ("[fd00::100]:6443", "fd00::100"),
    ] {
        let mut c = init_config(root, "v1.31.13");
        c.control_plane_endpoint = Some(endpoint.into());
        let d = docs(&c.to_yaml().unwrap());
        assert_eq!(field(&d[1], &["controlPlaneEndpoint"]), endpoint);
        let sans = field(&d[1], &["apiServer", "certSANs"]);
        assert_eq!(sans[0], "10.0.0.5");
        assert_eq!(sans[1], san);
        // The node still advertises and binds its own address.
        assert_eq!(
            field(&d[0], &["localAPIEndpoint", "advertiseAddress"]),
            "10.0.0.5"
        );
    }
    let mut c = init_config(root, "v1.31.13");
    c.control_plane_endpoint = Some("api.cluster.example\nkind: Evil:6443".into());
    assert!(matches!(
        c.to_yaml(),
        Err(ConfigError::ApiServerEndpoint(_))
    ));
}

#[test]
fn bad_inputs_are_refused_before_any_file_is_written() {
    let root = Path::new("/");
    let mut c = init_config(root, "v1.31.13");
    c.node_name = "CP_0".into();
    assert!(matches!(
        c.to_yaml(),
        Err(ConfigError::Name {
            field: "node name",
            ..
        })
    ));
    let mut c = init_config(root, "v1.31.13");
    c.cluster_name = "a\nkind: Evil".into();
    assert!(matches!(c.to_yaml(), Err(ConfigError::Name { .. })));
    for cidr in [
        "10.96.0.0",
        "10.96.0.0/33",
        "10.96.0.0/012",
        "x/12",
        "10.96.0.0/+8",
    ] {
        let mut c = init_config(root, "v1.31.13");
        c.service_cidr = cidr.into();
        assert!(
            matches!(c.to_yaml(), Err(ConfigError::Cidr { .. })),
            "{cidr}"
        );
    }
    let mut c = init_config(root, "v1.31.13");
    c.cert_sans.push("not a name".into());
    assert_eq!(c.to_yaml(), Err(ConfigError::CertSan("not a name".into())));
    assert!(matches!(
        init_config(root, "v1.29.9").to_yaml(),
        Err(ConfigError::Version(_))
    ));
    let mut c = init_config(root, "v1.31.13");
    c.patches_dir = PathBuf::from("relative/patches");
    assert!(matches!(c.to_yaml(), Err(ConfigError::PatchesDir(_))));

    let mut j = join_config(root, "v1.31.13");
    j.api_server_endpoint = "10.0.0.5".into();
    assert!(matches!(
        j.to_yaml(),
        Err(ConfigError::ApiServerEndpoint(_))
    ));
    let mut j = join_config(root, "v1.31.13");
    if let Discovery::Token { ca_cert_hashes, .. } = &mut j.discovery {
        ca_cert_hashes.clear();
    }
    assert_eq!(j.to_yaml().unwrap_err(), ConfigError::NoCaCertHash);
    let mut j = join_config(root, "v1.31.13");
    j.discovery = Discovery::File {
        path: PathBuf::from("relative.conf"),
        kubeconfig: discovery_kubeconfig("worker-1", "a key"),
    };
    assert!(matches!(j.to_yaml(), Err(ConfigError::DiscoveryFile(_))));

    for bad in [
        "abcdef0123456789abcdef",
        "ABCDEF.0123456789abcdef",
        "abcde.0123456789abcdef0",
    ] {
        assert_eq!(
            bad.parse::<BootstrapToken>().unwrap_err(),
            ParseSecretError::BootstrapToken
        );
    }
    assert_eq!(
        "sha256:00".parse::<CaCertHash>().unwrap_err(),
        ParseSecretError::CaCertHash
    );
    let generated = BootstrapToken::generate();
    assert!(generated.expose().parse::<BootstrapToken>().is_ok());
    assert_ne!(generated.expose(), BootstrapToken::generate().expose());
    assert!(!format!("{generated:?}").contains(&generated.expose()[7..]));
}

/// A node root with the stand-in installed as kubeadm from the mirror.
struct Node {
    _mirror: MirrorServer,
    dir: tempfile::TempDir,
}

impl Node {
    async fn new(v: &str) -> Self {
        let mirror = MirrorServer::start().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let kube = KubeExecutables::standin().unwrap();
        let list: Vec<Component> = stand_in_set_with(&mirror, root, v, &kube)
            .unwrap()
            .iter()
            .map(|c| Component::try_from(c).unwrap())
            .collect();
        Installer::new(InstallerConfig::default())
            .unwrap()
            .install_all(&list, &NoProgress)
            .await
            .unwrap();
        std::fs::create_dir_all(root.join("opt/kubernetes/patches")).unwrap();
        Self {
            _mirror: mirror,
            dir,
        }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn kubeadm(&self, v: &str, env: &[(&str, &str)]) -> Kubeadm {
        let mut k = Kubeadm::new(&self.root().join("run/state/bin"));
        k.root = self.root().to_owned();
        k.join_backoff = Duration::from_millis(10);
        k.env = [
            ("KEEL_STANDIN_ROOT", self.root().to_str().unwrap()),
            ("KEEL_STANDIN_VERSION", v),
        ]
        .iter()
        .chain(env)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        k
    }

    fn write(&self, name: &str, yaml: &str) -> PathBuf {
        let path = self.root().join("etc/kubernetes/keel").join(name);
        write_private(&path, yaml.as_bytes()).unwrap();
        path
    }
}

async fn run_init(k: &Kubeadm, config: &Path) -> (Result<Vec<u8>, KubeadmError>, Vec<String>) {
    let mut lines = Vec::new();
    let result = k
        .init(config, &mut |l: &str| lines.push(l.to_owned()))
        .await
        .map(|c| c.to_vec());
    (result, lines)
}

async fn run_join(k: &Kubeadm, config: &Path) -> (Result<(), KubeadmError>, Vec<String>) {
    run_join_restoring(k, config, &mut || Ok(())).await
}

async fn run_join_restoring(
    k: &Kubeadm,
    config: &Path,
    restore: &mut (dyn FnMut() -> Result<(), keel_agent::files::WriteFileError> + Send),
) -> (Result<(), KubeadmError>, Vec<String>) {
    let mut lines = Vec::new();
    let result = k
        .join(config, restore, &mut |l: &str| lines.push(l.to_owned()))
        .await;
    (result, lines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_returns_the_admin_kubeconfig_and_streams_scrubbed_output() {
    for v in ["v1.31.13", "v1.30.14"] {
        let node = Node::new(v).await;
        let config = node.write("init.yaml", &init_config(node.root(), v).to_yaml().unwrap());
        let (result, lines) = run_init(&node.kubeadm(v, &[]), &config).await;
        let kubeconfig = result.unwrap_or_else(|e| panic!("{v}: {e}: {lines:#?}"));

        let text = lines.join("\n");
        assert!(
            text.contains(&format!("[init] Using Kubernetes version: {v}")),
            "{text}"
        );
        assert!(text.contains("initialized successfully"), "{text}");
        assert!(
            text.contains("[bootstrap-token] Using token: abcdef.<redacted>"),
            "{text}"
        );
        assert!(
            !text.contains("0123456789abcdef"),
            "token secret leaked: {text}"
        );

        let kc: Value = serde_yaml::from_slice(&kubeconfig).unwrap();
        assert_eq!(
            kc["clusters"][0]["cluster"]["server"],
            "https://10.0.0.5:6443"
        );
        let ca_pem = base64::engine::general_purpose::STANDARD
            .decode(
                kc["clusters"][0]["cluster"]["certificate-authority-data"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(
            ca_pem,
            std::fs::read(node.root().join("etc/kubernetes/pki/ca.crt")).unwrap()
        );
        assert!(kc["users"][0]["user"]["client-key-data"].is_string());

        // The API server certificate carries the requested SANs.
        let pem = std::fs::read(node.root().join("etc/kubernetes/pki/apiserver.crt")).unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
        let cert = pem.parse_x509().unwrap();
        let sans = cert.subject_alternative_name().unwrap().unwrap().value;
        let names: Vec<String> = sans
            .general_names
            .iter()
            .map(|n| match n {
                x509_parser::extensions::GeneralName::DNSName(d) => (*d).to_owned(),
                x509_parser::extensions::GeneralName::IPAddress(ip) => {
                    let b: [u8; 4] = (*ip).try_into().unwrap();
                    IpAddr::from(b).to_string()
                }
                other => format!("{other:?}"),
            })
            .collect();
        for want in [
            "10.0.0.5",
            "192.0.2.10",
            "api.keel.example",
            "kubernetes.default.svc",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_fails_clearly_on_a_config_kubeadm_would_refuse() {
    let node = Node::new("v1.30.14").await;
    // A v1beta4 file for a kubeadm that is v1.30.
    let config = node.write(
        "init.yaml",
        &init_config(node.root(), "v1.31.13").to_yaml().unwrap(),
    );
    let (result, _) = run_init(&node.kubeadm("v1.30.14", &[]), &config).await;
    match result {
        Err(KubeadmError::Failed {
            command: "init",
            last_lines,
            ..
        }) => {
            assert!(
                last_lines
                    .iter()
                    .any(|l| l.contains("this kubeadm is v1.30.14")),
                "{last_lines:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // v1beta4 with v1beta3-shaped extra arguments.
    let yaml = init_config(node.root(), "v1.31.13")
        .to_yaml()
        .unwrap()
        .replace(
            "kubeletExtraArgs:\n    - name: \"node-ip\"\n      value: \"10.0.0.5\"",
            "kubeletExtraArgs:\n    node-ip: \"10.0.0.5\"",
        );
    assert!(yaml.contains("    node-ip: "), "{yaml}");
    let config = node.write("init.yaml", &yaml);
    let (result, _) = run_init(&node.kubeadm("v1.31.13", &[]), &config).await;
    let err = result.unwrap_err();
    assert!(err.to_string().contains("wrong shape for v1beta4"), "{err}");
    // Nothing was written by the refused runs.
    assert!(!node.root().join("etc/kubernetes/admin.conf").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_failure_and_timeout_are_reported() {
    let v = "v1.31.13";
    let node = Node::new(v).await;
    let config = node.write("init.yaml", &init_config(node.root(), v).to_yaml().unwrap());
    let (result, lines) = run_init(
        &node.kubeadm(v, &[("KEEL_STANDIN_FAIL", "always")]),
        &config,
    )
    .await;
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            KubeadmError::Failed {
                command: "init",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("failure injected"), "{err}");
    assert!(
        lines.iter().any(|l| l.contains("failure injected")),
        "{lines:?}"
    );

    let mut slow = node.kubeadm(v, &[("KEEL_STANDIN_SLEEP", "30")]);
    slow.init_timeout = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let (result, _) = run_init(&slow, &config).await;
    assert!(
        matches!(
            result,
            Err(KubeadmError::Timeout {
                command: "init",
                ..
            })
        ),
        "{result:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_writes_kubelet_conf_and_retries_with_a_reset() {
    let v = "v1.32.9";
    let node = Node::new(v).await;
    let config = node.write("join.yaml", &join_config(node.root(), v).to_yaml().unwrap());
    let kubelet_conf = node.root().join("etc/kubernetes/kubelet.conf");

    // Two failed attempts (each leaves kubelet.conf behind), then success:
    // only the reset in between lets the next attempt pass preflight.
    let (result, lines) = run_join(&node.kubeadm(v, &[("KEEL_STANDIN_FAIL", "2")]), &config).await;
    result.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
    assert_eq!(
        lines.iter().filter(|l| l.contains("attempt")).count(),
        2,
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("[reset] Deleted")),
        "{lines:#?}"
    );
    assert!(lines
        .iter()
        .any(|l| l.contains("This node has joined the cluster")));
    let kc: Value = serde_yaml::from_slice(&std::fs::read(&kubelet_conf).unwrap()).unwrap();
    assert_eq!(
        kc["clusters"][0]["cluster"]["server"],
        "https://10.0.0.5:6443"
    );
    assert_eq!(kc["users"][0]["name"], "system:node:worker-1");

    // A join over a joined node fails preflight; bounded attempts, each
    // reset, the last one too (a control plane's reset takes its etcd
    // member out again).
    let mut k = node.kubeadm(v, &[("KEEL_STANDIN_FAIL", "always")]);
    k.join_attempts = 2;
    let (result, lines) = run_join(&k, &config).await;
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.starts_with("[reset] Deleting contents of"))
            .count(),
        2 * 2,
        "{lines:#?}"
    );
    match result {
        Err(KubeadmError::JoinAttempts { attempts: 2, last }) => {
            assert!(
                matches!(
                    *last,
                    KubeadmError::Failed {
                        command: "join",
                        ..
                    }
                ),
                "{last:?}"
            );
        }
        other => panic!("{other:?}: {lines:#?}"),
    }
}

/// The discovery kubeconfig of a node `name`: a CA, a kubelet certificate
/// the CA issued for `O=system:nodes, CN=system:node:<name>`, and `key` as
/// its private key's PEM (the stand-in only checks its label).
fn discovery_kubeconfig(name: &str, key: &str) -> DiscoveryKubeconfig {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "kubernetes");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key_pair = rcgen::KeyPair::generate().unwrap();
    let mut node = rcgen::CertificateParams::new(Vec::new()).unwrap();
    node.distinguished_name
        .push(rcgen::DnType::OrganizationName, "system:nodes");
    node.distinguished_name
        .push(rcgen::DnType::CommonName, format!("system:node:{name}"));
    let cert = node.signed_by(&key_pair, &issuer).unwrap();
    DiscoveryKubeconfig {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: zeroize::Zeroizing::new(if key.is_empty() {
            key_pair.serialize_pem()
        } else {
            format!("-----BEGIN PRIVATE KEY-----\n{key}\n-----END PRIVATE KEY-----\n")
        }),
    }
}

/// A join with kubeadm's file discovery: the configuration names the
/// kubeconfig, which holds the server, the CA and the node's client
/// certificate and key (never a token). The stand-in, as kubeadm's TLS
/// bootstrap would, takes a certificate of this node's name only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_discovery_join_presents_the_nodes_own_certificate() {
    let v = "v1.32.9";
    let node = Node::new(v).await;
    let path = node.root().join("run/discovery.conf");
    let mut config = join_config(node.root(), v);
    config.discovery = Discovery::File {
        path: path.clone(),
        kubeconfig: discovery_kubeconfig("worker-1", ""),
    };
    let d = docs(&config.to_yaml().unwrap());
    assert_eq!(
        field(&d[0], &["discovery", "file", "kubeConfigPath"]),
        &Value::from(path.to_str().unwrap())
    );
    assert!(d[0]["discovery"].get("bootstrapToken").is_none());
    let Discovery::File { kubeconfig, .. } = &config.discovery else {
        unreachable!()
    };
    assert!(!format!("{kubeconfig:?}").contains("PRIVATE"));
    let file = kubeconfig.render("10.0.0.5:6443", "worker-1").unwrap();
    let kc: Value = serde_yaml::from_str(&file).unwrap();
    assert_eq!(
        kc["clusters"][0]["cluster"]["server"],
        "https://10.0.0.5:6443"
    );
    assert_eq!(kc["users"][0]["name"], "system:node:worker-1");
    assert_eq!(kc["current-context"], "keel-join");
    let b64 = |v: &Value| {
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(v.as_str().unwrap())
                .unwrap(),
        )
        .unwrap()
    };
    assert_eq!(
        b64(&kc["users"][0]["user"]["client-key-data"]),
        *kubeconfig.key_pem
    );
    assert!(kubeconfig.render("10.0.0.5", "worker-1").is_err());
    assert!(kubeconfig.render("10.0.0.5:6443", "Worker 1").is_err());

    // kubeadm (the stand-in) takes it, and joins as the node.
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    write_private(&path, file.as_bytes()).unwrap();
    let join = node.write("join.yaml", &config.to_yaml().unwrap());
    let (result, lines) = run_join(&node.kubeadm(v, &[]), &join).await;
    result.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
    let joined = std::fs::read_to_string(node.root().join("var/lib/keel-standin/joined-with"));
    assert_eq!(joined.unwrap(), "file\n");

    // Another node's certificate is not this node's bootstrap identity;
    // nor is this node's with another key, or signed by another CA.
    let own = discovery_kubeconfig("worker-1", "");
    let with_key_of = |other: &DiscoveryKubeconfig| DiscoveryKubeconfig {
        key_pem: other.key_pem.clone(),
        ..own.clone()
    };
    let with_ca_of = |other: &DiscoveryKubeconfig| DiscoveryKubeconfig {
        ca_pem: other.ca_pem.clone(),
        ..own.clone()
    };
    let stranger = discovery_kubeconfig("worker-1", "");
    for (i, (kubeconfig, why)) in [
        (
            discovery_kubeconfig("worker-2", ""),
            "is not system:node:worker-1 in system:nodes",
        ),
        (
            with_key_of(&stranger),
            "its client key is not its client certificate's",
        ),
        (
            with_ca_of(&stranger),
            "its client certificate is not signed by its CA",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let path = node.root().join(format!("run/other-{i}.conf"));
        let file = kubeconfig.render("10.0.0.5:6443", "worker-1").unwrap();
        write_private(&path, file.as_bytes()).unwrap();
        config.discovery = Discovery::File { path, kubeconfig };
        let join = node.write(&format!("join-other-{i}.yaml"), &config.to_yaml().unwrap());
        let mut k = node.kubeadm(v, &[]);
        k.join_attempts = 1;
        let (result, lines) = run_join(&k, &join).await;
        assert!(result.is_err(), "{why}: {lines:#?}");
        assert!(lines.iter().any(|l| l.contains(why)), "{why}: {lines:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_join_needs_the_cluster_ca_or_a_certificate_key() {
    let v = "v1.31.13";
    let node = Node::new(v).await;
    let mut cp = join_config(node.root(), v);
    cp.control_plane = Some(ControlPlaneJoin {
        advertise_address: "10.0.0.7".parse().unwrap(),
        certificate_key: None,
    });
    let config = node.write("join.yaml", &cp.to_yaml().unwrap());
    let mut k = node.kubeadm(v, &[]);
    k.join_attempts = 1;
    let (result, _) = run_join(&k, &config).await;
    let err = result.unwrap_err();
    let KubeadmError::JoinAttempts { last, .. } = &err else {
        panic!("{err:?}");
    };
    assert!(
        last.to_string()
            .contains("failure loading certificate authority"),
        "{last}"
    );

    // With the control-plane files in place (as a join ticket delivers them).
    let pki = node.root().join("etc/kubernetes/pki");
    std::fs::create_dir_all(&pki).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::fs::write(pki.join("ca.crt"), params.self_signed(&key).unwrap().pem()).unwrap();
    std::fs::write(pki.join("ca.key"), key.serialize_pem()).unwrap();
    let (result, lines) = run_join(&k, &config).await;
    result.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
    assert!(
        lines.iter().any(|l| l.contains("[control-plane]")),
        "{lines:#?}"
    );
}

/// A failed join is reset before the next attempt, and the reset empties
/// the certificates directory and the kubelet's directory: what the join
/// ticket brought (the cluster CA and its key, the kubelet's certificate)
/// must be put back, or every retry of a control plane fails for want of
/// the CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_join_gets_back_what_the_reset_removed() {
    let v = "v1.31.13";
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let files = [
        (
            "etc/kubernetes/pki/ca.crt",
            params.self_signed(&key).unwrap().pem(),
        ),
        ("etc/kubernetes/pki/ca.key", key.serialize_pem()),
        (
            "var/lib/kubelet/pki/kubelet-client.crt",
            "kubelet certificate".to_owned(),
        ),
    ];
    let files = &files;
    for restoring in [false, true] {
        let node = Node::new(v).await;
        let root = node.root().to_owned();
        let write = move || {
            files
                .iter()
                .try_for_each(|(path, data)| write_private(&root.join(path), data.as_bytes()))
        };
        write().unwrap();
        let mut cp = join_config(node.root(), v);
        cp.control_plane = Some(ControlPlaneJoin {
            advertise_address: "10.0.0.7".parse().unwrap(),
            certificate_key: None,
        });
        let config = node.write("join.yaml", &cp.to_yaml().unwrap());
        let mut k = node.kubeadm(v, &[("KEEL_STANDIN_FAIL", "1")]);
        k.join_attempts = 2;
        let mut restore = || if restoring { write() } else { Ok(()) };
        let (result, lines) = run_join_restoring(&k, &config, &mut restore).await;
        let kubelet_cert = node.root().join("var/lib/kubelet/pki/kubelet-client.crt");
        if restoring {
            result.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
            assert!(kubelet_cert.exists());
        } else {
            let Err(KubeadmError::JoinAttempts { last, .. }) = &result else {
                panic!("{result:?}: {lines:#?}");
            };
            assert!(
                last.to_string()
                    .contains("failure loading certificate authority"),
                "{last}"
            );
            assert!(!kubelet_cert.exists(), "the reset left the kubelet's files");
        }
    }
}

/// The init server and join client run these on tokio tasks: the futures
/// must be `Send`.
#[test]
fn futures_are_send() {
    fn send<T: Send>(_: &T) {}
    let k = Kubeadm::new(Path::new("/run/state/bin"));
    let mut sink = |_: &str| {};
    send(&k.init(Path::new("/x"), &mut sink));
    let mut sink = |_: &str| {};
    let mut restore = || Ok(());
    send(&k.join(Path::new("/x"), &mut restore, &mut sink));
}

#[tokio::test(flavor = "current_thread")]
async fn tokens_asked_for_together_are_registered_by_one_kubeadm_run() {
    use keel_agent::join::tokens::{TokenError, TokenRegistrar};
    use std::sync::Arc;

    let v = "v1.31.13";
    let node = Node::new(v).await;
    let config_dir = node.root().join("work/tokens");
    let registrar = Arc::new(TokenRegistrar::new(
        node.kubeadm(v, &[]),
        config_dir.clone(),
    ));
    let register_all = |tokens: Vec<BootstrapToken>| {
        let mut set = tokio::task::JoinSet::new();
        for token in tokens {
            let registrar = registrar.clone();
            set.spawn(async move { registrar.register(&token, version(v)).await });
        }
        set
    };

    // No cluster yet (no admin.conf): the run fails, and so does each token
    // of it, with kubeadm's cause.
    let mut failing = register_all((0..3).map(|_| BootstrapToken::generate()).collect());
    while let Some(result) = failing.join_next().await {
        let err = result.unwrap().unwrap_err();
        let TokenError::Kubeadm(cause) = &err else {
            panic!("{err:?}");
        };
        assert!(cause.to_string().contains("admin kubeconfig"), "{cause}");
    }

    std::fs::create_dir_all(node.root().join("etc/kubernetes")).unwrap();
    std::fs::write(
        node.root().join("etc/kubernetes/admin.conf"),
        "apiVersion: v1\n",
    )
    .unwrap();
    let before = registrar.stats();
    let tokens: Vec<BootstrapToken> = (0..20).map(|_| BootstrapToken::generate()).collect();
    let mut set = register_all(tokens.clone());
    while let Some(result) = set.join_next().await {
        result.unwrap().unwrap();
    }
    // Each token is registered, as the cluster would hold it.
    for token in &tokens {
        let record = node
            .root()
            .join("var/lib/keel-standin/tokens")
            .join(token.id());
        assert_eq!(
            std::fs::read_to_string(record).unwrap(),
            format!("{} ttl=15m0s\n", token.expose())
        );
    }
    // All were queued before the first run started: one run for twenty.
    let after = registrar.stats();
    assert_eq!(after.requests - before.requests, 20);
    assert_eq!(after.rounds - before.rounds, 1, "{after:?}");
    // The token file is gone after the run.
    assert_eq!(std::fs::read_dir(&config_dir).unwrap().count(), 0);
}

/// kubeadm's leaf certificates last a year and kubeadm renews them only in
/// an upgrade: a control plane renews them itself once the first is within
/// 30 days of its end, and restarts its control-plane pods (crictl, beside
/// kubeadm) so that they read the new ones. Not before: a certificate with
/// a year left is not touched, and no pod restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_renews_kubeadms_certificates_before_they_end() {
    use keel_agent::kubeadm::certs::{first_to_end, RENEW_BEFORE};
    use std::time::SystemTime;

    let v = "v1.31.13";
    let node = Node::new(v).await;
    // A crictl that records its calls and lists two control-plane pods.
    let calls = node.root().join("crictl-calls");
    let crictl = node.root().join("run/state/bin/crictl");
    std::fs::write(
        &crictl,
        format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\ncase \"$*\" in *' pods '*) echo 3f2a-pod; echo 9c1b-pod;; esac\n",
            calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&crictl, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = node.write("init.yaml", &init_config(node.root(), v).to_yaml().unwrap());
    let k = node.kubeadm(v, &[("KEEL_STANDIN_CERT_DAYS", "10")]);
    let (result, lines) = run_init(&k, &config).await;
    result.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));

    let now = SystemTime::now();
    let first = first_to_end(node.root()).unwrap().unwrap();
    assert!(first.path.ends_with("pki/apiserver.crt"), "{first:?}");
    assert!(first.at < now + RENEW_BEFORE, "{first:?}");
    let renewed = k.renew_certificates_if_due(now).await.unwrap();
    assert_eq!(renewed, Some(first));
    let after = first_to_end(node.root()).unwrap().unwrap();
    assert!(
        after.at > now + Duration::from_secs(300 * 86_400),
        "{after:?}"
    );
    let called = std::fs::read_to_string(&calls).unwrap();
    assert!(
        called.contains("pods --label=tier=control-plane")
            && called.contains("stopp 3f2a-pod 9c1b-pod"),
        "{called}"
    );

    // A year left: nothing renewed, no pod restarted.
    std::fs::remove_file(&calls).unwrap();
    assert_eq!(k.renew_certificates_if_due(now).await.unwrap(), None);
    assert_eq!(first_to_end(node.root()).unwrap(), Some(after));
    assert!(!calls.exists());
}
