//! `/metrics` as Kubernetes' own components and controller-runtime's secure metrics serve it: over TLS with the
//! certificate of a mounted Secret (re-read when its files change, as cert-manager renews them), and only to callers
//! whose bearer token the API server authenticates (`TokenReview`) and authorizes for `get` on the non-resource URL
//! `/metrics` (`SubjectAccessReview`), the right the chart's `<release>-metrics-reader` ClusterRole grants.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How long a handshake may take before the connection is dropped (a client that never finishes it holds nothing).
const HANDSHAKE: Duration = Duration::from_secs(5);
/// How long a caller's verdict is kept, and for how many callers at most (Prometheus is one or two).
const VERDICT_TTL: Duration = Duration::from_secs(60);
const VERDICTS_MAX: usize = 64;

/// The certificate and key of `dir` (`tls.crt`, `tls.key`, as a `kubernetes.io/tls` Secret mounts them), read
/// again at a handshake after either file changed.
#[derive(Debug)]
pub struct CertificateDir {
    dir: PathBuf,
    loaded: Mutex<(SystemTime, Arc<CertifiedKey>)>,
}

impl CertificateDir {
    pub fn load(dir: &Path) -> Result<Arc<CertificateDir>, String> {
        let (stamp, key) = (modified(dir), read_key(dir)?);
        Ok(Arc::new(CertificateDir { dir: dir.to_path_buf(), loaded: Mutex::new((stamp, key)) }))
    }

    /// A TLS acceptor serving this directory's certificate (TLS 1.2 and 1.3, no client certificate).
    pub fn acceptor(self: &Arc<Self>) -> TlsAcceptor {
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        TlsAcceptor::from(Arc::new(config))
    }
}

impl ResolvesServerCert for CertificateDir {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let mut loaded = self.loaded.lock().expect("certificate lock");
        let stamp = modified(&self.dir);
        if stamp != loaded.0 {
            // A renewal half written (the key before the certificate) keeps the old pair until both read.
            match read_key(&self.dir) {
                Ok(key) => *loaded = (stamp, key),
                Err(e) => tracing::warn!(error = %e, "metrics certificate not reloaded; serving the previous one"),
            }
        }
        Some(loaded.1.clone())
    }
}

/// The later modification time of the two files (a Secret's mount swaps a symlink: both change at once).
fn modified(dir: &Path) -> SystemTime {
    ["tls.crt", "tls.key"]
        .iter()
        .filter_map(|name| std::fs::metadata(dir.join(name)).and_then(|m| m.modified()).ok())
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

fn read_key(dir: &Path) -> Result<Arc<CertifiedKey>, String> {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert)
        .and_then(|certs| certs.collect())
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in it", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(&key).map_err(|e| format!("{}: {e}", key.display()))?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, key, &provider).map(Arc::new).map_err(|e| format!("{}: {e}", dir.display()))
}

/// A listener whose connections are TLS: a failed or slow handshake drops that connection only.
pub struct TlsListener {
    pub tcp: TcpListener,
    pub acceptor: TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = axum::serve::Listener::accept(&mut self.tcp).await;
            match tokio::time::timeout(HANDSHAKE, self.acceptor.accept(stream)).await {
                Ok(Ok(tls)) => return (tls, addr),
                Ok(Err(e)) => tracing::debug!(%addr, error = %e, "metrics TLS handshake failed"),
                Err(_) => tracing::debug!(%addr, "metrics TLS handshake timed out"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// Whether a caller may read `/metrics`: its bearer token authenticated by the API server and allowed `get` on
/// `/metrics`. Verdicts are kept a minute per token, so a scrape costs the API server two requests a minute.
pub struct Authorizer {
    client: kube::Client,
    verdicts: Mutex<HashMap<String, (Instant, Verdict)>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// 401: no token, or one the API server does not accept.
    Unauthenticated(String),
    /// 403: a known caller without the right.
    Forbidden(String),
}

impl Authorizer {
    pub fn new(client: kube::Client) -> Authorizer {
        Authorizer { client, verdicts: Mutex::default() }
    }

    pub async fn check(&self, authorization: Option<&str>) -> Verdict {
        let Some(token) = authorization.and_then(|h| h.strip_prefix("Bearer ")).map(str::trim) else {
            return Verdict::Unauthenticated("a bearer token is needed (Authorization: Bearer <token>)".into());
        };
        if let Some((at, verdict)) = self.verdicts.lock().expect("verdicts lock").get(token)
            && at.elapsed() < VERDICT_TTL
        {
            return verdict.clone();
        }
        let verdict = match self.review(token).await {
            Ok(verdict) => verdict,
            // The API server did not answer: say so, and decide again at the next scrape.
            Err(e) => return Verdict::Unauthenticated(format!("the token could not be reviewed: {e}")),
        };
        let mut verdicts = self.verdicts.lock().expect("verdicts lock");
        if verdicts.len() >= VERDICTS_MAX {
            verdicts.retain(|_, (at, _)| at.elapsed() < VERDICT_TTL);
            if verdicts.len() >= VERDICTS_MAX {
                verdicts.clear();
            }
        }
        verdicts.insert(token.to_string(), (Instant::now(), verdict.clone()));
        verdict
    }

    async fn review(&self, token: &str) -> Result<Verdict, kube::Error> {
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), ..Default::default() },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone()).create(&PostParams::default(), &review).await?;
        let status = reviewed.status.unwrap_or_default();
        let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
            return Ok(Verdict::Unauthenticated("the API server does not accept this token".into()));
        };
        let name = user.username.clone().unwrap_or_default();
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some("/metrics".into()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let decided =
            Api::<SubjectAccessReview>::all(self.client.clone()).create(&PostParams::default(), &access).await?;
        Ok(match decided.status.is_some_and(|s| s.allowed) {
            true => Verdict::Allowed,
            false => Verdict::Forbidden(format!(
                "{name} may not get /metrics: bind it to the ClusterRole that grants it (the chart's \
                 <release>-metrics-reader)"
            )),
        })
    }
}
