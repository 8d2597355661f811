//! One error type for the operator. Each error knows the condition reason it shows, whether it
//! is terminal (Stalled: wait for a spec or Secret change) or transient (retry with backoff), and its metric label.

use redis::{ErrorKind, RedisError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "Secret {namespace}/{name} or its key {key:?} not found: create it, or fix the reference to it (in the policy or RedisServer)"
    )]
    SecretNotFound { namespace: String, name: String, key: String },

    #[error(
        "Secret {namespace}/{name}: this operator reads Secrets only in the namespaces {allowed} (--secret-namespaces, \
         the chart's rbac.secretNamespaces): add {namespace} to them"
    )]
    SecretNamespaceNotAllowed { namespace: String, name: String, allowed: String },

    #[error(
        "Secret {namespace}/{name} key {key:?} is not valid UTF-8: a username or password must be text; rewrite the Secret"
    )]
    SecretInvalid { namespace: String, name: String, key: String },

    #[error("authentication refused by {server}: check the username and password Secrets ({detail})")]
    AuthenticationFailed { server: String, detail: String },

    #[error(
        "TLS with {server} failed: {detail}; check spec.redis.tls and its Secrets (CA, client certificate and key)"
    )]
    TlsFailed { server: String, detail: String },

    #[error("Redis at {server} refused a command for lack of permission: {detail}; grant it in the ACL user's rules")]
    PermissionDenied { server: String, detail: String },

    #[error("Redis at {server} is unavailable: {source}")]
    RedisUnavailable {
        server: String,
        #[source]
        source: RedisError,
    },

    #[error("Redis at {server} refused a command: {source}")]
    RedisCommand {
        server: String,
        #[source]
        source: RedisError,
    },

    #[error(
        "{server} has no database {database} (spec.redis.url): a server has the databases 0 to `databases` - 1 (16 by default); use one of those, or raise `databases` in the server's configuration"
    )]
    DatabaseNotFound { server: String, database: String },

    #[error(
        "spec.redis.mode is Cluster but {server} is not part of a Redis Cluster (cluster support disabled): set mode Standalone, or point spec.redis.url at a cluster node"
    )]
    NotACluster { server: String },

    #[error(
        "{server} is a node of a Redis Cluster (it redirected a command to another node): set spec.redis.mode to Cluster"
    )]
    ClusterNode { server: String },

    #[error(
        "the sentinel at {sentinel} knows no primary named {master:?}: set spec.redis.sentinel.masterName to a name of its `sentinel monitor` lines (SENTINEL MASTERS lists them)"
    )]
    SentinelMasterUnknown { sentinel: String, master: String },

    #[error(
        "the sentinels name {server} as the primary of {master:?}, but it answers ROLE {role}: a failover is under way; retrying until the sentinels name the new primary"
    )]
    NotPrimary { server: String, master: String, role: String },

    #[error(
        "RedisServer {namespace}/{name} not found: create it, or fix spec.redis.serverRef (`kubectl get redisservers -A` lists the servers; an operator installed with watchNamespace sees only the servers of that namespace)"
    )]
    ServerNotFound { namespace: String, name: String },

    #[error(
        "RedisServer {server} does not admit namespace {namespace:?}: ask whoever runs the server to add it to spec.tenants (by name or by a namespaceSelector matching its labels)"
    )]
    ServerNotAllowed { server: String, namespace: String },

    #[error(
        "{field} {key:?} is not among the keys RedisServer {server} admits for namespace {namespace:?} ({patterns}): use a key that matches one of them, or ask whoever runs the server to add a pattern to spec.tenants"
    )]
    KeyNotAllowed { server: String, namespace: String, field: String, key: String, patterns: String },

    #[error(
        "this operator does not connect to inline servers (--inline-connections=deny, the chart's tenancy.inlineConnections): replace spec.redis.url and its Secrets with spec.redis.serverRef naming a RedisServer"
    )]
    InlineConnectionDenied,

    #[error(
        "you may not read the Secrets of RedisServer {server} (this needs `get` on secrets in namespace {namespace}): `kubectl pelican status` works without them, from the policy's status; `dlq` and `redrive` read the server with its credentials, so ask whoever runs the server, or create a DeadLetterRedrive object, which the operator runs"
    )]
    ServerSecretsForbidden { server: String, namespace: String },

    #[error(
        "the operator may not list and watch Pods ({detail}): spec.consumers.pods reads them to tell which consumers \
         are gone; grant list and watch on pods in the watched namespaces (the chart's rbac.consumerPods: true). \
         Until then no consumer is taken for gone: their entries are retried after minIdle"
    )]
    PodsForbidden { detail: String },

    #[error("spec.startId {start_id:?}: {why}")]
    InvalidStartId { start_id: String, why: String },

    #[error("{0}: rename the key in the policy or remove the other value")]
    WrongKeyType(String),

    #[error("{server} runs {version}; Pelican needs Redis >= 7.0 or Valkey >= 7.2")]
    UnsupportedServerVersion { server: String, version: String },

    #[error(
        "{server} ({version}) has no Lua scripting (EVAL and EVALSHA are unknown commands: a Valkey built without its \
         Lua module, or the commands renamed away); Pelican's passes are scripts: load the module (Valkey: \
         loadmodule <path>/libvalkeylua.so) or use a server with scripting"
    )]
    ScriptingUnavailable { server: String, version: String },

    #[error(
        "another install of Pelican ({owner}) runs this group's jobs on {server}: this one ({me}) runs no pass and \
         writes nothing for it. Its claim lapses {left}s after it stops renewing it, and then this install takes \
         over. Two installs on one Redis: make the other passive (--passive, the chart's passive: true), or remove \
         the policy from one of them"
    )]
    AnotherInstallRuns { server: String, owner: String, me: String, left: u64 },

    #[error(
        "this install ({me}) is passive (--passive, the chart's passive: true): it runs no pass and writes nothing on \
         {server}; {owner}. To take over (a failover), set passive: false: it claims the group once no other install \
         renews its claim"
    )]
    Passive { server: String, me: String, owner: String },

    #[error("{0}")]
    ResourceConflict(String),

    #[error("{0}")]
    CrossSlot(String),

    #[error("invalid spec: {0}")]
    InvalidSpec(String),

    /// Redis lists a group's consumers only all at once (`XINFO CONSUMERS`), at a cost that grows with their number:
    /// past [`crate::jobs::CONSUMERS_LISTED_MAX`] Pelican does not list them, and what needs the list waits.
    #[error(
        "group {group} of stream {stream} on {server} has {count} consumers, more than the {max} Pelican lists in one \
         call (XINFO CONSUMERS holds the server for as long as there are consumers): {what} waits until fewer remain; \
         delete the consumers nobody uses (XGROUP DELCONSUMER) and \
         give workers stable names (the Pod's; Pelican's libraries leave the group when they stop)"
    )]
    TooManyConsumers { server: String, stream: String, group: String, count: u64, max: u64, what: &'static str },

    /// A script of Pelican's answered what this operator does not read: its keys written by something else (another
    /// version of Pelican, a person), not a spec to fix.
    #[error("{server} answered what this operator cannot read: {detail}")]
    UnexpectedReply { server: String, detail: String },

    #[error("Kubernetes API error: {0}")]
    Kube(#[source] kube::Error),

    #[error(
        "the reconcile did not finish within {}s (a server or the API server did not answer in time); it is retried, and pelican_reconcile_running_seconds names the policies whose reconciles run long",
        .0.as_secs()
    )]
    ReconcileTimedOut(std::time::Duration),

    /// Not a failure: the reconcile could not go on without holding its slot (its server's first probe is under
    /// way, or the share of slots for failing policies is taken) and looks again shortly. Never shown in status.
    #[error("deferred: {0}")]
    Deferred(String),

    #[error("finalizer error: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

