//! Tenancy: which namespaces a `RedisServer` admits, and which keys each may touch. Pure: the controllers pass the
//! namespace's labels in, and get back the rules to check each key against before anything is written.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

use crate::api::RedisServer;
use crate::{Error, Result};

/// What `${namespace}` in a key pattern stands for.
const NAMESPACE_VARIABLE: &str = "${namespace}";

/// The keys one namespace may touch on one server: the patterns of every tenant entry that admits it.
#[derive(Clone, Debug)]
pub struct KeyRules {
    /// `namespace/name` of the server.
    server: String,
    namespace: String,
    /// The patterns as written, `${namespace}` substituted.
    patterns: Vec<String>,
}

/// `namespace/name` of a server object.
pub fn server_name(server: &RedisServer) -> String {
    format!("{}/{}", server.namespace().unwrap_or_default(), server.name_any())
}

/// Whether admitting `namespace` depends on its labels (some tenant entry selects by label).
pub fn needs_labels(server: &RedisServer) -> bool {
    server.spec.tenants.iter().any(|t| t.namespace_selector.is_some())
}

/// The rules for a policy in `namespace` (`labels`: the namespace's labels, when known), or `ServerNotAllowed`.
/// A server without tenants admits its own namespace only, every key.
pub fn admit(server: &RedisServer, namespace: &str, labels: Option<&BTreeMap<String, String>>) -> Result<KeyRules> {
    let own = server.namespace().unwrap_or_default();
    let patterns: Vec<String> = if server.spec.tenants.is_empty() {
        if namespace != own {
            return Err(not_allowed(server, namespace));
        }
        vec!["*".to_string()]
    } else {
        server
            .spec
            .tenants
            .iter()
            .filter(|t| {
                t.namespaces.iter().any(|n| n.0 == namespace)
                    || t.namespace_selector.as_ref().is_some_and(|s| {
                        let selector = Selector::try_from(LabelSelector::from(s));
                        // A selector the API server accepted but that does not parse admits nobody.
                        labels.is_some_and(|labels| selector.is_ok_and(|s| s.matches(labels)))
                    })
            })
            .flat_map(|t| t.keys.iter().map(|k| k.0.replace(NAMESPACE_VARIABLE, namespace)))
            .collect()
    };
    if patterns.is_empty() {
        return Err(not_allowed(server, namespace));
    }
    Ok(KeyRules { server: server_name(server), namespace: namespace.to_string(), patterns })
}

fn not_allowed(server: &RedisServer, namespace: &str) -> Error {
    Error::ServerNotAllowed { server: server_name(server), namespace: namespace.to_string() }
}

impl KeyRules {
    /// The patterns, `${namespace}` substituted.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// `KeyNotAllowed` unless some pattern matches `key`; `field` names where the key comes from
    /// (`spec.stream`, ...).
    pub fn check(&self, field: &str, key: &str) -> Result<()> {
        if self.patterns.iter().any(|p| key_matches(p.as_bytes(), key.as_bytes())) {
            return Ok(());
        }
        Err(Error::KeyNotAllowed {
            server: self.server.clone(),
            namespace: self.namespace.clone(),
            field: field.to_string(),
            key: key.to_string(),
            patterns: self.patterns.join(", "),
        })
    }

    /// `KeyNotAllowed` unless Pelican's own keys for `stream` (`own`) are admitted too, when the stream has a hash
    /// tag: they live in `{tag}:pelican:...`, and a stream `a.{team-b}` admitted by `a.*` would otherwise put its
    /// counters, bounds and errors into the key space of whoever owns `{team-b}`. A stream without a tag is its own
    /// tag: its keys are `{<stream>}:pelican:<stream>:...`, named after a key this namespace was admitted to.
    pub fn check_own(&self, field: &str, stream: &str, own: &[String]) -> Result<()> {
        if crate::keys::hash_tag(stream) == stream {
            return Ok(());
        }
        let field =
            format!("Pelican's own key for {field} (in the stream's hash tag {{{}}})", crate::keys::hash_tag(stream));
        own.iter().try_for_each(|key| self.check(&field, key))
    }
}

