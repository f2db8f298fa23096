//! Builds the agent (`libcorsnap_agent.so`) so that the `corsnap` binary can
//! carry it (`src/embedded_agent.rs`): `cargo install --path crates/corsnap`,
//! or copying the one `corsnap` file, gives a working profiler.
//!
//! Cargo has no stable way for a binary to depend on another crate's
//! `cdylib` (artifact dependencies are nightly-only), so this runs a nested
//! `cargo build -p corsnap-agent` with the same profile and flags. It builds
//! into a target directory of its own (`<target>/embedded-agent`): the
//! outer build holds the lock of its own directory for as long as this
//! script runs, and a nested cargo waiting for it would wait for ever. The
//! nested cargo runs in the workspace, so it reads the same
//! `.cargo/config.toml` (the offline source of `scripts/cargo-source.sh`),
//! and shares the outer build's job slots through the jobserver cargo hands
//! to build scripts.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.join("../..");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let embedded = out_dir.join("libcorsnap_agent.so");

    for watched in ["crates/corsnap-agent", "crates/corsnap-abi", "crates/corsnap-unwind", "crates/corsnap-wire"] {
        println!("cargo:rerun-if-changed={}", workspace.join(watched).display());
    }
    println!("cargo:rerun-if-changed={}", workspace.join("Cargo.lock").display());
    println!("cargo:rerun-if-changed={}", workspace.join("Cargo.toml").display());
    println!("cargo:rerun-if-env-changed=CORSNAP_EMBED_AGENT");

    // CORSNAP_EMBED_AGENT=0 leaves the agent out (an empty file): for
    // `cargo check`-like uses where nobody runs the binary. Such a corsnap
    // finds its agent beside it or at $CORSNAP_AGENT, as before.
    if env::var("CORSNAP_EMBED_AGENT").is_ok_and(|v| v == "0") {
        std::fs::write(&embedded, b"").expect("writing an empty embedded agent");
        println!("cargo:rustc-env=CORSNAP_EMBEDDED_AGENT_HASH=none");
        return;
    }

    // <target>/<profile>/build/corsnap-<hash>/out → <target>
    let target_dir = out_dir.ancestors().nth(4).map(Path::to_path_buf).unwrap_or_else(|| out_dir.join("target"));
    let agent_target = target_dir.join("embedded-agent");
    let release = env::var("PROFILE").is_ok_and(|p| p == "release");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());

    let mut command = Command::new(cargo);
    command.current_dir(&workspace).arg("build").arg("-p").arg("corsnap-agent").arg("--lib");
    if release {
        command.arg("--release");
    }
    command.arg("--target-dir").arg(&agent_target);
    // A cross build (`--target`) builds the agent for the same target; the
    // flags in CARGO_ENCODED_RUSTFLAGS are then the target's alone.
    let target = env::var("TARGET").unwrap_or_default();
    let cross = env::var("HOST").is_ok_and(|host| host != target);
    if cross {
        command.arg("--target").arg(&target);
    }
    if env::var("CARGO_NET_OFFLINE").is_ok_and(|v| v == "true") {
        command.arg("--offline");
    }
    // The outer build's variables that would steer the nested cargo
    // elsewhere; CARGO_ENCODED_RUSTFLAGS stays, so the agent is built with
    // the flags the rest was built with.
    for var in ["CARGO_TARGET_DIR", "CARGO_BUILD_TARGET_DIR", "RUSTC_WRAPPER", "RUSTC_WORKSPACE_WRAPPER"] {
        command.env_remove(var);
    }
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        // Cargo's description of this crate to its build script
        // (CARGO_PKG_*, CARGO_MANIFEST_*, CARGO_CFG_*...) means nothing to
        // the nested build.
        if key.starts_with("CARGO_PKG_") || key.starts_with("CARGO_CFG_") || key.starts_with("CARGO_MANIFEST_") {
            command.env_remove(key.as_ref());
        }
    }
    let status = command.status().expect("running cargo to build the corsnap agent");
    if !status.success() {
        panic!("building the corsnap agent (cargo build -p corsnap-agent) failed: {status}");
    }
    let profile_dir = if cross { agent_target.join(&target) } else { agent_target.clone() };
    let built = profile_dir.join(if release { "release" } else { "debug" }).join("libcorsnap_agent.so");
    let bytes = std::fs::read(&built).unwrap_or_else(|e| panic!("reading the built agent {}: {e}", built.display()));
    std::fs::write(&embedded, &bytes).unwrap_or_else(|e| panic!("writing {}: {e}", embedded.display()));
    // The name the agent gets when corsnap writes it out: content-addressed,
    // so two corsnap builds never share (or fight over) one file. SipHash
    // with fixed keys is enough: the directory is private, and corsnap
    // compares the whole content before reusing a file anyway.
    use std::hash::{Hash, Hasher};
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    bytes.hash(&mut hasher);
    println!("cargo:rustc-env=CORSNAP_EMBEDDED_AGENT_HASH={:016x}", hasher.finish());
}
