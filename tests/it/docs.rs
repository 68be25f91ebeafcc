//! The documentation stays true to the files it shows and links:
//! - a fenced block right after `<!-- file: PATH -->` in README.md or
//!   docs/*.md is exactly PATH's contents (the C example of docs/c.md is
//!   the program CI compiles and runs);
//! - every relative link `](path)` of those pages names a file or folder
//!   of the repository.
//!
//! (The pages' Rust blocks are doctests, src/lib.rs; their Python blocks
//! run in page order in python/tests/test_docs.py.)

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page of docs/, with their text.
fn pages() -> Vec<(PathBuf, String)> {
    let mut paths = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    assert!(docs.len() >= 5, "docs/ has {} pages", docs.len());
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect()
}

/// The fenced blocks that follow `<!-- file: PATH -->` lines: (PATH, body).
fn shown_files(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(rest) = l.trim().strip_prefix("<!-- file:") else {
            continue;
        };
        let path = rest.trim_end_matches("-->").trim().to_string();
        let open = lines.get(i + 1).copied().unwrap_or("");
        assert!(
            open.starts_with("```"),
            "{path}: no fenced block after the marker"
        );
        let body: Vec<&str> = lines[i + 2..]
            .iter()
            .take_while(|l| !l.starts_with("```"))
            .copied()
            .collect();
        out.push((path, body.join("\n")));
    }
    out
}

#[test]
fn blocks_marked_with_a_file_show_that_file() {
    let mut n = 0;
    for (page, text) in pages() {
        for (path, body) in shown_files(&text) {
            let want = std::fs::read_to_string(root().join(&path))
                .unwrap_or_else(|e| panic!("{}: {path}: {e}", page.display()));
            assert!(
                body.trim_end() == want.trim_end(),
                "{}: the block marked {path} differs from the file (copy the file into the page)",
                page.display()
            );
            n += 1;
        }
    }
    assert!(n >= 1, "no <!-- file: --> block found");
}

#[test]
fn negative_control_a_changed_block_is_caught() {
    let text =
        "<!-- file: capi/examples/quickstart.c -->\n```c\nint main(void) { return 0; }\n```\n";
    let (path, body) = shown_files(text).pop().unwrap();
    let want = std::fs::read_to_string(root().join(path)).unwrap();
    assert_ne!(body.trim_end(), want.trim_end());
}

#[test]
fn relative_links_name_files_of_the_repository() {
    for (page, text) in pages() {
        let dir = page.parent().unwrap();
        let mut in_code = false;
        for line in text.lines() {
            if line.starts_with("```") {
                in_code = !in_code;
            }
            if in_code {
                continue;
            }
            let mut rest = line;
            while let Some(i) = rest.find("](") {
                let tail = &rest[i + 2..];
                let end = tail.find(')').unwrap_or(tail.len());
                let target = tail[..end].split('#').next().unwrap();
                rest = &tail[end..];
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                assert!(
                    Path::new(dir).join(target).exists(),
                    "{}: link to {target}, which does not exist",
                    page.display()
                );
            }
        }
    }
}
