// Generates the diond.v1 message types from the repository's proto/ folder with prost-build
// (protoc from PATH or $PROTOC). Nothing generated is committed: it lands in OUT_DIR.
fn main() {
    // Read at run time (not env!()): a build script binary may be reused for another checkout.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = std::path::Path::new(&manifest).join("../../proto");
    let files = [root.join("diond/v1/optimizer.proto"), root.join("diond/v1/peer.proto")];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let mut config = prost_build::Config::new();
    // Deterministic map order for the few map fields (update_norms, lr_override).
    config.btree_map(["."]);
    if let Err(e) = config.compile_protos(&files, &[root]) {
        panic!("prost-build on ../../proto failed (is protoc installed? Debian: protobuf-compiler): {e}");
    }
}
