//! Tenancy: which namespaces a `RedisServer` admits, and which keys each may touch. Pure: the controllers pass the
//! namespace's labels in, and get back the rules to check each key against before anything is written.

use std::collections::BTreeMap;

use glob::{MatchOptions, Pattern};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

use crate::api::RedisServer;
use crate::{Error, Result};

/// What `${namespace}` in a key pattern stands for.
const NAMESPACE_VARIABLE: &str = "${namespace}";

/// Redis ACL key patterns match the whole key, `*` across any character.
const MATCH: MatchOptions =
    MatchOptions { case_sensitive: true, require_literal_separator: false, require_literal_leading_dot: false };

/// The keys one namespace may touch on one server: the patterns of every tenant entry that admits it.
#[derive(Clone, Debug)]
pub struct KeyRules {
    /// `namespace/name` of the server.
    server: String,
    namespace: String,
    /// The patterns as written, `${namespace}` substituted (for messages).
    patterns: Vec<String>,
    compiled: Vec<Pattern>,
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
    let compiled = patterns.iter().filter_map(|p| Pattern::new(p).ok()).collect();
    Ok(KeyRules { server: server_name(server), namespace: namespace.to_string(), patterns, compiled })
}

fn not_allowed(server: &RedisServer, namespace: &str) -> Error {
    Error::ServerNotAllowed { server: server_name(server), namespace: namespace.to_string() }
}

/// Key patterns of the server that are not valid globs (they match nothing), for its status.
pub fn invalid_patterns(server: &RedisServer) -> Vec<String> {
    server
        .spec
        .tenants
        .iter()
        .flat_map(|t| &t.keys)
        .filter(|k| Pattern::new(&k.0.replace(NAMESPACE_VARIABLE, "ns")).is_err())
        .map(|k| k.0.clone())
        .collect()
}

impl KeyRules {
    /// `KeyNotAllowed` unless some pattern matches `key`; `field` names where the key comes from
    /// (`spec.stream`, ...).
    pub fn check(&self, field: &str, key: &str) -> Result<()> {
        if self.compiled.iter().any(|p| p.matches_with(key, MATCH)) {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{KeyPattern, NamespaceName, NamespaceSelector, RedisMode, RedisServerSpec, Tenant};

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
            Some(NamespaceSelector { match_labels: [("team".into(), "data".into())].into(), ..Default::default() });
        let s = server(vec![data, tenant(&["ops"], &["ops.*"])]);
        let labels: BTreeMap<String, String> = [("team".into(), "data".into())].into();
        assert!(admit(&s, "etl", Some(&labels)).unwrap().check("spec.stream", "data.raw").is_ok());
        assert_eq!(admit(&s, "etl", None).unwrap_err().reason(), "ServerNotAllowed");
        assert_eq!(admit(&s, "etl", Some(&BTreeMap::new())).unwrap_err().reason(), "ServerNotAllowed");
        assert!(needs_labels(&s));
    }

    #[test]
    fn patterns_of_every_admitting_entry_apply_and_invalid_ones_match_nothing() {
        let s = server(vec![tenant(&["a"], &["a.*", "[oops"]), tenant(&["a"], &["shared.?"])]);
        let a = admit(&s, "a", None).unwrap();
        assert!(a.check("spec.stream", "a.x").is_ok());
        assert!(a.check("spec.stream", "shared.1").is_ok());
        assert!(a.check("spec.stream", "[oops").is_err());
        assert_eq!(invalid_patterns(&s), vec!["[oops".to_string()]);
    }
}
