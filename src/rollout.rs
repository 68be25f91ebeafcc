//! Rollout input: a rollout is the list of model calls a harness made
//! (DESIGN §2).
//!
//! ```json
//! {"id": "r17", "calls": [
//!   {"context": [10, 11, 20], "completion": [30, 31], "logprobs": [-0.5, -1.25]}
//! ]}
//! ```
//!
//! `context` is the full rendered prompt of the call, `completion` the sampled
//! tokens (the targets), `logprobs` (optional, may be `null`) the rollout
//! policy's log-probability of each completion token.
//!
//! Two optional rollout fields serve RL (see [`crate::rl`]): `"reward"`, the
//! rollout's scalar reward (a finite number inside the f32 range, or `null`),
//! and `"group"`, the name of its GRPO group (a string, or `null`; rollouts
//! of a group answer the same prompt):
//!
//! ```json
//! {"id": "r17", "reward": 1.0, "group": "prompt-3", "calls": [...]}
//! ```
//!
//! Three more serve GAE: `"rewards"`, per-token rewards, one list per call
//! with one finite number (inside the f32 range) per completion token, added
//! to the scalar reward (which sits at the rollout's last token; see
//! [`crate::rl`]); `"truncated": true`, the rollout was cut off (a length
//! limit) rather than finished, so its last value bootstraps; and, on a
//! call, `"summary": true`, the call writes a summary that a compaction
//! carries into the next context (CompactionRL's segments: a summary call
//! is a segment of its own; the calls alone cannot tell a summary call from
//! an ordinary call before an eviction, DESIGN §9). Each may be absent or
//! `null`:
//!
//! ```json
//! {"id": "r18", "reward": 1.0, "truncated": true, "rewards": [[0.0, -0.1], [0.5]],
//!  "calls": [{"context": [1], "completion": [2, 3]},
//!            {"context": [1, 2, 3, 4], "completion": [5], "summary": true}]}
//! ```
//!
//! A valid rollout has a non-empty id (in JSON a string; a number is accepted
//! and kept as its decimal text), at least one call, and in every call a
//! non-empty `context` (the first completion token needs a predicting row), a
//! non-empty `completion`, and, when present, exactly one `logprobs` entry per
//! completion token, each finite, at most 0 (a log-probability) and inside
//! the f32 range. Token ids are `u32`.
//!
//! JSON Lines: one rollout per line. Blank (whitespace-only) lines are skipped;
//! every other line must be one rollout object, and rollout ids must be unique
//! within a file. Unknown keys are ignored (harness logs carry extra fields),
//! but a key repeated inside one object is an error (which one would count is
//! ambiguous). A UTF-8 byte-order mark at the start of the input is skipped.
//! Every problem is reported as an `Err` naming the line (1-based), rollout id,
//! call index and field; JSON syntax errors give the column on that line, and
//! a read failure (a directory, say) is an [`Error::Io`] with the line.

use std::io::{BufRead, Write};

use serde_json::Value;

use crate::{Error, Result};

/// One model call: the rendered prompt and what the model sampled.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// The full rendered prompt of the call.
    pub context: Vec<u32>,
    /// The tokens the model sampled (the targets).
    pub completion: Vec<u32>,
    /// Rollout log-probability of each completion token, if the harness logged it.
    pub logprobs: Option<Vec<f32>>,
}

impl Call {
    /// A call without logged log-probabilities.
    pub fn new(context: Vec<u32>, completion: Vec<u32>) -> Call {
        Call {
            context,
            completion,
            logprobs: None,
        }
    }

    /// The call's full sequence `context ++ completion` (its branch prefix).
    pub fn sequence(&self) -> Vec<u32> {
        let mut s = Vec::with_capacity(self.context.len() + self.completion.len());
        s.extend_from_slice(&self.context);
        s.extend_from_slice(&self.completion);
        s
    }

    /// Length of `context ++ completion`.
    pub fn sequence_len(&self) -> usize {
        self.context.len() + self.completion.len()
    }

    /// Token at position `i` of `context ++ completion`.
    #[inline]
    pub fn token_at(&self, i: usize) -> u32 {
        if i < self.context.len() {
            self.context[i]
        } else {
            self.completion[i - self.context.len()]
        }
    }
}