impl Error {
    /// The condition reason (CamelCase) shown in status and used as Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::SecretNotFound { .. } => "SecretNotFound",
            Error::SecretNamespaceNotAllowed { .. } => "SecretNamespaceNotAllowed",
            Error::SecretInvalid { .. } => "SecretInvalid",
            Error::AuthenticationFailed { .. } => "AuthenticationFailed",
            Error::TlsFailed { .. } => "TLSHandshakeFailed",
            Error::PermissionDenied { .. } => "PermissionDenied",
            Error::RedisUnavailable { .. } => "RedisUnavailable",
            Error::RedisCommand { .. } => "RedisError",
            Error::DatabaseNotFound { .. } => "DatabaseNotFound",
            Error::InvalidStartId { .. } => "InvalidStartId",
            Error::ServerNotFound { .. } => "ServerNotFound",
            Error::ServerNotAllowed { .. } => "ServerNotAllowed",
            Error::KeyNotAllowed { .. } => "KeyNotAllowed",
            Error::InlineConnectionDenied => "InlineConnectionDenied",
            Error::ServerSecretsForbidden { .. } => "Forbidden",
            Error::PodsForbidden { .. } => "PodsForbidden",
            Error::NotACluster { .. } => "NotACluster",
            Error::ClusterNode { .. } => "ClusterNode",
            Error::SentinelMasterUnknown { .. } => "SentinelMasterUnknown",
            Error::NotPrimary { .. } => "NotPrimary",
            Error::WrongKeyType(_) => "WrongKeyType",
            Error::UnsupportedServerVersion { .. } => "UnsupportedServerVersion",
            Error::ScriptingUnavailable { .. } => "ScriptingUnavailable",
            Error::AnotherInstallRuns { .. } => "AnotherInstallRuns",
            Error::Passive { .. } => "Passive",
            Error::ResourceConflict(_) => "ResourceConflict",
            Error::InvalidSpec(_) => "InvalidSpec",
            Error::TooManyConsumers { .. } => "TooManyConsumers",
            Error::UnexpectedReply { .. } => "UnexpectedReply",
            Error::CrossSlot(_) => "CrossSlot",
            Error::Kube(_) => "KubernetesApiError",
            Error::Finalizer(_) => "FinalizerError",
            Error::Deferred(_) => "Deferred",
            Error::ReconcileTimedOut(_) => "ReconcileTimeout",
        }
    }

    /// Terminal errors need a change of the spec, a Secret or Redis data; the policy is Stalled until then.
    pub fn is_stalled(&self) -> bool {
        matches!(
            self,
            Error::SecretNotFound { .. }
                | Error::SecretNamespaceNotAllowed { .. }
                | Error::SecretInvalid { .. }
                | Error::AuthenticationFailed { .. }
                | Error::TlsFailed { .. }
                | Error::PermissionDenied { .. }
                | Error::DatabaseNotFound { .. }
                | Error::InvalidStartId { .. }
                | Error::ServerNotFound { .. }
                | Error::ServerNotAllowed { .. }
                | Error::KeyNotAllowed { .. }
                | Error::InlineConnectionDenied
                | Error::PodsForbidden { .. }
                | Error::NotACluster { .. }
                | Error::ClusterNode { .. }
                | Error::SentinelMasterUnknown { .. }
                | Error::WrongKeyType(_)
                | Error::UnsupportedServerVersion { .. }
                | Error::ScriptingUnavailable { .. }
                | Error::AnotherInstallRuns { .. }
                | Error::Passive { .. }
                | Error::ResourceConflict(_)
                | Error::InvalidSpec(_)
                | Error::UnexpectedReply { .. }
                | Error::CrossSlot(_)
        )
    }

    /// A tenancy refusal: the operator was not allowed to act on the server for this policy, so nothing of it is
    /// there to clean up.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Error::ServerNotAllowed { .. } | Error::KeyNotAllowed { .. } | Error::InlineConnectionDenied)
    }

    /// Classifies a Redis client error by what the user should do about it: by its kind and the server's error
    /// code, never by words of a message that may quote a key name.
    pub fn from_redis(server: &str, source: RedisError) -> Error {
        let server = server.to_string();
        if source.kind() == ErrorKind::AuthenticationFailed || matches!(source.code(), Some("WRONGPASS" | "NOAUTH")) {
            let detail = server_message(&source);
            return Error::AuthenticationFailed { server, detail };
        }
        // A command a script calls without permission is refused inside the script: an ERR naming the user, not a
        // NOPERM reply (Redis and Valkey alike).
        let in_script = source.detail().is_some_and(|d| d.contains("The user executing the script can't"));
        // A NOPERM to a command the client sends while connecting (SELECT) comes wrapped, without its code.
        let while_connecting = source.code().is_none() && source.to_string().contains("no permissions to run");
        if source.code() == Some("NOPERM") || in_script || while_connecting {
            let mut detail = server_message(&source);
            if in_script {
                // The server names the script's line, not the command: point at the list of what scripts call.
                detail.push_str(
                    " (a command one of Pelican's Lua scripts calls: examples/acl/pelican.acl lists them all)",
                );
            }
            return Error::PermissionDenied { server, detail };
        }
        if let Some(detail) = tls_failure(&source) {
            return Error::TlsFailed { server, detail };
        }
        if source.is_io_error()
            || source.is_connection_refusal()
            || source.is_connection_dropped()
            || source.is_timeout()
            || source.kind() == ErrorKind::ClusterConnectionNotFound
            // The server is loading, failing over or resharding: a redirect the cluster client could not follow
            // within its retries is as transient as a node that is down.
            || matches!(
                source.code(),
                Some("LOADING" | "MASTERDOWN" | "TRYAGAIN" | "CLUSTERDOWN" | "MOVED" | "ASK" | "READONLY" | "BUSY")
            )
        {
            return Error::RedisUnavailable { server, source };
        }
        if source.code() == Some("WRONGTYPE") {
            return Error::WrongKeyType(server_message(&source));
        }
        Error::RedisCommand { server, source }
    }

    /// A redirection (`MOVED`, `ASK`) is transient for the cluster client, which follows slot moves; a standalone
    /// connection that receives one is talking to a cluster node and never will follow it.
    pub fn for_standalone(self) -> Error {
        match self {
            Error::RedisUnavailable { server, source } if matches!(source.code(), Some("MOVED" | "ASK")) => {
                Error::ClusterNode { server }
            }
            other => other,
        }
    }

    /// The message of a key that holds another type than the one Pelican needs.
    pub fn wrong_key_type(key: &str, actual: &str, expected: &str) -> Error {
        Error::WrongKeyType(format!("key {key:?} holds a {actual}, not a {expected}"))
    }
}

/// The server's words: the detail of a plain error reply, or the whole error when it came wrapped (a reply inside
/// a pipeline has no separate detail), so messages always name the command or key the server refused.
fn server_message(source: &RedisError) -> String {
    source.detail().map_or_else(|| source.to_string(), str::to_string)
}

/// A certificate problem (unknown CA, expired, wrong name) surfaces as an I/O error (or a client configuration
/// error for unreadable PEM) whose text names it. An error the server answered (it has a code) is never one:
/// its message may quote a key such as `mtls-audit`.
fn tls_failure(source: &RedisError) -> Option<String> {
    let client_side = matches!(source.kind(), ErrorKind::Io | ErrorKind::InvalidClientConfig | ErrorKind::Client);
    if !client_side || source.code().is_some() {
        return None;
    }
    let text = source.to_string();
    let lower = text.to_lowercase();
    let markers = ["certificate", "unknownissuer", "handshake", "tls", "notvalidforname", "expired", "badsignature"];
    markers.iter().any(|m| lower.contains(m)).then_some(text)
}

impl From<kube::Error> for Error {
    fn from(e: kube::Error) -> Self {
        Error::Kube(e)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
