//! KEDA's external scaler (`proto/externalscaler.proto`, served by `pelican run --external-scaler-addr`): a
//! `ScaledObject` trigger of `type: external` or `external-push` names a policy of its own namespace, and KEDA
//! scales the policy's consumers on the group's backlog as Pelican measures it.
//!
//! - **The numbers** are the status's: `backlog` (lag + pending, the lag's upper bound when the server cannot tell
//!   it, so never 0 while unread entries exist), `pending` or `lag`. They come from one `XINFO GROUPS` + `XLEN`
//!   round trip per policy per second at most, however many ScaledObjects ask and however often; a reconcile's own
//!   probe counts as that reading.
//! - **Only a Ready policy answers.** Anything else (no such policy in the ScaledObject's namespace, a policy not
//!   Ready, the server unreachable) answers an error KEDA logs and shows on the ScaledObject, never a number that
//!   would scale the consumers to zero.
//! - **Which replica.** The server runs where the controller runs: on the leader (or the only replica), whose
//!   reflector holds the policies and whose connections reach their servers. A standby does not listen. In a Pod,
//!   the replica that serves labels itself [`SERVING_LABEL`] and the chart's Service selects that label, so KEDA
//!   reaches the leader whatever the replica count; a replica takes the label off its Pod when it starts.
//! - **Push.** `StreamIsActive` reads every second while KEDA listens and sends a message whenever the answer
//!   changes, so consumers at zero replicas start within a second of the first entry.

pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("externalscaler");
}

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use crate::api::{ConsumerGroupPolicy, READY};
use crate::context::Shared;
use crate::keys::partition_stream;
use crate::redis::{Backlog, probe_backlog};
use proto::external_scaler_server::{ExternalScaler, ExternalScalerServer};
use proto::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec, MetricValue,
    ScaledObjectRef,
};

/// How old a reading may be when KEDA asks: the most one policy costs its server, however many ask.
pub const MAX_AGE: Duration = Duration::from_secs(1);
/// `target` when the trigger gives none: entries per consumer replica.
pub const DEFAULT_TARGET: f64 = 5.0;

/// Which number of the group scales its consumers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Lag + pending: everything the consumers have still to do.
    Backlog,
    /// Delivered and not acknowledged.
    Pending,
    /// Not yet delivered (the stream's length when the server cannot tell).
    Lag,
    /// Age in seconds of the oldest entry not yet delivered: how long the newest work has waited to be read.
    LagSeconds,
}

impl Metric {
    fn name(self) -> &'static str {
        match self {
            Metric::Backlog => "backlog",
            Metric::Pending => "pending",
            Metric::Lag => "lag",
            Metric::LagSeconds => "lag-seconds",
        }
    }

    pub fn of(self, backlog: &Backlog) -> i64 {
        match self {
            Metric::Backlog => backlog.total(),
            Metric::Pending => backlog.pending,
            Metric::Lag => backlog.lag_or_bound(),
            Metric::LagSeconds => backlog.lag_seconds,
        }
    }
}

/// A trigger's metadata, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Trigger {
    pub policy: String,
    pub metric: Metric,
    /// The metric's value per consumer replica the HPA aims at.
    pub target: f64,
    /// Active (scaled up from zero) while the metric is above this.
    pub activation: f64,
}