/// A validated rollout: an id and its calls in the order they were made.
#[derive(Clone, Debug, PartialEq)]
pub struct Rollout {
    id: String,
    calls: Vec<Call>,
    reward: Option<f32>,
    group: Option<String>,
    /// Per call, per completion token.
    token_rewards: Option<Vec<Vec<f32>>>,
    truncated: bool,
    /// Per call: does it write a summary (CompactionRL)?
    summary: Vec<bool>,
}

impl Rollout {
    /// Validates and builds a rollout (see the module docs for the rules).
    pub fn new(id: impl Into<String>, calls: Vec<Call>) -> Result<Rollout> {
        let id = id.into();
        let err = |call: Option<usize>, field: &'static str, msg: String| Error::Rollout {
            rollout: id.clone(),
            call,
            field,
            msg,
        };
        if id.is_empty() {
            return Err(err(None, "id", "the rollout id is empty".into()));
        }
        if calls.is_empty() {
            return Err(err(
                None,
                "calls",
                "a rollout needs at least one call".into(),
            ));
        }
        for (c, call) in calls.iter().enumerate() {
            if call.context.is_empty() {
                return Err(err(
                    Some(c),
                    "context",
                    "empty context: the first completion token would have no predicting row".into(),
                ));
            }
            if call.completion.is_empty() {
                return Err(err(
                    Some(c),
                    "completion",
                    "empty completion: a call must sample at least one token".into(),
                ));
            }
            if let Some(lp) = &call.logprobs {
                if lp.len() != call.completion.len() {
                    return Err(err(
                        Some(c),
                        "logprobs",
                        format!(
                            "{} logprobs for {} completion tokens",
                            lp.len(),
                            call.completion.len()
                        ),
                    ));
                }
                if let Some(j) = lp.iter().position(|x| !x.is_finite()) {
                    return Err(err(
                        Some(c),
                        "logprobs",
                        format!("non-finite logprob {} at offset {j}", lp[j]),
                    ));
                }
                if let Some(j) = lp.iter().position(|&x| x > 0.0) {
                    return Err(err(
                        Some(c),
                        "logprobs",
                        format!(
                            "logprob {} at offset {j} is positive: a log-probability is at most 0",
                            lp[j]
                        ),
                    ));
                }
            }
            if call.sequence_len() > u32::MAX as usize / 2 {
                return Err(err(
                    Some(c),
                    "context",
                    format!("sequence of {} tokens is too long", call.sequence_len()),
                ));
            }
        }
        let summary = vec![false; calls.len()];
        Ok(Rollout {
            id,
            calls,
            reward: None,
            group: None,
            token_rewards: None,
            truncated: false,
            summary,
        })
    }

    /// The rollout with a scalar reward (RL; see [`crate::rl`]). A reward
    /// that is not finite is an [`Error::Rollout`] naming the rollout.
    pub fn with_reward(mut self, reward: f32) -> Result<Rollout> {
        if !reward.is_finite() {
            return Err(Error::Rollout {
                rollout: self.id.clone(),
                call: None,
                field: "reward",
                msg: format!("reward {reward} is not finite"),
            });
        }
        self.reward = Some(reward);
        Ok(self)
    }

    /// The rollout as a member of the GRPO group `group` (rollouts of a
    /// group answer the same prompt; see [`crate::rl::grpo_advantages`]).
    pub fn with_group(mut self, group: impl Into<String>) -> Rollout {
        self.group = Some(group.into());
        self
    }

    /// The rollout with per-token rewards: `rewards[c][j]` for completion
    /// token `j` of call `c` (RL; see [`crate::rl`]). One list per call and
    /// one finite reward per completion token, else an [`Error::Rollout`]
    /// naming the call and the field `rewards`.
    pub fn with_token_rewards(mut self, rewards: Vec<Vec<f32>>) -> Result<Rollout> {
        let err = |call: Option<usize>, msg: String| Error::Rollout {
            rollout: self.id.clone(),
            call,
            field: "rewards",
            msg,
        };
        if rewards.len() != self.calls.len() {
            return Err(err(
                None,
                format!(
                    "{} reward lists for {} calls (one list per call)",
                    rewards.len(),
                    self.calls.len()
                ),
            ));
        }
        for (c, (r, call)) in rewards.iter().zip(&self.calls).enumerate() {
            if r.len() != call.completion.len() {
                return Err(err(
                    Some(c),
                    format!(
                        "{} rewards for {} completion tokens",
                        r.len(),
                        call.completion.len()
                    ),
                ));
            }
            if let Some(j) = r.iter().position(|x| !x.is_finite()) {
                return Err(err(
                    Some(c),
                    format!("reward {} at offset {j} is not finite", r[j]),
                ));
            }
        }
        self.token_rewards = Some(rewards);
        Ok(self)
    }

    /// The rollout marked as truncated (cut off by a length limit rather
    /// than finished: its last value bootstraps in GAE) or not.
    pub fn with_truncated(mut self, truncated: bool) -> Rollout {
        self.truncated = truncated;
        self
    }

    /// The rollout with call `call` marked as a summary call (it writes the
    /// summary a compaction carries on; CompactionRL makes it a segment of
    /// its own). A call index out of range is an [`Error::Rollout`].
    pub fn with_summary(mut self, call: usize) -> Result<Rollout> {
        if call >= self.calls.len() {
            return Err(Error::Rollout {
                rollout: self.id.clone(),
                call: Some(call),
                field: "summary",
                msg: format!("no call {call} in a rollout of {}", self.calls.len()),
            });
        }
        self.summary[call] = true;
        Ok(self)
    }

    /// The rollout's reward, if the input had one.
    pub fn reward(&self) -> Option<f32> {
        self.reward
    }

    /// The per-token rewards (one list per call, one reward per completion
    /// token), if the input had them.
    pub fn token_rewards(&self) -> Option<&[Vec<f32>]> {
        self.token_rewards.as_deref()
    }

    /// Whether the rollout was cut off rather than finished.
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// Whether call `c` is marked as a summary call (false out of range).
    pub fn is_summary(&self, c: usize) -> bool {
        self.summary.get(c).copied().unwrap_or(false)
    }

    /// The rollout's GRPO group, if the input had one.
    pub fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    /// The rollout id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The calls, in the order they were made.
    pub fn calls(&self) -> &[Call] {
        &self.calls
    }

    /// Number of sampled (completion) tokens over all calls.
    pub fn targets(&self) -> usize {
        self.calls.iter().map(|c| c.completion.len()).sum()
    }

    /// Whether call `c` (> 0) is a junction: its context does not extend the
    /// previous call's `context ++ completion`.
    pub fn is_junction(&self, c: usize) -> bool {
        if c == 0 || c >= self.calls.len() {
            return false;
        }
        let (prev, cur) = (&self.calls[c - 1], &self.calls[c]);
        let n = prev.sequence_len();
        !(cur.context.len() >= n && (0..n).all(|i| prev.token_at(i) == cur.context[i]))
    }

    /// The rollout as one JSON object (the JSONL line, without newline).
    pub fn to_json(&self) -> String {
        let calls: Vec<Value> = self
            .calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut m = serde_json::Map::new();
                m.insert("context".into(), Value::from(c.context.clone()));
                m.insert("completion".into(), Value::from(c.completion.clone()));
                if let Some(lp) = &c.logprobs {
                    // f32 -> f64 is exact, and serde_json prints the shortest
                    // f64 that round-trips, so reading gives back the same f32.
                    m.insert(
                        "logprobs".into(),
                        Value::from(lp.iter().map(|&x| x as f64).collect::<Vec<_>>()),
                    );
                }
                if self.summary[i] {
                    m.insert("summary".into(), Value::Bool(true));
                }
                Value::Object(m)
            })
            .collect();
        let mut obj = serde_json::Map::new();
        obj.insert("id".into(), Value::from(self.id.clone()));
        if let Some(r) = self.reward {
            // f32 -> f64 is exact; the shortest round-trip text reads back
            // as the same f32.
            obj.insert("reward".into(), Value::from(r as f64));
        }
        if let Some(g) = &self.group {
            obj.insert("group".into(), Value::from(g.clone()));
        }
        if let Some(rw) = &self.token_rewards {
            let lists: Vec<Value> = rw
                .iter()
                .map(|r| Value::from(r.iter().map(|&x| x as f64).collect::<Vec<_>>()))
                .collect();
            obj.insert("rewards".into(), Value::Array(lists));
        }
        if self.truncated {
            obj.insert("truncated".into(), Value::Bool(true));
        }
        obj.insert("calls".into(), Value::Array(calls));
        Value::Object(obj).to_string()
    }
}

