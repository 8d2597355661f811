//! What a command's documentation (`COMMAND DOCS`) says about its arguments: whether a server's `XADD` takes `IDMP`,
//! its `XREADGROUP` `CLAIM`. Shared by the operator's feature detection and the worker SDK (which has no operator
//! modules), read the same from RESP2 and RESP3 replies.

use std::collections::{HashMap, HashSet};

use redis::Value;

/// A reply's text, whichever of RESP2's and RESP3's string kinds it came as.
pub(crate) fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// Every `token` of a command's documentation, at any depth (arguments nest in `oneof` and `block` arguments).
fn tokens(value: &Value, out: &mut HashSet<String>) {
    let token = |key: &Value, value: &Value| match text(key).as_deref() {
        Some("token") => text(value).map(|t| t.to_ascii_uppercase()),
        _ => None,
    };
    match value {
        Value::Array(items) | Value::Set(items) => {
            out.extend(items.windows(2).filter_map(|w| token(&w[0], &w[1])));
            for item in items {
                tokens(item, out);
            }
        }
        Value::Map(entries) => {
            for (key, item) in entries {
                out.extend(token(key, item));
                tokens(item, out);
            }
        }
        _ => {}
    }
}

/// `COMMAND DOCS` as command name -> its tokens: a flat array `[name, docs, name, docs, ...]` (RESP2) or a map
/// (RESP3).
fn tokens_by_command(docs: &Value) -> HashMap<String, HashSet<String>> {
    let pairs: Vec<(&Value, &Value)> = match docs {
        Value::Array(items) => items.chunks(2).filter(|c| c.len() == 2).map(|c| (&c[0], &c[1])).collect(),
        Value::Map(entries) => entries.iter().map(|(k, v)| (k, v)).collect(),
        _ => Vec::new(),
    };
    pairs
        .into_iter()
        .filter_map(|(name, doc)| {
            let mut found = HashSet::new();
            tokens(doc, &mut found);
            Some((text(name)?.to_ascii_lowercase(), found))
        })
        .collect()
}

/// Whether `COMMAND DOCS <command>`'s reply names `token` among the command's arguments.
pub fn has_argument(docs: &Value, command: &str, token: &str) -> bool {
    tokens_by_command(docs).get(command).is_some_and(|tokens| tokens.contains(token))
}