impl Trigger {
    /// The trigger's metadata, or what is wrong with it and how to fix it.
    pub fn parse(metadata: &HashMap<String, String>) -> Result<Trigger, String> {
        let policy = metadata.get("policy").map(|p| p.trim()).unwrap_or_default();
        if policy.is_empty() {
            return Err("metadata.policy is missing: name the ConsumerGroupPolicy of the consumers".into());
        }
        if policy.contains('/') {
            return Err(format!(
                "metadata.policy {policy:?} names a namespace: a ScaledObject reads the policies of its own \
                 namespace only; give the policy's name alone"
            ));
        }
        let metric = match metadata.get("metric").map(|m| m.trim()).unwrap_or("backlog") {
            "backlog" => Metric::Backlog,
            "pending" => Metric::Pending,
            "lag" => Metric::Lag,
            "lagSeconds" => Metric::LagSeconds,
            other => {
                return Err(format!("metadata.metric {other:?} is not one of backlog, pending, lag, lagSeconds"));
            }
        };
        let number = |key: &str, default: f64, least: f64| -> Result<f64, String> {
            match metadata.get(key) {
                None => Ok(default),
                Some(text) => match text.trim().parse::<f64>() {
                    Ok(n) if n.is_finite() && n >= least => Ok(n),
                    _ => Err(format!("metadata.{key} {text:?} is not a number of at least {least}")),
                },
            }
        };
        let target = number("target", DEFAULT_TARGET, f64::MIN_POSITIVE)
            .map_err(|_| format!("metadata.target {:?} is not a number above 0", metadata["target"]))?;
        let activation = number("activationTarget", 0.0, 0.0)?;
        Ok(Trigger { policy: policy.to_string(), metric, target, activation })
    }

    /// The name KEDA gives the HPA (it prefixes the trigger's index).
    pub fn metric_name(&self) -> String {
        format!("pelican-{}-{}", self.metric.name(), self.policy)
    }

    /// The metric's value for a group's `backlog`. On a topic of `partitions`, a count never asks for more replicas
    /// than partitions (`partitions * target` at most, as KEDA's Kafka scaler caps its lag): a member beyond them
    /// owns no partition and handles nothing. An age is not per replica and is never capped.
    pub fn value(&self, backlog: &Backlog, partitions: Option<u32>) -> i64 {
        let value = self.metric.of(backlog);
        match partitions {
            Some(n) if self.metric != Metric::LagSeconds => value.min((f64::from(n) * self.target).floor() as i64),
            _ => value,
        }
    }

    pub fn active(&self, value: i64) -> bool {
        value as f64 > self.activation
    }
}

/// The service: the policies from the controller's reflector, their backlog from [`crate::redis::Readings`].
#[derive(Clone)]
pub struct Scaler {
    shared: Arc<Shared>,
}

impl Scaler {
    pub fn new(shared: Arc<Shared>) -> Scaler {
        Scaler { shared }
    }

