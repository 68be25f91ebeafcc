//! `treeattn pack`: rollouts in, safetensors pack files out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use treeattn::pack::{batch, Layout};
use treeattn::safetensors::{pack_tensors, write_file};
use treeattn::{Error, Result};

use crate::args::{emit, one_file, read_rollouts, Args};

const HELP: &str = "\
treeattn pack FILE.jsonl --out PACK.safetensors [--budget TOKENS] [--share-prefixes]
                         [--layout trie|replicated]

Packs the rollouts of FILE into exact packs of at most TOKENS tokens each
(default: one pack for the whole file) by greedy first-fit decreasing on each
rollout's size in the layout. With --share-prefixes (trie layout), rollouts in
a pack share identical prefixes (a GRPO group's prompt is stored once).
Layouts: trie (deduplicated pre-order trie, the default) or replicated (each
branch its own chain, the paper's 4D layout).

Output: one safetensors file per pack. With one pack it is PACK.safetensors
itself; with several, pack i goes to PACK-00000.safetensors, PACK-00001...
(the index inserted before the extension). Tensors (L tokens, T loss entries):
  tokens, position_ids, kv_end            [L] int64
  loss_rows, loss_labels, loss_call,
  loss_offset, loss_rollout               [T] int64
  loss_weights                            [T] float32
  loss_logprobs                           [T] float32 (only if every target has one)
  sdcc_student_rows, sdcc_teacher_rows    [P] int64 (trie layout only)
Mask: query q sees key k iff k <= q < kv_end[k]; position_ids are depths.
Loss: row loss_rows[t]'s logits predict loss_labels[t]; loss_call is the call's
global index in FILE's order counting from 0; loss entries are sorted by
(rollout, call, offset). Metadata (__metadata__): format, layout, source,
pack index and count, rollout indices and ids (JSON arrays).";

pub fn run(args: Vec<String>) -> Result<()> {
    let mut a = Args::new(args);
    if a.help() {
        return emit(&format!("{HELP}\n"));
    }
    let out = a
        .value("out")?
        .ok_or_else(|| Error::Usage("pack needs --out PACK.safetensors".into()))?;
    let budget = a.number("budget")?;
    let share = a.flag("share-prefixes")?;
    let layout = match a.value("layout")?.as_deref() {
        None | Some("trie") => Layout::Trie,
        Some("replicated") => Layout::Replicated,
        Some(other) => {
            return Err(Error::Usage(format!(
                "--layout {other:?}: expected trie or replicated"
            )))
        }
    };
    if budget == Some(0) {
        return Err(Error::Usage("--budget must be positive".into()));
    }
    let input = one_file(a, "FILE.jsonl")?;
    let rollouts = read_rollouts(&input)?;
    if rollouts.is_empty() {
        return Err(Error::Io(format!("{input}: no rollouts")));
    }
    let budget = budget.map_or(usize::MAX, |b| usize::try_from(b).unwrap_or(usize::MAX));
    let batches = batch(&rollouts, budget, share, layout)?;
    let mut call_base = Vec::with_capacity(rollouts.len());
    let mut calls = 0u64;
    for r in &rollouts {
        call_base.push(calls);
        calls += r.calls().len() as u64;
    }
    let n = batches.len();
    for (i, b) in batches.iter().enumerate() {
        let path = output_path(Path::new(&out), i, n);
        let tensors = pack_tensors(&b.pack, b.sdcc.as_deref(), &call_base)?;
        let ids: Vec<&str> = b
            .rollouts
            .iter()
            .map(|&r| rollouts[r as usize].id())
            .collect();
        let meta = BTreeMap::from([
            ("format".to_string(), "treeattn-pack-v1".to_string()),
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
        ]);
        write_file(&path, &tensors, &meta)?;
        emit(&format!(
            "{}: {} rollouts, L = {} tokens, T = {} loss entries, {} visible pairs{}\n",
            path.display(),
            b.rollouts.len(),
            b.pack.len(),
            b.pack.loss.len(),
            b.pack.mask()?.visible_pairs(),
            b.sdcc
                .as_ref()
                .map_or(String::new(), |p| format!(", {} SDCC pairs", p.len()))
        ))?;
    }
    Ok(())
}

/// `PACK.safetensors` for a single pack, else `PACK-00000.safetensors`, ...
fn output_path(out: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return out.to_path_buf();
    }
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match out.extension() {
        Some(ext) => format!("{stem}-{i:05}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{i:05}"),
    };
    out.with_file_name(name)
}