/// A serde_json error without its "at line 1" (the caller names the file
/// line): the message and the column on the line.
fn json_msg(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let msg = match full.rfind(" at line ") {
        Some(p) => &full[..p],
        None => &full,
    };
    if e.column() > 0 {
        format!("{msg} at column {}", e.column())
    } else {
        msg.to_string()
    }
}

/// Parses JSON like `serde_json::from_str::<Value>`, but a key repeated in
/// one object is an error instead of "the last one wins".
pub(crate) fn parse_json_strict(text: &str) -> std::result::Result<Value, serde_json::Error> {
    use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
    use std::fmt;

    struct Strict;
    impl<'de> DeserializeSeed<'de> for Strict {
        type Value = Value;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
            d.deserialize_any(Strict)
        }
    }
    impl<'de> Visitor<'de> for Strict {
        type Value = Value;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
            Ok(Value::String(v.to_string()))
        }
        fn visit_string<E>(self, v: String) -> std::result::Result<Value, E> {
            Ok(Value::String(v))
        }
        fn visit_unit<E>(self) -> std::result::Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_none<E>(self) -> std::result::Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
            d.deserialize_any(Strict)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(x) = seq.next_element_seed(Strict)? {
                v.push(x);
            }
            Ok(Value::Array(v))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
            let mut m = serde_json::Map::new();
            while let Some(k) = map.next_key::<String>()? {
                if m.contains_key(&k) {
                    return Err(A::Error::custom(format!("duplicate key {k:?}")));
                }
                let v = map.next_value_seed(Strict)?;
                m.insert(k, v);
            }
            Ok(Value::Object(m))
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let v = Strict.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// Parses one JSONL line (already known to be non-blank) into a rollout.
fn parse_line(text: &str, line: usize) -> Result<Rollout> {
    let v: Value = parse_json_strict(text).map_err(|e| Error::Json {
        line,
        msg: json_msg(&e),
    })?;
    let obj = v.as_object().ok_or_else(|| Error::Json {
        line,
        msg: "a rollout line must be a JSON object".into(),
    })?;
    let id = match obj.get("id") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(Error::Json {
                line,
                msg: format!("field `id` must be a string, got {other}"),
            })
        }
        None => {
            return Err(Error::Json {
                line,
                msg: "missing field `id`".into(),
            })
        }
    };
    let rerr = |call: Option<usize>, field: &'static str, msg: String| Error::Rollout {
        rollout: id.clone(),
        call,
        field,
        msg: format!("line {line}: {msg}"),
    };
    let reward = match obj.get("reward") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => {
            let f = n.as_f64().map(|x| x as f32).filter(|x| x.is_finite());
            Some(f.ok_or_else(|| {
                rerr(
                    None,
                    "reward",
                    format!("{n} is outside the f32 range: a reward must be a finite number"),
                )
            })?)
        }
        Some(other) => {
            return Err(rerr(
                None,
                "reward",
                format!("must be a number or null, got {other}"),
            ))
        }
    };
    let group = match obj.get("group") {
        None | Some(Value::Null) => None,
        Some(Value::String(g)) => Some(g.clone()),
        Some(other) => {
            return Err(rerr(
                None,
                "group",
                format!("must be a string (the GRPO group's name) or null, got {other}"),
            ))
        }
    };
    // One finite f32 from a JSON number, or an error naming the field.
    let number = |x: &Value, call: Option<usize>, field: &'static str, what: String| {
        let f = x
            .as_f64()
            .ok_or_else(|| rerr(call, field, format!("{what} = {x} is not a number")))?;
        let v = f as f32;
        if v.is_finite() {
            Ok(v)
        } else {
            Err(rerr(
                call,
                field,
                format!("{what} = {x} is outside the f32 range"),
            ))
        }
    };
    let token_rewards = match obj.get("rewards") {
        None | Some(Value::Null) => None,
        Some(Value::Array(lists)) => Some(
            lists
                .iter()
                .enumerate()
                .map(|(c, l)| match l {
                    Value::Array(a) => a
                        .iter()
                        .enumerate()
                        .map(|(j, x)| number(x, Some(c), "rewards", format!("entry {j}")))
                        .collect::<Result<Vec<f32>>>(),
                    other => Err(rerr(
                        Some(c),
                        "rewards",
                        format!(
                            "must be a list of numbers (one per completion token), got {other}"
                        ),
                    )),
                })
                .collect::<Result<Vec<Vec<f32>>>>()?,
        ),
        Some(other) => {
            return Err(rerr(
                None,
                "rewards",
                format!("must be a list of per-call lists of numbers, or null, got {other}"),
            ))
        }
    };
    let truncated = match obj.get("truncated") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(rerr(
                None,
                "truncated",
                format!("must be true, false or null, got {other}"),
            ))
        }
    };
    let mut summary_calls = Vec::new();
    let calls_v = match obj.get("calls") {
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(rerr(
                None,
                "calls",
                "must be an array of call objects".into(),
            ))
        }
        None => return Err(rerr(None, "calls", "missing field".into())),
    };
    let mut calls = Vec::with_capacity(calls_v.len());
    for (c, cv) in calls_v.iter().enumerate() {
        let co = cv
            .as_object()
            .ok_or_else(|| rerr(Some(c), "calls", "a call must be a JSON object".into()))?;
        let tokens = |field: &'static str| -> Result<Vec<u32>> {
            let arr = match co.get(field) {
                Some(Value::Array(a)) => a,
                Some(_) => {
                    return Err(rerr(Some(c), field, "must be an array of token ids".into()))
                }
                None => return Err(rerr(Some(c), field, "missing field".into())),
            };
            arr.iter()
                .enumerate()
                .map(|(i, t)| {
                    t.as_u64()
                        .filter(|&x| x <= u32::MAX as u64)
                        .map(|x| x as u32)
                        .ok_or_else(|| {
                            rerr(
                                Some(c),
                                field,
                                format!("entry {i} = {t} is not a u32 token id"),
                            )
                        })
                })
                .collect()
        };
        let context = tokens("context")?;
        let completion = tokens("completion")?;
        let logprobs = match co.get("logprobs") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => Some(
                a.iter()
                    .enumerate()
                    .map(|(i, x)| {
                        let f = x.as_f64().ok_or_else(|| {
                            rerr(
                                Some(c),
                                "logprobs",
                                format!("entry {i} = {x} is not a number"),
                            )
                        })?;
                        let v = f as f32;
                        if v.is_infinite() {
                            return Err(rerr(
                                Some(c),
                                "logprobs",
                                format!("entry {i} = {x} is outside the f32 range"),
                            ));
                        }
                        Ok(v)
                    })
                    .collect::<Result<Vec<f32>>>()?,
            ),
            Some(_) => {
                return Err(rerr(
                    Some(c),
                    "logprobs",
                    "must be an array of numbers or null".into(),
                ))
            }
        };
        match co.get("summary") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => summary_calls.push(c),
            Some(other) => {
                return Err(rerr(
                    Some(c),
                    "summary",
                    format!("must be true, false or null, got {other}"),
                ))
            }
        }
        calls.push(Call {
            context,
            completion,
            logprobs,
        });
    }
    let with_fields = |r: Rollout| -> Result<Rollout> {
        let mut r = match reward {
            Some(x) => r.with_reward(x)?,
            None => r,
        };
        if let Some(rw) = token_rewards {
            r = r.with_token_rewards(rw)?;
        }
        for &c in &summary_calls {
            r = r.with_summary(c)?;
        }
        let r = r.with_truncated(truncated);
        Ok(match group {
            Some(g) => r.with_group(g),
            None => r,
        })
    };
    Rollout::new(id, calls)
        .and_then(with_fields)
        .map_err(|e| match e {
            Error::Rollout {
                rollout,
                call,
                field,
                msg,
            } => Error::Rollout {
                rollout,
                call,
                field,
                msg: format!("line {line}: {msg}"),
            },
            other => other,
        })
}

