//! Bad input: every validation error of the calls format names the rollout,
//! the call, the field and (for JSONL) the line; nothing panics and nothing
//! is skipped silently except blank lines.

use treeattn::rollout::{parse_jsonl, read_jsonl, Call, Rollout};
use treeattn::Error;

const GOOD: &str =
    r#"{"id": "a", "calls": [{"context": [1, 2], "completion": [3], "logprobs": [-0.5]}]}"#;

/// The error of parsing `GOOD` on line 1 followed by `bad` on line 2.
fn second_line(bad: &str) -> Error {
    parse_jsonl(&format!("{GOOD}\n{bad}\n")).unwrap_err()
}

fn assert_rollout_err(e: Error, id: &str, call: Option<usize>, field: &str, line: usize) {
    match &e {
        Error::Rollout {
            rollout,
            call: c,
            field: f,
            msg,
        } => {
            assert_eq!((rollout.as_str(), *c, *f), (id, call, field), "{e}");
            assert!(msg.contains(&format!("line {line}")), "{e}");
        }
        other => panic!("expected a rollout error, got {other:?}"),
    }
}

#[test]
fn empty_call_list() {
    assert_rollout_err(
        second_line(r#"{"id": "b", "calls": []}"#),
        "b",
        None,
        "calls",
        2,
    );
    let e = Rollout::new("b", vec![]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Rollout {
                call: None,
                field: "calls",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn empty_context() {
    let bad = r#"{"id": "b", "calls": [{"context": [1], "completion": [2]}, {"context": [], "completion": [3]}]}"#;
    assert_rollout_err(second_line(bad), "b", Some(1), "context", 2);
}

#[test]
fn empty_completion() {
    let bad = r#"{"id": "b", "calls": [{"context": [1], "completion": []}]}"#;
    assert_rollout_err(second_line(bad), "b", Some(0), "completion", 2);
    let e = Rollout::new("c", vec![Call::new(vec![1], vec![])]).unwrap_err();
    assert!(
        e.to_string().contains("call 0") && e.to_string().contains("completion"),
        "{e}"
    );
}

#[test]
fn logprobs_length_differs_from_completion() {
    let bad =
        r#"{"id": "b", "calls": [{"context": [1], "completion": [2, 3], "logprobs": [-1.0]}]}"#;
    let e = second_line(bad);
    assert!(
        e.to_string().contains("1 logprobs for 2 completion tokens"),
        "{e}"
    );
    assert_rollout_err(e, "b", Some(0), "logprobs", 2);
}

#[test]
fn non_finite_logprobs() {
    // JSON has no NaN or infinity literal; 1e39 overflows f32 to infinity.
    let bad = r#"{"id": "b", "calls": [{"context": [1], "completion": [2], "logprobs": [-1e39]}]}"#;
    assert_rollout_err(second_line(bad), "b", Some(0), "logprobs", 2);
    let nan = Call {
        context: vec![1],
        completion: vec![2, 3],
        logprobs: Some(vec![-0.1, f32::NAN]),
    };
    let e = Rollout::new("c", vec![nan]).unwrap_err();
    assert!(e.to_string().contains("offset 1"), "{e}");
    let text = r#"{"id": "b", "calls": [{"context": [1], "completion": [2], "logprobs": [NaN]}]}"#;
    assert!(matches!(second_line(text), Error::Json { line: 2, .. }));
}

#[test]
fn invalid_json_names_its_line() {
    for bad in [
        "{\"id\": \"b\", \"calls\": [",
        "not json",
        "[1, 2]",
        "\"just a string\"",
    ] {
        match second_line(bad) {
            Error::Json { line, .. } => assert_eq!(line, 2, "{bad}"),
            other => panic!("{bad}: expected a JSON error, got {other:?}"),
        }
    }
    // Line numbers count blank lines too.
    let e = parse_jsonl(&format!("\n{GOOD}\n   \n{{oops\n")).unwrap_err();
    assert!(matches!(e, Error::Json { line: 4, .. }), "{e}");
    assert!(e.to_string().starts_with("line 4"), "{e}");
}

#[test]
fn missing_and_mistyped_fields() {
    assert!(matches!(
        second_line(r#"{"calls": []}"#),
        Error::Json { line: 2, .. }
    ));
    assert_rollout_err(second_line(r#"{"id": "b"}"#), "b", None, "calls", 2);
    assert_rollout_err(
        second_line(r#"{"id": "b", "calls": [{"completion": [2]}]}"#),
        "b",
        Some(0),
        "context",
        2,
    );
    assert_rollout_err(
        second_line(r#"{"id": "b", "calls": [{"context": [1]}]}"#),
        "b",
        Some(0),
        "completion",
        2,
    );
    assert_rollout_err(
        second_line(r#"{"id": "b", "calls": [{"context": [1, -2], "completion": [2]}]}"#),
        "b",
        Some(0),
        "context",
        2,
    );
    assert_rollout_err(
        second_line(r#"{"id": "b", "calls": [{"context": [1], "completion": [4294967296]}]}"#),
        "b",
        Some(0),
        "completion",
        2,
    );
    assert_rollout_err(
        second_line(r#"{"id": "b", "calls": [{"context": [1.5], "completion": [2]}]}"#),
        "b",
        Some(0),
        "context",
        2,
    );
    assert_rollout_err(
        second_line(
            r#"{"id": "b", "calls": [{"context": [1], "completion": [2], "logprobs": "x"}]}"#,
        ),
        "b",
        Some(0),
        "logprobs",
        2,
    );
    assert_rollout_err(
        second_line(r#"{"id": "b", "calls": [7]}"#),
        "b",
        Some(0),
        "calls",
        2,
    );
    assert!(matches!(
        second_line(r#"{"id": ["b"], "calls": []}"#),
        Error::Json { line: 2, .. }
    ));
}

#[test]
fn blank_lines_are_skipped_and_ids_must_be_unique() {
    let ok = parse_jsonl(&format!("\n\n{GOOD}\n\t\n")).unwrap();
    assert_eq!(ok.len(), 1);
    assert_eq!(ok[0].calls()[0].logprobs, Some(vec![-0.5]));
    assert!(parse_jsonl("").unwrap().is_empty());
    let e = parse_jsonl(&format!("{GOOD}\n\n{GOOD}\n")).unwrap_err();
    assert_rollout_err(e.clone(), "a", None, "id", 3);
    assert!(e.to_string().contains("first seen on line 1"), "{e}");
    // null logprobs are the same as absent ones.
    let r = parse_jsonl(
        r#"{"id": "n", "calls": [{"context": [1], "completion": [2], "logprobs": null}]}"#,
    )
    .unwrap();
    assert_eq!(r[0].calls()[0].logprobs, None);
}

#[test]
fn invalid_utf8_is_an_error_not_a_panic() {
    let bytes: &[u8] = b"{\"id\": \"\xff\", \"calls\": []}\n";
    assert!(matches!(
        read_jsonl(bytes).unwrap_err(),
        Error::Json { line: 1, .. }
    ));
}

#[test]
fn positive_logprobs_are_errors() {
    // A log-probability is at most 0; 5.0 or 100 is a logit or a mistake.
    for lp in ["5.0", "100", "1e-3"] {
        let bad = format!(
            r#"{{"id": "b", "calls": [{{"context": [1], "completion": [2, 3], "logprobs": [-0.5, {lp}]}}]}}"#
        );
        let e = second_line(&bad);
        assert!(e.to_string().contains("offset 1"), "{e}");
        assert!(e.to_string().contains("positive"), "{e}");
        assert_rollout_err(e, "b", Some(0), "logprobs", 2);
    }
    let pos = Call {
        context: vec![1],
        completion: vec![2],
        logprobs: Some(vec![5.0]),
    };
    assert!(Rollout::new("c", vec![pos]).is_err());
    // 0 (certainty) and -0 are valid.
    let zero =
        r#"{"id": "z", "calls": [{"context": [1], "completion": [2, 3], "logprobs": [0, -0.0]}]}"#;
    assert!(parse_jsonl(zero).is_ok());
}

#[test]
fn duplicate_json_keys_are_errors() {
    for bad in [
        r#"{"id": "b", "id": "c", "calls": [{"context": [1], "completion": [2]}]}"#,
        r#"{"id": "b", "calls": [{"context": [1], "completion": [2], "context": [5]}]}"#,
        r#"{"id": "b", "calls": [{"context": [1], "completion": [2]}], "calls": []}"#,
    ] {
        let e = second_line(bad);
        assert!(matches!(e, Error::Json { line: 2, .. }), "{e}");
        assert!(e.to_string().contains("duplicate key"), "{e}");
    }
    // Repeated keys in unrelated objects are fine.
    let ok = r#"{"id": "b", "meta": {"x": 1}, "calls": [{"context": [1], "completion": [2], "meta": {"x": 2}}]}"#;
    assert!(parse_jsonl(ok).is_ok());
}

#[test]
fn json_errors_name_the_file_line_and_column_only() {
    let e = second_line(r#"{"id": "b", "calls": [}"#);
    let s = e.to_string();
    assert!(s.starts_with("line 2: "), "{s}");
    assert!(s.contains("column 23"), "{s}");
    assert!(!s.contains("line 1"), "one line number only: {s}");
}

#[test]
fn a_byte_order_mark_at_the_start_is_skipped() {
    let with_bom = format!("\u{feff}{GOOD}\n");
    let rs = parse_jsonl(&with_bom).unwrap();
    assert_eq!(rs[0].id(), "a");
    // Only at the start of the input: elsewhere it is not JSON.
    let e = parse_jsonl(&format!("{GOOD}\n\u{feff}{GOOD}\n")).unwrap_err();
    assert!(matches!(e, Error::Json { line: 2, .. }), "{e}");
}

#[test]
fn logprobs_outside_f32_say_so() {
    let bad = r#"{"id": "b", "calls": [{"context": [1], "completion": [2], "logprobs": [-1e39]}]}"#;
    let s = second_line(bad).to_string();
    assert!(s.contains("-1e+39") && s.contains("f32 range"), "{s}");
    assert!(!s.contains("inf"), "{s}");
}

#[test]
fn a_directory_is_an_io_error() {
    let dir = std::env::temp_dir();
    let e = treeattn::rollout::read_jsonl_file(&dir).unwrap_err();
    assert!(matches!(e, Error::Io(_)), "{e:?}");
    assert!(e.to_string().contains("directory"), "{e}");
    let missing = dir.join("treeattn-no-such-file.jsonl");
    assert!(matches!(
        treeattn::rollout::read_jsonl_file(&missing).unwrap_err(),
        Error::Io(_)
    ));
}

#[test]
fn reward_and_group_are_read_checked_and_written_back() {
    let line = r#"{"id": "g", "reward": 0.75, "group": "p3", "calls": [{"context": [1], "completion": [2]}]}"#;
    let rs = parse_jsonl(line).unwrap();
    assert_eq!((rs[0].reward(), rs[0].group()), (Some(0.75), Some("p3")));
    let back = parse_jsonl(&rs[0].to_json()).unwrap();
    assert_eq!(back, rs);
    // Absent and null are the same: no reward, no group.
    let none = r#"{"id": "n", "reward": null, "group": null, "calls": [{"context": [1], "completion": [2]}]}"#;
    let rs = parse_jsonl(none).unwrap();
    assert_eq!((rs[0].reward(), rs[0].group()), (None, None));
    assert!(!rs[0].to_json().contains("reward"));

    let call = r#""calls": [{"context": [1], "completion": [2]}]"#;
    for (bad, field) in [
        (
            format!(r#"{{"id": "b", "reward": "1.0", {call}}}"#),
            "reward",
        ),
        (
            format!(r#"{{"id": "b", "reward": true, {call}}}"#),
            "reward",
        ),
        (
            format!(r#"{{"id": "b", "reward": 1e300, {call}}}"#),
            "reward",
        ),
        (format!(r#"{{"id": "b", "reward": [1], {call}}}"#), "reward"),
        (format!(r#"{{"id": "b", "group": 3, {call}}}"#), "group"),
        (format!(r#"{{"id": "b", "group": ["a"], {call}}}"#), "group"),
    ] {
        assert_rollout_err(second_line(&bad), "b", None, field, 2);
    }
    let r = Rollout::new("x", vec![Call::new(vec![1], vec![2])]).unwrap();
    assert!(matches!(
        r.clone().with_reward(f32::NAN),
        Err(Error::Rollout {
            field: "reward",
            ..
        })
    ));
    assert!(r.with_reward(f32::INFINITY).is_err());
}
