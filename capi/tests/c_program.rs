//! Compiles `tests/c/smoke.c` with the system C compiler (`$CC`, else
//! `cc`), links it against the shared library cargo built for this test
//! run (`libtreeattn_capi.so`), and runs it. The program checks the pack of
//! the README's worked example, attention forward / backward against the
//! values the Rust API computes here (written to a file it reads) and
//! against its own dense reference, SDCC, and the status codes and
//! messages of bad input.

use std::path::{Path, PathBuf};
use std::process::Command;

use treeattn::backend::cpu::Cpu;
use treeattn::backend::{AttnArgs, AttnParams, AttnShape, HostAttention};
use treeattn::rollout::{Call, Rollout};
use treeattn::tree::Tree;

/// The directory that holds the shared library cargo built with this
/// test: the test binary's own directory (`<target>/<profile>/deps`, where
/// `cargo test` leaves the cdylib; it uplifts it to `<target>/<profile>`
/// only for `cargo build`). Of the two, the newer copy.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("<profile>/deps").to_path_buf();
    let name = format!(
        "{}treeattn_capi{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let candidates = [deps.clone(), deps.parent().unwrap_or(&deps).to_path_buf()];
    candidates
        .into_iter()
        .filter_map(|dir| {
            let modified = std::fs::metadata(dir.join(&name)).ok()?.modified().ok()?;
            Some((modified, dir))
        })
        .max()
        .map(|(_, dir)| dir)
        .unwrap_or_else(|| panic!("{name} not found next to {}", exe.display()))
}

/// O, dQ, dK, dV of the C program's f64 call, then O, dQ, dK, dV, dsinks
/// of its call with the attention variants, computed with the Rust API.
fn expected() -> String {
    let rollout = Rollout::new(
        "r17",
        vec![
            Call::new(vec![10, 11, 20], vec![30, 31]),
            Call::new(vec![10, 11, 20, 30, 31, 40], vec![32]),
            Call::new(vec![10, 11, 20, 30, 31, 40, 32, 1], vec![50, 51]),
            Call::new(vec![10, 11, 3, 50, 51, 40, 32], vec![33]),
        ],
    )
    .unwrap();
    let pack = Tree::build(&[rollout], false).unwrap().trie_pack();
    let shape = AttnShape {
        tokens: pack.len(),
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
        v_head_dim: 16,
    };
    let wave = |n: usize, f: fn(f64) -> f64, a: f64| (0..n).map(|i| f(i as f64 * a)).collect();
    let q: Vec<f64> = wave(shape.q_len(), f64::sin, 0.37);
    let k: Vec<f64> = wave(shape.kv_len(), f64::sin, 0.53);
    let v: Vec<f64> = wave(shape.kv_len(), f64::sin, 0.71);
    let d_o: Vec<f64> = wave(shape.q_len(), f64::cos, 0.29);
    let mask = pack.mask().unwrap();
    let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, AttnParams::new(16)).unwrap();
    let fwd = Cpu::default().forward_owned(&args).unwrap();
    let g = Cpu::default()
        .backward_owned(&args, fwd.saved(), &d_o)
        .unwrap();
    // The same pack with the attention variants: a window of 2 tree
    // levels, a softcap of 3, sinks and a value head dim of 8.
    let vshape = AttnShape {
        v_head_dim: 8,
        ..shape
    };
    let mut params = AttnParams::new(16);
    params.window = Some(2);
    params.softcap = Some(3.0);
    let vv: Vec<f64> = wave(vshape.v_len(), f64::sin, 0.71);
    let vdo: Vec<f64> = wave(vshape.o_len(), f64::cos, 0.29);
    let sinks: Vec<f64> = (0..4).map(|h| h as f64 - 1.5).collect();
    let vargs = AttnArgs::new(&q[..], &k[..], &vv[..], vshape, mask, params)
        .unwrap()
        .with_sinks(&sinks[..])
        .unwrap();
    let vfwd = Cpu::default().forward_owned(&vargs).unwrap();
    let vg = Cpu::default()
        .backward_owned(&vargs, vfwd.saved(), &vdo)
        .unwrap();
    let dsinks = vg.dsinks.unwrap();
    [
        &fwd.o, &g.dq, &g.dk, &g.dv, &vfwd.o, &vg.dq, &vg.dk, &vg.dv, &dsinks,
    ]
    .iter()
    .flat_map(|a| a.iter())
    .map(|x| format!("{x:.17e}\n"))
    .collect()
}

/// Compiles `tests/c/{source}` against the header and the shared library
/// of this test run; returns the executable.
fn compile(source: &str, extra: &[&str]) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let lib_dir = library_dir();
    let exe = tmp.join(format!("treeattn-capi-{}", source.trim_end_matches(".c")));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args([
            "-std=c99",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
        ])
        .arg("-I")
        .arg(root.join("../include"))
        .arg(root.join("tests/c").join(source))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib_dir)
        .arg("-ltreeattn_capi")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lm")
        .args(extra)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(status.success(), "compiling tests/c/{source} failed");
    exe
}

fn run(exe: &Path, args: &[&Path]) -> (bool, String) {
    // The library this test built, first: cargo's LD_LIBRARY_PATH also
    // names `<target>/<profile>`, where an older `cargo build` may have
    // left another copy (searched before the executable's RUNPATH).
    // At most the AVX-512 path: smoke.c checks bf16 bit for bit against
    // the f32 call on the widened inputs, which the AVX-512 BF16 path's
    // pair products are not (the crate's `attention_isa` tests that path).
    let out = Command::new(exe)
        .args(args)
        .env("LD_LIBRARY_PATH", library_dir())
        .env("TREEATTN_ISA", "avx512")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    (out.status.success(), text)
}

#[test]
fn c_program_links_and_passes() {
    let want = Path::new(env!("CARGO_TARGET_TMPDIR")).join("capi-expected.txt");
    std::fs::write(&want, expected()).unwrap();
    let exe = compile("smoke.c", &[]);
    let (ok, text) = run(&exe, &[&want]);
    assert!(ok, "the C program failed:\n{text}");
    assert!(text.contains("all C ABI checks passed"), "{text}");
}

/// The device entries from a C host that owns context, memory and stream
/// (`tests/c/device.c`, the driver API loaded with dlopen): on a GPU
/// machine with the `cuda` feature, bf16 / f16 attention and SDCC against
/// the CPU entries; here, without a GPU, their clean failure. The GPU check
/// script runs the same program with `--require-gpu`.
#[test]
fn c_device_program_links_and_passes() {
    let exe = compile("device.c", &["-ldl"]);
    let (ok, text) = run(&exe, &[]);
    assert!(ok, "the C device program failed:\n{text}");
    assert!(text.contains("device C ABI checks passed"), "{text}");
}