/// Reads rollouts from JSON Lines (see the module docs for the rules).
pub fn read_jsonl<R: BufRead>(reader: R) -> Result<Vec<Rollout>> {
    let mut out: Vec<Rollout> = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let mut text = line.map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                Error::Json {
                    line: line_no,
                    msg: "the line is not valid UTF-8".into(),
                }
            } else {
                Error::Io(format!("reading line {line_no}: {e}"))
            }
        })?;
        if line_no == 1 {
            if let Some(rest) = text.strip_prefix('\u{feff}') {
                text = rest.to_string();
            }
        }
        if text.trim().is_empty() {
            continue;
        }
        let r = parse_line(&text, line_no)?;
        if let Some(first) = seen.insert(r.id().to_string(), line_no) {
            return Err(Error::Rollout {
                rollout: r.id().to_string(),
                call: None,
                field: "id",
                msg: format!("line {line_no}: duplicate rollout id (first seen on line {first})"),
            });
        }
        out.push(r);
    }
    Ok(out)
}

/// Reads rollouts from a JSON Lines file (same rules as [`read_jsonl`]);
/// every error names the path. A directory or an unreadable file is an
/// [`Error::Io`].
pub fn read_jsonl_file(path: &std::path::Path) -> Result<Vec<Rollout>> {
    read_jsonl_file_progress(path, |_, _| {})
}