    /// The trigger and the Ready policy it names in the ScaledObject's namespace.
    fn policy(&self, object: &ScaledObjectRef) -> Result<(Trigger, Arc<ConsumerGroupPolicy>), Status> {
        let trigger = Trigger::parse(&object.scaler_metadata).map_err(Status::invalid_argument)?;
        let namespace = &object.namespace;
        let reference = ObjectRef::new(&trigger.policy).within(namespace);
        let Some(policy) = self.shared.policies.get(&reference) else {
            return Err(Status::not_found(format!(
                "no ConsumerGroupPolicy {:?} in namespace {namespace:?} (ScaledObject {namespace}/{}): a \
                 ScaledObject reads the policies of its own namespace only",
                trigger.policy, object.name
            )));
        };
        let ready = policy.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == READY));
        match ready {
            Some(c) if c.status == "True" => Ok((trigger, policy)),
            // The reason only: the condition's message may name servers and keys, and the caller is whoever reaches
            // the port.
            Some(c) => Err(Status::failed_precondition(format!(
                "ConsumerGroupPolicy {namespace}/{} is not Ready ({}): no number until it is; `kubectl describe cgp` \
                 says why",
                trigger.policy, c.reason
            ))),
            None => Err(Status::unavailable(format!(
                "ConsumerGroupPolicy {namespace}/{} has not been reconciled yet: no number until it is Ready",
                trigger.policy
            ))),
        }
    }

    /// The trigger and its metric's value, from a reading at most [`MAX_AGE`] old: as the HPA gets it (capped on a
    /// topic, [`Trigger::value`]) and as activity is judged (the whole value).
    async fn value(&self, object: &ScaledObjectRef) -> Result<(Trigger, i64, i64), Status> {
        let (trigger, policy) = self.policy(object)?;
        let id = format!("{}/{}", object.namespace, trigger.policy);
        let probe = || async {
            self.shared.metrics.scaler_read();
            let unavailable = |e: crate::Error| {
                debug!(policy = %id, error = %e, "the external scaler could not read the backlog");
                Status::unavailable(format!("ConsumerGroupPolicy {id}: its server cannot be read now ({})", e.reason()))
            };
            let target = self.shared.target(&policy).await.map_err(unavailable)?;
            let (target, mut conn) = self.shared.pools.connect_primary(&target).await.map_err(unavailable)?;
            let group = &policy.spec.group;
            // A topic's backlog is its partitions', one bounded read each.
            let streams: Vec<String> = match policy.spec.partitions {
                Some(n) => (0..n).map(|p| partition_stream(&policy.spec.stream, p)).collect(),
                None => vec![policy.spec.stream.clone()],
            };
            let mut total: Option<Backlog> = None;
            for stream in &streams {
                let Some(backlog) =
                    probe_backlog(&mut conn, &target.server(), stream, group).await.map_err(unavailable)?
                else {
                    return Err(Status::failed_precondition(format!(
                        "ConsumerGroupPolicy {id}: stream {stream:?} has no group {group:?} on the server (deleted \
                         behind the operator's back?); the next reconcile creates it again"
                    )));
                };
                total = Some(total.map_or(backlog, |sum| sum.and(backlog)));
            }
            Ok(total.unwrap_or_default())
        };
        let (_, backlog) = self.shared.readings.read(&id, MAX_AGE, probe).await?;
        let (value, whole) = (trigger.value(&backlog, policy.spec.partitions), trigger.metric.of(&backlog));
        Ok((trigger, value, whole))
    }
}

type ActiveStream = Pin<Box<dyn Stream<Item = Result<IsActiveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalScaler for Scaler {
    async fn is_active(&self, request: Request<ScaledObjectRef>) -> Result<Response<IsActiveResponse>, Status> {
        let object = request.into_inner();
        let (trigger, _, whole) = self.answer("IsActive", &object, self.value(&object).await)?;
        Ok(Response::new(IsActiveResponse { result: trigger.active(whole) }))
    }

    type StreamIsActiveStream = ActiveStream;

    async fn stream_is_active(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let object = request.into_inner();
        // Refused at once when the trigger or the policy is wrong; after that, errors end the stream and KEDA
        // opens it again.
        self.answer("StreamIsActive", &object, self.policy(&object))?;
        let (tx, rx) = mpsc::channel(1);
        let scaler = self.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let message = scaler.value(&object).await.map(|(trigger, _, whole)| trigger.active(whole));
                let failed = message.is_err();
                // A message goes out (and is counted) only when the answer changes.
                if last != Some(message.as_ref().ok().copied()) {
                    last = Some(message.as_ref().ok().copied());
                    let message = scaler.answer("StreamIsActive", &object, message);
                    let sent = tokio::select! {
                        sent = tx.send(message.map(|result| IsActiveResponse { result })) => sent.is_ok(),
                        _ = tx.closed() => false,
                    };
                    if !sent || failed {
                        return;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(MAX_AGE) => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx)) as ActiveStream))
    }

    type StreamMetricSpecStream = Pin<Box<dyn Stream<Item = Result<GetMetricSpecResponse, Status>> + Send>>;

    /// A trigger's target is in its metadata, which only changes with the ScaledObject: KEDA reads it again then,
    /// so there is nothing to push (KEDA's proto: answering Unimplemented keeps the pull).
    async fn stream_metric_spec(
        &self,
        _: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamMetricSpecStream>, Status> {
        Err(Status::unimplemented("the metric spec is the trigger's metadata: nothing to push"))
    }

    async fn get_metric_spec(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let object = request.into_inner();
        let parsed = Trigger::parse(&object.scaler_metadata).map_err(Status::invalid_argument);
        let trigger = self.answer("GetMetricSpec", &object, parsed)?;
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: trigger.metric_name(),
                target_size: trigger.target.ceil() as i64,
                target_size_float: trigger.target,
            }],
        }))
    }

    async fn get_metrics(&self, request: Request<GetMetricsRequest>) -> Result<Response<GetMetricsResponse>, Status> {
        let request = request.into_inner();
        let object = request.scaled_object_ref.unwrap_or_default();
        let (_, value, _) = self.answer("GetMetrics", &object, self.value(&object).await)?;
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: request.metric_name,
                metric_value: value,
                metric_value_float: value as f64,
            }],
        }))
    }
}