/// Whether `key` matches `pattern` as Redis matches ACL key patterns (`stringmatchlen` of its `util.c`, case
/// sensitive): `*` any run of bytes, `?` one byte, `[abc]`, `[a-z]` and `[^...]` a byte of (or not of) a set, `\`
/// makes the next byte plain, inside a set too; a `[` never closed runs to the pattern's end. No glob crate has these
/// semantics (`glob` has no `^`, no escapes and refuses `**`), and a mismatch admits keys the server would refuse, or
/// refuses keys it admits.
pub fn key_matches(pattern: &[u8], key: &[u8]) -> bool {
    let mut skip_longer = false;
    match_from(pattern, key, &mut skip_longer, 0)
}

fn match_from(mut pattern: &[u8], mut key: &[u8], skip_longer: &mut bool, nesting: usize) -> bool {
    // As the server, which stops at this depth rather than overflow its stack.
    if nesting > 1000 {
        return false;
    }
    while !pattern.is_empty() && !key.is_empty() {
        match pattern[0] {
            b'*' => {
                while pattern.len() > 1 && pattern[1] == b'*' {
                    pattern = &pattern[1..];
                }
                if pattern.len() == 1 {
                    return true;
                }
                while !key.is_empty() {
                    if match_from(&pattern[1..], key, skip_longer, nesting + 1) {
                        return true;
                    }
                    if *skip_longer {
                        return false;
                    }
                    key = &key[1..];
                }
                // No tail of the key matches the rest: neither will any shorter one tried by an outer `*`.
                *skip_longer = true;
                return false;
            }
            b'?' => key = &key[1..],
            b'[' => {
                pattern = &pattern[1..];
                let negate = pattern.first() == Some(&b'^');
                if negate {
                    pattern = &pattern[1..];
                }
                let (c, mut found) = (key[0], false);
                loop {
                    match pattern {
                        [b'\\', escaped, ..] => {
                            pattern = &pattern[1..];
                            found |= *escaped == c;
                        }
                        [b']', ..] => break,
                        // Unclosed: the set ends with the pattern (the caller's step below eats nothing more).
                        [] => break,
                        [start, b'-', end, ..] => {
                            let (low, high) = if start <= end { (*start, *end) } else { (*end, *start) };
                            found |= (low..=high).contains(&c);
                            pattern = &pattern[2..];
                        }
                        [byte, ..] => found |= *byte == c,
                    }
                    pattern = &pattern[1..];
                }
                if found == negate {
                    return false;
                }
                key = &key[1..];
                if pattern.is_empty() {
                    // The unclosed set consumed the whole pattern.
                    return key.is_empty();
                }
            }
            b'\\' if pattern.len() >= 2 => {
                pattern = &pattern[1..];
                if pattern[0] != key[0] {
                    return false;
                }
                key = &key[1..];
            }
            byte => {
                if byte != key[0] {
                    return false;
                }
                key = &key[1..];
            }
        }
        pattern = &pattern[1..];
        if key.is_empty() {
            while pattern.first() == Some(&b'*') {
                pattern = &pattern[1..];
            }
            break;
        }
    }
    pattern.is_empty() && key.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{KeyPattern, LabelSelectorSpec, NamespaceName, RedisMode, RedisServerSpec, Tenant};

    fn server(tenants: Vec<Tenant>) -> RedisServer {
        let mut server = RedisServer::new(
            "shared",
            RedisServerSpec {
                url: "redis://redis:6379".into(),
                mode: RedisMode::Standalone,
                sentinel: None,
                username_secret_ref: None,
                password_secret_ref: None,
                tls: None,
                tenants,
                drain_pause: None,
            },
        );
        server.metadata.namespace = Some("platform".into());
        server
    }

    fn tenant(namespaces: &[&str], keys: &[&str]) -> Tenant {
        Tenant {
            namespaces: namespaces.iter().map(|s| NamespaceName(s.to_string())).collect(),
            namespace_selector: None,
            keys: keys.iter().map(|s| KeyPattern(s.to_string())).collect(),
        }
    }

    #[test]
    fn without_tenants_only_the_servers_own_namespace_is_admitted_with_every_key() {
        let s = server(vec![]);
        assert!(admit(&s, "platform", None).unwrap().check("spec.stream", "anything").is_ok());
        let e = admit(&s, "billing", None).unwrap_err();
        assert_eq!(e.reason(), "ServerNotAllowed");
        assert!(e.to_string().contains("platform/shared") && e.to_string().contains("\"billing\""), "{e}");
    }

    #[test]
    fn namespace_is_substituted_and_braces_are_plain_characters() {
        let s = server(vec![tenant(&["billing", "shipping"], &["{${namespace}}:*", "${namespace}.*"])]);
        let billing = admit(&s, "billing", None).unwrap();
        assert!(billing.check("spec.stream", "{billing}:orders").is_ok());
        assert!(billing.check("spec.stream", "billing.orders").is_ok());
        let e = billing.check("spec.deadLetter.stream", "{shipping}:orders").unwrap_err();
        assert_eq!(e.reason(), "KeyNotAllowed");
        let text = e.to_string();
        assert!(text.contains("spec.deadLetter.stream \"{shipping}:orders\""), "{text}");
        assert!(text.contains("{billing}:*, billing.*"), "{text}");
        // `b` alone is neither of billing's patterns.
        assert!(billing.check("spec.stream", "b").is_err());
    }

    #[test]
    fn a_label_selector_admits_by_the_namespaces_labels_and_unknown_labels_admit_nothing() {
        let mut data = tenant(&[], &["data.*"]);
        data.namespace_selector =
            Some(LabelSelectorSpec { match_labels: [("team".into(), "data".into())].into(), ..Default::default() });
        let s = server(vec![data, tenant(&["ops"], &["ops.*"])]);
        let labels: BTreeMap<String, String> = [("team".into(), "data".into())].into();
        assert!(admit(&s, "etl", Some(&labels)).unwrap().check("spec.stream", "data.raw").is_ok());
        assert_eq!(admit(&s, "etl", None).unwrap_err().reason(), "ServerNotAllowed");
        assert_eq!(admit(&s, "etl", Some(&BTreeMap::new())).unwrap_err().reason(), "ServerNotAllowed");
        assert!(needs_labels(&s));
    }

    #[test]
    fn a_hash_tag_outside_the_patterns_is_refused_for_pelicans_own_keys() {
        let s = server(vec![tenant(&["a"], &["a.*", "{a}:*"])]);
        let a = admit(&s, "a", None).unwrap();
        let own = |stream: &str| crate::keys::group_keys(stream, "g");
        // Admitted by `a.*`, but its keys would be {team-b}:pelican:...: refused, naming the key and the tag.
        assert!(a.check("spec.stream", "a.{team-b}").is_ok());
        let e = a.check_own("spec.stream", "a.{team-b}", &own("a.{team-b}")).unwrap_err();
        assert_eq!(e.reason(), "KeyNotAllowed");
        assert!(e.to_string().contains("{team-b}:pelican:a.{team-b}:g:totals"), "{e}");
        assert!(e.to_string().contains("hash tag {team-b}"), "{e}");
        // Its own tag, or no tag: admitted.
        assert!(a.check_own("spec.stream", "{a}:orders", &own("{a}:orders")).is_ok());
        assert!(a.check_own("spec.stream", "a.orders", &own("a.orders")).is_ok());
    }

    #[test]
    fn patterns_of_every_admitting_entry_apply() {
        let s = server(vec![tenant(&["a"], &["a.*", "team-a:[^_]*"]), tenant(&["a"], &["shared.?"])]);
        let a = admit(&s, "a", None).unwrap();
        assert!(a.check("spec.stream", "a.x").is_ok());
        assert!(a.check("spec.stream", "shared.1").is_ok());
        assert!(a.check("spec.stream", "team-a:orders").is_ok());
        assert!(a.check("spec.stream", "team-a:_internal").is_err());
    }
}