/// [`read_jsonl_file`], calling `progress(bytes read, file size)` as it
/// reads (for a progress display).
pub fn read_jsonl_file_progress(
    path: &std::path::Path,
    mut progress: impl FnMut(u64, u64),
) -> Result<Vec<Rollout>> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    if meta.is_dir() {
        return Err(Error::Io(format!(
            "{shown}: is a directory, not a JSON Lines file"
        )));
    }
    let f = std::fs::File::open(path).map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    struct Counting<'a, R, F: FnMut(u64, u64)> {
        inner: R,
        done: u64,
        total: u64,
        progress: &'a mut F,
    }
    impl<R: std::io::Read, F: FnMut(u64, u64)> std::io::Read for Counting<'_, R, F> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.done += n as u64;
            (self.progress)(self.done, self.total);
            Ok(n)
        }
    }
    let f = Counting {
        inner: f,
        done: 0,
        total: meta.len(),
        progress: &mut progress,
    };
    read_jsonl(std::io::BufReader::new(f)).map_err(|e| match e {
        Error::Json { line, msg } => Error::Json {
            line,
            msg: format!("{shown}: {msg}"),
        },
        Error::Rollout {
            rollout,
            call,
            field,
            msg,
        } => Error::Rollout {
            rollout,
            call,
            field,
            msg: format!("{shown}: {msg}"),
        },
        Error::Io(m) => Error::Io(format!("{shown}: {m}")),
        other => other,
    })
}

