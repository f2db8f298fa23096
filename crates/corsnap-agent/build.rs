//! Links the agent with the functions an exception's dispatch calls at
//! every throw (`.text.hot.corsnap_throw`) kept together, in the output's
//! `.text.hot` (lld's `-z keep-text-section-prefix`): without it they lay
//! on several pages, and each throw's first instruction on each one missed.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,keep-text-section-prefix");
}