impl Scaler {
    /// Counts an answer, and logs a refused one (KEDA shows it too).
    fn answer<T>(
        &self,
        method: &'static str,
        object: &ScaledObjectRef,
        result: Result<T, Status>,
    ) -> Result<T, Status> {
        let code = result.as_ref().err().map_or(tonic::Code::Ok, Status::code);
        self.shared.metrics.scaler_answered(method, &format!("{code:?}"));
        if let Err(status) = &result {
            debug!(namespace = %object.namespace, scaled_object = %object.name, method, code = ?code,
                message = status.message(), "external scaler refused an answer");
        }
        result
    }
}

/// The label on the Pod of the replica that serves (value `serving`), which the chart's scaler Service selects.
pub const SERVING_LABEL: &str = "pelican.io/scaler";

/// Puts [`SERVING_LABEL`] on this replica's Pod or takes it off (`POD_NAME`, `POD_NAMESPACE`, as the chart sets
/// them; nothing outside a Pod). A failure (no RBAC to patch Pods) is logged: KEDA then cannot find the leader.
pub async fn label_pod(client: &kube::Client, serving: bool) {
    let (Ok(name), Ok(namespace)) = (std::env::var("POD_NAME"), std::env::var("POD_NAMESPACE")) else {
        return;
    };
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client.clone(), &namespace);
    let value = serving.then_some("serving");
    let patch = serde_json::json!({"metadata": {"labels": {SERVING_LABEL: value}}});
    let params = kube::api::PatchParams::default();
    if let Err(e) = pods.patch(&name, &params, &kube::api::Patch::Merge(&patch)).await {
        warn!(pod = %format!("{namespace}/{name}"), serving, error = %e,
            "could not label this Pod for the external scaler's Service (RBAC: patch pods in its namespace)");
    }
}

/// Serves the external scaler on `addr` until `stop`, this replica's Pod labelled for the Service meanwhile.
pub async fn serve(
    addr: SocketAddr,
    tls: Option<ServerTlsConfig>,
    shared: Arc<Shared>,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(e) => return warn!(%addr, error = %e, "the external scaler cannot listen"),
    };
    info!(%addr, mutual_tls = tls.is_some(), "serving KEDA's external scaler");
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = match server.tls_config(tls) {
            Ok(server) => server,
            Err(e) => return warn!(%addr, error = %e, "the external scaler's TLS settings are refused"),
        };
    }
    let client = shared.client.clone();
    label_pod(&client, true).await;
    let served = server
        .add_service(ExternalScalerServer::new(Scaler::new(shared)))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), stop)
        .await;
    label_pod(&client, false).await;
    if let Err(e) = served {
        warn!(%addr, error = %e, "the external scaler stopped");
    }
}

