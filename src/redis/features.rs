//! What a server can do, detected per command (`COMMAND INFO`, `COMMAND DOCS`), not by version: Valkey reports
//! `redis_version 7.2.4` whatever its own version, Redis 8.2 and Valkey 9.2 differ in what they added, and a build
//! may leave Lua out. Detected once per server and again when its version changes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Mutex;

use redis::Value;

use super::Conn;
use crate::command_docs::{has_argument, text};
use crate::{Error, Result};

/// Commands whose presence is a feature.
const COMMANDS: [&str; 5] = ["XACKDEL", "XDELEX", "XNACK", "EVAL", "EVALSHA"];
/// Commands whose arguments hold a feature: (command, token, feature name).
const ARGUMENTS: [(&str, &str, &str); 3] =
    [("xtrim", "ACKED", "XTRIM ACKED"), ("xreadgroup", "CLAIM", "XREADGROUP CLAIM"), ("xadd", "IDMP", "XADD IDMP")];

/// What a server has, as far as Pelican cares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// The version the features were read at (`INFO server`), so an upgrade in place is seen.
    pub version: String,
    /// `XACKDEL`, `XDELEX`, `XNACK`, `XTRIM ACKED`, `XREADGROUP CLAIM`, `XADD IDMP`: the ones found.
    pub found: BTreeSet<&'static str>,
    /// Whether `EVAL` and `EVALSHA` exist. True when the server would not say (an ACL without `+command`).
    pub scripting: bool,
    /// False when `COMMAND INFO` or `COMMAND DOCS` was refused: nothing is known beyond scripting being assumed.
    pub known: bool,
}

impl Features {
    pub fn has(&self, feature: &str) -> bool {
        self.found.contains(feature)
    }

    /// From the replies of `COMMAND INFO <COMMANDS...>` and `COMMAND DOCS xtrim xreadgroup xadd`.
    fn read(version: String, info: &[Value], docs: &Value) -> Features {
        let present = |name: &str| {
            COMMANDS.iter().position(|c| *c == name).and_then(|i| info.get(i)).is_some_and(|v| !matches!(v, Value::Nil))
        };
        let mut found: BTreeSet<&'static str> =
            ["XACKDEL", "XDELEX", "XNACK"].into_iter().filter(|name| present(name)).collect();
        for (command, token, feature) in ARGUMENTS {
            if has_argument(docs, command, token) {
                found.insert(feature);
            }
        }
        Features { version, found, scripting: present("EVAL") && present("EVALSHA"), known: true }
    }
}

/// Asks the server. A refused `COMMAND` (an ACL without it) is no error: the features are then unknown, and
/// scripting is assumed (the first script says otherwise if it is not there).
pub async fn detect(conn: &mut Conn, server: &str) -> Result<Features> {
    let info: Value =
        redis::cmd("INFO").arg("server").query_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
    // A cluster connection asks every node and answers a map of node -> reply: the nodes of one cluster run one
    // version (the first one's is taken).
    let info = match &info {
        Value::Map(nodes) => nodes.first().and_then(|(_, reply)| text(reply)),
        reply => text(reply),
    };
    let version = super::ServerInfo::parse(&info.unwrap_or_default()).to_string();
    let mut command_info = redis::cmd("COMMAND");
    command_info.arg("INFO").arg(&COMMANDS[..]);
    let mut command_docs = redis::cmd("COMMAND");
    command_docs.arg("DOCS").arg(ARGUMENTS.map(|(command, _, _)| command).as_slice());
    let info: redis::RedisResult<Vec<Value>> = command_info.query_async(conn).await;
    let docs: redis::RedisResult<Value> = command_docs.query_async(conn).await;
    match (info, docs) {
        (Ok(info), Ok(docs)) => Ok(Features::read(version, &info, &docs)),
        (Err(e), _) | (_, Err(e)) if e.is_io_error() || e.is_timeout() => Err(Error::from_redis(server, e)),
        _ => Ok(Features { version, scripting: true, ..Features::default() }),
    }
}

/// The features of each server, by its address, as last detected.
#[derive(Default)]
pub struct Detected(Mutex<HashMap<String, Features>>);

impl Detected {
    pub fn get(&self, server: &str) -> Option<Features> {
        self.0.lock().expect("features lock").get(server).cloned()
    }

    pub fn insert(&self, server: &str, features: Features) {
        self.0.lock().expect("features lock").insert(server.to_string(), features);
    }

    pub fn forget(&self, server: &str) {
        self.0.lock().expect("features lock").remove(server);
    }