/// The error for a rollout file with no rollout in it (empty, or blank
/// lines only), naming it: the commands that read a file (`inspect`,
/// `pack`, `demo --input`) refuse one rather than report or write nothing.
pub fn no_rollouts_error(path: &std::path::Path) -> Error {
    let what = match std::fs::metadata(path) {
        Ok(m) if m.len() == 0 => "the file is empty",
        _ => "the file has only blank lines",
    };
    Error::Json {
        line: 1,
        msg: format!(
            "{}: no rollouts ({what}; one JSON object per line expected)",
            path.display()
        ),
    }
}

/// Parses rollouts from a JSON Lines string (same rules as [`read_jsonl`]).
pub fn parse_jsonl(text: &str) -> Result<Vec<Rollout>> {
    read_jsonl(text.as_bytes())
}

/// Writes rollouts as JSON Lines, one per line.
pub fn write_jsonl<W: Write>(mut writer: W, rollouts: &[Rollout]) -> Result<()> {
    for r in rollouts {
        writeln!(writer, "{}", r.to_json())
            .map_err(|e| Error::Io(format!("writing rollout {:?}: {e}", r.id())))?;
    }
    writer.flush().map_err(|e| Error::Io(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_tokens_and_logprobs() {
        let r = Rollout::new(
            "a",
            vec![Call {
                context: vec![1, 2],
                completion: vec![3, u32::MAX],
                logprobs: Some(vec![-0.1, -17.25]),
            }],
        )
        .unwrap();
        let mut buf = Vec::new();
        write_jsonl(&mut buf, std::slice::from_ref(&r)).unwrap();
        let back = read_jsonl(&buf[..]).unwrap();
        assert_eq!(back, vec![r]);
    }

    #[test]
    fn token_rewards_truncation_and_summary_are_read_checked_and_written_back() {
        let line = r#"{"id": "t", "reward": 1.0, "truncated": true, "rewards": [[0.5, -0.25], [2]],
            "calls": [{"context": [1], "completion": [2, 3]},
                      {"context": [1, 2, 3, 4], "completion": [5], "summary": true}]}"#
            .replace('\n', " ");
        let rs = parse_jsonl(&line).unwrap();
        let r = &rs[0];
        assert_eq!(
            r.token_rewards().unwrap(),
            &[vec![0.5, -0.25], vec![2.0]][..]
        );
        assert!(r.truncated() && !r.is_summary(0) && r.is_summary(1) && !r.is_summary(2));
        let back = parse_jsonl(&r.to_json()).unwrap();
        assert_eq!(&back, &rs);
        // Absent, null and false are the same.
        let plain = r#"{"id": "p", "rewards": null, "truncated": false, "calls": [{"context": [1], "completion": [2], "summary": null}]}"#;
        let p = &parse_jsonl(plain).unwrap()[0];
        assert!(p.token_rewards().is_none() && !p.truncated() && !p.is_summary(0));
        let json = p.to_json();
        assert!(
            !json.contains("rewards") && !json.contains("truncated") && !json.contains("summary")
        );

        let call = r#""calls": [{"context": [1], "completion": [2, 3]}]"#;
        for (bad, field, call_index) in [
            (
                format!(r#"{{"id": "b", "rewards": [[1]], {call}}}"#),
                "rewards",
                Some(0),
            ),
            (
                format!(r#"{{"id": "b", "rewards": [[1, 2], [3]], {call}}}"#),
                "rewards",
                None,
            ),
            (
                format!(r#"{{"id": "b", "rewards": [1, 2], {call}}}"#),
                "rewards",
                Some(0),
            ),
            (
                format!(r#"{{"id": "b", "rewards": [[1, "x"]], {call}}}"#),
                "rewards",
                Some(0),
            ),
            (
                format!(r#"{{"id": "b", "rewards": [[1, 1e300]], {call}}}"#),
                "rewards",
                Some(0),
            ),
            (
                format!(r#"{{"id": "b", "rewards": 1, {call}}}"#),
                "rewards",
                None,
            ),
            (
                format!(r#"{{"id": "b", "truncated": 1, {call}}}"#),
                "truncated",
                None,
            ),
            (
                r#"{"id": "b", "calls": [{"context": [1], "completion": [2], "summary": "yes"}]}"#
                    .to_string(),
                "summary",
                Some(0),
            ),
        ] {
            match parse_jsonl(&bad) {
                Err(Error::Rollout {
                    rollout,
                    call,
                    field: f,
                    msg,
                }) => {
                    assert_eq!(
                        (rollout.as_str(), f, call),
                        ("b", field, call_index),
                        "{bad}: {msg}"
                    );
                    assert!(msg.starts_with("line 1: "), "{msg}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        let r = Rollout::new("x", vec![Call::new(vec![1], vec![2])]).unwrap();
        assert!(r.clone().with_token_rewards(vec![vec![f32::NAN]]).is_err());
        assert!(r.clone().with_summary(1).is_err());
    }

    #[test]
    fn junction_is_a_context_that_does_not_extend() {
        let r = Rollout::new(
            "j",
            vec![
                Call::new(vec![1], vec![2]),
                Call::new(vec![1, 2, 5], vec![6]),
                Call::new(vec![1, 5], vec![7]),
            ],
        )
        .unwrap();
        assert!(!r.is_junction(0) && !r.is_junction(1) && r.is_junction(2));
    }
}
