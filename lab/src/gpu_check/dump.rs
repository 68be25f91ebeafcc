//! `gpu-check --dump DIR`: the packs, inputs and our outputs of every
//! correctness case, for `scripts/gpu-anchor.py` to run PyTorch on the very
//! same packs.
//!
//! Layout of `DIR`:
//! - `manifest.json`: `{"format": "treeattn-gpu-check-dump-v1", "backend",
//!   "device", "seed", "cases": [...]}`; each case has `name`, `file`,
//!   `kind` (`"forward"`: no dO and no gradients; `"backward"`), `dtype`
//!   (`"bf16"` / `"f16"`), `tokens`, `q_heads`, `kv_heads`, `head_dim`,
//!   `softmax_scale`, `rope` (`null` or `{"base", "dims"}`, Llama
//!   rotate-half at the pack's position ids), `dq_mode`, `tensors` (name →
//!   `{"dtype", "shape"}`), `tolerance` (`o_rel`, `lse_abs`, `grad_rel`:
//!   the table our kernels are held to against the CPU backend), `ours_ms`
//!   (`fwd`, `bwd`: one launch, no warm-up; `null` where not run;
//!   `timing` says whether they are GPU times or the emulator's wall
//!   clock), and `errors` (ours against the CPU backend).
//! - one safetensors file per case: `kv_end`, `position_ids` (I64 `[L]`;
//!   query `q` sees key `k` iff `k <= q < kv_end[k]`), `q` `[L, hq, d]`,
//!   `k`, `v` `[L, hkv, d]`, `o` `[L, hq, d]` and `lse` (F32 `[hq, L]`,
//!   natural log, `-inf` for a row with no visible key) from our forward;
//!   backward cases add `d_o` `[L, hq, d]`, `dq`, `dk`, `dv` from our
//!   backward (given the CPU backend's O rounded to the element type and
//!   its LSE, as the check runs it).
//!
//! The directory appears whole or not at all: everything is written into
//! `.NAME.partial-PID` beside it, synced, and renamed to `DIR` at the end; a
//! failed run removes the partial directory. `DIR` must not exist, or be an
//! empty directory.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use treeattn::backend::launch::KernelElem;
use treeattn::{Error, Result};

/// The manifest's `format`.
pub const DUMP_FORMAT: &str = "treeattn-gpu-check-dump-v1";

