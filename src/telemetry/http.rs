//! `/metrics` on one port, `/healthz` and `/readyz` on another.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use super::metrics::Metrics;
use super::secure::{Authorizer, CertificateDir, TlsListener, Verdict};

/// `/metrics` secured (`--metrics-tls-dir`, `--metrics-auth`): over TLS, to authorized callers, or both.
#[derive(Default)]
pub struct Secure {
    pub tls: Option<Arc<CertificateDir>>,
    pub auth: Option<Authorizer>,
}

#[derive(Clone)]
struct Scrape {
    metrics: Arc<Metrics>,
    auth: Option<Arc<Authorizer>>,
}

/// Ready once the controller's caches have synced (independent of leadership: a standby replica is ready);
/// alive until leadership ends, when the process exits (a liveness probe restarts it should the exit stall).
#[derive(Clone, Default)]
pub struct Readiness {
    ready: Arc<AtomicBool>,
    ended: Arc<AtomicBool>,
}

impl Readiness {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// This replica led and no longer does: `/healthz` fails from now on.
    pub fn set_ended(&self) {
        self.ended.store(true, Ordering::Relaxed);
    }
}

/// Binds both listeners (so a taken port fails at start, not later) and serves them until `shutdown` resolves.
pub async fn serve(
    metrics_addr: SocketAddr,
    health_addr: SocketAddr,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    secure: Secure,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<impl Future<Output = ()>> {
    let metrics_listener = TcpListener::bind(metrics_addr).await?;
    let health_listener = TcpListener::bind(health_addr).await?;
    let scrape = Scrape { metrics, auth: secure.auth.map(Arc::new) };
    let metrics_app = Router::new().route("/metrics", get(render)).with_state(scrape);
    let health_app = Router::new().route("/healthz", get(alive)).route("/readyz", get(ready)).with_state(readiness);
    let (stop, stopped) = tokio::sync::watch::channel(());
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(());
    });
    let wait = |mut rx: tokio::sync::watch::Receiver<()>| async move {
        let _ = rx.changed().await;
    };
    let metrics_server: std::pin::Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> = match secure.tls {
        Some(certificate) => {
            let listener = TlsListener { tcp: metrics_listener, acceptor: certificate.acceptor() };
            Box::pin(axum::serve(listener, metrics_app).with_graceful_shutdown(wait(stopped.clone())).into_future())
        }
        None => Box::pin(
            axum::serve(metrics_listener, metrics_app).with_graceful_shutdown(wait(stopped.clone())).into_future(),
        ),
    };
    let health_server = axum::serve(health_listener, health_app).with_graceful_shutdown(wait(stopped));
    Ok(async move {
        let (m, h) = tokio::join!(metrics_server, health_server);
        if let Err(e) = m.and(h) {
            tracing::warn!(error = %e, "HTTP server stopped with an error");
        }
    })
}

async fn render(State(scrape): State<Scrape>, headers: HeaderMap) -> axum::response::Response {
    if let Some(auth) = &scrape.auth {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        match auth.check(given).await {
            Verdict::Allowed => {}
            Verdict::Unauthenticated(why) => return (StatusCode::UNAUTHORIZED, why).into_response(),
            Verdict::Forbidden(why) => return (StatusCode::FORBIDDEN, why).into_response(),
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], scrape.metrics.render()).into_response()
}

async fn ready(State(readiness): State<Readiness>) -> impl IntoResponse {
    if readiness.is_ready() { (StatusCode::OK, "ok") } else { (StatusCode::SERVICE_UNAVAILABLE, "caches not synced") }
}

async fn alive(State(readiness): State<Readiness>) -> impl IntoResponse {
    if readiness.ended.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "leadership ended: this process is exiting")
    } else {
        (StatusCode::OK, "ok")
    }
}