    /// Forgets the servers not in `servers`.
    pub fn retain<'a>(&self, servers: impl IntoIterator<Item = &'a str>) {
        let keep: HashSet<&str> = servers.into_iter().collect();
        self.0.lock().expect("features lock").retain(|server, _| keep.contains(server.as_str()));
    }

    pub fn len(&self) -> usize {
        self.0.lock().expect("features lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn array(items: Vec<Value>) -> Value {
        Value::Array(items)
    }

    /// An argument as `COMMAND DOCS` describes one (RESP2: a flat array of field, value).
    fn argument(name: &str, token: Option<&str>, nested: Vec<Value>) -> Value {
        let mut fields =
            vec![bulk("name"), bulk(name), bulk("type"), bulk(if nested.is_empty() { "pure-token" } else { "oneof" })];
        if let Some(token) = token {
            fields.extend([bulk("token"), bulk(token)]);
        }
        if !nested.is_empty() {
            fields.extend([bulk("arguments"), array(nested)]);
        }
        array(fields)
    }

    fn docs(command: &str, arguments: Vec<Value>) -> Vec<Value> {
        vec![bulk(command), array(vec![bulk("summary"), bulk("..."), bulk("arguments"), array(arguments)])]
    }

    #[test]
    fn redis_8_2_has_the_new_stream_commands_and_acked_trimming() {
        // COMMAND INFO XACKDEL XDELEX XNACK EVAL EVALSHA on Redis 8.2: XNACK (8.8) is missing.
        let info = vec![
            array(vec![bulk("xackdel")]),
            array(vec![bulk("xdelex")]),
            Value::Nil,
            array(vec![bulk("eval")]),
            array(vec![bulk("evalsha")]),
        ];
        // XTRIM's trimming policy is a oneof of KEEPREF | DELREF | ACKED (8.2).
        let refs = argument(
            "condition",
            None,
            vec![
                argument("keepref", Some("KEEPREF"), vec![]),
                argument("delref", Some("DELREF"), vec![]),
                argument("acked", Some("ACKED"), vec![]),
            ],
        );
        let mut reply = docs("xtrim", vec![argument("key", None, vec![]), refs]);
        reply.extend(docs("xreadgroup", vec![argument("noack", Some("NOACK"), vec![])]));
        reply.extend(docs("xadd", vec![argument("nomkstream", Some("NOMKSTREAM"), vec![])]));
        let features = Features::read("redis 8.2.3".into(), &info, &array(reply));
        assert_eq!(features.found, ["XACKDEL", "XDELEX", "XTRIM ACKED"].into());
        assert!(features.scripting && features.known);
    }

    #[test]
    fn claim_idmp_and_xnack_are_read_from_their_documented_shapes() {
        let info = vec![
            array(vec![bulk("xackdel")]),
            array(vec![bulk("xdelex")]),
            array(vec![bulk("xnack")]),
            array(vec![bulk("eval")]),
            array(vec![bulk("evalsha")]),
        ];
        // RESP3: a map of command -> map, CLAIM (8.4) with its min-idle-time argument, IDMP (8.6) a block argument.
        let map = |pairs: Vec<(Value, Value)>| Value::Map(pairs);
        let claim = map(vec![
            (bulk("name"), bulk("min-idle-time")),
            (bulk("type"), bulk("integer")),
            (bulk("token"), bulk("CLAIM")),
        ]);
        let idmp = map(vec![
            (bulk("name"), bulk("idmp")),
            (bulk("type"), bulk("block")),
            (bulk("arguments"), Value::Array(vec![map(vec![(bulk("token"), bulk("IDMP"))])])),
        ]);
        let reply = map(vec![
            (bulk("xreadgroup"), map(vec![(bulk("arguments"), Value::Array(vec![claim]))])),
            (bulk("xadd"), map(vec![(bulk("arguments"), Value::Array(vec![idmp]))])),
            (bulk("xtrim"), map(vec![(bulk("arguments"), Value::Array(vec![]))])),
        ]);
        let features = Features::read("redis 8.8.0".into(), &info, &reply);
        assert_eq!(features.found, ["XACKDEL", "XDELEX", "XNACK", "XREADGROUP CLAIM", "XADD IDMP"].into());
    }

    #[test]
    fn a_server_without_lua_has_no_scripting() {
        // Valkey 9.1 built without its Lua module: EVAL and EVALSHA are unknown commands.
        let info = vec![Value::Nil, Value::Nil, Value::Nil, Value::Nil, Value::Nil];
        let features = Features::read("valkey 9.1.2".into(), &info, &Value::Array(vec![]));
        assert!(!features.scripting);
        assert!(features.found.is_empty());
    }
}