/// One tensor of a case file.
pub(crate) struct DumpTensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl DumpTensor {
    /// A kernel tensor (bf16 / f16) of `shape`.
    pub fn elems<T: KernelElem>(x: &[T], shape: &[usize]) -> DumpTensor {
        let dtype = match T::NAME {
            "bf16" => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F16,
        };
        DumpTensor {
            dtype,
            shape: shape.to_vec(),
            data: bytemuck::cast_slice::<T, u8>(x).to_vec(),
        }
    }
    /// An f32 tensor of `shape`.
    pub fn f32s(x: &[f32], shape: &[usize]) -> DumpTensor {
        DumpTensor {
            dtype: safetensors::Dtype::F32,
            shape: shape.to_vec(),
            data: x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
    /// A 1-D int64 tensor of `u32` values.
    pub fn index(x: &[u32]) -> DumpTensor {
        DumpTensor {
            dtype: safetensors::Dtype::I64,
            shape: vec![x.len()],
            data: x.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect(),
        }
    }
    /// `tensors` as one safetensors file's bytes.
    pub fn serialize(tensors: &[(&str, DumpTensor)]) -> Result<Vec<u8>> {
        safetensors::serialize(tensors.iter().map(|(n, t)| (*n, t)), None)
            .map_err(|e| Error::Io(format!("safetensors: {e}")))
    }
    fn describe(&self) -> Value {
        json!({"dtype": format!("{:?}", self.dtype), "shape": self.shape})
    }
}

impl safetensors::View for &DumpTensor {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// A dump being written (see the module docs).
pub(crate) struct Dump {
    target: PathBuf,
    partial: PathBuf,
    cases: Vec<Value>,
    committed: bool,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Io(format!("{}: {e}", path.display()))
}

impl Dump {
    /// Starts a dump into `dir` (which must not exist, or be empty).
    pub fn create(dir: &Path) -> Result<Dump> {
        if let Ok(mut entries) = std::fs::read_dir(dir) {
            if entries.next().is_some() {
                return Err(Error::Usage(format!(
                    "--dump {}: the directory exists and is not empty (the dump never overwrites)",
                    dir.display()
                )));
            }
        } else if dir.exists() {
            return Err(Error::Usage(format!(
                "--dump {}: exists and is not a directory",
                dir.display()
            )));
        }
        let name = dir.file_name().ok_or_else(|| {
            Error::Usage(format!("--dump {}: not a directory name", dir.display()))
        })?;
        let partial = dir.with_file_name(format!(
            ".{}.partial-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        std::fs::create_dir_all(&partial).map_err(io(&partial))?;
        Ok(Dump {
            target: dir.to_path_buf(),
            partial,
            cases: Vec::new(),
            committed: false,
        })
    }

    /// Writes one case's tensors and records its manifest entry (`meta`,
    /// to which `name`, `file` and `tensors` are added).
    pub fn case(
        &mut self,
        name: &str,
        mut meta: Value,
        tensors: &[(&str, DumpTensor)],
    ) -> Result<()> {
        let slug: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let file = format!("case{:02}-{slug}.safetensors", self.cases.len());
        let bytes =
            DumpTensor::serialize(tensors).map_err(|e| Error::Io(format!("{file}: {e}")))?;
        write_synced(&self.partial.join(&file), &bytes)?;
        let described: serde_json::Map<String, Value> = tensors
            .iter()
            .map(|(n, t)| (n.to_string(), t.describe()))
            .collect();
        meta["name"] = json!(name);
        meta["file"] = json!(file);
        meta["tensors"] = Value::Object(described);
        self.cases.push(meta);
        Ok(())
    }

    /// Writes the manifest (`head` plus the cases) and renames the
    /// directory into place; returns its path.
    pub fn commit(mut self, mut head: Value) -> Result<PathBuf> {
        head["format"] = json!(DUMP_FORMAT);
        head["cases"] = Value::Array(std::mem::take(&mut self.cases));
        let text =
            serde_json::to_string_pretty(&head).map_err(|e| Error::Io(format!("manifest: {e}")))?;
        write_synced(&self.partial.join("manifest.json"), text.as_bytes())?;
        // An empty target directory (allowed by `create`) gives way.
        if self.target.is_dir() {
            std::fs::remove_dir(&self.target).map_err(io(&self.target))?;
        }
        std::fs::rename(&self.partial, &self.target).map_err(io(&self.target))?;
        if let Some(parent) = self.target.parent() {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            if let Ok(d) = std::fs::File::open(parent) {
                let _ = d.sync_all();
            }
        }
        self.committed = true;
        Ok(self.target.clone())
    }
}

impl Drop for Dump {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.partial);
        }
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_appears_whole_and_a_dropped_one_leaves_nothing() {
        let base = std::env::temp_dir().join(format!("treeattn-dump-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let dir = base.join("d");
        let mut d = Dump::create(&dir).unwrap();
        let x = [half::bf16::from_f32(1.5); 4];
        d.case(
            "a b",
            json!({"kind": "forward"}),
            &[
                ("kv_end", DumpTensor::index(&[2, 2])),
                ("q", DumpTensor::elems(&x, &[2, 1, 2])),
                ("lse", DumpTensor::f32s(&[0.5, f32::NEG_INFINITY], &[1, 2])),
            ],
        )
        .unwrap();
        assert!(!dir.exists(), "nothing at the target before the commit");
        let out = d.commit(json!({"backend": "emu"})).unwrap();
        let m: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap())
                .unwrap();
        assert_eq!(m["format"], DUMP_FORMAT);
        let f = m["cases"][0]["file"].as_str().unwrap();
        assert_eq!(f, "case00-a-b.safetensors");
        let bytes = std::fs::read(out.join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("q").unwrap().dtype(), safetensors::Dtype::BF16);
        assert_eq!(
            st.tensor("kv_end").unwrap().data(),
            &[2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]
        );
        // A non-empty target is refused; a dropped dump leaves no partial dir.
        assert!(Dump::create(&dir).is_err());
        let other = base.join("e");
        drop(Dump::create(&other).unwrap());
        let left: Vec<_> = std::fs::read_dir(&base)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("d")], "{left:?}");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
