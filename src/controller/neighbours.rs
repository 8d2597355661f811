//! Which policies can affect one another, kept up to date from the watch events.
//!
//! Three checks of a reconcile look at other policies: who owns a group or a counter key name, whose 0.1 counters
//! are shared, and what retention a stream has. Scanning every policy for them made each reconcile O(n): with
//! 10,000 policies, each reconciled once per `interval`, the scans alone kept two cores busy. Policies can only
//! affect one another when they share a server and a stream, a counter key name, or a 0.1 counter key name; this
//! index maps each of those to the policies that have it, so a reconcile reads only its neighbours.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use crate::api::ConsumerGroupPolicy;
use crate::keys;
use crate::redis::server_identity;

/// What a policy shares with its neighbours: the server (URL) and a stream or a key name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Claim {
    Stream(String, String),
    Counters(String, String),
    LegacyCounters(String, String),
}

fn claims(policy: &ConsumerGroupPolicy) -> [Claim; 3] {
    let (url, stream, group) = (&server_identity(policy), &policy.spec.stream, &policy.spec.group);
    let [legacy_totals, _] = keys::legacy_keys(stream, group);
    [
        Claim::Stream(url.clone(), stream.clone()),
        Claim::Counters(url.clone(), keys::totals_key(stream, group)),
        Claim::LegacyCounters(url.clone(), legacy_totals),
    ]
}

#[derive(Default)]
struct Index {
    by_policy: HashMap<ObjectRef<ConsumerGroupPolicy>, [Claim; 3]>,
    by_claim: HashMap<Claim, HashSet<ObjectRef<ConsumerGroupPolicy>>>,
    /// Policies seen since the watch (re)started listing; the rest are gone once the listing is done.
    listed: Option<HashSet<ObjectRef<ConsumerGroupPolicy>>>,
}

impl Index {
    fn insert(&mut self, policy: &ConsumerGroupPolicy) {
        let key = ObjectRef::from_obj(policy);
        let claims = claims(policy);
        if self.by_policy.get(&key) == Some(&claims) {
            return;
        }
        self.remove(&key);
        for claim in &claims {
            self.by_claim.entry(claim.clone()).or_default().insert(key.clone());
        }
        self.by_policy.insert(key, claims);
    }

    fn remove(&mut self, key: &ObjectRef<ConsumerGroupPolicy>) {
        for claim in self.by_policy.remove(key).into_iter().flatten() {
            if let Some(set) = self.by_claim.get_mut(&claim) {
                set.remove(key);
                if set.is_empty() {
                    self.by_claim.remove(&claim);
                }
            }
        }
    }
}

/// The index, shared by the watch stream (which writes it) and the reconciles (which read it).
#[derive(Clone, Default)]
pub struct Neighbours(Arc<Mutex<Index>>);

impl Neighbours {
    /// Follows one watch event; returns the policies it learned are gone.
    pub fn observe(&self, event: &watcher::Event<ConsumerGroupPolicy>) -> Vec<ObjectRef<ConsumerGroupPolicy>> {
        let mut index = self.0.lock().expect("neighbours lock");
        match event {
            watcher::Event::Apply(policy) => index.insert(policy),
            watcher::Event::Delete(policy) => {
                let key = ObjectRef::from_obj(policy);
                index.remove(&key);
                return vec![key];
            }
            watcher::Event::Init => index.listed = Some(HashSet::new()),
            watcher::Event::InitApply(policy) => {
                index.insert(policy);
                if let Some(listed) = index.listed.as_mut() {
                    listed.insert(ObjectRef::from_obj(policy));
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = index.listed.take() {
                    let gone: Vec<_> = index.by_policy.keys().filter(|k| !listed.contains(*k)).cloned().collect();
                    for key in &gone {
                        index.remove(key);
                    }
                    return gone;
                }
            }
        }
        Vec::new()
    }

    /// Policies indexed.
    pub fn len(&self) -> usize {
        self.0.lock().expect("neighbours lock").by_policy.len()
    }

    /// The policies that share a server and a stream, a counter key name or a 0.1 counter key name with `policy`
    /// (itself included when the store has it), as the store holds them now.
    pub fn of(
        &self,
        policy: &ConsumerGroupPolicy,
        store: &Store<ConsumerGroupPolicy>,
    ) -> Vec<Arc<ConsumerGroupPolicy>> {
        let keys: HashSet<ObjectRef<ConsumerGroupPolicy>> = {
            let index = self.0.lock().expect("neighbours lock");
            claims(policy).iter().filter_map(|claim| index.by_claim.get(claim)).flatten().cloned().collect()
        };
        keys.iter().filter_map(|key| store.get(key)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, stream: &str, group: &str) -> ConsumerGroupPolicy {
        let spec = serde_json::from_value(serde_json::json!({
            "redis": {"url": "redis://r:6379/0"},
            "stream": stream, "group": group,
            "deadLetter": {"stream": "dlq"},
        }))
        .unwrap();
        let mut p = ConsumerGroupPolicy::new(name, spec);
        p.metadata.namespace = Some("apps".into());
        p
    }

    fn names(index: &Neighbours, of: &ConsumerGroupPolicy) -> Vec<String> {
        let guard = index.0.lock().unwrap();
        let mut names: Vec<String> = claims(of)
            .iter()
            .filter_map(|c| guard.by_claim.get(c))
            .flatten()
            .map(|k| k.name.clone())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        names.sort();
        names
    }

    #[test]
    fn neighbours_share_a_stream_or_a_key_name() {
        let index = Neighbours::default();
        for p in [
            policy("a", "{x}s", "g1"),
            policy("b", "{x}s", "g2"),   // same stream
            policy("c", "{x}s:g1", "z"), // different stream, different key
            policy("d", "{x}t", "g1"),   // same tag and group: shared 0.1 counters
            policy("e", "{x}s:g9", "h"), // nothing in common with a
            policy("f", "{x}s", "g1:q"), // same stream
            policy("k", "{x}s:g1", "q"), // its key {x}:pelican:{x}s:g1:q collides with f's
        ] {
            index.observe(&watcher::Event::Apply(p));
        }
        assert_eq!(names(&index, &policy("a", "{x}s", "g1")), ["a", "b", "d", "f"]);
        assert_eq!(names(&index, &policy("f", "{x}s", "g1:q")), ["a", "b", "f", "k"]);
        index.observe(&watcher::Event::Delete(policy("b", "{x}s", "g2")));
        assert_eq!(names(&index, &policy("a", "{x}s", "g1")), ["a", "d", "f"]);
    }

    #[test]
    fn a_relist_forgets_what_was_deleted_meanwhile() {
        let index = Neighbours::default();
        index.observe(&watcher::Event::Apply(policy("a", "s", "g")));
        index.observe(&watcher::Event::Apply(policy("b", "s", "h")));
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitApply(policy("a", "s", "g")));
        index.observe(&watcher::Event::InitDone);
        assert_eq!(names(&index, &policy("a", "s", "g")), ["a"]);
    }
}