/// Mutual TLS for the scaler from a directory holding `tls.crt` and `tls.key` (the server's certificate and key)
/// and `ca.crt` (the CA whose client certificates are answered), as a Secret of type `kubernetes.io/tls` with
/// `ca.crt` mounts it (cert-manager writes one). Without it, anyone who reaches the port reads any namespace's
/// numbers: the NetworkPolicy is then the boundary.
pub fn mutual_tls(dir: &std::path::Path) -> Result<ServerTlsConfig, String> {
    let read = |name: &str| {
        std::fs::read(dir.join(name)).map_err(|e| format!("cannot read {}: {e}", dir.join(name).display()))
    };
    let identity = Identity::from_pem(read("tls.crt")?, read("tls.key")?);
    Ok(ServerTlsConfig::new().identity(identity).client_ca_root(Certificate::from_pem(read("ca.crt")?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn a_trigger_names_a_policy_and_defaults_the_rest() {
        let trigger = Trigger::parse(&metadata(&[("policy", "orders")])).unwrap();
        assert_eq!(
            trigger,
            Trigger { policy: "orders".into(), metric: Metric::Backlog, target: DEFAULT_TARGET, activation: 0.0 }
        );
        assert_eq!(trigger.metric_name(), "pelican-backlog-orders");
        let trigger = Trigger::parse(&metadata(&[
            ("policy", "orders"),
            ("metric", "pending"),
            ("target", "2.5"),
            ("activationTarget", "10"),
        ]))
        .unwrap();
        assert_eq!((trigger.metric, trigger.target), (Metric::Pending, 2.5));
        assert!(!trigger.active(10) && trigger.active(11));
        let trigger = Trigger::parse(&metadata(&[("policy", "orders"), ("metric", "lagSeconds")])).unwrap();
        assert_eq!(trigger.metric_name(), "pelican-lag-seconds-orders");
        let waiting = Backlog { stream_length: 9, lag: Some(4), pending: 5, lag_seconds: 125 };
        assert_eq!(trigger.metric.of(&waiting), 125);
    }

    #[test]
    fn bad_metadata_says_what_to_fix() {
        let error = |pairs: &[(&str, &str)]| Trigger::parse(&metadata(pairs)).unwrap_err();
        assert!(error(&[]).contains("metadata.policy is missing"));
        assert!(error(&[("policy", "team-a/orders")]).contains("own namespace only"));
        assert!(
            error(&[("policy", "orders"), ("metric", "depth")])
                .contains("not one of backlog, pending, lag, lagSeconds")
        );
        assert!(
            error(&[("policy", "orders"), ("target", "0")]).contains("metadata.target \"0\" is not a number above 0")
        );
        assert!(error(&[("policy", "orders"), ("target", "many")]).contains("above 0"));
        assert!(error(&[("policy", "orders"), ("activationTarget", "-1")]).contains("at least 0"));
    }

    #[test]
    fn on_a_topic_a_count_asks_for_no_more_replicas_than_partitions_and_an_age_is_not_capped() {
        let backlog = Backlog { stream_length: 40, lag: Some(30), pending: 10, lag_seconds: 90 };
        let trigger = |metric: &str| Trigger::parse(&metadata(&[("policy", "t"), ("metric", metric)])).unwrap();
        assert_eq!(trigger("backlog").value(&backlog, None), 40, "a plain stream: the whole backlog");
        assert_eq!(trigger("backlog").value(&backlog, Some(4)), 20, "4 partitions at the default target 5");
        assert_eq!(trigger("lag").value(&backlog, Some(8)), 30, "under the cap");
        assert_eq!(trigger("lagSeconds").value(&backlog, Some(1)), 90);
        let summed = backlog.and(Backlog { stream_length: 5, lag: None, pending: 1, lag_seconds: 100 });
        assert_eq!((summed.lag, summed.lag_or_bound(), summed.pending, summed.lag_seconds), (None, 45, 11, 100));
    }

    #[test]
    fn the_lag_metric_never_reads_zero_while_the_stream_holds_unread_entries() {
        let unknown = Backlog { stream_length: 3, lag: None, pending: 0, lag_seconds: 0 };
        assert_eq!((Metric::Lag.of(&unknown), Metric::Backlog.of(&unknown), Metric::Pending.of(&unknown)), (3, 3, 0));
    }
}
