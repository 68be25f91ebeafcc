//! `treeattn pack`: rollouts in, safetensors pack files out.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, ValueEnum};
use treeattn::cost::ModelCost;
use treeattn::pack::{batch, Layout};
use treeattn::safetensors::{
    loss_field_tensors, pack_tensors, read_metadata, rollout_tensors, serialize, PACK_FORMAT,
};
use treeattn::{Error, Result};

use crate::args::{emit, nonempty, number, plural};
use crate::output;

/// Write the exact pack(s) of a JSONL file as safetensors.
#[derive(Args, Debug)]
#[command(long_about = "\
Packs the rollouts of FILE into exact packs of at most TOKENS tokens each
(default: one pack for the whole file) by greedy first-fit decreasing on each
rollout's size in the layout. Rollouts in a pack share identical prefixes
(trie layout: a GRPO group's prompt is stored once); --no-share-prefixes
keeps each rollout's own copy (the same attention, more tokens).
Layouts: trie (deduplicated pre-order trie, the default) or replicated (each
branch its own chain, the paper's 4D layout).

Output: one safetensors file per pack. With one pack it is PACK.safetensors
itself; with several, pack i goes to PACK-00000.safetensors, PACK-00001...
(the index inserted before the extension). The files are written to
temporary names and renamed into place only when every pack has been
written, all or nothing: on any error the files of an earlier run are left
as they were and no temporary file is left; SIGINT, SIGTERM or SIGHUP removes
the temporary files too (once the renames have begun, after they finish).
Pack files of an earlier run at the same PACK that this run does not
overwrite (PACK-00007 when this run writes 5 packs, PACK itself when it
writes several) are removed in the same step; a file with such a name that
is not a treeattn pack is refused before anything is written, as is a PACK
that is FILE itself. A link at an output name is followed (the file it
leads to is replaced); a directory, FIFO or device there is refused.
Temporary files .NAME.tmp-PID-N beside an output name whose run was killed
are removed (on Linux, where /proc tells). The same input gives
byte-identical files. An empty FILE is an error.
Tensors (L tokens, T loss entries):
  tokens, position_ids, kv_end            [L] int64
  loss_rows, loss_labels, loss_call,
  loss_offset, loss_rollout, loss_segment [T] int64
  loss_weights                            [T] float32
  loss_logprobs                           [T] float32 (only if every target has one)
  loss_reward                             [T] float32 (per-token \"rewards\"; NaN: none)
  loss_summary                            [T] bool (the call is marked \"summary\")
  sdcc_student_rows, sdcc_teacher_rows    [P] int64 (trie layout only)
  rollout_reward                          [R] float32 (NaN: no reward)
  rollout_group                           [R] int64 (index into groups; -1: none)
  rollout_fingerprint                     [R] int64 (FNV-1a 64 of its calls)
  rollout_truncated                       [R] bool (marked \"truncated\")
Mask: query q sees key k iff k <= q < kv_end[k]; position_ids are depths.
Each pack's line gives its visible pairs and the FLOPs of one training step
(forward + backward) of a Llama-3-8B-shaped model on it (treeattn::cost).
Loss: row loss_rows[t]'s logits predict loss_labels[t]; loss_call is the call's
global index in FILE's order counting from 0; loss entries are sorted by
(rollout, call, offset); loss_segment is the call's segment in its rollout (0
from the first call, +1 at every junction). The R rollouts of a pack are those
of the metadata's rollout_indices, in that order. Metadata (__metadata__):
format, layout, source, pack index and count, rollout indices and ids, groups
(the GRPO group names, in order of first appearance) (JSON arrays).
Progress goes to stderr when it is a terminal.")]
pub struct PackArgs {
    /// Rollouts, one JSON object per line.
    #[arg(value_name = "FILE.jsonl")]
    file: String,
    /// Output file (PACK-00000.safetensors, ... with several packs).
    #[arg(long, value_name = "PACK.safetensors")]
    out: PathBuf,
    /// Token budget per pack [default: one pack for the whole file].
    #[arg(long, value_name = "TOKENS", value_parser = budget)]
    budget: Option<u64>,
    /// Rollouts in a pack share identical prefixes (trie layout) [default].
    #[arg(long, overrides_with = "no_share_prefixes")]
    share_prefixes: bool,
    /// Each rollout keeps its own copy of its prefixes (exact either way; more tokens).
    #[arg(long, overrides_with = "share_prefixes")]
    no_share_prefixes: bool,
    /// Pack layout.
    #[arg(long, value_enum, default_value_t = LayoutArg::Trie)]
    layout: LayoutArg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LayoutArg {
    /// Deduplicated pre-order trie.
    Trie,
    /// Each branch its own chain (the paper's 4D layout).
    Replicated,
}

fn budget(s: &str) -> std::result::Result<u64, String> {
    match number(s)? {
        0 => Err("--budget must be positive".into()),
        n => Ok(n),
    }
}

/// Progress lines on stderr, only when it is a terminal.
struct Progress {
    on: bool,
    start: Instant,
}

impl Progress {
    fn say(&self, msg: &str) {
        if self.on {
            eprintln!("[{:6.1} s] {msg}", self.start.elapsed().as_secs_f64());
        }
    }
}

pub fn run(a: PackArgs) -> Result<()> {
    let layout = match a.layout {
        LayoutArg::Trie => Layout::Trie,
        LayoutArg::Replicated => Layout::Replicated,
    };
    // On unless turned off; the last of the two flags wins.
    let share = a.share_prefixes || !a.no_share_prefixes;
    let input = a.file;
    let progress = Progress {
        on: std::io::stderr().is_terminal(),
        start: Instant::now(),
    };
    if a.out.is_dir() {
        return Err(Error::Usage(format!(
            "--out {}: is a directory; give a file name",
            a.out.display()
        )));
    }
    // `NAME/` or `NAME/.` names a directory: with no directory NAME there,
    // writing the file NAME instead would replace a link or create a name
    // the user did not give (`cp` refuses such a path too).
    let text = a.out.as_os_str().as_encoded_bytes();
    if text.ends_with(b"/") || text.ends_with(b"/.") || text.ends_with(b"/..") {
        return Err(Error::Usage(format!(
            "--out {}: names a directory (a trailing '/'), and there is none; give a file name",
            a.out.display()
        )));
    }
    refuse_input_as_output(Path::new(&input), &a.out)?;
    let mut last = Instant::now();
    let rollouts =
        treeattn::rollout::read_jsonl_file_progress(Path::new(&input), |done, total| {
            if progress.on && last.elapsed().as_secs_f64() >= 0.5 {
                last = Instant::now();
                progress.say(&format!(
                    "reading {input}: {:.0}% of {:.1} MB",
                    100.0 * done as f64 / total.max(1) as f64,
                    total as f64 / 1e6
                ));
            }
        })?;
    let rollouts = nonempty(&input, rollouts)?;
    progress.say(&format!(
        "read {}; packing ({} layout{})",
        plural(rollouts.len(), "rollout"),
        layout.name(),
        if share { ", shared prefixes" } else { "" }
    ));
    let budget = a
        .budget
        .map_or(usize::MAX, |b| usize::try_from(b).unwrap_or(usize::MAX));
    let batches = batch(&rollouts, budget, share, layout)?;
    let mut call_base = Vec::with_capacity(rollouts.len());
    let mut calls = 0u64;
    for r in &rollouts {
        call_base.push(calls);
        calls += r.calls().len() as u64;
    }
    let n = batches.len();
    let paths: Vec<PathBuf> = (0..n).map(|i| output_path(&a.out, i, n)).collect();
    for p in &paths {
        refuse_input_as_output(Path::new(&input), p)?;
    }
    let stale = stale_packs(&a.out, &paths)?;
    let mut staged = output::staged();
    let mut lines = String::new();
    for (i, b) in batches.iter().enumerate() {
        progress.say(&format!("writing pack {} of {n}", i + 1));
        let mut tensors = pack_tensors(&b.pack, b.sdcc.as_deref(), &call_base)?;
        tensors.extend(rollout_tensors(&b.fields));
        tensors.extend(loss_field_tensors(&b.loss_fields));
        let ids: Vec<&str> = b
            .rollouts
            .iter()
            .map(|&r| rollouts[r as usize].id())
            .collect();
        let meta = BTreeMap::from([
            ("format".to_string(), PACK_FORMAT.to_string()),
            ("layout".to_string(), layout.name().to_string()),
            ("share_prefixes".to_string(), share.to_string()),
            ("source".to_string(), input.clone()),
            ("pack_index".to_string(), i.to_string()),
            ("pack_count".to_string(), n.to_string()),
            (
                "rollout_indices".to_string(),
                serde_json::to_string(&b.rollouts).expect("u32 list"),
            ),
            (
                "rollout_ids".to_string(),
                serde_json::to_string(&ids).expect("string list"),
            ),
            (
                "groups".to_string(),
                serde_json::to_string(&b.fields.groups).expect("string list"),
            ),
        ]);
        staged.stage(&paths[i], &serialize(&tensors, &meta)?)?;
        let step = b.pack.cost(&ModelCost::LLAMA3_8B)?;
        lines.push_str(&format!(
            "{}: {}, L = {} tokens, T = {} loss entries, {} visible pairs, \
             {:.3e} FLOPs per step (Llama-3-8B shape, {:.1}% attention){}\n",
            paths[i].display(),
            plural(b.rollouts.len(), "rollout"),
            b.pack.len(),
            b.pack.loss.len(),
            step.visible_pairs,
            step.total,
            100.0 * step.attention / step.total.max(f64::MIN_POSITIVE),
            b.sdcc.as_ref().map_or(String::new(), |p| format!(
                ", {}",
                plural(p.len(), "SDCC pair")
            ))
        ));
    }
    for s in &stale {
        staged.remove(s);
    }
    output::commit(staged)?;
    for s in &stale {
        eprintln!("removed {} (a pack of an earlier run)", s.display());
    }
    progress.say("done");
    emit(&lines)
}

/// `PACK.safetensors` for a single pack, else `PACK-00000.safetensors`, ...
fn output_path(out: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return out.to_path_buf();
    }
    let (stem, ext) = stem_ext(out);
    let name = match ext {
        Some(ext) => format!("{stem}-{i:05}.{ext}"),
        None => format!("{stem}-{i:05}"),
    };
    out.with_file_name(name)
}

fn stem_ext(out: &Path) -> (String, Option<String>) {
    (
        out.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        out.extension().map(|e| e.to_string_lossy().into_owned()),
    )
}

/// The path as the file system resolves it (the parent directory resolved
/// when the file does not exist yet).
fn resolved(p: &Path) -> Option<PathBuf> {
    if let Ok(c) = std::fs::canonicalize(p) {
        return Some(c);
    }
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Some(std::fs::canonicalize(parent).ok()?.join(p.file_name()?))
}

/// An `--out` that is (or resolves to, through links or `..`) the input
/// would overwrite the rollouts being read.
fn refuse_input_as_output(input: &Path, out: &Path) -> Result<()> {
    if let (Some(i), Some(o)) = (resolved(input), resolved(out)) {
        if i == o {
            return Err(Error::Usage(format!(
                "--out {} is the input file {}: refusing to overwrite it",
                out.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// Files named like the packs of an earlier run at `out` (`out` itself and
/// `STEM-NNNNN.EXT`) that this run will not overwrite. A file with such a
/// name that is not a treeattn pack is an error (nothing is removed).
fn stale_packs(out: &Path, written: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (stem, ext) = stem_ext(out);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(Vec::new()); // the staging write reports a missing directory
    };
    let mut stale = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let numbered = name
            .strip_prefix(&format!("{stem}-"))
            .and_then(|rest| match &ext {
                Some(x) => rest.strip_suffix(&format!(".{x}")),
                None => Some(rest),
            })
            .is_some_and(|num| num.len() >= 5 && num.bytes().all(|c| c.is_ascii_digit()));
        let path = dir.join(&name);
        let is_out = Some(name.as_str()) == out.file_name().and_then(|n| n.to_str());
        if !(numbered || is_out) || written.iter().any(|w| w.file_name() == path.file_name()) {
            continue;
        }
        if !path.is_file() {
            continue;
        }
        // Packs of an earlier treeattn (an older format) are ours too.
        let ours = read_metadata(&path)?.is_some_and(|m| {
            m.get("format")
                .is_some_and(|f| f.starts_with("treeattn-pack-v"))
        });
        if !ours {
            return Err(Error::Io(format!(
                "{}: named like a pack of this output but not a treeattn pack; refusing to \
                 leave it next to the new packs (move it or choose another --out)",
                path.display()
            )));
        }
        stale.push(path);
    }
    stale.sort();
    Ok(stale)
}
