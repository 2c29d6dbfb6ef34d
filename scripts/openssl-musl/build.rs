//! Builds OpenSSL into `$KEEL_OPENSSL_PREFIX` (lib/, include/).
fn main() {
    let Some(prefix) = std::env::var_os("KEEL_OPENSSL_PREFIX") else {
        println!("cargo:warning=KEEL_OPENSSL_PREFIX not set; nothing built");
        return;
    };
    let artifacts = openssl_src::Build::new()
        .out_dir(std::path::PathBuf::from(prefix))
        .build();
    println!("cargo:warning=openssl installed in {}", artifacts.lib_dir().display());
    println!("cargo:rerun-if-env-changed=KEEL_OPENSSL_PREFIX");
}
