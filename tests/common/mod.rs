//! Scaffolding shared by the integration tests (each test file that needs it
//! declares `mod common;`).

use treeattn::gen::Rng;

/// A fresh generator and its seed: `TREEATTN_SEED` when set (to replay a
/// failure), otherwise the clock. Tests put the seed in every failure
/// message.
pub fn seeded_rng() -> (Rng, u64) {
    let seed = std::env::var("TREEATTN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x5eed, |d| d.as_nanos() as u64)
        });
    (Rng::new(seed), seed)
}
