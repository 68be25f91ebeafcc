//! Builds the kernels of `kernels/`.
//!
//! - With the `emu` feature (on for the crate's own tests, off by default):
//!   the SIMT emulator — the same `.cu` sources compiled as host C++ against
//!   `kernels/emu/shim.h` (`-DTA_EMU`) with the `cc` crate, so that `cargo
//!   test` runs the kernels on the CPU. Always optimised (`-O2`): the
//!   emulator's speed is what keeps the kernel tests short. Without it no C++
//!   is compiled at all.
//! - With the `cuda` feature: `nvcc` compiles the kernels to one fatbin with
//!   SASS for sm_80 and sm_90a and PTX for compute_80, embedded by
//!   `backend::cuda` with `include_bytes!`. The `ptxas -v` report is written
//!   next to it (`$OUT_DIR/ptxas-report.txt`).
//!
//! nvcc is looked for in this order: `$TREEATTN_NVCC`; `$CUDA_HOME/bin/nvcc`;
//! `nvcc` on `PATH`; the PyPI compiler (`<site-packages>/nvidia/cu13/bin/nvcc`,
//! found by asking `python3` where the `nvidia` namespace package lives).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const EMU_SOURCES: &[&str] = &[
    "kernels/emu/runtime.cpp",
    "kernels/emu/fwd_entry.cpp",
    "kernels/emu/shim_selftest.cpp",
    "kernels/emu/bwd_entry.cpp",
    "kernels/emu/sdcc_entry.cpp",
    "kernels/emu/rope_entry.cpp",
];
const CUDA_SOURCES: &[&str] = &[
    "kernels/tree_attn_fwd.cu",
    "kernels/tree_attn_bwd.cu",
    "kernels/sdcc_kl.cu",
    "kernels/rope.cu",
];
const HEADERS: &[&str] = &[
    "kernels/common.cuh",
    "kernels/kernel_traits.cuh",
    "kernels/mask.cuh",
    "kernels/tile_load.cuh",
    "kernels/emu/shim.h",
];

fn main() {
    for f in EMU_SOURCES.iter().chain(CUDA_SOURCES).chain(HEADERS) {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_EMU").is_some() {
        build_emulator();
    }
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build_cuda();
    }
}

fn build_emulator() {
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .opt_level(2)
        .define("TA_EMU", None)
        .include("kernels")
        // The kernels carry `#pragma unroll` for nvcc; g++ does not know it.
        .flag_if_supported("-Wno-unknown-pragmas");
    for f in EMU_SOURCES {
        b.file(f);
    }
    b.compile("treeattn_emu");
}

fn build_cuda() {
    for v in ["TREEATTN_NVCC", "CUDA_HOME", "PATH", "PYTHONPATH"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let nvcc = find_nvcc().unwrap_or_else(|tried| {
        panic!(
            "\n\nthe `cuda` feature needs nvcc (CUDA 13.0), and none was found.\nTried: {tried}\n\
             Install the pinned compiler from PyPI (driver 580 loads nothing newer):\n\
             \n    python3 -m pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
             nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85\n\
             \nthen build again (it is found through `python3 -c 'import nvidia'`), or point \
             TREEATTN_NVCC at .../nvidia/cu13/bin/nvcc, or set CUDA_HOME.\n\
             Without `--features cuda` no CUDA is needed at all.\n"
        )
    });
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let mut report = String::new();
    for src in CUDA_SOURCES {
        let stem = Path::new(src)
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("kernel file name");
        let fatbin = out.join(format!("{stem}.fatbin"));
        let o = Command::new(&nvcc)
            .args(nvcc_args())
            .arg("-fatbin")
            .arg(src)
            .arg("-o")
            .arg(&fatbin)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        let log = String::from_utf8_lossy(&o.stderr);
        if !o.status.success() {
            panic!(
                "nvcc failed on {src} ({}):\n{log}{}",
                nvcc.display(),
                String::from_utf8_lossy(&o.stdout)
            );
        }
        report.push_str(&format!("== {src}\n{log}"));
    }
    std::fs::write(out.join("ptxas-report.txt"), report).expect("write ptxas report");
}

/// The nvcc flags of the embedded fatbin (scripts/ptxas-report.sh uses the
/// same ones).
fn nvcc_args() -> Vec<&'static str> {
    vec![
        "-std=c++17",
        "-O3",
        // Source lines in the SASS for compute-sanitizer and ncu reports
        // (scripts/gpu-check.sh); no effect on the generated code.
        "-lineinfo",
        "-Ikernels",
        "-Xptxas",
        "-v",
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_80,code=compute_80",
    ]
}

fn runs(nvcc: &Path) -> bool {
    Command::new(nvcc)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The first working nvcc, or a description of everything tried.
fn find_nvcc() -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os("TREEATTN_NVCC") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(h) = env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(h).join("bin").join("nvcc"));
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    for py in ["python3", "python"] {
        let script = "import nvidia, os\nfor p in nvidia.__path__: print(os.path.join(p, 'cu13', 'bin', 'nvcc'))";
        if let Ok(o) = Command::new(py).args(["-c", script]).output() {
            if o.status.success() {
                candidates.extend(
                    String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .map(PathBuf::from),
                );
                break;
            }
        }
        tried.push(format!("{py} -c 'import nvidia' (no PyPI nvidia packages)"));
    }
    for c in candidates {
        if c.is_file() && runs(&c) {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(tried.join(", "))
}
